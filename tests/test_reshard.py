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


def _drifting_model():
    """Circular pad module + conv without padding: exact on slabs, but the split drifts per block."""
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
    drifted = y.shape[2] != y_full[snn.local_slices(y_full.shape, m)].shape[2]
    torch.testing.assert_close(y, y_full.detach()[snn.local_slices(y, m)])  # exact where it lies
    yb = snn.reshard(y, m)
    sl = snn.local_slices(y_full.shape, m)
    torch.testing.assert_close(yb, y_full.detach()[sl])
    (yb * g[sl]).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad[snn.local_slices(x, m)])
    return drifted


@pytest.mark.parametrize("world", [2, 3])
def test_drifted_model_output_resharded(run, world):
    drifted = run(world, _drifting_model)
    assert any(drifted)  # the model does drift: the test exercises a real move
