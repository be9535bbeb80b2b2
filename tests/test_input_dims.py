"""``convert(..., input_dims=...)``: root inputs sharded along dims of their own, or whole.

Every tensor input of a converted root used to be taken as a slab along the model's ``dims``: a
mask of class indices ``(N, H, W)`` next to a field ``(N, C, H, W)`` sharded along dim 2 was taken
as sharded along its W, and refused (or, with even slabs, mis-laid). ``input_dims`` names such
inputs by parameter name or position: compared with the single-device model (output, input
gradient, summed parameter gradients) on uneven slabs of 2 and 3 ranks and a 2x2 mesh, with the
layout scope's entry agreement on and off; bad entries raise a ``ValueError`` naming them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.mesh import domain_axes

from .harness import mesh

TOL = {"atol": 1e-10, "rtol": 1e-10}


class Masked(nn.Module):
    """A conv whose output is masked by ``mask`` (N, H, W) and shifted by a whole ``bias`` (C, 1, 1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.out = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x, mask, bias):
        y = self.conv(x) * mask[:, None] + bias
        return self.out(y)


def _slab(t, m, sizes, first):
    for k, axis in enumerate(domain_axes(m)):
        r = m.get_local_rank(axis)
        t = t.narrow(first + k, sum(sizes[k][:r]), sizes[k][r])
    return t.contiguous()


def _masked(domain, sizes, key, layout_scope: bool):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Masked().double()
    shape = [sum(s) for s in sizes] + [5] * (2 - len(sizes))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, *shape, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = (torch.rand(2, *shape, generator=gen) > 0.3).double()
    bias = torch.randn(4, 1, 1, dtype=torch.float64, generator=gen)
    y = ref(x, mask, bias)
    g = torch.randn(y.shape, dtype=y.dtype, generator=gen)
    (y * g).sum().backward()
    mask_dims = tuple(range(1, 1 + len(sizes)))
    # (Named by parameter name or by position after self.)
    input_dims = {"mask": mask_dims, "bias": None} if key == "name" else {1: mask_dims, 2: None}
    model = snn.convert(copy.deepcopy(ref), m, input_dims=input_dims, layout_scope=layout_scope)
    xl = _slab(x.detach(), m, sizes, 2).requires_grad_()
    yl = model(xl, _slab(mask, m, sizes, 1), bias)
    (yl * _slab(g, m, sizes, 2)).sum().backward()
    dims = [2 + k for k in range(len(sizes))]
    torch.testing.assert_close(snn.gather(yl.detach(), m, dims=dims), y.detach(), **TOL)
    torch.testing.assert_close(snn.gather(xl.grad, m, dims=dims), x.grad, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, **TOL)
    return True


@pytest.mark.parametrize("layout_scope", [True, False])
@pytest.mark.parametrize("key", ["name", "position"])
def test_mask_of_another_rank_is_exact(run, key, layout_scope):
    assert all(run(2, _masked, 2, ((7, 3),), key, layout_scope))
    assert all(run(3, _masked, 3, ((2, 5, 4),), key, layout_scope))


def test_mask_of_another_rank_on_a_2x2_mesh(run):
    assert all(run(4, _masked, (2, 2), ((5, 2), (3, 4)), "name", True))


def _without_input_dims(domain):
    """Without ``input_dims`` the mask is taken along the model's dims (its W): refused alike."""
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Masked().double(), m)
    x = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    mask = torch.ones(2, 9, 5, dtype=torch.float64)
    try:
        model(snn.shard(x, m), snn.shard(mask, m, dims=[1]), torch.zeros(4, 1, 1, dtype=torch.float64))
    except snn.ShardingError as e:
        return type(e).__name__
    return "no error"


def test_mask_without_input_dims_is_refused_alike(run):
    out = run(2, _without_input_dims, 2)
    assert out == ["ShardingError"] * 2, out


def _bad(domain, input_dims):
    m = mesh(domain)
    try:
        snn.convert(Masked(), m, input_dims=input_dims)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "input_dims, expected",
    [({"target": 1}, "not a tensor input of Masked.forward (its inputs: x, mask, bias)"),
     ({5: 1}, "not a tensor input"),
     ({"mask": (1, 2)}, "must be None (a whole tensor) or 1 distinct non-negative dim(s)"),
     ({"mask": -1}, "non-negative")],
)
def test_bad_input_dims_are_named(run, input_dims, expected):
    out = run(2, _bad, 2, input_dims)
    assert expected in out[0], out[0]


def _too_few_dims(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Masked().double(), m, input_dims={"mask": 1, "bias": None})
    x = snn.shard(torch.randn(2, 3, 8, 5, dtype=torch.float64), m)
    bias = torch.zeros(4, 1, 1, dtype=torch.float64)
    try:
        model(x, torch.ones(2, dtype=torch.float64), bias)  # a mask of one dim cannot be sharded along dim 1
    except snn.ShardingError as e:
        msg = str(e)
    else:
        msg = "no error"
    # The refused call left nothing behind (its scope ended): a right call on the same model runs.
    mask = snn.shard(torch.ones(2, 8, 5, dtype=torch.float64), m, dims=[1])
    torch.testing.assert_close(model(x, mask, bias), model.out(model.conv(x)))
    return msg


def test_input_dims_beyond_the_tensor_are_refused(run):
    out = run(2, _too_few_dims, 2)
    assert len(set(out)) == 1 and "expected a tensor with more than 1 dims" in out[0], out


def _parallelized(domain, how: str):
    """input_dims through parallelize: given to it, or to an earlier convert (kept: parallelize
    converts what it is given again, and converting twice changes nothing)."""
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Masked().double()
    sizes = (5, 4) if domain == 2 else (3, 2, 4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, sum(sizes), 5, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = (torch.rand(2, sum(sizes), 5, generator=gen) > 0.3).double()
    bias = torch.randn(4, 1, 1, dtype=torch.float64, generator=gen)
    ref(x, mask, bias).square().sum().backward()
    dims = {"mask": 1, "bias": None}
    model = copy.deepcopy(ref)
    if how == "convert_first":
        model = snn.parallelize(snn.convert(model, m, input_dims=dims), m)
    else:
        model = snn.parallelize(model, m, input_dims=dims)
    y = model(_slab(x.detach(), m, (sizes,), 2), _slab(mask, m, (sizes,), 1), bias)
    y.square().sum().backward()  # (a partial sum per rank: no share)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)  # (parallelize summed the domain's parts)
    return True


@pytest.mark.parametrize("how", ["convert_first", "parallelize"])
def test_input_dims_through_parallelize(run, how):
    assert all(run(2, _parallelized, 2, how))
    assert all(run(3, _parallelized, 3, how))
