"""Exact neighbour search where the queries are local and the candidates distributed.

Every rank holds some query points and some candidate points (its part of the cloud). The
candidate blocks travel once around the domain ring (``comm.ring_pass``); while the next block
is in flight, each rank merges the block in hand into a running top-k of its queries. After
``P`` steps every query has seen every candidate, so the result equals brute force on one
process. Distances are Euclidean, computed by differences (no ``|a|^2 + |b|^2 - 2ab`` rounding).

Global indices number the candidates of all ranks concatenated in domain-rank order (rank r's
``pos_l[i]`` is ``sum(sizes[:r]) + i``). ``PointCloudPartition.all_index``-style maps turn them
into original indices; ``gather_neighbours`` fetches features at them with gradients.

Pure torch (PyG's compiled ``knn`` needs torch-cluster); the work is ``O(Q * N)`` distance
evaluations per rank, chunked so memory stays ``O(Q * k + chunk^2)``.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..comm import domain_peers, gather_ints, ring_pass
from .exchange import gather_rows

__all__ = ["gather_neighbours", "knn", "radius", "within_radius"]

_QUERY_CHUNK = 2048
_CAND_CHUNK = 4096


def _dist(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.cdist(q, c, compute_mode="donot_use_mm_for_euclid_dist")


def _layout(query: torch.Tensor, pos: torch.Tensor, mesh: DeviceMesh | None, what: str):
    """(ring or None, candidate sizes); validates on gathered facts so every rank raises alike."""
    shape_ok = query.dim() == 2 and pos.dim() == 2 and query.shape[1] == pos.shape[1]
    if mesh is None:
        if not shape_ok:
            raise ValueError(
                f"{what}: expected query (Q, d) and pos (N, d), got {tuple(query.shape)} and {tuple(pos.shape)}."
            )
        return None, [pos.shape[0]]
    ring = domain_peers(mesh)
    rows = gather_ints([pos.shape[0] if shape_ok else -1, pos.shape[-1] if pos.dim() else -1], ring)
    if any(r[0] < 0 for r in rows) or len({r[1] for r in rows}) != 1:
        raise ValueError(
            f"{what}: every rank needs query (Q, d) and pos (N_local, d) with the same d; the ranks hold "
            f"pos widths {[r[1] for r in rows]} (-1 in the counts marks a bad shape: {[r[0] for r in rows]})."
        )
    return ring, [r[0] for r in rows]


def _merge(best_d, best_i, query, block, offset):
    """Fold candidates ``block`` (global indices from ``offset``) into the running top-k."""
    k = best_d.shape[1]
    for q0 in range(0, query.shape[0], _QUERY_CHUNK):
        q = query[q0 : q0 + _QUERY_CHUNK]
        d_run, i_run = best_d[q0 : q0 + _QUERY_CHUNK], best_i[q0 : q0 + _QUERY_CHUNK]
        for c0 in range(0, block.shape[0], _CAND_CHUNK):
            c = block[c0 : c0 + _CAND_CHUNK]
            d = torch.cat([d_run, _dist(q, c)], 1)
            ids = torch.arange(offset + c0, offset + c0 + c.shape[0], device=q.device).expand(q.shape[0], -1)
            i = torch.cat([i_run, ids], 1)
            d_run, i_run = _smallest(d, i, k)
        best_d[q0 : q0 + _QUERY_CHUNK], best_i[q0 : q0 + _QUERY_CHUNK] = d_run, i_run


def _smallest(d: torch.Tensor, i: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``k`` entries smallest by (distance, global index): the documented tie rule
    decides which of equal distances at the k-th place are kept, so the result does not depend
    on the order the blocks arrive in (the ranks and their sizes). ``torch.topk`` keeps an
    arbitrary one of them (on a lattice of points the k nearest differed from one process's,
    found by tests/test_fuzz_points.py). One ``topk`` of ``k + 1`` shows the rows with such a
    tie (the k-th and the next distance equal); only those are redone by two stable sorts."""
    if d.shape[1] <= k:
        return d, i
    d_sel, sel = torch.topk(d, k + 1, dim=1, largest=False, sorted=True)
    i_sel = i.gather(1, sel)
    tied = d_sel[:, k - 1] == d_sel[:, k]
    d_sel, i_sel = d_sel[:, :k].contiguous(), i_sel[:, :k].contiguous()
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        dr, ir = d[rows], i[rows]
        o = torch.argsort(ir, dim=1, stable=True)
        dr, ir = dr.gather(1, o), ir.gather(1, o)
        o = torch.argsort(dr, dim=1, stable=True)[:, :k]
        d_sel[rows], i_sel[rows] = dr.gather(1, o), ir.gather(1, o)
    return d_sel, i_sel


def _ring_blocks(pos: torch.Tensor, ring, sizes: list[int]):
    """Yield ``(block, global_offset)`` for every rank's candidates; the next hop overlaps the caller."""
    offsets = [sum(sizes[:r]) for r in range(len(sizes))]
    if ring is None:
        yield pos, 0
        return
    block, owner = pos.contiguous(), ring.index
    for step in range(ring.size):
        handle = None
        if step < ring.size - 1:
            nxt = (owner - 1) % ring.size
            handle = ring_pass(ring, [block], [(sizes[nxt], pos.shape[1])], tag=7300)
        yield block, offsets[owner]
        if handle is not None:
            (block,) = handle.wait()
            owner = nxt


@torch.no_grad()
def knn(
    query_l: torch.Tensor, pos_l: torch.Tensor, k: int = 16, *, mesh: DeviceMesh | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest candidates of every local query among the candidates of all ranks.

    Args:
        query_l: ``(Q, d)`` this rank's queries.
        pos_l: ``(N_local, d)`` this rank's candidates (typically its part of the cloud).
        k: neighbours per query; at most the total number of candidates.
        mesh: the domain mesh (``None``: one process, brute force). Collective.

    Returns:
        ``(dist, idx)``, each ``(Q, k)``, sorted by distance (ties by global index): Euclidean
        distances and global candidate indices. A query that is itself a candidate finds itself
        at distance 0.
    """
    ring, sizes = _layout(query_l, pos_l, mesh, "knn")
    total = sum(sizes)
    if not 1 <= k <= total:
        raise ValueError(f"knn: k must be between 1 and the number of candidates ({total}), got {k}.")
    best_d = torch.full((query_l.shape[0], k), float("inf"), dtype=query_l.dtype, device=query_l.device)
    best_i = torch.full((query_l.shape[0], k), -1, dtype=torch.int64, device=query_l.device)
    for block, offset in _ring_blocks(pos_l, ring, sizes):
        _merge(best_d, best_i, query_l, block.to(query_l.dtype), offset)
    # Canonical order: by distance, ties by index (two stable sorts).
    o = torch.argsort(best_i, dim=1, stable=True)
    best_d, best_i = best_d.gather(1, o), best_i.gather(1, o)
    o = torch.argsort(best_d, dim=1, stable=True)
    return best_d.gather(1, o), best_i.gather(1, o)


@torch.no_grad()
def radius(
    query_l: torch.Tensor, pos_l: torch.Tensor, r: float, *, mesh: DeviceMesh | None = None,
    max_num_neighbors: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Candidates within distance ``r`` of every local query, at most ``max_num_neighbors`` (the nearest).

    Returns:
        ``(dist, idx)``, each ``(Q, max_num_neighbors)`` (fewer columns when there are fewer
        candidates in all), sorted by distance; missing neighbours have ``idx = -1`` and
        ``dist = inf``. ``(idx >= 0).sum(1)`` counts each query's neighbours.
    """
    if r < 0:
        raise ValueError(f"radius: r must be >= 0, got {r}.")
    _, sizes = _layout(query_l, pos_l, mesh, "radius")
    d, i = knn(query_l, pos_l, min(max_num_neighbors, sum(sizes)), mesh=mesh)
    far = d > r
    return d.masked_fill(far, float("inf")), i.masked_fill(far, -1)


@torch.no_grad()
def within_radius(
    query_l: torch.Tensor, pos_l: torch.Tensor, r: float, *, mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Global indices (ascending) of all candidates within ``r`` of at least one local query."""
    ring, sizes = _layout(query_l, pos_l, mesh, "within_radius")
    found = []
    for block, offset in _ring_blocks(pos_l, ring, sizes):
        block = block.to(query_l.dtype)
        for c0 in range(0, block.shape[0], _CAND_CHUNK):
            c = block[c0 : c0 + _CAND_CHUNK]
            near = torch.zeros(c.shape[0], dtype=torch.bool, device=c.device)
            for q0 in range(0, query_l.shape[0], _QUERY_CHUNK):
                near |= (_dist(query_l[q0 : q0 + _QUERY_CHUNK], c) <= r).any(0)
            found.append(torch.nonzero(near).squeeze(1) + offset + c0)
    return torch.sort(torch.cat(found)).values if found else torch.zeros(0, dtype=torch.int64)


def gather_neighbours(x_l: torch.Tensor, idx: torch.Tensor, *, mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Features of the points ``idx`` (global indices, e.g. from ``knn``) of a distributed point tensor.

    Args:
        x_l: ``(N_local, C)`` or ``(B, N_local, C)``, this rank's points on dim -2 (the same
            points, in the same order, as the ``pos_l`` given to ``knn``).
        idx: global indices of any shape, ``-1`` for "none" (gives zeros).
        mesh: the domain mesh (``None``: one process). Collective.

    Returns:
        ``(*idx.shape, C)`` or ``(B, *idx.shape, C)``. Differentiable: gradients flow back to the
        ranks owning the rows.
    """
    dim = x_l.dim() - 2
    if dim < 0:
        raise ValueError(f"gather_neighbours: expected (N, C) or (B, N, C) features, got {tuple(x_l.shape)}.")
    rows = x_l.movedim(dim, 0)
    # Explicit width: a rank whose part holds no points has rows.shape[0] == 0, where -1 is ambiguous.
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    if mesh is None:
        sizes, ring = [flat.shape[0]], None
        # One zero row at the end serves the -1 entries.
        safe = torch.where(idx.flatten() < 0, flat.shape[0], idx.flatten())
        got = torch.cat([flat, flat.new_zeros(1, flat.shape[1])]).index_select(0, safe)
    else:
        ring = domain_peers(mesh)
        rows_info = gather_ints([flat.shape[0], flat.shape[1]], ring)
        if len({r[1] for r in rows_info}) != 1:
            raise ValueError(
                f"gather_neighbours: every rank needs features of the same shape apart from the points; "
                f"the ranks hold {[r[1] for r in rows_info]} values per point."
            )
        sizes = [r[0] for r in rows_info]
        got = gather_rows(flat, idx.flatten(), sizes, ring)
    out = got.reshape(*idx.shape, *rows.shape[1:])
    return out.movedim(idx.dim(), 0) if dim == 1 else out
