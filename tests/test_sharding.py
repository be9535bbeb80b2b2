"""shard / local_slices / gather on real process groups (world sizes 1-4, a 2x2 mesh, a data axis)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn import Layout, ShardingError

from .harness import mesh, world_of

# Few examples, and no shrinking: every failing example restarts a pool, so shrinking is slow.
MP = settings(
    max_examples=10,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _full(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def _coords(m, dims):
    axes = snn.domain_axes(m)
    return tuple(m.get_local_rank(a) for a in axes[: len(dims)])


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


def _roundtrip(domain, data, shape, dims, align, seed):
    m = mesh(domain, data)
    x = _full(shape, seed)
    sl = snn.local_slices(x.shape, m, dims=dims, align=align)
    x_loc = snn.shard(x, m, dims=dims, align=align)
    # shard == x[local_slices]
    assert torch.equal(x_loc, x[sl])
    assert x_loc.is_contiguous()
    # The slab owns its memory: it does not keep x alive.
    assert x_loc.untyped_storage().nbytes() == x_loc.numel() * x_loc.element_size()
    assert x_loc.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    # Only the sharded dims are cut.
    for d in range(x.dim()):
        if d not in [dd % x.dim() for dd in dims]:
            assert sl[d] == slice(None)
    # Sizes follow the balanced rule on each domain axis.
    axes = snn.domain_axes(m)
    aligns = (align,) * len(dims) if isinstance(align, int) else align
    for k, d in enumerate(dims):
        lay = Layout.balanced(shape[d], m.size(m._get_mesh_dim_by_name(axes[k])), aligns[k])
        assert sl[d] == lay.slice(m.get_local_rank(axes[k]))
    y = snn.gather(x_loc, m, dims=dims)
    assert torch.equal(y, x)
    return dist.get_rank(), _coords(m, dims), tuple((s.start, s.stop) for s in (sl[d] for d in dims))


def _check_tiling(results, shape, dims):
    """The slabs of all ranks of one sample tile the sharded dims exactly once."""
    cover = torch.zeros([shape[d] for d in dims], dtype=torch.int64)
    for _, _, ranges in results:
        cover[tuple(slice(a, b) for a, b in ranges)] += 1
    assert bool((cover == 1).all()), cover


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("shape", "dims", "align"),
    [
        ((2, 3, 13, 4), (2,), 1),  # uneven
        ((2, 3, 13, 4), (2,), 3),  # align > 1, short last slab
        ((1, 2, 16, 3), (-2,), 4),  # negative dim, divisible
        ((2, 11, 5), (1,), 2),  # token tensor (B, L, C)
        ((9, 3), (0,), 1),  # point tensor (N, C)
    ],
)
def test_roundtrip(run, world, shape, dims, align):
    res = run(world, _roundtrip, world, 1, shape, dims, align, 0)
    _check_tiling(res, shape, [d % len(shape) for d in dims])


@MP
@given(
    world=st.integers(1, 4),
    size=st.integers(1, 40),
    align=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_property(pools, world, size, align, seed):
    if -(-size // align) < world:
        return
    shape = (1, 2, size, 3)
    res = pools.run(world, _roundtrip, world, 1, shape, (2,), align, seed)
    _check_tiling(res, shape, (2,))


@pytest.mark.parametrize(
    ("shape", "align"),
    [
        ((2, 3, 7, 5), 1),
        ((1, 2, 9, 10), (2, 4)),
        ((1, 1, 8, 8), 4),
    ],
)
def test_roundtrip_2x2(run, shape, align):
    res = run(4, _roundtrip, (2, 2), 1, shape, (2, 3), align, 1)
    _check_tiling(res, shape, (2, 3))
    # The 2-D coordinates of the four ranks are distinct: a genuine 2x2 decomposition.
    assert sorted(c for _, c, _ in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_roundtrip_2x2_one_dim(run):
    # Sharding only the first spatial dim on a 2x2 mesh: dims[0] is cut by domain0 only.
    res = run(4, _one_dim_on_2x2)
    assert sorted(res) == [(0, (0, 4)), (0, (0, 4)), (1, (4, 7)), (1, (4, 7))]


def _one_dim_on_2x2():
    m = mesh((2, 2))
    x = _full((1, 2, 7, 5), 3)
    sl = snn.local_slices(x.shape, m, dims=(2,))
    assert torch.equal(snn.shard(x, m, dims=(2,)), x[sl])
    return m.get_local_rank("domain0"), (sl[2].start, sl[2].stop)


# ---------------------------------------------------------------------------------------------
# shard(..., src=r): only one rank holds the tensor
# ---------------------------------------------------------------------------------------------


def _src_case(domain, data, shape, dims, align, src, dtype):
    m = mesh(domain, data)
    group = snn.domain_group(m)
    me = dist.get_rank(group)
    # Different data replicas hold different samples.
    data_index = m.get_local_rank("data") if snn.data_axis(m) else 0
    x = _full(shape, 100 + data_index, dtype)
    expected = snn.shard(x, m, dims=dims, align=align)
    got = snn.shard(x if me == src else None, m, dims=dims, align=align, src=src)
    assert got.dtype == dtype
    assert got.shape == expected.shape
    assert got.is_contiguous()
    assert torch.equal(got, expected)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_shard_from_src0(run, world, dtype):
    assert all(run(world, _src_case, world, 1, (2, 3, 11, 4), (2,), 2, 0, dtype))


def _src_noncontiguous_case():
    m = mesh(2)
    # A non-contiguous view that requires grad: the slab is a plain contiguous copy.
    x = _full((1, 2, 6, 9), 5).transpose(2, 3).requires_grad_()
    expected = snn.shard(x, m, dims=(2,)).detach()
    got = snn.shard(x if dist.get_rank() == 0 else None, m, dims=(2,), src=0)
    assert got.is_contiguous()
    assert torch.equal(got, expected)
    # gather of a non-contiguous slab.
    y = snn.gather(expected.transpose(2, 3), m, dims=(3,))
    assert torch.equal(y, x.detach().transpose(2, 3))
    return True


def test_shard_from_src_noncontiguous(run):
    assert run(2, _src_noncontiguous_case) == [True, True]


@pytest.mark.parametrize("world", [2, 3])
def test_shard_from_last_src(run, world):
    assert all(run(world, _src_case, world, 1, (1, 2, 10, 3), (2,), 1, world - 1, torch.float64))


def test_shard_from_src_2x2(run):
    assert all(run(4, _src_case, (2, 2), 1, (1, 2, 9, 7), (2, 3), (2, 1), 0, torch.float64))
    assert all(run(4, _src_case, (2, 2), 1, (1, 2, 9, 7), (2, 3), 1, 3, torch.float64))


def test_shard_from_src_data_axis(run):
    # src is a domain rank: in each data replica its own domain rank 0 holds its own sample.
    assert all(run(4, _src_case, 2, 2, (2, 3, 7, 2), (2,), 1, 0, torch.float64))


# ---------------------------------------------------------------------------------------------
# Data axis: sharding happens within the domain group only
# ---------------------------------------------------------------------------------------------


def _data_axis_case():
    m = mesh(2, 2)
    assert m.mesh_dim_names == ("data", "domain")
    assert snn.domain_size(m) == 2
    assert dist.get_world_size(snn.domain_group(m)) == 2
    d = m.get_local_rank("data")
    x = _full((2, 3, 9, 4), 200 + d)
    x_loc = snn.shard(x, m, dims=(2,))
    # Split over the 2 domain ranks, not the 4 ranks of the world.
    assert x_loc.shape[2] == Layout.balanced(9, 2).sizes[m.get_local_rank("domain")]
    y = snn.gather(x_loc, m, dims=(2,))
    # Each replica reassembles its own sample, not the other replica's.
    assert torch.equal(y, x)
    return d, m.get_local_rank("domain"), x_loc.shape[2]


def test_data_axis(run):
    res = run(4, _data_axis_case)
    assert sorted(res) == [(0, 0, 5), (0, 1, 4), (1, 0, 5), (1, 1, 4)]


# ---------------------------------------------------------------------------------------------
# gather autograd under the gradient convention
# ---------------------------------------------------------------------------------------------


def _loss_on_full(y, w):
    return (y * w).sum() + 0.5 * y.square().sum() + y.sum() ** 2 / y.numel()


def _gather_grad_case(domain, data, shape, dims, align, seed):
    m = mesh(domain, data)
    x = _full(shape, seed)
    w = _full(shape, seed + 1)
    # Single-device reference.
    xr = x.clone().requires_grad_()
    ref_loss = _loss_on_full(torch.sin(xr), w)
    ref_loss.backward()

    x_loc = snn.shard(x, m, dims=dims, align=align).requires_grad_()
    y_full = snn.gather(torch.sin(x_loc), m, dims=dims)
    assert y_full.requires_grad
    loss = snn.losses.share(_loss_on_full(y_full, w), m)
    # The reported value is the global loss on every rank.
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    loss.backward()
    sl = snn.local_slices(shape, m, dims=dims, align=align)
    torch.testing.assert_close(x_loc.grad, xr.grad[sl], rtol=1e-12, atol=1e-12)
    # Per-rank losses sum to the global loss: the sum of the per-rank share gradients of
    # y_full is the full gradient; reassembling the slab gradients gives the whole reference.
    g_full = snn.gather(x_loc.grad, m, dims=dims)
    torch.testing.assert_close(g_full, xr.grad, rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_backward(run, world):
    assert all(run(world, _gather_grad_case, world, 1, (2, 3, 10, 3), (2,), 3, 7))


def test_gather_backward_2x2(run):
    assert all(run(4, _gather_grad_case, (2, 2), 1, (1, 2, 7, 5), (2, 3), 1, 8))


def test_gather_backward_data_axis(run):
    assert all(run(4, _gather_grad_case, 2, 2, (2, 2, 7, 3), (2,), 1, 9))


def _gather_manual_grad_case(world):
    # By hand: y.backward(g / P) on every rank gives the exact slab gradient.
    m = mesh(world)
    x = _full((1, 2, 9), 11)
    g = _full((1, 2, 9), 12)
    x_loc = snn.shard(x, m, dims=(2,)).requires_grad_()
    y = snn.gather(x_loc * 3.0, m, dims=(2,))
    y.backward(g / snn.domain_size(m))
    sl = snn.local_slices(x.shape, m, dims=(2,))
    torch.testing.assert_close(x_loc.grad, 3.0 * g[sl], rtol=0, atol=1e-15)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_gather_manual_backward(run, world):
    assert all(run(world, _gather_manual_grad_case, world))


# ---------------------------------------------------------------------------------------------
# Bad input: the same clear error on every rank
# ---------------------------------------------------------------------------------------------


def _gather_unsharded_differ(world):
    m = mesh(world)
    r = dist.get_rank()
    x_loc = torch.zeros(2, 3 + (r == world - 1), 4, dtype=torch.float64)
    sizes = [3] * world
    sizes[-1] = 4
    match = re.escape(f"gather: dim 1 is not sharded but its size differs across ranks: {sizes}")
    with pytest.raises(ShardingError, match=match):
        snn.gather(x_loc, m, dims=(2,))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_gather_unsharded_dims_differ(run, world):
    assert run(world, _gather_unsharded_differ, world) == [True] * world


def _gather_ndim_differ():
    m = mesh(2)
    x_loc = torch.zeros((2, 3, 4) if dist.get_rank() == 0 else (2, 3, 4, 1), dtype=torch.float64)
    with pytest.raises(ShardingError, match=r"different ranks \(ndims\)"):
        snn.gather(x_loc, m, dims=(2,))
    return True


def test_gather_ndim_differs(run):
    assert run(2, _gather_ndim_differ) == [True, True]


def _gather_empty_slab():
    m = mesh(3)
    r = dist.get_rank()
    x_loc = torch.full((1, 2, 0 if r == 1 else 3), float(r), dtype=torch.float64, requires_grad=True)
    y = snn.gather(x_loc, m, dims=(2,))
    expected = torch.cat([torch.full((1, 2, 3), 0.0), torch.full((1, 2, 3), 2.0)], dim=2).double()
    (y * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    # Gradient convention: each rank's share of the replicated gradient, summed, on its own rows.
    want_grad = 3 * torch.arange(6.0, dtype=torch.float64).expand(1, 2, 6)[..., {0: slice(0, 3), 1: slice(3, 3), 2: slice(3, 6)}[r]]
    return torch.equal(y, expected), torch.allclose(x_loc.grad, want_grad)


def test_gather_empty_slab(run):
    # A deep stage can leave a rank without rows: gathering skips its empty slab.
    assert run(3, _gather_empty_slab) == [(True, True)] * 3


def _gather_not_tensor_product():
    m = mesh((2, 2))
    c0, c1 = m.get_local_rank("domain0"), m.get_local_rank("domain1")
    # Rank (0, 1) disagrees with rank (0, 0) on the size of row 0.
    s0 = 3 if (c0, c1) == (0, 1) else 2
    x_loc = torch.zeros(1, 1, s0, 2, dtype=torch.float64)
    with pytest.raises(ShardingError, match="tensor product"):
        snn.gather(x_loc, m, dims=(2, 3))
    return True


def test_gather_not_tensor_product(run):
    assert run(4, _gather_not_tensor_product) == [True] * 4


def _too_many_dims(world):
    m = mesh(world)
    x = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ShardingError, match=r"cannot shard 2 dims \(2, 3\) on a mesh with 1 domain axes"):
        snn.shard(x, m, dims=(2, 3))
    with pytest.raises(ShardingError, match=r"cannot shard 2 dims"):
        snn.local_slices(x.shape, m, dims=(2, 3))
    with pytest.raises(ShardingError, match=r"cannot shard 2 dims"):
        snn.shard(x if dist.get_rank() == 0 else None, m, dims=(2, 3), src=0)
    with pytest.raises(ShardingError, match=r"2 sharded dims \(2, 3\) but the mesh has only 1 domain axes"):
        snn.gather(x, m, dims=(2, 3))
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_too_many_dims(run, world):
    assert run(world, _too_many_dims, world) == [True] * world


def _too_small(domain, shape, dims, align):
    m = mesh(domain)
    x = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ShardingError, match="fewer than the"):
        snn.shard(x, m, dims=dims, align=align)
    with pytest.raises(ShardingError, match="fewer than the"):
        snn.local_slices(x.shape, m, dims=dims, align=align)
    # With src, the check runs after the shape broadcast: every rank still raises.
    with pytest.raises(ShardingError, match="fewer than the"):
        snn.shard(x if dist.get_rank() == 0 else None, m, dims=dims, align=align, src=0)
    return True


@pytest.mark.parametrize(
    ("domain", "shape", "dims", "align"),
    [
        (2, (1, 1, 1), (2,), 1),
        (3, (1, 2, 5, 4), (2,), 3),  # 2 blocks of 3 for 3 ranks
        (4, (1, 2, 3, 4), (-2,), 1),
        ((2, 2), (1, 1, 4, 1), (2, 3), 1),
    ],
)
def test_too_small(run, domain, shape, dims, align):
    world = world_of(domain)
    assert run(world, _too_small, domain, shape, dims, align) == [True] * world


def _bad_dims():
    m = mesh(2)
    x = torch.zeros(1, 2, 8, dtype=torch.float64)
    with pytest.raises(ShardingError, match="out of range"):
        snn.shard(x, m, dims=(3,))
    with pytest.raises(ShardingError, match="repeat a dim"):
        snn.local_slices(x.shape, m, dims=(2, -1))
    with pytest.raises(ShardingError, match="out of range"):
        snn.gather(x, m, dims=(5,))
    with pytest.raises(ShardingError, match="align needs one value per sharded dim"):
        snn.shard(x, m, dims=(2,), align=(2, 2))
    with pytest.raises(ValueError, match="x is None but src is None"):
        snn.shard(None, m, dims=(2,))
    return True


def test_bad_dims(run):
    assert run(2, _bad_dims) == [True, True]


def _src_rank_passes_none():
    # The src rank forgot its tensor: every rank must raise, not only src (which would leave the
    # others waiting in the shape broadcast).
    m = mesh(2)
    with pytest.raises(ValueError, match="src"):
        snn.shard(None, m, dims=(2,), src=1)
    return True


def test_src_rank_passes_none_raises_everywhere(pools):
    # A short timeout: a hang here is the bug (rank 0 stuck in the broadcast).
    assert pools.run(2, _ready) == [True, True]  # start the pool outside the short timeout
    assert pools.run(2, _src_rank_passes_none, timeout=10) == [True, True]


def _ready():
    return True
