"""Point clouds: PointCloudPartition, cross-part knn / radius, neighbour gathers, ghosts, PyG."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import sharded_nn as snn
from sharded_nn.points import PointCloudPartition, gather_neighbours, knn, radius, within_radius
from sharded_nn.points.partition import _assign_local, balanced_sizes

from .harness import mesh


def _cloud(n: int, seed: int = 0, dup: int = 10) -> torch.Tensor:
    """Random points with some exact duplicates and shared coordinates (ties for the cuts)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.rand(n, 3, generator=g, dtype=torch.float64)
    pos[:dup] = pos[dup : 2 * dup]  # duplicated points
    pos[2 * dup : 3 * dup, 0] = 0.5  # a plane of equal x
    return pos


def _rank(m) -> int:
    return snn.domain_group(m).rank()


# ---------------------------------------------------------------------------------------------
# Partition of a full cloud


def _partition_case(domain: int, method: str, n: int, batched: bool):
    m = mesh(domain)
    r = _rank(m)
    pos = _cloud(n)
    g = torch.Generator().manual_seed(1)
    f = torch.randn(2, n, 4, generator=g, dtype=torch.float64, requires_grad=True)
    part = PointCloudPartition(m, method=method)
    pos_in = pos.expand(2, -1, -1) if batched else pos
    pos_l, f_l = part(pos_in, f)
    sizes = part.sizes
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n and len(sizes) == domain
    assert pos_l.shape[-2] == sizes[r]
    torch.testing.assert_close(pos_l[0] if batched else pos_l, pos[part.index], rtol=0, atol=0)
    assert torch.equal(part.index, torch.sort(part.index).values)
    # Deterministic and the same on every rank: the local recomputation matches.
    assign = _assign_local(pos, balanced_sizes(n, domain), method)
    assert torch.equal(torch.nonzero(assign == r).squeeze(1), part.index)

    # restore: full output in the original order on every rank, replicated-gradient convention.
    y_l = f_l.square() * 3.0
    y = part.restore(y_l)
    torch.testing.assert_close(y, f.detach().square() * 3.0, rtol=0, atol=0)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    snn.losses.share((y * w).sum(), m).backward()
    grad = f.grad.clone()
    dist.all_reduce(grad, group=snn.domain_group(m))
    torch.testing.assert_close(grad, 6.0 * f.detach() * w, rtol=1e-12, atol=1e-12)
    return sizes


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["rcb", "morton"])
def test_partition_balanced_and_restore(run, domain, method):
    out = run(domain, _partition_case, domain, method, 203, domain == 3)
    assert all(o == out[0] for o in out)


def _coherence_case(domain: int):
    """RCB and Morton parts have far fewer boundary points (ghosts) than a random split."""
    m = mesh(domain)
    pos = _cloud(600, seed=3)
    counts = {}
    for method in ("rcb", "morton", "random"):
        if method == "random":
            part = PointCloudPartition(m)
            part(pos)
            perm = torch.randperm(600, generator=torch.Generator().manual_seed(0))
            sizes = part.sizes
            start = sum(sizes[: _rank(m)])
            part._plan.index = torch.sort(perm[start : start + sizes[_rank(m)]]).values
            part._plan.all_index = None
            pos_l = pos[part.index]
        else:
            part = PointCloudPartition(m, method=method)
            (pos_l,) = part(pos)
        gh = part.ghosts(pos_l, k=8)
        c = torch.tensor([gh.index.numel()])
        dist.all_reduce(c, group=snn.domain_group(m))
        counts[method] = int(c)
    assert counts["rcb"] < counts["random"] / 3, counts
    assert counts["morton"] < counts["random"] / 3, counts
    return counts


def test_partition_spatially_coherent(run):
    run(4, _coherence_case, 4)


# ---------------------------------------------------------------------------------------------
# Repartition of per-rank chunks


def _repartition_case(domain: int, method: str, chunks: list[int]):
    m = mesh(domain)
    r = _rank(m)
    n = sum(chunks)
    pos = _cloud(n, seed=5)
    g = torch.Generator().manual_seed(2)
    f = torch.randn(3, n, 2, generator=g, dtype=torch.float64)
    c0 = sum(chunks[:r])
    pos_c = pos[c0 : c0 + chunks[r]].clone()
    f_c = f[:, c0 : c0 + chunks[r]].clone().requires_grad_()

    part = PointCloudPartition(m, method=method)
    pos_l, f_l = part.repartition(pos_c, f_c)
    # The same parts as partitioning the full cloud.
    ref = PointCloudPartition(m, method=method)
    ref_pos_l, ref_f_l = ref(pos, f)
    assert torch.equal(part.index, ref.index)
    assert torch.equal(pos_l, ref_pos_l) and torch.equal(f_l, ref_f_l)
    # Gradients travel back to the chunks.
    w = torch.randn(f.shape, generator=g, dtype=torch.float64)
    (f_l * w[:, part.index]).sum().backward()
    torch.testing.assert_close(f_c.grad, w[:, c0 : c0 + chunks[r]], rtol=0, atol=0)
    # Results go back to the chunk layout, or to the full cloud.
    y_l = f_l.detach() + 1.0
    torch.testing.assert_close(part.to_chunks(y_l), f[:, c0 : c0 + chunks[r]] + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(part.restore(y_l), f + 1.0, rtol=0, atol=0)
    return part.sizes


@pytest.mark.parametrize(
    "domain, method, chunks",
    [(1, "rcb", [57]), (2, "rcb", [0, 90]), (2, "morton", [61, 30]), (3, "rcb", [40, 7, 50]),
     (4, "rcb", [30, 0, 51, 16]), (4, "morton", [5, 40, 40, 12])],  # fmt: skip
)
def test_repartition_matches_partition(run, domain, method, chunks):
    run(domain, _repartition_case, domain, method, chunks)


# ---------------------------------------------------------------------------------------------
# kNN, radius, neighbour gathers, ghosts


def _knn_case(domain: int, sizes: list[int], k: int):
    m = mesh(domain)
    r = _rank(m)
    n = sum(sizes)
    pos = _cloud(n, seed=7, dup=0)
    start = sum(sizes[:r])
    pos_l = pos[start : start + sizes[r]]
    query = torch.rand(13 + r, 3, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)
    d, i = knn(query, pos_l, k, mesh=m)
    ref = torch.cdist(query, pos, compute_mode="donot_use_mm_for_euclid_dist").topk(k, largest=False)
    assert torch.equal(i, ref.indices)
    torch.testing.assert_close(d, ref.values, rtol=0, atol=0)

    rad = 0.2
    dr, ir = radius(query, pos_l, rad, mesh=m, max_num_neighbors=6)
    full = torch.cdist(query, pos, compute_mode="donot_use_mm_for_euclid_dist")
    top6 = full.topk(6, largest=False)
    assert torch.equal(ir, torch.where(top6.values <= rad, top6.indices, -1))
    assert torch.equal((ir >= 0).sum(1), (full <= rad).sum(1).clamp(max=6))
    assert torch.isinf(dr[ir < 0]).all()
    near = within_radius(query, pos_l, rad, mesh=m)
    assert torch.equal(near, torch.nonzero((full <= rad).any(0)).squeeze(1))

    # Neighbour features with gradients, batched features and -1 entries.
    x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x_l = x[:, start : start + sizes[r]].clone().requires_grad_()
    idx = i.clone()
    idx[0, -1] = -1
    got = gather_neighbours(x_l, idx, mesh=m)
    expect = x[:, idx.clamp(min=0)] * (idx >= 0).unsqueeze(-1)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(20 + r), dtype=torch.float64)
    (got * w).sum().backward()
    # Reference: the sum over ranks of every rank's scatter of its weights.
    ref_grad = torch.zeros_like(x)
    ref_grad.index_add_(1, idx[idx >= 0], w[:, idx >= 0])
    dist.all_reduce(ref_grad, group=snn.domain_group(m))
    torch.testing.assert_close(x_l.grad, ref_grad[:, start : start + sizes[r]], rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize(
    "domain, sizes, k", [(1, [40], 5), (2, [33, 8], 8), (3, [5, 17, 30], 16), (4, [9, 1, 20, 14], 6)]
)
def test_knn_radius_gather_exact(run, domain, sizes, k):
    assert all(run(domain, _knn_case, domain, sizes, k))


def test_knn_single_process():
    pos = _cloud(300, dup=0)
    q = torch.rand(20, 3, dtype=torch.float64)
    d, i = knn(q, pos, 9)
    ref = torch.cdist(q, pos, compute_mode="donot_use_mm_for_euclid_dist").topk(9, largest=False)
    assert torch.equal(i, ref.indices) and torch.equal(d, ref.values)
    x = torch.randn(300, 2, dtype=torch.float64)
    torch.testing.assert_close(gather_neighbours(x, i), x[i], rtol=0, atol=0)


def _ghost_case(domain: int, k: int | None, rad: float | None):
    m = mesh(domain)
    n = 240
    pos = _cloud(n, seed=11, dup=0)
    f = torch.randn(n, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    part = PointCloudPartition(m)
    pos_l, f_l = part(pos, f)
    gh = part.ghosts(pos_l, f_l, k=k, radius=rad)
    mine = torch.zeros(n, dtype=torch.bool)
    mine[part.index] = True
    dmat = torch.cdist(pos[part.index], pos, compute_mode="donot_use_mm_for_euclid_dist")
    if k is not None:
        near = torch.zeros(n, dtype=torch.bool)
        near[dmat.topk(k, largest=False).indices.flatten()] = True
    else:
        near = (dmat <= rad).any(0)
    expect = torch.nonzero(near & ~mine).squeeze(1)
    assert torch.equal(torch.sort(gh.index).values, expect)
    torch.testing.assert_close(gh.pos, pos[gh.index], rtol=0, atol=0)
    torch.testing.assert_close(gh.fields[0], f.detach()[gh.index], rtol=0, atol=0)
    assert not mine[gh.index].any() and (gh.owner != _rank(m)).all()
    # The ghost values are differentiable: gradients reach the owners' full-field rows.
    gh.fields[0].sum().backward()
    assert f.grad is not None
    return gh.index.numel()


@pytest.mark.parametrize("domain, k, rad", [(2, 6, None), (3, None, 0.15), (4, 4, None)])
def test_ghosts_match_brute_force(run, domain, k, rad):
    run(domain, _ghost_case, domain, k, rad)


# ---------------------------------------------------------------------------------------------
# PyG containers


def _pyg_case(domain: int):
    from torch_geometric.data import Batch, Data

    m = mesh(domain)
    clouds = []
    for i, n in enumerate((31, 17, 44)):
        pos = _cloud(n, seed=20 + i, dup=0)
        src = torch.arange(n - 1)
        g = torch.Generator().manual_seed(i)  # the same cloud on every rank
        clouds.append(Data(pos=pos, x=torch.randn(n, 2, generator=g, dtype=torch.float64),
                           y=torch.randn(n, generator=g, dtype=torch.float64),
                           edge_index=torch.stack([src, src + 1]), label=torch.tensor([i])))  # fmt: skip
    part = PointCloudPartition(m)
    d_l = part(clouds[0])
    assert d_l.num_nodes == part.sizes[_rank(m)]
    torch.testing.assert_close(d_l.x, clouds[0].x[part.index], rtol=0, atol=0)
    # Local edges are kept and relabelled.
    e = d_l.edge_index
    assert torch.equal(part.index[e[1]] - part.index[e[0]], torch.ones(e.shape[1], dtype=torch.int64))
    d_l.pred = d_l.x.sum(1, keepdim=True)
    back = part.restore(d_l)
    torch.testing.assert_close(back.x, clouds[0].x, rtol=0, atol=0)
    torch.testing.assert_close(back.pred, clouds[0].x.sum(1, keepdim=True), rtol=0, atol=0)
    assert torch.equal(back.edge_index, clouds[0].edge_index)

    batch = Batch.from_data_list(clouds)
    b_l = part(batch)
    assert b_l.num_graphs == 3
    for c, g_l in zip(clouds, b_l.to_data_list()):
        assert g_l.num_nodes in balanced_sizes(c.num_nodes, domain)
    b_back = part.restore(b_l)
    for key in ("pos", "x", "y", "batch"):
        torch.testing.assert_close(b_back[key], batch[key], rtol=0, atol=0)
    assert torch.equal(b_back.label, batch.label)
    return True


@pytest.mark.parametrize("domain", [1, 3])
def test_pyg_round_trips(run, domain):
    assert all(run(domain, _pyg_case, domain))


# ---------------------------------------------------------------------------------------------
# Errors raised on every rank


def _error_case(kind: str):
    m = mesh(2)
    r = _rank(m)
    pos = _cloud(20, dup=0)
    try:
        if kind == "k":
            knn(pos[:5], pos[10 * r : 10 * r + 10], 21, mesh=m)
        elif kind == "nan":
            chunk = pos[10 * r : 10 * r + 10].clone()
            if r == 1:
                chunk[3, 1] = float("nan")
            PointCloudPartition(m).repartition(chunk)
        elif kind == "width":
            knn(pos[:5], pos[10 * r : 10 * r + 10, : 3 - r], 3, mesh=m)
        elif kind == "batched":
            b = pos.expand(2, -1, -1).clone()
            b[1, 0, 0] += 1.0
            PointCloudPartition(m)(b)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "kind, match",
    [("k", "k must be between 1 and the number of candidates \\(20\\)"), ("nan", "must be finite"),
     ("width", "same d"), ("batched", "same for every sample")],  # fmt: skip
)
def test_errors_on_every_rank(run, kind, match):
    import re

    msgs = run(2, _error_case, kind)
    assert all(re.search(match, msg) for msg in msgs), msgs
    assert msgs[0] == msgs[1]
