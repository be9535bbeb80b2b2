"""Halo exchange (``comm.halo_cat``, with and without edge padding, and the async ``comm.halo_exchange``) against plain indexing.

The reference for rank r's extended slab is ``x.index_select(dim, arange(a - left, b + right) % S)``
on the full tensor: the halos are the neighbours' edge positions, wrapped around for periodic
specs. Backward: per-rank losses ``(ext_r * W_r).sum()`` sum to the global loss
``sum_r (ref_ext_r * W_r).sum()``, whose autograd gradient on the full tensor must equal, slab by
slab, the gradient that the exchange returns to each rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn import Layout, ShardingError, comm
from sharded_nn.comm import HaloSpec

from .harness import mesh

# Few examples, and no shrinking: every failing example restarts a pool, so shrinking is slow.
MP = settings(
    max_examples=10,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ext_index(lay: Layout, r: int, left: int, right: int) -> torch.Tensor:
    sl = lay.slice(r)
    return torch.arange(sl.start - left, sl.stop + right) % lay.size


def _extend(x_loc, spec, ring, mode):
    """The extended slab and the (left, right) halos, through halo_cat or halo_exchange."""
    r = ring.index
    if mode == "pad":
        # Constant padding written around the extended slab in the same buffer (a domain edge's
        # zero padding in ``window.extend``): other widths on every rank, checked, then cut off.
        pl, pr, d = 1 + r % 2, r % 3, spec.dim
        full = comm.halo_cat(x_loc, spec, ring, pad=(pl, pr), value=3.5)
        n_full = full.shape[d]
        assert torch.all(full.narrow(d, 0, pl) == 3.5) and torch.all(full.narrow(d, n_full - pr, pr) == 3.5)
        ext = full.narrow(d, pl, n_full - pl - pr)
        lw, rw = spec.left[r], spec.right[r]
        n = x_loc.shape[d]
        return ext, ext.narrow(d, 0, lw), ext.narrow(d, lw + n, rw)
    if mode == "cat":
        ext = comm.halo_cat(x_loc, spec, ring)
        lw, rw = spec.left[r], spec.right[r]
        n = x_loc.shape[spec.dim]
        left = ext.narrow(spec.dim, 0, lw)
        right = ext.narrow(spec.dim, lw + n, rw)
        return ext, left, right
    handle = comm.halo_exchange(x_loc, spec, ring)
    # Work that overlaps with the exchange in flight, on the autograd alias ``handle.x`` (whose
    # backward returns the halo gradients to the neighbours).
    inner = handle.x * 1.0
    left, right = handle.wait()
    # A zero-width halo comes back as None (or, equally fine, as a zero-width tensor).
    for halo, width in ((left, spec.left[r]), (right, spec.right[r])):
        assert (halo.shape[spec.dim] if halo is not None else 0) == width
    ext = torch.cat([t for t in (left, inner, right) if t is not None], spec.dim)
    empty = x_loc.narrow(spec.dim, 0, 0)
    return ext, (left if left is not None else empty), (right if right is not None else empty)


def _halo_case(world, shape, dim, align, left, right, periodic, seed, mode):
    m = mesh(world)
    ring = comm.axis_peers(m, "domain")
    me = ring.index
    assert ring.size == world
    x = _rand(shape, seed)
    lay = Layout.balanced(shape[dim], world, align)
    spec = HaloSpec(dim, tuple(left), tuple(right), periodic)
    spec.check(lay.sizes, "test")

    x_loc = snn.shard(x, m, dims=(dim,), align=align).requires_grad_()
    ext, lh, rh = _extend(x_loc, spec, ring, mode)

    idx = _ext_index(lay, me, left[me], right[me])
    ref = x.index_select(dim, idx)
    assert torch.equal(ext.detach(), ref)
    sl = lay.slice(me)
    assert torch.equal(lh.detach(), x.index_select(dim, torch.arange(sl.start - left[me], sl.start) % lay.size))
    assert torch.equal(rh.detach(), x.index_select(dim, torch.arange(sl.stop, sl.stop + right[me]) % lay.size))

    # Backward against autograd through plain indexing of the full tensor.
    xr = x.clone().requires_grad_()
    total = 0.0
    weights = []
    for r in range(world):
        ref_r = xr.index_select(dim, _ext_index(lay, r, left[r], right[r]))
        w = _rand(ref_r.shape, 1000 * seed + r + 1)
        weights.append(w)
        total = total + (ref_r * w).sum()
    total.backward()
    (ext * weights[me]).sum().backward()
    idx_slab = [slice(None)] * x.dim()
    idx_slab[dim] = sl
    torch.testing.assert_close(x_loc.grad, xr.grad[tuple(idx_slab)], rtol=1e-13, atol=1e-13)
    return True


def _run_case(run, world, shape, dim, align, left, right, periodic, seed=0):
    for mode in ("cat", "pad", "exchange"):
        assert run(world, _halo_case, world, shape, dim, align, left, right, periodic, seed, mode) == [True] * world


@pytest.mark.parametrize(
    ("world", "shape", "dim", "align", "left", "right", "periodic"),
    [
        # P = 1: nothing to exchange, or a wrap onto itself.
        (1, (2, 3, 7), 2, 1, (0,), (0,), False),
        (1, (2, 3, 7), 2, 1, (2,), (3,), True),
        (1, (1, 2, 5, 3), 2, 1, (5,), (0,), True),
        # P = 2, non-periodic and periodic (left and right neighbour are the same rank).
        (2, (2, 3, 9, 2), 2, 1, (0, 2), (1, 0), False),
        (2, (2, 3, 9, 2), 2, 1, (3, 1), (2, 4), True),
        (2, (1, 2, 10), 2, 4, (1, 4), (2, 0), True),
        (2, (1, 2, 10), -1, 4, (0, 0), (0, 0), True),
        # P = 3, 4: differing and zero widths, uneven slabs.
        (3, (1, 2, 11, 3), 2, 1, (0, 3, 0), (1, 0, 0), False),
        (3, (1, 2, 11, 3), 2, 2, (1, 2, 3), (3, 0, 2), True),
        (4, (2, 13, 3), 1, 1, (0, 1, 2, 3), (3, 2, 1, 0), False),
        (4, (2, 13, 3), 1, 3, (1, 0, 3, 2), (0, 2, 1, 3), True),
        # Halos along the last dim of a point-like layout.
        (3, (3, 8), 1, 1, (2, 2, 2), (2, 2, 2), True),
    ],
)
def test_halo(run, world, shape, dim, align, left, right, periodic):
    _run_case(run, world, shape, dim % len(shape), align, left, right, periodic)


@pytest.mark.parametrize(
    ("world", "left", "right", "periodic"),
    [
        (2, (0, 1), (0, 0), False),  # rank 0 receives nothing but sends its tail to rank 1
        (2, (0, 0), (1, 0), False),  # rank 1 receives nothing but sends its head to rank 0
        (3, (0, 0, 2), (0, 0, 0), False),  # rank 1 only sends
        (3, (0, 1, 0), (0, 0, 1), True),  # rank 1 only sends, in a ring
    ],
)
def test_halo_exchange_backward_on_rank_without_halos(run, world, left, right, periodic):
    """A rank that receives no halo (``wait()`` gives ``(None, None)``) still sent its edges.

    The gradient of those edges lives on the neighbour and must come back in the backward;
    it can only do so if the sending rank takes part in the backward exchange (through
    ``handle.x``, even though its ``wait()`` outputs are not part of the loss).
    """
    shape = (1, 2, 3 * world)
    assert run(world, _halo_case, world, shape, 2, 1, left, right, periodic, 5, "exchange") == [True] * world


def _unused_halos_case(world, use_on_rank):
    """Halos fetched but used only on rank ``use_on_rank`` (-1: on none): the backward still matches."""
    m = mesh(world)
    ring = comm.axis_peers(m, "domain")
    lay = Layout.balanced(4 * world, world)
    x = _rand((1, 2, lay.size), 3)
    spec = HaloSpec(2, (0,) + (1,) * (world - 1), (1,) * (world - 1) + (0,))
    x_loc = snn.shard(x, m, dims=(2,)).requires_grad_()
    handle = comm.halo_exchange(x_loc, spec, ring)
    w = _rand(x_loc.shape, 10 + ring.index)
    loss = (handle.x * w).sum()
    left, right = handle.wait()
    gl = gr = None
    if ring.index == use_on_rank:
        if left is not None:
            gl = _rand(left.shape, 20)
            loss = loss + (left * gl).sum()
        if right is not None:
            gr = _rand(right.shape, 21)
            loss = loss + (right * gr).sum()
    loss.backward()
    # Expected: w, plus the gradients that rank use_on_rank sent back for this rank's edges.
    expected = w.clone()
    n = x_loc.shape[2]
    if use_on_rank == ring.index + 1:  # its left halo is this rank's tail
        expected[..., n - 1 :] += _rand((1, 2, 1), 20)
    if use_on_rank >= 0 and use_on_rank == ring.index - 1:  # its right halo is this rank's head
        expected[..., :1] += _rand((1, 2, 1), 21)
    torch.testing.assert_close(x_loc.grad, expected, rtol=0, atol=0)
    return True


@pytest.mark.parametrize(("world", "use_on_rank"), [(2, -1), (2, 0), (3, 1)])
def test_halo_exchange_backward_with_unused_halos(pools, world, use_on_rank):
    """``handle.x`` promises a backward on every rank "even on a rank whose halos are unused"."""
    assert pools.run(world, _ready) == [True] * world  # start the pool outside the short timeout
    assert pools.run(world, _unused_halos_case, world, use_on_rank, timeout=10) == [True] * world


@st.composite
def halo_cases(draw):
    world = draw(st.integers(1, 4))
    align = draw(st.integers(1, 3))
    blocks = draw(st.integers(world, 4 * world))
    size = blocks * align - draw(st.integers(0, align - 1))
    sizes = Layout.balanced(size, world, align).sizes
    periodic = draw(st.booleans())
    left, right = [], []
    for r in range(world):
        has_left = r > 0 or periodic
        has_right = r < world - 1 or periodic
        left.append(draw(st.integers(0, sizes[(r - 1) % world])) if has_left else 0)
        right.append(draw(st.integers(0, sizes[(r + 1) % world])) if has_right else 0)
    seed = draw(st.integers(0, 1000))
    return world, (2, size, 2), 1, align, tuple(left), tuple(right), periodic, seed


@MP
@given(halo_cases())
def test_halo_property(pools, case):
    world, shape, dim, align, left, right, periodic, seed = case
    _run_case(pools.run, world, shape, dim, align, left, right, periodic, seed)


# ---------------------------------------------------------------------------------------------
# Two sharded dims on a 2x2 mesh: exchanging one after the other fills the corners
# ---------------------------------------------------------------------------------------------


def _corner_case(shape, spec0, spec1, seed, mode):
    m = mesh((2, 2))
    rings = comm.axis_peers(m, "domain0"), comm.axis_peers(m, "domain1")
    c = (rings[0].index, rings[1].index)
    assert c == (m.get_local_rank("domain0"), m.get_local_rank("domain1"))
    specs = HaloSpec(2, *spec0), HaloSpec(3, *spec1)
    x = _rand(shape, seed)
    lays = Layout.balanced(shape[2], 2), Layout.balanced(shape[3], 2)
    for s, lay in zip(specs, lays):
        s.check(lay.sizes, "test")

    x_loc = snn.shard(x, m, dims=(2, 3)).requires_grad_()
    ext = x_loc
    for s, ring in zip(specs, rings):
        ext, _, _ = _extend(ext, s, ring, mode)

    def ref_ext(t, c0, c1):
        i0 = _ext_index(lays[0], c0, specs[0].left[c0], specs[0].right[c0])
        i1 = _ext_index(lays[1], c1, specs[1].left[c1], specs[1].right[c1])
        return t.index_select(2, i0).index_select(3, i1)

    assert torch.equal(ext.detach(), ref_ext(x, *c))

    xr = x.clone().requires_grad_()
    total, weights = 0.0, {}
    for c0 in range(2):
        for c1 in range(2):
            e = ref_ext(xr, c0, c1)
            weights[c0, c1] = _rand(e.shape, 7 + 10 * c0 + c1)
            total = total + (e * weights[c0, c1]).sum()
    total.backward()
    (ext * weights[c]).sum().backward()
    sl = snn.local_slices(shape, m, dims=(2, 3))
    torch.testing.assert_close(x_loc.grad, xr.grad[sl], rtol=1e-13, atol=1e-13)
    return c


@pytest.mark.parametrize("mode", ["cat", "exchange"])
@pytest.mark.parametrize(
    ("shape", "spec0", "spec1"),
    [
        ((1, 2, 7, 6), ((0, 2), (1, 0), False), ((0, 1), (2, 0), False)),
        ((2, 1, 6, 5), ((1, 2), (3, 1), True), ((2, 1), (1, 2), True)),
        ((1, 1, 5, 8), ((0, 3), (2, 0), False), ((4, 1), (0, 3), True)),
    ],
)
def test_halo_corners_2x2(run, shape, spec0, spec1, mode):
    res = run(4, _corner_case, shape, spec0, spec1, 3, mode)
    assert sorted(res) == [(0, 0), (0, 1), (1, 0), (1, 1)]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _check_too_wide(world, size, left, right, periodic):
    m = mesh(world)
    x = _rand((1, 2, size), 0)
    x_loc = snn.shard(x, m, dims=(2,))
    # Sizes agreed by all ranks from their local shapes, as a layer would.
    (lay,) = comm.gather_layouts(x_loc.shape, m, (2,), what="test")
    assert lay.sizes == Layout.balanced(size, world).sizes
    spec = HaloSpec(2, left, right, periodic)
    match = r"MyConv: rank \d needs a (left|right) halo of \d+ along dim 2.*holds only"
    with pytest.raises(ShardingError, match=match):
        spec.check(lay.sizes, "MyConv")
    return True


@pytest.mark.parametrize(
    ("world", "size", "left", "right", "periodic"),
    [
        (2, 5, (0, 4), (1, 0), False),  # sizes (3, 2): rank 1 wants 4 from rank 0 which holds 3
        (2, 5, (0, 1), (3, 0), False),  # rank 0 wants 3 from rank 1 which holds 2
        (3, 7, (0, 4, 1), (1, 1, 0), False),  # rank 1 wants 4 from rank 0 which holds 3
        (3, 7, (3, 1, 1), (1, 1, 1), True),  # rank 0 wraps to rank 2 which holds 2
        (1, 4, (5,), (0,), True),  # a single periodic rank reading more than itself
    ],
)
def test_halo_check_too_wide(run, world, size, left, right, periodic):
    assert run(world, _check_too_wide, world, size, left, right, periodic) == [True] * world


def _spec_for_wrong_ring():
    m = mesh(2)
    ring = comm.axis_peers(m, "domain")
    x_loc = torch.zeros(1, 1, 3, dtype=torch.float64)
    # Widths for 3 ranks on a ring of 2 (e.g. a spec planned for another mesh axis).
    spec = HaloSpec(2, (0, 1, 1), (1, 1, 0))
    with pytest.raises(ValueError, match=r"\b3\b.*\b2\b|\b2\b.*\b3\b"):
        comm.halo_cat(x_loc, spec, ring)
    with pytest.raises(ValueError, match=r"\b3\b.*\b2\b|\b2\b.*\b3\b"):
        comm.halo_exchange(x_loc, spec, ring)
    return True


def test_halo_spec_for_wrong_ring_raises_everywhere(pools):
    # A short timeout: a hang here is the bug (one rank raises, the other waits for its peer).
    assert pools.run(2, _ready) == [True, True]  # start the pool outside the short timeout
    assert pools.run(2, _spec_for_wrong_ring, timeout=10) == [True, True]


def test_halo_check_accepts_exact_width():
    spec = HaloSpec(2, (0, 3, 2), (3, 2, 0))
    spec.check((3, 3, 2), "ok")
    spec = HaloSpec(2, (2, 3), (2, 3), periodic=True)
    spec.check((3, 2), "ok")
    match = r"x: rank 1 needs a left halo of 3 along dim 2, but its left neighbour \(rank 0\) holds only 2"
    with pytest.raises(ShardingError, match=match):
        spec.check((2, 3), "x")


@pytest.mark.parametrize(
    ("left", "right", "periodic", "match"),
    [
        ((0, 1), (1,), False, "equal-length non-negative"),
        ((0, -1), (1, 0), False, "equal-length non-negative"),
        ((1, 1), (1, 0), False, "without periodic wrap"),
        ((0, 1), (1, 1), False, "without periodic wrap"),
        # No ranks at all: a clear ValueError, not an IndexError (or silent acceptance).
        ((), (), False, "HaloSpec"),
        ((), (), True, "HaloSpec"),
    ],
)
def test_halo_spec_validation(left, right, periodic, match):
    with pytest.raises(ValueError, match=match):
        HaloSpec(2, left, right, periodic)


def test_send_widths():
    spec = HaloSpec(1, (0, 2, 3), (4, 5, 0))
    # (to the left, to the right): what the neighbours receive from this rank.
    assert [spec.send_widths(r) for r in range(3)] == [(0, 2), (4, 3), (5, 0)]
    spec = HaloSpec(1, (1, 2, 3), (4, 5, 6), periodic=True)
    assert [spec.send_widths(r) for r in range(3)] == [(6, 2), (4, 3), (5, 1)]


def _ready():
    return True
