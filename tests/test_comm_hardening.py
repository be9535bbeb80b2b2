"""Hardening of the comm layer (issue 8): process groups, message tags, layout agreement, autocast.

* Stale process groups: objects derived from a mesh (axis peers, flattened groups) belong to that
  mesh object; a mesh built after ``destroy_process_group`` gets new ones, although it compares
  equal to the old mesh.
* Message tags: every exchange reserves its own tags in program order, so exchanges of different
  layers in flight at the same time match on gloo even when ranks issue them in different orders.
* ``gather_layouts`` on a gloo side group (the path NCCL meshes take) gives the same layouts and
  errors as on the domain group itself.
* The comm autograd Functions under ``torch.autocast("cpu", torch.bfloat16)``.
"""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn import Layout, ShardingError, comm
from sharded_nn import functional as snf
from sharded_nn.comm import HaloSpec
from sharded_nn.comm import sizes as comm_sizes
from sharded_nn.comm.halo import HALO_TAGS

from .harness import mesh


def _rand(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _slab(x: torch.Tensor, dim: int, lay: Layout, r: int) -> torch.Tensor:
    sl = lay.slice(r)
    return x.narrow(dim, sl.start, sl.stop - sl.start).clone()


# --------------------------------------------------------------------------- stale process groups


def _attention_matches(m, seed: int) -> bool:
    """Ring attention on ``m`` (one domain axis) against SDPA on the full sequence, fwd + bwd."""
    q, k, v, g = (_rand((1, 2, 11, 4), seed + i) for i in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves)
    ref.backward(g)
    peers = comm.domain_peers(m)
    lay = Layout.balanced(11, peers.size)
    local = [_slab(t, 2, lay, peers.index).requires_grad_() for t in (q, k, v)]
    out = snf.ring_attention(*local, m)
    out.backward(_slab(g, 2, lay, peers.index))
    torch.testing.assert_close(out, _slab(ref.detach(), 2, lay, peers.index))
    for loc, leaf in zip(local, leaves):
        torch.testing.assert_close(loc.grad, _slab(leaf.grad, 2, lay, peers.index))
    return True


def _domain_sum_matches(m) -> bool:
    """``all_reduce_sum`` over the (flattened) domain group of ``m`` sums every rank's value."""
    world = dist.get_world_size()
    got = comm.all_reduce_sum(torch.tensor([float(dist.get_rank() + 1)]), snn.domain_group(m))
    assert got.item() == world * (world + 1) / 2, got
    return True


def _reinit_worker(store_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Two meshes: one domain axis (ring attention), and two domain axes (1, 2) whose domain group
    # is a flattened mesh (a process group made by torch's DeviceMesh._flatten).
    old = snn.init_mesh(domain=world, device_type="cpu")
    old_2d = snn.init_mesh(domain=(1, world), device_type="cpu")
    assert _attention_matches(old, 0) and _domain_sum_matches(old_2d)
    old_group = comm.domain_peers(old).group
    dist.destroy_process_group()
    # A new process group in the same process (a file store: the old TCP store went with the old
    # group), and new meshes that compare equal to the old ones. The old meshes stay alive, as
    # they would in a model that still holds them.
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    new = snn.init_mesh(domain=world, device_type="cpu")
    new_2d = snn.init_mesh(domain=(1, world), device_type="cpu")
    assert new == old and new_2d == old_2d  # why an equality-keyed cache returned the dead groups
    peers = comm.domain_peers(new)
    assert peers.group is not old_group
    assert _attention_matches(new, 10) and _domain_sum_matches(new_2d)
    # Derived objects die with their mesh: the per-mesh store does not keep groups alive.
    from sharded_nn import mesh as mesh_mod

    before = len(mesh_mod._STORE)
    del old, old_2d
    gc.collect()
    return {"ok": True, "freed": before - len(mesh_mod._STORE)}


def test_reinit_process_group_gets_fresh_groups(tmp_path):
    # Fresh processes (not the shared pool): the worker destroys its process group.
    out = snn.launch(_reinit_worker, 2, str(tmp_path), device_type="cpu", timeout=240)
    assert out["ok"]
    assert out["freed"] == 2, out  # the store entries of both old meshes went with them


# --------------------------------------------------------------------------- message tags


def _tags_in_step(world: int) -> list[int]:
    """After halos (open and periodic, edge ranks with nothing to send), ring attention, all-to-all
    and a ring pass, forward and backward, every rank's tag counter is at the same place."""
    m = mesh(world)
    peers = comm.axis_peers(m, "domain")
    x = _rand((2, 3, 4 * world + 1), 0).requires_grad_()
    lay = Layout.balanced(x.shape[2], world)
    x_loc = _slab(x.detach(), 2, lay, peers.index).requires_grad_()
    left = (0, *([1] * (world - 1)))
    open_spec = HaloSpec(2, left, (*([0] * (world - 1)), 0))  # only leftward halos; last rank sends none
    per_spec = HaloSpec(2, (1,) * world, (2,) * world, periodic=True)
    y = comm.halo_cat(x_loc, open_spec, peers).sum()
    y = y + comm.halo_add(comm.halo_cat(x_loc, per_spec, peers), per_spec, peers).sum()
    h = comm.halo_exchange(x_loc, per_spec, peers)
    inner = h.x
    lh, rh = h.wait()
    y = y + inner.sum() + lh.sum() + rh.sum()
    q = _rand((1, world, 3, 4), peers.index).requires_grad_()
    y = y + snf.ring_attention(q, q, q, m).sum() + snf.ulysses_attention(q, q, q, m).sum()
    y.backward()
    from_left = (*x_loc.shape[:2], lay.sizes[(peers.index - 1) % world])
    comm.ring_pass(peers, [x_loc.detach()], [from_left]).wait()
    return [comm.axis_peers(m, "domain").next_tags(1), comm.domain_peers(m).next_tags(1)]


@pytest.mark.parametrize("world", [2, 3])
def test_tag_counters_stay_in_step(run, world):
    out = run(world, _tags_in_step, world)
    assert all(o == out[0] for o in out), out
    # axis_peers and domain_peers of a one-axis mesh share one group, hence one counter.
    assert out[0][1] == out[0][0] + 1


def test_tag_blocks_wrap_without_overlap(monkeypatch):
    # Blocks stay within gloo's tag range and never straddle the wrap-around; a block handed out
    # after the wrap does not overlap the blocks just before it.
    from sharded_nn.comm import peers as peers_mod

    monkeypatch.setattr(peers_mod, "_TAG_SPAN", 10)
    counter = peers_mod._TagCounter()
    sizes = (4, 4, 4, 3, 3, 3, 3)
    blocks = [counter.take(n) - peers_mod._TAG_BASE for n in sizes]
    assert blocks == [0, 4, 0, 4, 7, 0, 3]
    for i, (start, n) in enumerate(zip(blocks, sizes)):
        assert 0 <= start and start + n <= 10
        if i + 1 < len(blocks):
            assert blocks[i + 1] >= start + n or blocks[i + 1] == 0  # next block follows, or wraps


def _reversed_in_flight(world: int, fixed_tag: bool) -> list[bool]:
    """Two layers' halo exchanges in flight at once, started in the opposite order on odd ranks.

    Stands for an exchange issued outside program order (a halo-gradient exchange started from a
    backward hook as soon as its gradient is ready, while another layer's exchange is in
    flight): the tags are reserved in program order on every rank, so gloo pairs every message
    with its own exchange whatever order the ranks issue them in. With one fixed tag (what every
    halo used before) gloo pairs them by arrival order and the layers receive each other's halos.
    """
    m = mesh(world)
    peers = comm.axis_peers(m, "domain")
    me = peers.index
    n = 4 * world + 1
    lay = Layout.balanced(n, world)
    spec = HaloSpec(2, (1,) * world, (1,) * world, periodic=True)  # same halo shapes in both layers
    xa, xb = _rand((2, 3, n), 1), _rand((2, 3, n), 2)
    loc_a = _slab(xa, 2, lay, me).requires_grad_()
    loc_b = _slab(xb, 2, lay, me).requires_grad_()
    if fixed_tag:
        tag_a = tag_b = peers.next_tags(HALO_TAGS)
    else:
        tag_a, tag_b = peers.next_tags(HALO_TAGS), peers.next_tags(HALO_TAGS)
    order = [("a", loc_a, tag_a), ("b", loc_b, tag_b)]
    if me % 2:
        order.reverse()
    handles = {name: comm.halo_exchange(t, spec, peers, tag=tag) for name, t, tag in order}
    ok = []
    losses = []
    for name, x, loc in (("a", xa, loc_a), ("b", xb, loc_b)):
        h = handles[name]
        inner = h.x
        left, right = h.wait()
        ext = torch.cat([left, inner, right], 2)
        sl = lay.slice(me)
        ref = x.index_select(2, torch.arange(sl.start - 1, sl.stop + 1) % n)
        ok.append(torch.equal(ext.detach(), ref))
        weight = _rand(ext.shape, 10 + me)
        losses.append((ext * weight).sum())
    if not fixed_tag:
        # Backward, one layer after the other in program order on every rank (a halo-gradient
        # exchange waits for its messages, so the ranks must reach them in the same order), on
        # the tags reserved in forward: against the gradient of the sum of all ranks' losses on
        # the full tensors.
        for loss in losses:
            loss.backward()
        ok.append(_grads_match(world, lay, (xa, xb), (loc_a, loc_b), me))
    return ok


def _grads_match(world, lay, fulls, locs, me) -> bool:
    n = lay.size
    total = [torch.zeros_like(x) for x in fulls]
    for r in range(world):
        sl = lay.slice(r)
        idx = torch.arange(sl.start - 1, sl.stop + 1) % n
        w = _rand((2, 3, len(idx)), 10 + r)
        for t in total:
            t.index_add_(2, idx, w)
    return all(torch.allclose(loc.grad, _slab(t, 2, lay, me)) for loc, t in zip(locs, total))


@pytest.mark.parametrize("world", [2, 3])
def test_halo_exchanges_in_flight_in_any_order(run, world):
    assert all(all(r) for r in run(world, _reversed_in_flight, world, False))


def test_fixed_tags_mix_up_exchanges_in_flight(run):
    # The hazard the per-call tags remove: with one tag for both layers, the odd rank's
    # messages land in the wrong layer's buffers (silently: the shapes match).
    out = run(2, _reversed_in_flight, 2, True)
    assert not all(all(r) for r in out), out


# --------------------------------------------------------------------------- layout agreement


def _side_group_layouts(domain) -> list:
    """``gather_layouts`` forced onto a gloo side group (as on NCCL meshes) on a fresh mesh."""
    m_main = mesh(domain)
    m_side = snn.init_mesh(domain=domain, device_type="cpu")
    saved = comm_sizes._needs_side_group
    comm_sizes._needs_side_group = lambda group: True
    try:
        side = comm.metadata_group(m_side)
    finally:
        comm_sizes._needs_side_group = saved
    assert side is not snn.domain_group(m_side) and dist.get_backend(side) == "gloo"
    dims = (2,) if isinstance(domain, int) else (2, 3)
    axes = snn.domain_axes(m_main)
    coords = [m_main.get_local_rank(a) for a in axes]
    # Uneven slabs: coordinate c holds 3 + c rows (and 2 + c columns on a 2-D mesh).
    shape = [2, 3, 3 + coords[0], 2 + (coords[1] if len(coords) > 1 else 0)]
    results = []
    for mm in (m_main, m_side):
        results.append(comm.gather_layouts(shape, mm, dims, what="t"))
        # A rank-asymmetric error raises on every rank alike, through either group.
        bad = list(shape)
        if dist.get_rank() == 0:
            bad[1] = 4
        try:
            comm.gather_layouts(bad, mm, dims, what="t")
            results.append(None)
        except ShardingError as e:
            results.append(str(e))
    # Ring attention's shape agreement (gather_ints) on the side group: rows by ring coordinate.
    peers = comm.domain_peers(m_side)
    assert peers.meta_group is side
    results.append(comm.gather_ints([peers.index, 7], peers))
    return results


@pytest.mark.parametrize("domain", [3, (2, 2)])
def test_gather_layouts_on_side_group(run, domain):
    world = domain if isinstance(domain, int) else 4
    out = run(world, _side_group_layouts, domain)
    for r in out:
        assert r == out[0]
        main, main_err, side, side_err, ints = r
        assert side == main
        assert main_err is not None and main_err == side_err and "differs across ranks" in main_err
        assert ints == [(i, 7) for i in range(world)]
    n_axes = 1 if isinstance(domain, int) else 2
    sizes = [lay.sizes for lay in out[0][0]]
    want = [tuple(3 + c for c in range(domain))] if n_axes == 1 else [(3, 4), (2, 3)]
    assert sizes == want


def _layouts_after_one_rank_changes() -> list:
    """The cache of validated layouts is keyed by gathered facts: one rank's slab changing
    (the last slab of a new input) is seen by every rank."""
    m = mesh(2)
    me = m.get_local_rank("domain")
    out = []
    for last in (5, 5, 4, 5):
        shape = (1, 2, 6 if me == 0 else last)
        out.append(comm.gather_layouts(shape, m, (2,), what="t")[0].sizes)
    return out


def test_gather_layouts_cache_sees_one_rank_change(run):
    out = run(2, _layouts_after_one_rank_changes)
    assert out[0] == out[1] == [(6, 5), (6, 5), (6, 4), (6, 5)]


# --------------------------------------------------------------------------- autocast


def _autocast_case(world: int) -> bool:
    m = mesh(world)
    peers = comm.axis_peers(m, "domain")
    me = peers.index
    n = 3 * world + 2
    lay = Layout.balanced(n, world)
    spec = HaloSpec(2, (1,) * world, (1,) * world, periodic=True)
    x = _rand((2, 4, n), 0, torch.bfloat16)
    w = _rand((4, 4, 3), 1, torch.float32)
    gw = _rand((4, 4), 2, torch.float32)

    def model(x_ext, reduce):
        # A bf16 tensor through halo_cat, an autocast conv (bf16 out), a float32 statistic summed
        # across ranks by all_reduce_sum and used in bf16 again.
        y = F.conv1d(x_ext, w)
        s = reduce(y.float().sum(2))  # (N, C) float32
        return (y * (s @ gw).to(y.dtype)[..., None]).float()

    # Single device: circular padding gives the same extended tensor.
    x_ref = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        ref = model(F.pad(x_ref, (1, 1), mode="circular"), lambda s: s)
    g = _rand(ref.shape, 3, torch.float32)
    ref.backward(g)

    x_loc = _slab(x, 2, lay, me).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        ext = comm.halo_cat(x_loc, spec, peers)
        assert ext.dtype == torch.bfloat16
        out = model(ext, lambda s: comm.all_reduce_sum(s, peers.group))
    out.backward(_slab(g, 2, lay, me))
    assert x_loc.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, _slab(ref.detach(), 2, lay, me), atol=0.1, rtol=0.02)
    torch.testing.assert_close(x_loc.grad.float(), _slab(x_ref.grad.float(), 2, lay, me), atol=0.2, rtol=0.03)
    return True


@pytest.mark.parametrize("world", [2])
def test_comm_functions_under_bf16_autocast(run, world):
    assert all(run(world, _autocast_case, world))
