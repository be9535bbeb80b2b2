"""Layouts that drift, ``local_slices`` of a slab and ``reshard`` (issue 15, item 3)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

D = torch.float64


def _cut(full: torch.Tensor, sizes: list[int], dim: int, r: int) -> torch.Tensor:
    a = sum(sizes[:r])
    return full.narrow(dim, a, sizes[r])


def _reshard_sizes(sizes: list[int], align: int):
    m = mesh(len(sizes))
    r = torch.distributed.get_rank()
    torch.manual_seed(0)
    full = torch.randn(2, 3, sum(sizes), 5, dtype=D)
    g = torch.randn_like(full)  # upstream gradient of the full output
    x = _cut(full, sizes, 2, r).clone().requires_grad_()
    # local_slices of a slab: the global rows it covers, from its actual layout.
    assert full[snn.local_slices(x, m)].equal(x.detach())
    y = snn.reshard(x, m, align=align)
    sl = snn.local_slices(full.shape, m, align=align)
    torch.testing.assert_close(y, full[sl], rtol=0, atol=0)
    assert snn.local_slices(y, m) == sl
    (y * g[sl]).sum().backward()  # backward moves the gradient rows back to their owners
    torch.testing.assert_close(x.grad, _cut(g, sizes, 2, r), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("sizes,align", [([9, 3], 1), ([13, 1], 2), ([5, 9, 2], 1), ([0, 7, 10], 4), ([6, 6, 6], 3)])
def test_reshard_to_balanced(run, sizes, align):
    assert all(run(len(sizes), _reshard_sizes, sizes, align))


def _pad_conv_model():
    """Circular pad module + conv without padding: the split used to drift per block (the first
    rank owned the rows its left padding added: 8/8/8 -> 9/8/7 -> ...); since session 51 the
    sharded pad keeps the slab boundaries, so the output lies on the input's layout and matches
    targets cut with ``local_slices``; ``reshard`` of it moves nothing and stays exact."""
    m = mesh(torch.distributed.get_world_size())
    torch.manual_seed(2)
    ref = nn.Sequential(
        nn.CircularPad2d((0, 0, 1, 1)), nn.Conv2d(2, 3, 3, padding=(0, 1)),
        nn.CircularPad2d((0, 0, 1, 1)), nn.Conv2d(3, 2, 3, padding=(0, 1)),
    ).to(D)  # fmt: skip
    model = snn.convert(copy.deepcopy(ref), m)
    x_full = torch.randn(1, 2, 24, 6, dtype=D, requires_grad=True)
    y_full = ref(x_full)
    g = torch.randn_like(y_full)
    (y_full * g).sum().backward()
    x = snn.shard(x_full.detach(), m).requires_grad_()
    y = model(x)
    sl = snn.local_slices(y_full.shape, m)
    assert y.shape == y_full[sl].shape, (tuple(y.shape), tuple(y_full[sl].shape))
    torch.testing.assert_close(y, y_full.detach()[sl])
    yb = snn.reshard(y, m)
    torch.testing.assert_close(yb, y_full.detach()[sl])
    (yb * g[sl]).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad[snn.local_slices(x, m)])
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_pad_conv_model_keeps_the_layout(run, world):
    assert all(run(world, _pad_conv_model))
