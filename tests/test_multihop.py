"""Multi-hop halos, clipped halos and empty slabs against the single-device modules.

A slab thinner than the halo a layer needs (the deep stages of a UNet or a ConvNeXt on many
ranks) is served by ``comm.halo_gather``: each rank reads the rows it needs from every rank its
halo spans. A rank whose output slab is empty (13 rows, pool k4 s3, P=3: slabs 6, 6, 1) carries
an empty slab through the following layers. Every case compares forward output, input gradient
and parameter gradients (summed over the ranks) with the single-device module in float64; slabs
are cut explicitly, so the case says which ranks a halo spans.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn
from sharded_nn import comm

from .harness import mesh
from .reference import reduce_param_grads


def _rand(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach())
    return out


def _check(make, shape, sizes, dim=2, seed=0, atol=1e-10):
    """Reference check with explicit slab ``sizes`` along ``dim``; returns the output slab sizes."""
    m = mesh(len(sizes))
    torch.manual_seed(seed)
    ref = make().double()
    model = snn.convert(copy.deepcopy(ref), m, dims=(dim,))
    x = _rand(shape, seed).requires_grad_()
    y = ref(x)
    g_out = _rand(y.shape, seed + 1)
    (y * g_out).sum().backward()
    r = m.get_local_rank("domain")
    x_loc = x.detach().narrow(dim, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    y_loc = model(x_loc)
    ys = _all_gather(y_loc)
    torch.testing.assert_close(torch.cat(ys, dim), y.detach(), atol=atol, rtol=atol)
    off = sum(t.shape[dim] for t in ys[:r])
    # Per-rank losses sum to the global loss (no replicated value here).
    (y_loc * g_out.narrow(dim, off, y_loc.shape[dim])).sum().backward()
    torch.testing.assert_close(torch.cat(_all_gather(x_loc.grad), dim), x.grad, atol=atol, rtol=atol)
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=atol, rtol=atol, msg=lambda s, n=name: f"{n}: {s}")
    return tuple(t.shape[dim] for t in ys)


CASES = {
    # Conv2d k7 p3 on H=7: the halo of 3 spans two ranks at P=3, three at P=4.
    "conv2d-k7-p3": (lambda: nn.Conv2d(2, 3, 7, padding=3), (1, 2, 7, 5), [(3, 2, 2), (2, 2, 2, 1)]),
    # Conv1d k11 p5 on L=8 at P=4: a halo of 5 over slabs of 2 spans three ranks.
    "conv1d-k11-p5": (lambda: nn.Conv1d(2, 3, 11, padding=5), (2, 2, 8), [(2, 2, 2, 2)]),
    # ConvNeXt's depthwise 7x7 at 1/32 resolution on 3 ranks: slabs 3, 2, 2.
    "depthwise-7x7": (lambda: nn.Conv2d(4, 4, 7, padding=3, groups=4), (1, 4, 7, 7), [(3, 2, 2)]),
    # Periodic padding wider than a slab wraps across several ranks; reflect and replicate
    # padding read rows the first and last ranks do not hold.
    "circular-wide": (
        lambda: nn.Conv1d(2, 2, 7, padding=3, padding_mode="circular"), (1, 2, 8), [(2, 2, 2, 2), (4, 3, 1)]
    ),
    "reflect-thin": (
        lambda: nn.Conv1d(2, 2, 7, padding=3, padding_mode="reflect"), (1, 2, 8), [(2, 2, 2, 2), (1, 5, 2)]
    ),
    "replicate-thin": (lambda: nn.Conv1d(2, 2, 5, padding=2, padding_mode="replicate"), (1, 2, 7), [(1, 1, 4, 1)]),
    "strided-thin": (lambda: nn.Conv1d(2, 3, 9, stride=2, padding=4), (1, 2, 10), [(2, 2, 2, 4)]),
    # A transposed conv whose output strip spans several ranks' output slabs.
    "convT-wide-strip": (lambda: nn.ConvTranspose1d(2, 3, 11, stride=2, padding=5), (1, 2, 5), [(2, 1, 1, 1)]),
    "convT-k9": (lambda: nn.ConvTranspose1d(2, 2, 9, padding=2), (1, 2, 6), [(2, 2, 1, 1)]),
    # Halos clipped to the domain: a dilated conv whose halo (6) exceeds the rows that exist
    # before rank 1 (4 at P=2, 3 at P=3); the taps beyond the global edge read zero padding.
    "dilated-clipped": (lambda: nn.Conv2d(2, 2, 3, dilation=6, padding=6), (1, 2, 8, 5), [(4, 4), (3, 3, 2)]),
    "dilated-clipped-reflect": (
        lambda: nn.Conv1d(2, 2, 3, dilation=3, padding=3, padding_mode="reflect"), (1, 2, 7), [(2, 3, 2)]
    ),
    "maxpool-k7": (lambda: nn.MaxPool1d(7, stride=1, padding=3), (1, 2, 8), [(2, 2, 2, 2)]),
    "avgpool2d-k5": (
        lambda: nn.AvgPool2d(5, stride=1, padding=2, count_include_pad=False), (1, 2, 6, 4), [(2, 2, 1, 1)]
    ),
}


def _case(name, sizes):
    make, shape, _ = CASES[name]
    return _check(make, shape, sizes)


@pytest.mark.parametrize(
    ("name", "sizes"), [(n, s) for n, (_, _, all_sizes) in CASES.items() for s in all_sizes], ids=str
)
def test_multihop_layer(run, name, sizes):
    outs = run(len(sizes), _case, name, sizes)
    assert len(set(outs)) == 1


def _chain(spatial: int) -> nn.Module:
    """Pool leaves rank 2 without rows; conv, norms, pool, upsample and activations carry it."""
    if spatial == 1:
        conv, pool, bn = nn.Conv1d, nn.MaxPool1d, nn.BatchNorm1d
    else:
        conv, pool, bn = nn.Conv2d, nn.MaxPool2d, nn.BatchNorm2d
    mode = "linear" if spatial == 1 else "bilinear"
    return nn.Sequential(
        pool(4, stride=3),  # 13 rows in slabs 6, 6, 1 -> outputs 2, 2, 0
        conv(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        conv(4, 4, 3, padding=1, padding_mode="replicate"),
        bn(4),
        nn.GELU(),
        pool(2, stride=2),  # 2, 2, 0 -> 1, 1, 0
        nn.Upsample(scale_factor=2, mode=mode),  # -> 2, 2, 0
        conv(4, 3, 3, padding=1),
        nn.Upsample(scale_factor=2, mode="nearest"),  # -> 4, 4, 0
    )


@pytest.mark.parametrize("spatial", [1, 2])
def test_empty_output_slab_carried_through_a_chain(run, spatial):
    shape = (2, 2, 13) if spatial == 1 else (1, 2, 13, 8)
    outs = run(3, _check, functools.partial(_chain, spatial), shape, (6, 6, 1))
    assert outs == [(4, 4, 0)] * 3


def _empty_pool(n):
    make = (lambda: nn.MaxPool1d(4, stride=3)) if n == 1 else (lambda: nn.AvgPool2d(4, stride=3))
    return _check(make, (1, 2, 13) if n == 1 else (1, 2, 13, 6), (6, 6, 1))


@pytest.mark.parametrize("n", [1, 2])
def test_pool_leaves_a_rank_without_output(run, n):
    assert run(3, _empty_pool, n) == [(2, 2, 0)] * 3


def _gather_direct(sizes, left, right, keep_all):
    """``comm.halo_gather`` against indexing of the full tensor, and its adjoint ``halo_scatter``."""
    m = mesh(len(sizes))
    ring = comm.axis_peers(m, "domain")
    r = ring.index
    n = sum(sizes)
    x = _rand((2, 3, n), 3).requires_grad_()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    spec = comm.halo.HaloGather(
        2, tuple(sizes), tuple(left), tuple((0, s if keep_all else 0) for s in sizes), tuple(right)
    )
    x_loc = x.detach().narrow(2, starts[r], sizes[r]).clone().requires_grad_()
    ext = comm.halo.halo_gather(x_loc, spec, ring, value=-7.0)
    full = torch.cat([x, torch.full((2, 3, 1), -7.0, dtype=x.dtype)], 2)
    keep = list(range(starts[r], starts[r] + (sizes[r] if keep_all else 0)))
    idx = [g if g >= 0 else n for g in (*left[r], *keep, *right[r])]
    ref = full.index_select(2, torch.tensor(idx, dtype=torch.long))
    torch.testing.assert_close(ext, ref, atol=0, rtol=0)
    w = _rand(ext.shape, 10 + r)
    (ext * w).sum().backward()
    # The reference gradient: the sum over ranks of each rank's loss, on the full tensor.
    xs = x.detach().requires_grad_()
    fulls = torch.cat([xs, torch.zeros(2, 3, 1, dtype=x.dtype)], 2)
    total = 0
    for q in range(len(sizes)):
        kq = list(range(starts[q], starts[q] + (sizes[q] if keep_all else 0)))
        iq = [g if g >= 0 else n for g in (*left[q], *kq, *right[q])]
        shape = (2, 3, len(iq))
        total = total + (fulls.index_select(2, torch.tensor(iq, dtype=torch.long)) * _rand(shape, 10 + q)).sum()
    total.backward()
    torch.testing.assert_close(x_loc.grad, xs.grad.narrow(2, starts[r], sizes[r]))
    # halo_scatter adds every position into its owner: the adjoint of the gather.
    y = comm.halo.halo_scatter(w, spec, ring)
    torch.testing.assert_close(y, x_loc.grad)
    return True


@pytest.mark.parametrize(
    ("sizes", "left", "right", "keep_all"),
    [
        # Rank 3 reads 5 rows from ranks 0-2; rank 0 reads from ranks 2-3 (reflect-like, reversed).
        (
            (2, 2, 2, 2),
            ((), (0, 1), (-1, 0, 1, 2, 3), (1, 2, 3, 4, 5)),
            ((5, 4, 7), (4, 5, 6), (6, 7), (-1, -1)),
            True,
        ),
        # An empty slab in the middle, and a rank that keeps nothing (a placeholder of fill).
        ((3, 0, 2, 1), ((), (1, 2), (-1,), (2, 1, 0)), ((3, 4, 5), (3,), (5,), ()), False),
    ],
)
def test_halo_gather_and_scatter_against_indexing(run, sizes, left, right, keep_all):
    assert run(len(sizes), _gather_direct, sizes, left, right, keep_all) == [True] * len(sizes)


def _deeplab_trunk():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    m = mesh(2)
    torch.manual_seed(0)
    ref = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3, aux_loss=False)
    ref = ref.double().eval()
    for mod in ref.modules():  # statistics that no zero-initialised branch hides
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 1.5)
    model = snn.convert(copy.deepcopy(ref), m)
    x = _rand((1, 3, 160, 48), 5)
    x_loc = snn.shard(x, m, dims=(2,), align=16)
    with torch.no_grad():
        # At 160 px the ASPP's dilated convs (dilation 12, 24, 36) on a 10-row map sharded 5/5
        # ask for halos wider than the rows that exist past the edge: clipped to the domain.
        # The whole model runs, under the forward guard that convert installs: its squeeze-excite
        # blocks and the final F.interpolate(size=local shape) are computed by their sharded forms.
        want = ref(x)["out"]
        got = model(x_loc)["out"]
    torch.testing.assert_close(snn.gather(got, m, dims=(2,)), want, atol=1e-12, rtol=1e-10)
    return tuple(got.shape)


def test_deeplabv3_mobilenet_halos_clipped_to_the_domain(run):
    pytest.importorskip("torchvision")
    assert run(2, _deeplab_trunk) == [(1, 3, 80, 48)] * 2
