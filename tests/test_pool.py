"""Sharded pooling layers against the torch layers on the full tensor, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference


def _input(shape, seed=1):
    torch.manual_seed(seed)
    # A random permutation: no ties, so max pooling has one well-defined argmax everywhere.
    return torch.randperm(int(torch.tensor(shape).prod())).reshape(shape).double() / 7 - 3


def _check_many(cases, domain, dims=(2,), sizes=None):
    """``cases``: (torch module, input shape, align) triples; returns the max output errors."""
    m = mesh(domain)
    out = []
    for ref, shape, align in cases:
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
        assert all(type(a) is not type(b) for a, b in zip(sharded.modules(), ref.modules()) if not list(b.children()))
        res = check_against_reference(ref, _input(shape), m, dims=dims, align=align, sizes=sizes, sharded=sharded)
        out.append(res["out"])
    return out


S2 = (2, 3, 23, 7)
MAX_CASES = [
    (nn.MaxPool2d(3, 2, 1), S2, 2),  # the ResNet stem pool
    (nn.MaxPool2d(2), S2, 2),
    (nn.MaxPool2d(3, 1, 1), S2, 1),
    (nn.MaxPool2d(3, 2, 1, ceil_mode=True), S2, 2),
    (nn.MaxPool2d(2, 2, 0, ceil_mode=True), S2, 2),
    (nn.MaxPool2d((3, 2), (3, 1), (1, 0), dilation=(2, 1)), (2, 3, 24, 7), 3),
    (nn.MaxPool2d(4, 3, 2, dilation=1, ceil_mode=True), (2, 3, 25, 7), 3),
    (nn.MaxPool1d(5, 2, 2), (2, 3, 23), 2),
    (nn.MaxPool3d(3, 2, 1), (1, 2, 11, 5, 4), 2),
    (nn.MaxPool3d((2, 3, 3), (2, 1, 2), (1, 1, 1), ceil_mode=True), (1, 2, 11, 5, 4), 2),
]
AVG_CASES = [
    (nn.AvgPool2d(3, 2, 1), S2, 2),
    (nn.AvgPool2d(3, 2, 1, count_include_pad=False), S2, 2),
    (nn.AvgPool2d(2), S2, 2),
    (nn.AvgPool2d(3, 2, 1, ceil_mode=True), S2, 2),
    (nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), S2, 2),
    (nn.AvgPool2d(4, 3, 2, ceil_mode=True), (2, 3, 25, 7), 3),
    (nn.AvgPool2d(3, 2, 1, divisor_override=5), S2, 2),
    (nn.AvgPool2d((3, 2), (1, 2), (1, 1)), S2, 1),
    (nn.AvgPool1d(5, 2, 2, ceil_mode=True, count_include_pad=False), (2, 3, 23), 2),
    (nn.AvgPool3d(3, 2, 1, count_include_pad=False), (1, 2, 11, 5, 4), 2),
    (nn.AvgPool3d(2, ceil_mode=True, divisor_override=3), (1, 2, 11, 5, 5), 2),
]


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool_matches_torch_1d_mesh(run, kind, domain):
    cases = MAX_CASES if kind == "max" else AVG_CASES
    errs = run(domain, _check_many, cases, domain)
    assert all(e <= 1e-10 for rank in errs for e in rank)


def test_pool_2x2_mesh(run):
    cases = [(nn.MaxPool2d(3, 2, 1, ceil_mode=True), (1, 2, 11, 9), 2),
             (nn.AvgPool2d(3, 2, 1, count_include_pad=False), (1, 2, 11, 9), 2),
             (nn.MaxPool3d(3, 2, 1), (1, 2, 9, 7, 3), 2)]
    run(4, _check_many, cases, (2, 2), (2, 3))


def test_pool_explicit_uneven_slabs(run):
    cases = [(nn.MaxPool1d(3, 2, 1), (1, 2, 20), 2), (nn.AvgPool1d(3, 2, 1, ceil_mode=True), (1, 2, 20), 2)]
    run(3, _check_many, cases, 3, (2,), (8, 4, 8))


# --- global indices and unpooling -----------------------------------------------------------


class PoolUnpool(nn.Module):
    def __init__(self, pool: nn.Module, unpool: nn.Module, size=None) -> None:
        super().__init__()
        self.pool, self.unpool, self.size = pool, unpool, size

    def forward(self, x):
        y, idx = self.pool(x)
        return self.unpool(y, idx, output_size=self.size)  # a global size, as on one device


def _indices(domain, dims):
    m = mesh(domain)
    cases = [(nn.MaxPool2d(3, 2, 1, return_indices=True), (2, 3, 14, 10)),
             (nn.MaxPool2d(2, return_indices=True, ceil_mode=True), (2, 3, 13, 9)),
             (nn.MaxPool1d(4, 2, 1, dilation=2, return_indices=True), (2, 3, 21)),
             (nn.MaxPool3d(3, 2, 1, return_indices=True), (1, 2, 10, 6, 5))]
    for ref, shape in cases:
        if len(dims) > len(shape) - 2:
            continue
        x = _input(shape)
        y_ref, i_ref = ref(x)
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
        y, i = sharded(snn.shard(x, m, dims=dims, align=2))
        torch.testing.assert_close(snn.gather(y, m, dims=dims), y_ref)
        assert torch.equal(snn.gather(i, m, dims=dims), i_ref)
    return True


@pytest.mark.parametrize("domain,dims", [(2, (2,)), (3, (2,)), ((2, 2), (2, 3))])
def test_return_indices_are_global(run, domain, dims):
    world = domain if isinstance(domain, int) else 4
    assert all(run(world, _indices, domain, dims))


def test_max_unpool_round_trip(run):
    cases = [(PoolUnpool(nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)), (2, 3, 14, 6), 2),
             (PoolUnpool(nn.MaxPool2d(3, 2, 1, return_indices=True), nn.MaxUnpool2d(3, 2, 1)), (2, 3, 13, 5), 2),
             (PoolUnpool(nn.MaxPool2d(3, 2, 1, return_indices=True), nn.MaxUnpool2d(3, 2, 1), (14, 6)),
              (2, 3, 14, 6), 2),
             (PoolUnpool(nn.MaxPool1d(4, 2, 1, return_indices=True), nn.MaxUnpool1d(4, 2, 1)), (2, 3, 14), 2),
             (PoolUnpool(nn.MaxPool3d(2, return_indices=True), nn.MaxUnpool3d(2)), (1, 2, 10, 4, 4), 2)]
    for domain in (2, 3):
        run(domain, _check_many, cases, domain)


# A dilated pool picks positions further than its kernel from the window start (torch's
# MaxUnpool accepts its indices): the halos are sized by how far the indices reach, not by the
# unpool's kernel, which used to make scatter_ raise on one rank while its neighbour waited.
DILATED_UNPOOL = [
    (PoolUnpool(nn.MaxPool1d(3, 3, 1, dilation=2, return_indices=True), nn.MaxUnpool1d(3, 3, 1), (12,)),
     (2, 3, 12), 3),
    (PoolUnpool(nn.MaxPool2d((3, 2), (3, 2), (1, 0), dilation=(2, 1), return_indices=True),
                nn.MaxUnpool2d((3, 2), (3, 2), (1, 0)), (12, 6)), (2, 3, 12, 6), 3),
]


@pytest.mark.parametrize("domain", [2, 3])
def test_max_unpool_of_a_dilated_pool(run, domain):
    run(domain, _check_many, DILATED_UNPOOL, domain)


def test_max_unpool_2x2_mesh(run):
    cases = [(PoolUnpool(nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)), (1, 2, 8, 8), 2),
             (PoolUnpool(nn.MaxPool2d(3, 3, 1, dilation=2, return_indices=True), nn.MaxUnpool2d(3, 3, 1), (12, 12)),
              (1, 2, 12, 12), 3)]
    run(4, _check_many, cases, (2, 2), (2, 3))


# --- adaptive pooling -----------------------------------------------------------------------


def _check_replicated(ref, shape, domain, dims):
    """Output replicated on every rank (global pooling): compare it directly, backward exactly."""
    m = mesh(domain)
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
    x = _input(shape).requires_grad_()
    y_ref = ref(x)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(0), dtype=y_ref.dtype)
    (y_ref * g).sum().backward()
    x_loc = snn.shard(x.detach(), m, dims=dims).requires_grad_()
    y = sharded(x_loc)
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-12, rtol=1e-12)
    snn.losses.share((y * g).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_loc.grad, m, dims=dims), x.grad, atol=1e-12, rtol=1e-12)
    return True


GLOBAL_CASES = [
    (nn.AdaptiveAvgPool2d(1), (2, 3, 11, 7)),
    (nn.AdaptiveMaxPool2d(1), (2, 3, 11, 7)),
    (nn.AdaptiveAvgPool2d((1, 3)), (2, 3, 11, 7)),
    (nn.AdaptiveMaxPool2d((1, None)), (2, 3, 11, 7)),
    (nn.AdaptiveAvgPool1d(1), (2, 3, 13)),
    (nn.AdaptiveMaxPool3d((1, 2, 2)), (1, 2, 9, 5, 4)),
]


def _global_many(domain, dims):
    for ref, shape in GLOBAL_CASES:
        if len(dims) <= len(shape) - 2 and all(ref.output_size if isinstance(ref.output_size, int) else
                                               ref.output_size[d - 2] == 1 for d in dims):
            _check_replicated(ref, shape, domain, dims)
    return True


@pytest.mark.parametrize("domain,dims", [(1, (2,)), (2, (2,)), (3, (2,)), (4, (2,)), ((2, 2), (2, 3))])
def test_global_adaptive_pool(run, domain, dims):
    world = domain if isinstance(domain, int) else 4
    assert all(run(world, _global_many, domain, dims))


def _binned_many(domain, dims):
    m = mesh(domain)
    cases = [(nn.AdaptiveAvgPool2d((6, 3)), (2, 3, 13, 7)),
             (nn.AdaptiveMaxPool2d((5, 3)), (2, 3, 13, 7)),
             (nn.AdaptiveAvgPool2d((13, 7)), (2, 3, 13, 7)),
             (nn.AdaptiveMaxPool1d(6), (2, 3, 17)),
             (nn.AdaptiveAvgPool3d((5, 4, 2)), (1, 2, 10, 9, 4))]
    for ref, shape in cases:
        if len(dims) <= len(shape) - 2:
            sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
            check_against_reference(ref, _input(shape), m, dims=dims, sharded=sharded)
    return True


@pytest.mark.parametrize("domain,dims", [(2, (2,)), (3, (2,)), (4, (2,)), ((2, 2), (2, 3))])
def test_adaptive_pool_other_sizes(run, domain, dims):
    world = domain if isinstance(domain, int) else 4
    assert all(run(world, _binned_many, domain, dims))


def _global_on_empty_slabs(sizes):
    """Global adaptive pools where one rank's slab is empty (a deep stage on many ranks): torch's
    value and gradient (a line of -inf included: the empty slab's candidate never owns the
    maximum)."""
    m = mesh(len(sizes))
    x = _input((2, 3, sum(sizes), 5))
    x[1, 2, :, 3] = -float("inf")
    for ref in (nn.AdaptiveAvgPool2d(1), nn.AdaptiveMaxPool2d(1), nn.AdaptiveMaxPool2d((1, None))):
        xr = x.clone().requires_grad_()
        want = ref(xr) if not isinstance(ref, nn.AdaptiveAvgPool2d) else ref(xr.nan_to_num(neginf=0))
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=want.dtype)
        (want * g).sum().backward()
        local = _slab(x, sizes, m).clone().requires_grad_()
        pool = snn.convert(copy.deepcopy(ref), m)
        got = pool(local) if not isinstance(ref, nn.AdaptiveAvgPool2d) else pool(local.nan_to_num(neginf=0))
        snn.losses.share((got * g).sum(), m).backward()
        torch.testing.assert_close(got, want.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(local.grad, _slab(xr.grad, sizes, m), atol=1e-12, rtol=1e-12)
    return True


@pytest.mark.parametrize("sizes", [(5, 0), (0, 2, 3), (2, 0, 3)])
def test_global_adaptive_pool_takes_empty_slabs(run, sizes):
    """Refused on every rank before session 67 (the guard fuzzer's pooled heads after a deep stage)."""
    assert all(run(len(sizes), _global_on_empty_slabs, sizes))


def _binned_without_bins(domain, dims, sizes):
    """Binned sizes where some ranks hold no bin start (more ranks than output positions, empty
    or thin slabs whose bins reach past the next rank): those ranks hold empty output slabs,
    the others' bins read rows from several ranks away."""
    m = mesh(domain)
    cases = [(nn.AdaptiveAvgPool1d(2), (1, 2, 6)), (nn.AdaptiveMaxPool1d(3), (2, 2, 6)),
             (nn.AdaptiveAvgPool2d((2, 3)), (2, 3, 6, 5)), (nn.AdaptiveMaxPool2d((4, 2)), (1, 2, 6, 6))]
    for ref, shape in cases:
        if len(dims) <= len(shape) - 2:
            sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
            check_against_reference(ref, _input(shape), m, dims=dims, sizes=sizes, sharded=sharded)
    return True


@pytest.mark.parametrize("domain,dims,sizes", [(2, (2,), (4, 2)), (3, (2,), (1, 0, 5)), (4, (2,), (2, 1, 1, 2)),
                                               (4, (2,), (0, 6, 0, 0))], ids=str)
def test_adaptive_pool_ranks_without_bins(run, domain, dims, sizes):
    # Refused before session 67 ("leaves rank(s) without a bin": about a quarter of the adaptive
    # pool fuzzer's examples), e.g. torchvision's AdaptiveAvgPool2d((7, 7)) on 8 ranks.
    assert all(run(domain, _binned_without_bins, domain, dims, sizes))


# --- errors -------------------------------------------------------------------------------


def _slab(x, sizes, m):
    r = m.get_local_rank("domain")
    return x.narrow(2, sum(sizes[:r]), sizes[r])


def _errors():
    m = mesh(2)
    with pytest.raises(snn.ShardingError, match="multiple of 2"):
        snn.convert(nn.MaxPool2d(2), m)(_slab(_input((1, 2, 12, 4)), (5, 7), m))
    with pytest.raises(ValueError, match="at most half"):
        snn.convert(nn.AvgPool1d(2, padding=2), m)(_slab(_input((1, 2, 6)), (4, 2), m))
    with pytest.raises(snn.ShardingNotImplementedError, match="return_indices"):
        snn.convert(nn.AdaptiveMaxPool2d(1, return_indices=True), m)
    return True


def test_bad_input_raises_on_every_rank(run):
    assert all(run(2, _errors))


def test_pool_files_and_classes():
    """Window pools, adaptive pools and unpooling live in their own files, as real classes."""
    from sharded_nn.layers import adaptive_pool, pool, unpool

    assert pool.ShardedAdaptiveAvgPool2d is adaptive_pool.ShardedAdaptiveAvgPool2d  # old import path
    assert pool.ShardedMaxUnpool2d is unpool.ShardedMaxUnpool2d
    for module, names in ((pool, ("MaxPool", "AvgPool")), (adaptive_pool, ("AdaptiveAvgPool", "AdaptiveMaxPool")),
                          (unpool, ("MaxUnpool",))):
        for name in names:
            for n in (1, 2, 3):
                cls = getattr(module, f"Sharded{name}{n}d")
                assert cls.__module__ == module.__name__ and cls.__doc__ and cls._spatial_dims == n
                assert issubclass(cls, getattr(nn, f"{name}{n}d"))


def _lp_pool(domain, nd, p, kernel, stride, ceil):
    # nn.LPPool*d / F.lp_pool*d: the guard computes torch's formula with the sharded average pool
    # (before session 60 they were reported by convert and refused at run time).
    import warnings

    m = mesh(domain)
    torch.manual_seed(0)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
    # (Softplus: a power 1.5 or 1/3 of a negative average is NaN, on one device too.)
    ref = nn.Sequential(conv(2, 3, 3, padding=1), nn.Softplus(), getattr(nn, f"LPPool{nd}d")(p, kernel, stride, ceil),
                        conv(3, 2, 1)).double()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sharded = snn.convert(copy.deepcopy(ref), m)
    assert not w, [str(a.message) for a in w]
    a = stride if stride is not None else (kernel if isinstance(kernel, int) else kernel[0])
    a = a if isinstance(a, int) else a[0]
    sizes = {2: (3 * a, 2 * a + 1), 3: (2 * a, 2 * a, a + 1)}.get(domain) if isinstance(domain, int) else None
    n0 = sum(sizes) if sizes else 4 * a + 1
    x = torch.rand(2, 2, n0, *([5] * (nd - 1)), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dims = (2,) if isinstance(domain, int) else (2, 3)
    check_against_reference(ref, x, m, sharded=sharded, dims=dims, sizes=sizes, align=a)
    return True


@pytest.mark.parametrize(
    "domain,nd,p,kernel,stride,ceil",
    [(2, 1, 2, 3, 2, False), (3, 2, 1.5, (2, 3), None, False), (2, 2, 3, 2, 2, True), ((2, 2), 2, 2, 2, (2, 1), False),
     (2, 3, 2, (2, 2, 1), None, True)],
)
def test_lp_pool_is_exact(run, domain, nd, p, kernel, stride, ceil):
    from .harness import world_of

    assert all(run(world_of(domain), _lp_pool, domain, nd, p, kernel, stride, ceil))
