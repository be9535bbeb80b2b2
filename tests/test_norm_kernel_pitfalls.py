"""Sharded norms stay exact where torch 2.14's own CPU batch-norm kernels do not.

1. Memory layouts. torch's CPU batch-norm backward (``F.batch_norm`` in training and in eval,
   and ``native_batch_norm_backward``'s reduction pass) returns wrong gradients when the input
   and the output gradient are laid out differently and one of them is channels-last with a
   batch of one whose batch stride is not the full sample (e.g. strides ``(C, 1, W*C, C)`` for
   ``(1, C, H, W)``). ``F.instance_norm`` runs batch norm on the ``(1, N*C, ...)`` view, so it
   hits this for any batch as soon as the gradient arrives in ``(H, W, N, C)`` order, which is
   what ``x.flatten(2).transpose(1, 2)`` into ``nn.MultiheadAttention(batch_first=True)`` gives
   back (the zoo UNet's attention block, found by ``tests/test_fuzz_unet.py``). Every case here
   feeds a norm an input and an output gradient in such layouts and compares with the same
   normalization written in elementwise float64 ops (whose backward does not go through those
   kernels), at P=1 (the layers' torch-kernel path) and sharded.
2. Stride-0 statistics. The CPU kernel's path for one position per channel reads the per-channel
   vectors as dense arrays: a GroupNorm of one group on a slab of one row and one column (a
   UNet's bottleneck on thin slabs, MONAI's BasicUNet) had an ``expand``-ed statistic and gave
   garbage gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

# Memory orders (a permutation of the dims, outermost first) that a tensor may arrive in.
ORDERS_4D = {"contiguous": (0, 1, 2, 3), "channels_last": (0, 2, 3, 1), "HWNC": (2, 3, 0, 1), "CNHW": (1, 0, 2, 3)}


def _in_order(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s values stored in memory order ``order`` (a permutation of its dims)."""
    inverse = [order.index(d) for d in range(t.dim())]
    return t.permute(order).contiguous().permute(inverse)


def _reference(kind: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm in elementwise float64 ops: mean and biased variance over its reduction dims."""
    if kind == "batch" and not module.training:
        shape = (1, -1, *[1] * (x.dim() - 2))
        mean, var = module.running_mean.view(shape), module.running_var.view(shape)
    elif kind == "group":
        g = x.reshape(x.shape[0], module.num_groups, -1)
        y = (g - g.mean(2, keepdim=True)) / torch.sqrt(g.var(2, unbiased=False, keepdim=True) + module.eps)
        y = y.reshape(x.shape)
        shape = (1, -1, *[1] * (x.dim() - 2))
        return y * module.weight.view(shape) + module.bias.view(shape)
    else:
        dims = (0, *range(2, x.dim())) if kind == "batch" else tuple(range(2, x.dim()))
        mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    shape = (1, -1, *[1] * (x.dim() - 2))
    y = (x - mean) / torch.sqrt(var + module.eps)
    return y * module.weight.view(shape) + module.bias.view(shape) if module.weight is not None else y


def _module(kind: str, c: int, train: bool) -> nn.Module:
    torch.manual_seed(0)
    m = {"batch": nn.BatchNorm2d(c), "instance": nn.InstanceNorm2d(c, affine=True), "group": nn.GroupNorm(2, c)}[kind]
    m = m.double().train(train)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        if kind == "batch":
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return m


def _layouts(domain: int, kind: str, train: bool, batch: int, x_order: str, g_order: str):
    m = mesh(domain)
    ref = _module(kind, 4, train)
    sharded = snn.convert(copy.deepcopy(ref), m)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, 6, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(batch, 4, 6, 5, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    want = _reference(kind, ref, xr)
    want.backward(g)

    x_local = _in_order(snn.shard(x, m, dims=(2,)), ORDERS_4D[x_order]).requires_grad_()
    g_local = _in_order(snn.shard(g, m, dims=(2,)), ORDERS_4D[g_order])
    y = sharded(x_local)
    y.backward(g_local)
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(snn.gather(y.detach(), m, dims=(2,)), want.detach(), **tol)
    torch.testing.assert_close(snn.gather(x_local.grad, m, dims=(2,)), xr.grad, **tol, msg=lambda s: f"input grad: {s}")
    from .reference import reduce_param_grads

    grads = reduce_param_grads(sharded, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("domain", [1, 2])
@pytest.mark.parametrize("kind,train", [("batch", True), ("batch", False), ("instance", True), ("group", True)])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("x_order,g_order", [("contiguous", "HWNC"), ("contiguous", "channels_last"),
                                             ("channels_last", "contiguous"), ("HWNC", "contiguous"),
                                             ("CNHW", "HWNC"), ("HWNC", "channels_last")])  # fmt: skip
def test_norm_gradients_in_any_layout(run, domain, kind, train, batch, x_order, g_order):
    assert all(run(domain, _layouts, domain, kind, train, batch, x_order, g_order))


def _attention_block(norm: str):
    """The zoo UNet's attention block on one device: its input gradient against the same block
    with the norm written elementwise (before the fix torch's instance norm got the attention's
    (H, W, N, C)-ordered gradient and the plain model trained on wrong gradients)."""
    from sharded_nn.zoo.unet import AttentionBlock

    torch.manual_seed(0)
    block = AttentionBlock(2, 4, num_heads=2, norm=norm).double()
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    g = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    grads = []
    for elementwise in (False, True):
        xr = x.clone().requires_grad_()
        if elementwise:
            kind = "instance" if norm == "instance" else "batch"
            tokens = _reference(kind, block.norm, xr).flatten(2).transpose(1, 2)
            out, _ = block.attn(tokens, tokens, tokens, need_weights=False)
            y = xr + out.transpose(1, 2).reshape(xr.shape)
        else:
            y = block(xr)
        y.backward(g)
        grads.append(xr.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("norm", ["instance", "batch"])
def test_zoo_attention_block_gradient_on_one_device(norm):
    _attention_block(norm)


def _one_position_groups(domain: int, sizes, width: int):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = nn.GroupNorm(1, 2).double()
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    sharded = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 2, sum(sizes), width, dtype=torch.float64)
    g = torch.randn(1, 2, sum(sizes), width, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    r = m.get_local_rank("domain")
    x_local = x.narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    sharded(x_local).backward(g.narrow(2, sum(sizes[:r]), sizes[r]).contiguous())
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(snn.gather(x_local.grad, m, dims=(2,)), xr.grad, **tol)
    from .reference import reduce_param_grads

    grads = reduce_param_grads(sharded, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("domain,sizes", [(2, (1, 2)), (3, (1, 1, 2))])
def test_group_norm_of_one_group_on_one_position_slabs(run, domain, sizes):
    assert all(run(domain, _one_position_groups, domain, sizes, 1))
