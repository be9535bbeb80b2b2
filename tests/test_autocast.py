"""Sharded layers under CPU autocast (bf16 and fp16) against single-device autocast of torch's layers.

Each case runs the torch module and its converted copy under ``torch.autocast("cpu", dtype)``,
forward and backward, and compares both with the float32 result (the same module without
autocast). The sharded error may not exceed twice the single-device error, or one unit in the
last place of the autocast dtype (per rank and of the per-rank partial, for parameter gradients,
which are sums of per-rank partial sums each rounded once). Every layer family is covered;
most cases put the layer after a convolution, so that it sees the autocast dtype as input.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sharded_nn as snn

from .harness import mesh
from .reference import reduce_param_grads


class PoolUnpool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

    def forward(self, x):
        y, idx = self.pool(self.conv(x))
        return self.unpool(y, idx)


class Tokens(nn.Module):
    """Attention over (B, L, C) tokens: a projection, then the attention module."""

    def __init__(self, attn: nn.Module, mha: bool) -> None:
        super().__init__()
        self.proj, self.attn, self.mha = nn.Linear(8, 8), attn, mha

    def forward(self, x):
        x = self.proj(x)
        return self.attn(x, x, x, need_weights=False)[0] if self.mha else self.attn(x)


def _conv2d():
    return nn.Conv2d(3, 4, 3, padding=1)


def _timm_attention():
    from timm.models.vision_transformer import Attention

    return Tokens(Attention(8, num_heads=2), mha=False)


# name -> (module factory, full input shape, sharded dim)
CASES = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.Conv1d(4, 2, 5, padding=2)), (2, 3, 17), 2),
    "conv2d_circular": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), (2, 3, 12, 7), 2),
    "conv3d_depth_padded": (lambda: nn.Conv3d(3, 4, 3, padding=1), (1, 3, 9, 5, 4), 2),
    "conv3d_grouped": (lambda: nn.Conv3d(4, 2, (3, 1, 3), padding=(1, 0, 1), groups=2), (1, 4, 9, 5, 4), 2),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1), (2, 3, 9, 6), 2),
    "max_pool": (lambda: nn.Sequential(_conv2d(), nn.MaxPool2d(3, 1, 1)), (2, 3, 12, 7), 2),
    "avg_pool": (lambda: nn.Sequential(_conv2d(), nn.AvgPool2d(3, 1, 1, count_include_pad=False)), (2, 3, 12, 7), 2),
    "adaptive_avg_global": (lambda: nn.Sequential(_conv2d(), nn.AdaptiveAvgPool2d(1)), (2, 3, 12, 7), 2),
    "adaptive_avg_bins": (lambda: nn.Sequential(_conv2d(), nn.AdaptiveAvgPool2d((4, 3))), (2, 3, 12, 7), 2),
    # One reduced dim: with several, low-precision ties are broken in another order than torch's
    # (first position in row-major order), which routes the gradient to another (equal) maximum.
    "adaptive_max_global": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.AdaptiveMaxPool1d(1)),
                            (2, 3, 17), 2),
    "max_unpool": (PoolUnpool, (2, 3, 12, 6), 2),
    "group_norm": (lambda: nn.Sequential(_conv2d(), nn.GroupNorm(2, 4)), (2, 3, 12, 7), 2),
    "batch_norm": (lambda: nn.Sequential(_conv2d(), nn.BatchNorm2d(4)), (2, 3, 12, 7), 2),
    "instance_norm": (lambda: nn.Sequential(_conv2d(), nn.InstanceNorm2d(4, affine=True)), (2, 3, 12, 7), 2),
    "layer_norm": (lambda: nn.Sequential(_conv2d(), nn.LayerNorm([4, 12, 7])), (2, 3, 12, 7), 2),
    "upsample_bilinear": (lambda: nn.Sequential(_conv2d(), nn.Upsample(scale_factor=2, mode="bilinear")),
                          (2, 3, 12, 7), 2),
    "upsample_nearest": (lambda: nn.Sequential(_conv2d(), nn.Upsample(scale_factor=2)), (2, 3, 12, 7), 2),
    "reflection_pad": (lambda: nn.Sequential(_conv2d(), nn.ReflectionPad2d(2)), (2, 3, 12, 7), 2),
    "circular_pad": (lambda: nn.Sequential(_conv2d(), nn.CircularPad2d(1)), (2, 3, 12, 7), 2),
    "multihead_attention": (lambda: Tokens(nn.MultiheadAttention(8, 2, batch_first=True), mha=True), (2, 11, 8), 1),
    "timm_attention": (_timm_attention, (2, 11, 8), 1),
}


def _run(model, x, g, m=None, dim=2, dtype=None):
    """Output and gradients (input, parameters) of ``model``; sharded when a mesh is given."""
    x = x.detach().clone()
    if m is not None:
        x = snn.shard(x, m, dims=(dim,))
    x.requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        y = model(x)
    # float32 before any collective: the comparison is in float32 anyway.
    y = y.float()
    if m is None:
        (y * g).sum().backward()
        return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}
    # A global pool's output is replicated (not sharded): compared as it is.
    y_full = y if y.shape == g.shape else snn.gather(y, m, dims=(dim,))
    snn.losses.share((y_full * g).sum(), m).backward()
    # The largest per-rank partial of each parameter gradient (what each rank rounds).
    partial = {}
    for n, p in model.named_parameters():
        t = p.grad.abs().max().reshape(1) if p.grad is not None else torch.zeros(1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=snn.domain_group(m))
        partial[n] = t.item()
    return y_full.detach(), snn.gather(x.grad.float(), m, dims=(dim,)), reduce_param_grads(model, m), partial


def _check(world: int, name: str, dtype_name: str):
    if name != "conv3d_depth_padded":
        return _compare(world, name, dtype_name)
    # The explicitly padded weight-gradient Function (layers/conv.py) casts as F.conv3d does;
    # forced on, as this CPU may take the plain path (conv3d_grouped takes the CPU's choice).
    from sharded_nn.layers import conv

    saved, conv._EXPLICIT_DEPTH_PAD = conv._EXPLICIT_DEPTH_PAD, True
    try:
        return _compare(world, name, dtype_name)
    finally:
        conv._EXPLICIT_DEPTH_PAD = saved


def _compare(world: int, name: str, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    m = mesh(world)
    factory, shape, dim = CASES[name]
    torch.manual_seed(0)
    ref = factory()
    sharded = copy.deepcopy(ref)
    if dim == 1:  # token tensors: the sequence dim is sharded
        sharded = snn.convert(sharded, m, plan={"attn": {"attention": "ring"}})
    else:
        sharded = snn.convert(sharded, m)
    single = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    with torch.no_grad():
        g = torch.randn(copy.deepcopy(ref)(x).shape, generator=gen)
    y32, gx32, gp32 = _run(ref, x, g)
    y1, gx1, gp1 = _run(single, x, g, dtype=dtype)
    ys, gxs, gps, partial = _run(sharded, x, g, m, dim, dtype=dtype)
    eps = torch.finfo(dtype).eps
    report = {}
    pairs = [("out", y32, y1, ys, 0.0), ("grad_in", gx32, gx1, gxs, 0.0)]
    pairs += [(f"grad_{n}", gp32[n], gp1[n], gps[n], partial[n]) for n in gp32 if gp32[n] is not None]
    for what, ref_v, single_v, sharded_v, part in pairs:
        e_single = (single_v.float() - ref_v).abs().max().item()
        e_sharded = (sharded_v.float() - ref_v).abs().max().item()
        # A parameter gradient is a sum of per-rank partial sums, each rounded once in the
        # autocast dtype: one rounding per rank, of the partial's magnitude (which can exceed
        # the total's: a conv bias before a norm has partials that cancel to a zero gradient).
        floor = eps * max(ref_v.abs().max().item(), world * part)
        assert e_sharded <= max(2 * e_single, floor), (name, dtype_name, what, e_sharded, e_single, floor)
        report[what] = (e_sharded, e_single)
    return report


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_autocast_matches_single_device(run, name, dtype_name):
    run(2, _check, 2, name, dtype_name)


@pytest.mark.parametrize("name", ["conv3d_depth_padded", "group_norm", "upsample_bilinear"])
def test_autocast_three_ranks(run, name):
    run(3, _check, 3, name, "bfloat16")
