"""``PointCloudPartition``: spatially coherent, balanced parts of a point cloud, one per domain rank.

Methods:
    ``"rcb"`` (default), recursive coordinate bisection: the P parts are split into
    ``floor(P/2)`` and ``ceil(P/2)``, the points of the current box are cut across the longest
    side of their bounding box so that each side gets exactly the points its parts need, and
    each side is cut again. Parts are boxes, so the boundary between parts (the points that
    have neighbours in another part: the ghosts) stays small.
    ``"morton"``: the points are sorted along a Morton (Z-order) space-filling curve, 21 bits per
    axis inside the cloud's bounding box, and cut into consecutive runs.

Balance: part r holds ``N // P + (r < N % P)`` points (sizes differ by at most one), whatever
the cloud. Ties (equal coordinates) are broken by the original point index, so the partition is
a deterministic function of the coordinates: ``part(pos)`` on a full cloud and
``part.repartition(chunks)`` on any chunking of the same cloud give every rank the same points,
in the same order (ascending original index).

Sharding contract: points on dim -2. ``part(...)`` needs the full cloud on every rank and
communicates nothing. ``restore`` all-gathers the parts (the output is replicated; its backward
sums the ranks' gradients, DESIGN.md section 3). ``repartition`` works on per-rank chunks: the
cuts are found by bisection on the coordinates with all-reduces of a few counts per segment
(about 64 + log2(N) small all-reduces per level of the recursion, log2(P) levels), then the
points travel to their parts through a ring exchange (``comm.ring_pass``); no rank ever holds
more than its chunk, its part and one travelling block.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import all_gather_grid, all_gather_uneven, all_reduce_max, all_reduce_sum, domain_peers, gather_ints
from ..layout import Layout
from ..mesh import domain_group
from .exchange import exchange, gather_rows, ring_offsets
from .graph import HaloGraph, build_halo_graph

__all__ = ["Ghosts", "PointCloudPartition", "balanced_sizes"]

METHODS = ("rcb", "morton")
_MORTON_BITS = 21


def balanced_sizes(n: int, parts: int) -> list[int]:
    """``n // parts + (r < n % parts)`` for each part r."""
    return list(Layout.balanced(n, parts).sizes)


def _sortable(v: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of the float values ``v`` (``-0.0`` counts as ``+0.0``)."""
    v = v + 0.0  # -0.0 -> +0.0, so that equal values get equal keys
    if v.dtype == torch.float64:
        bits = v.view(torch.int64)
        return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    bits = v.float().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _morton(pos: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Morton codes (int64, 21 bits per axis) of ``pos`` ``(n, d <= 3)`` in the box ``[lo, hi]``."""
    scale = (2**_MORTON_BITS - 1) / torch.clamp(hi - lo, min=torch.finfo(pos.dtype).tiny)
    q = ((pos - lo) * scale).floor().clamp(0, 2**_MORTON_BITS - 1).to(torch.int64)
    code = torch.zeros(pos.shape[0], dtype=torch.int64, device=pos.device)
    d = pos.shape[1]
    for bit in range(_MORTON_BITS):
        for a in range(d):
            code |= ((q[:, a] >> bit) & 1) << (bit * d + (d - 1 - a))
    return code


def _check_pos(pos: torch.Tensor, what: str) -> None:
    if pos.dim() != 2 or not 1 <= pos.shape[1] <= 3 or not pos.is_floating_point():
        raise ValueError(
            f"{what}: expected float positions (N, 1..3) or (B, N, 1..3), got {tuple(pos.shape)} {pos.dtype}."
        )
    if not torch.isfinite(pos).all():
        raise ValueError(f"{what}: positions must be finite (found NaN or inf).")


# ---------------------------------------------------------------------------------------------
# The assignment of points to parts. Both versions cut by the same rule: the first n_left points
# in (key, global index) order go left. The local one sorts; the distributed one bisects.


def _assign_local(pos: torch.Tensor, sizes: list[int], method: str) -> torch.Tensor:
    """Part of every point of a full cloud ``pos`` ``(N, d)``."""
    n = pos.shape[0]
    part = torch.empty(n, dtype=torch.int64, device=pos.device)
    if method == "morton":
        key = _morton(pos, pos.min(0).values, pos.max(0).values)
        order = torch.argsort(key, stable=True)
        part[order] = torch.repeat_interleave(torch.arange(len(sizes), device=pos.device),
                                              torch.tensor(sizes, device=pos.device))  # fmt: skip
        return part
    stack = [(torch.arange(n, device=pos.device), 0, len(sizes))]
    while stack:
        idx, p0, p1 = stack.pop()
        if p1 - p0 == 1:
            part[idx] = p0
            continue
        mid = p0 + (p1 - p0) // 2
        n_left = sum(sizes[p0:mid])
        sub = pos[idx]
        axis = int(torch.argmax(sub.max(0).values - sub.min(0).values)) if idx.numel() else 0
        # idx is ascending, so a stable sort breaks ties by the global index.
        order = torch.argsort(_sortable(sub[:, axis]), stable=True)
        stack.append((torch.sort(idx[order[:n_left]]).values, p0, mid))
        stack.append((torch.sort(idx[order[n_left:]]).values, mid, p1))
    return part


def _assign_distributed(pos: torch.Tensor, gid: torch.Tensor, sizes: list[int], method: str, mesh) -> torch.Tensor:
    """Part of every point of this rank's chunk ``pos``; ``gid`` are their global indices."""
    group = domain_group(mesh)
    dev = pos.device
    n_total = sum(sizes)
    part = torch.zeros(pos.shape[0], dtype=torch.int64, device=dev)
    segments = [(0, len(sizes))]  # the same list on every rank
    if method == "morton":
        lo = -all_reduce_max(-_masked_min(pos), group)
        hi = all_reduce_max(_masked_max(pos), group)
        morton_key = _morton(pos, lo, hi)
    while True:
        active = [(k, p0, p1) for k, (p0, p1) in enumerate(segments) if p1 - p0 > 1]
        if not active:
            break
        seg_of_point = part  # points carry the index of their segment while the recursion runs
        keys = torch.zeros(pos.shape[0], dtype=torch.int64, device=dev)
        if method == "morton":
            keys = morton_key
        else:
            # Bounding box of each segment: one max-all-reduce of (max, -min) per axis.
            d = pos.shape[1]
            stats = torch.full((len(segments), 2 * d), float("-inf"), dtype=pos.dtype, device=dev)
            for k, _, _ in active:
                m = seg_of_point == k
                if m.any():
                    stats[k, :d] = pos[m].max(0).values
                    stats[k, d:] = -pos[m].min(0).values
            stats = all_reduce_max(stats, group)
            axes = torch.argmax(stats[:, :d] + stats[:, d:], dim=1)
            keys = _sortable(pos.gather(1, axes[seg_of_point].unsqueeze(1)).squeeze(1))
        goes_left = _select(keys, gid, seg_of_point, active, sizes, n_total, group)
        new_segments: list[tuple[int, int]] = []
        new_part = torch.empty_like(part)
        for k, (p0, p1) in enumerate(segments):
            m = seg_of_point == k
            if p1 - p0 == 1:
                new_part[m] = len(new_segments)
                new_segments.append((p0, p1))
                continue
            mid = p0 + (p1 - p0) // 2
            new_part[m & goes_left] = len(new_segments)
            new_part[m & ~goes_left] = len(new_segments) + 1
            new_segments += [(p0, mid), (mid, p1)]
        part, segments = new_part, new_segments
    return torch.tensor([p0 for p0, _ in segments], dtype=torch.int64, device=dev)[part]


def _masked_min(pos: torch.Tensor) -> torch.Tensor:
    return pos.min(0).values if pos.shape[0] else torch.full(pos.shape[1:], float("inf"), dtype=pos.dtype)


def _masked_max(pos: torch.Tensor) -> torch.Tensor:
    return pos.max(0).values if pos.shape[0] else torch.full(pos.shape[1:], float("-inf"), dtype=pos.dtype)


def _select(keys, gid, seg, active, sizes, n_total, group) -> torch.Tensor:
    """Points among the first ``n_left`` of their segment in (key, gid) order, all segments at once.

    Bisection on the key, then on the global index among the points that share the threshold
    key; every step is one all-reduce of one count per active segment.
    """
    dev = keys.device
    nseg = int(seg.max()) + 1 if seg.numel() else 0
    nseg = max([nseg] + [k + 1 for k, _, _ in active])
    ks = [k for k, _, _ in active]
    need = {k: sum(sizes[p0 : p0 + (p1 - p0) // 2]) for k, p0, p1 in active}

    def counts(pred: torch.Tensor) -> list[int]:
        c = torch.bincount(seg[pred], minlength=nseg)[ks] if pred.any() else torch.zeros(len(ks), dtype=torch.int64)
        return all_reduce_sum(c.to(torch.int64).to(dev), group).tolist()

    def per_point(values: dict[int, int]) -> torch.Tensor:
        table = torch.zeros(nseg, dtype=torch.int64)
        for k, v in values.items():
            table[k] = v
        return table.to(dev)[seg] if seg.numel() else torch.zeros(0, dtype=torch.int64, device=dev)

    in_active = torch.zeros(nseg, dtype=torch.bool)
    in_active[ks] = True
    in_active = in_active.to(dev)[seg] if seg.numel() else torch.zeros(0, dtype=torch.bool, device=dev)
    # Smallest key t with count(key <= t) >= need (int64 keys; bounds kept as Python ints).
    lo = {k: -(2**63) for k in ks}
    hi = {k: 2**63 - 1 for k in ks}
    while any(lo[k] < hi[k] for k in ks):
        mid = {k: (lo[k] + hi[k]) // 2 for k in ks}
        c = counts(in_active & (keys <= per_point(mid)))
        for k, ck in zip(ks, c):
            if lo[k] < hi[k]:
                if ck >= need[k]:
                    hi[k] = mid[k]
                else:
                    lo[k] = mid[k] + 1
    t = per_point(lo)
    below = counts(in_active & (keys < t))
    rest = {k: need[k] - b for k, b in zip(ks, below)}  # >= 1 points with key == t go left
    at = in_active & (keys == t)
    glo = {k: 0 for k in ks}
    ghi = {k: n_total - 1 for k in ks}
    while any(glo[k] < ghi[k] for k in ks):
        mid = {k: (glo[k] + ghi[k]) // 2 for k in ks}
        c = counts(at & (gid <= per_point(mid)))
        for k, ck in zip(ks, c):
            if glo[k] < ghi[k]:
                if ck >= rest[k]:
                    ghi[k] = mid[k]
                else:
                    glo[k] = mid[k] + 1
    return in_active & ((keys < t) | (at & (gid <= per_point(glo))))


# ---------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Where the points went: this rank's original indices and every part's size."""

    index: torch.Tensor  # (N_local,) original indices of this rank's points, ascending
    sizes: list[int]  # points per part (= per domain rank)
    n: int  # points in the cloud
    all_index: torch.Tensor | None = None  # (N,) original indices of all parts, in rank order
    chunk_sizes: list[int] | None = None  # repartition: every rank's chunk size
    chunk_counts: list[list[int]] | None = None  # repartition: rows sent from chunk r to part d
    chunk_order: torch.Tensor | None = None  # repartition: chunk rows sorted by destination
    data: Any = None  # PyG Data the plan came from (restore returns a copy of it)


class Ghosts(NamedTuple):
    """Points of other parts near this rank's part.

    Attributes:
        pos: ``(G, d)`` (or ``(B, G, d)``) positions.
        fields: the requested fields at those points, points on dim -2.
        index: ``(G,)`` original indices of the ghost points (ascending).
        owner: ``(G,)`` the domain rank owning each ghost point.
    """

    pos: torch.Tensor
    fields: tuple[torch.Tensor, ...]
    index: torch.Tensor
    owner: torch.Tensor


class PointCloudPartition(nn.Module):
    """Splits point clouds into spatially coherent, balanced parts, one per domain rank.

    Args:
        mesh: a ``DeviceMesh`` with domain axes (all domain ranks share one cloud; part r goes
            to the rank at position r of the flattened domain group).
        method: ``"rcb"`` (recursive coordinate bisection) or ``"morton"`` (Z-order curve).

    ``pos_l, *fields_l = part(pos, *fields)`` returns this rank's points; see the module docstring
    for the sharding contract. After a call, ``part.index`` holds this rank's original point
    indices and ``part.sizes`` every part's size. PyG ``Data`` and ``Batch`` objects are accepted
    in place of tensors (node attributes are partitioned; edges between two local points are
    kept and relabelled, cut edges dropped; a ``Batch`` partitions each of its clouds).
    """

    def __init__(self, mesh: DeviceMesh, *, method: str = "rcb") -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"PointCloudPartition: method must be one of {METHODS}, got {method!r}.")
        self.mesh = mesh
        self.method = method
        self.ring = domain_peers(mesh)
        self._plan: _Plan | None = None
        self._plans: list[_Plan] | None = None  # one per cloud of a PyG Batch

    def extra_repr(self) -> str:  # noqa: D102
        return f"method={self.method!r}, parts={self.ring.size}"

    # -- state -------------------------------------------------------------------------------

    def _require_plan(self, what: str) -> _Plan:
        if self._plan is None:
            raise RuntimeError(f"PointCloudPartition.{what}: call part(...) or part.repartition(...) first.")
        return self._plan

    @property
    def index(self) -> torch.Tensor:
        """Original indices of this rank's points (ascending)."""
        return self._require_plan("index").index

    @property
    def sizes(self) -> list[int]:
        """Points of every part, indexed by domain rank."""
        return list(self._require_plan("sizes").sizes)

    # -- full cloud in ---------------------------------------------------------------------

    def forward(self, pos, *fields):
        """This rank's part of a full cloud: ``(pos_l, *fields_l)``, or a PyG Data/Batch."""
        if _is_pyg(pos):
            if fields:
                raise TypeError("PointCloudPartition: pass a PyG Data/Batch alone, without extra fields.")
            return self._forward_pyg(pos)
        plan = self._plan_full(pos)
        self._plan, self._plans = plan, None
        return self._select(plan, pos, *fields)

    def _plan_full(self, pos: torch.Tensor) -> _Plan:
        coords = pos
        if pos.dim() == 3:
            coords = pos[0]
            if not torch.equal(pos, coords.expand_as(pos)):
                raise ValueError(
                    "PointCloudPartition: batched positions (B, N, d) must be the same for every sample "
                    "(one partition serves the whole batch); partition clouds of different shapes one by one "
                    "or pass a PyG Batch."
                )
        _check_pos(coords, "PointCloudPartition")
        n, p = coords.shape[0], self.ring.size
        if n < p:
            raise ValueError(f"PointCloudPartition: {n} points cannot fill {p} parts (at least one point each).")
        sizes = balanced_sizes(n, p)
        part = _assign_local(coords, sizes, self.method)
        order = torch.argsort(part, stable=True)  # parts in rank order, ascending index inside
        start = sum(sizes[: self.ring.index])
        return _Plan(index=order[start : start + sizes[self.ring.index]], sizes=sizes, n=n, all_index=order)

    def _select(self, plan: _Plan, pos: torch.Tensor, *fields: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for i, t in enumerate((pos, *fields)):
            if t.dim() < 2 or t.shape[-2] != plan.n:
                raise ValueError(
                    f"PointCloudPartition: argument {i} has shape {tuple(t.shape)}; expected the {plan.n} points "
                    "on dim -2, (N, C) or (B, N, C)."
                )
            out.append(t.index_select(t.dim() - 2, plan.index.to(t.device)))
        return tuple(out)

    # -- back to the full cloud ------------------------------------------------------------

    def restore(self, y_l):
        """The full ``(..., N, C)`` tensor in the original point order, on every rank.

        The result is replicated: its backward sums the gradients of all ranks and hands each its
        own points' rows (DESIGN.md section 3; by hand, ``y.backward(g / P)`` on every rank).
        A PyG Data/Batch gives a copy of the partitioned object with its node attributes restored.
        """
        if _is_pyg(y_l):
            return self._restore_pyg(y_l)
        return self._restore(self._require_plan("restore"), y_l)

    def _restore(self, plan: _Plan, y_l: torch.Tensor) -> torch.Tensor:
        dim = y_l.dim() - 2
        if dim < 0 or y_l.shape[dim] != plan.sizes[self.ring.index]:
            raise ValueError(
                f"PointCloudPartition.restore: expected this rank's {plan.sizes[self.ring.index]} points on dim -2, "
                f"got shape {tuple(y_l.shape)}."
            )
        if plan.all_index is None:
            # After repartition only the parts' own indices are known: gather them once.
            plan.all_index = torch.cat(
                all_gather_uneven(plan.index, domain_group(self.mesh), [(s,) for s in plan.sizes])
            )
        p = self.ring.size
        if p == 1:
            full = y_l
        else:
            full = all_gather_grid(y_l, domain_group(self.mesh), (dim,), [(r,) for r in range(p)], [plan.sizes],
                                   self.ring.index)  # fmt: skip
        inverse = torch.empty_like(plan.all_index)
        inverse[plan.all_index] = torch.arange(plan.n, device=inverse.device)
        return full.index_select(dim, inverse.to(full.device))

    # -- chunks in ---------------------------------------------------------------------------

    def repartition(self, pos_chunk: torch.Tensor, *fields_chunk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part, from per-rank chunks of one cloud (e.g. each rank read part of a file).

        The cloud is the concatenation of the chunks in domain-rank order; chunk sizes may differ
        (even be empty). The parts are the ones ``part(full_cloud)`` would make. Differentiable:
        gradients travel back to the chunks. ``part.index`` then holds original indices into the
        concatenated cloud, ``restore`` works as after ``part(...)``, and ``to_chunks`` sends a
        per-point result back to the chunk layout.
        """
        coords = pos_chunk[0] if pos_chunk.dim() == 3 else pos_chunk
        if coords.dim() != 2:
            raise ValueError(
                "PointCloudPartition.repartition: expected (n, d) or (B, n, d) positions, "
                f"got {tuple(pos_chunk.shape)}."
            )
        chunk_sizes = ring_offsets(coords.shape[0], self.ring)
        n, p = sum(chunk_sizes), self.ring.size
        # Validation on gathered facts, identical on every rank.
        if n < p:
            raise ValueError(f"PointCloudPartition.repartition: {n} points cannot fill {p} parts.")
        finite = all_reduce_sum(torch.tensor([int(not torch.isfinite(coords).all())]), domain_group(self.mesh))
        if int(finite) or not coords.is_floating_point():
            raise ValueError("PointCloudPartition.repartition: positions must be finite floats on every rank.")
        sizes = balanced_sizes(n, p)
        start = sum(chunk_sizes[: self.ring.index])
        gid = torch.arange(start, start + coords.shape[0], device=coords.device)
        dest = _assign_distributed(coords, gid, sizes, self.method, self.mesh)
        order = torch.argsort(dest, stable=True)
        mine = torch.bincount(dest, minlength=p).tolist()
        counts = [list(r) for r in gather_ints(mine, self.ring)]
        plan = _Plan(index=torch.empty(0, dtype=torch.int64), sizes=sizes, n=n, chunk_sizes=chunk_sizes,
                     chunk_counts=counts, chunk_order=order)  # fmt: skip
        plan.index = exchange(gid[order].unsqueeze(1), counts, self.ring).squeeze(1)
        self._plan, self._plans = plan, None
        return tuple(self._move(plan, t) for t in (pos_chunk, *fields_chunk))

    def _move(self, plan: _Plan, t: torch.Tensor) -> torch.Tensor:
        dim = t.dim() - 2
        if dim < 0 or t.shape[dim] != plan.chunk_sizes[self.ring.index]:
            raise ValueError(
                f"PointCloudPartition.repartition: expected this rank's {plan.chunk_sizes[self.ring.index]} points "
                f"on dim -2, got shape {tuple(t.shape)}."
            )
        rows = t.index_select(dim, plan.chunk_order.to(t.device)).movedim(dim, 0)
        moved = exchange(rows.contiguous(), plan.chunk_counts, self.ring)
        return moved.movedim(0, dim)

    def to_chunks(self, y_l: torch.Tensor) -> torch.Tensor:
        """Send this rank's per-point result back to the chunk layout given to ``repartition``."""
        plan = self._require_plan("to_chunks")
        if plan.chunk_counts is None:
            raise RuntimeError(
                "PointCloudPartition.to_chunks: the last partition came from part(...), not repartition."
            )
        dim = y_l.dim() - 2
        p = self.ring.size
        back = [[plan.chunk_counts[d][s] for d in range(p)] for s in range(p)]
        rows = exchange(y_l.movedim(dim, 0).contiguous(), back, self.ring)  # chunk rows sorted by destination
        inverse = torch.empty_like(plan.chunk_order)
        inverse[plan.chunk_order] = torch.arange(plan.chunk_order.numel(), device=inverse.device)
        return rows.index_select(0, inverse.to(rows.device)).movedim(0, dim)

    # -- ghosts ------------------------------------------------------------------------------

    def ghosts(self, pos_l: torch.Tensor, *fields_l: torch.Tensor, k: int | None = None,
               radius: float | None = None) -> Ghosts:  # fmt: skip
        """Points owned by other parts that neighbour this rank's points (differentiable fields).

        Exactly one of ``k`` (the ghosts are the points of other parts among the k nearest
        neighbours of some local point) or ``radius`` (points of other parts within ``radius``
        of some local point) must be given. Collective: every domain rank must call it.
        """
        from .knn import knn, within_radius

        if (k is None) == (radius is None):
            raise ValueError("PointCloudPartition.ghosts: pass exactly one of k=... or radius=....")
        plan = self._require_plan("ghosts")
        coords = pos_l[0] if pos_l.dim() == 3 else pos_l
        sizes = plan.sizes
        rank = self.ring.index
        off = sum(sizes[:rank])
        if k is not None:
            _, idx = knn(coords, coords, k, mesh=self.mesh)
            idx = idx.flatten()
        else:
            idx = within_radius(coords, coords, radius, mesh=self.mesh)
        idx = torch.unique(idx[(idx >= 0) & ((idx < off) | (idx >= off + sizes[rank]))])
        bounds = torch.tensor([sum(sizes[: r + 1]) for r in range(len(sizes))], device=idx.device)
        owner = torch.bucketize(idx, bounds, right=True)
        out = [self._gather(t, idx, sizes) for t in (pos_l, *fields_l)]
        return Ghosts(out[0], tuple(out[1:]), self._all_index(plan)[idx], owner)

    def _all_index(self, plan: _Plan) -> torch.Tensor:
        """Every part's original indices, parts concatenated in rank order (one all-gather the
        first time after a repartition; a full cloud's plan has them already)."""
        if plan.all_index is None:
            plan.all_index = torch.cat(
                all_gather_uneven(plan.index, domain_group(self.mesh), [(s,) for s in plan.sizes])
            )
        return plan.all_index

    # -- graphs ------------------------------------------------------------------------------

    def graph(self, edge_index, *, flow: str = "source_to_target") -> HaloGraph:
        """This rank's in-edges of a graph over the partitioned cloud, with its halo points.

        ``edge_index``: the whole graph's ``(2, E)`` edges in original point indices, the same on
        every rank (or a PyG ``Data``, whose ``edge_index`` is taken). Returns a ``HaloGraph``:
        local ``edge_index`` (this rank's points, then the halo points), ``edge_ids`` (slice
        edge attributes with them), ``halo(x_l)`` (the halo points' features fetched from their
        owners, differentiable). See ``sharded_nn/points/graph.py`` for which layers are then
        exact. Collective after ``repartition`` (one all-gather of the parts' indices).
        """
        if self._plans is not None and self._plan is None:
            raise RuntimeError(
                "PointCloudPartition.graph: the last call partitioned a PyG Batch; partition each graph's Data "
                "on its own to build its halo graph."
            )
        plan = self._require_plan("graph")
        if _is_pyg(edge_index):
            edge_index = edge_index.edge_index
        return build_halo_graph(edge_index, self._all_index(plan), plan.sizes, self.ring, flow)

    def _gather(self, t: torch.Tensor, idx: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        dim = t.dim() - 2
        rows = t.movedim(dim, 0)
        flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))  # (a part of no points: 0 rows)
        got = gather_rows(flat, idx, sizes, self.ring)
        return got.reshape(idx.shape[0], *rows.shape[1:]).movedim(0, dim)

    # -- PyG ---------------------------------------------------------------------------------

    def _forward_pyg(self, data):
        from torch_geometric.data import Batch

        if isinstance(data, Batch):
            graphs = data.to_data_list()
            plans, parts = [], []
            for g in graphs:
                plan = self._plan_pyg(g)
                plans.append(plan)
                parts.append(g.subgraph(plan.index))
            self._plans, self._plan = plans, None
            return Batch.from_data_list(parts)
        plan = self._plan_pyg(data)
        self._plan, self._plans = plan, None
        return data.subgraph(plan.index)

    def _plan_pyg(self, data) -> _Plan:
        if getattr(data, "pos", None) is None:
            raise ValueError("PointCloudPartition: a PyG Data needs a 'pos' attribute to partition by.")
        plan = self._plan_full(data.pos)
        plan.data = data
        return plan

    def _restore_pyg(self, data_l):
        from torch_geometric.data import Batch

        if isinstance(data_l, Batch):
            if self._plans is None:
                raise RuntimeError("PointCloudPartition.restore: the last call partitioned a Data, not a Batch.")
            return Batch.from_data_list(
                [self._restore_data(p, d) for p, d in zip(self._plans, data_l.to_data_list())]
            )
        return self._restore_data(self._require_plan("restore"), data_l)

    def _restore_data(self, plan: _Plan, data_l):
        out = plan.data.clone()
        for key, value in data_l.items():
            if isinstance(value, torch.Tensor) and data_l.is_node_attr(key) and key != "edge_index":
                # PyG keeps the nodes on dim 0: restore (N_local, F) rows and reshape back.
                full = self._restore(plan, value.reshape(value.shape[0], -1))
                out[key] = full.reshape(plan.n, *value.shape[1:])
        return out


def _is_pyg(obj) -> bool:
    try:
        from torch_geometric.data import Data
        from torch_geometric.data.data import BaseData
    except ImportError:  # pragma: no cover - torch_geometric is a dependency
        return False
    return isinstance(obj, (BaseData, Data))


