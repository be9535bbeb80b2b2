"""Graphs over a partitioned point cloud: each rank's in-edges and the halo points they reach.

A graph network layer (PyG's ``MessagePassing``, a MeshGraphNet block) computes node ``i``'s
output from ``i``'s features, its in-edges' attributes and their source nodes' features. On a
part of the cloud, the edges whose source lies on another rank would be missing (``part(data)``
drops cut edges), and the nodes near the cut would be silently wrong. ``HaloGraph`` keeps every
in-edge of the rank's own nodes: their sources owned elsewhere become *halo* nodes, numbered
after the rank's own, whose features ``g.halo(x_l)`` fetches from their owners before each layer
(``exchange``: each owner sends each rank just the rows it needs, known to both from the whole
graph, so nothing but features travels; differentiable, the gradients of the halo rows flow
back to the owners). So, for such a layer::

    g = part.graph(edge_index)                       # the full graph, the same on every rank
    y_l = conv(g.halo(x_l), g.edge_index, edge_attr[g.edge_ids])[: g.n_local]

gives this rank's rows of ``conv(x, edge_index, edge_attr)`` on the whole graph, forward and
backward (parameter gradients are per-rank partial sums, as everywhere in sharded_nn). Exact
for layers whose output at a node depends only on its in-edges and their end points:
``GraphConv``, ``SAGEConv``, ``GINConv``/``GINEConv``, ``GATConv``/``GATv2Conv`` (the softmax
runs over a node's in-edges, all local), ``TransformerConv``, ``EdgeConv`` on a given graph,
MeshGraphNet's edge and node blocks. **Not** automatically exact: layers that normalise by the
degree of *source* nodes computed from the edges they are given (``GCNConv`` with
``normalize=True``, ``ChebConv``): a halo node's local degree counts only its edges into this
rank. Compute such weights on the whole graph and pass them sliced (``gcn_norm`` once, then
``GCNConv(normalize=False)`` with ``edge_weight=w[g.edge_ids]``; tests/test_points_graph.py).

Edges are taken with PyG's default ``flow="source_to_target"``: row 0 of ``edge_index`` holds
sources, row 1 targets (pass ``flow="target_to_source"`` for the other convention). One PyG
detail breaks the in-edge rule under ``target_to_source``: a layer that adds self-loops whose
attributes are the mean of a node's edge attributes (``GATConv``/``GATv2Conv`` with ``edge_dim``
and their default ``add_self_loops=True, fill_value="mean"``) groups the edges by row 1 whatever
the flow, which under ``target_to_source`` is a node's *out*-edges, not kept here: its self-loop
attributes, hence its outputs, differ from the whole graph's (found by tests/test_fuzz_graph.py).
There, add the self-loops on the whole graph (``torch_geometric.utils.add_self_loops`` after
``remove_self_loops``, attributes included) and build the layer with ``add_self_loops=False``,
use ``source_to_target``, or a numeric ``fill_value``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import AxisPeers
from .exchange import exchange

__all__ = ["HaloGraph", "build_halo_graph"]


@dataclass(frozen=True)
class HaloGraph:
    """This rank's in-edges of a graph over a partitioned cloud (see the module docstring).

    Attributes:
        edge_index: ``(2, E_local)`` in local numbering: ``[0, n_local)`` this rank's points in
            the partition's order (``part.index``), ``[n_local, n_local + n_halo)`` the halo
            points; same flow as the input (sources in the row the input had them).
        edge_ids: ``(E_local,)`` positions of these edges in the full edge list (slice edge
            attributes and weights with it).
        halo_index: ``(n_halo,)`` original indices of the halo points, grouped by owner in rank
            order (ascending within each owner).
        halo_owner: ``(n_halo,)`` the domain rank that owns each halo point.
        n_local: this rank's points.
    """

    edge_index: torch.Tensor
    edge_ids: torch.Tensor
    halo_index: torch.Tensor
    halo_owner: torch.Tensor
    n_local: int
    _send: torch.Tensor  # this rank's rows the others' halos need, grouped by the rank that needs them
    _counts: tuple[tuple[int, ...], ...]  # _counts[s][d]: rows owner s sends to rank d
    _ring: AxisPeers

    @property
    def n_halo(self) -> int:
        return int(self.halo_index.numel())

    def halo(self, x_l: torch.Tensor) -> torch.Tensor:
        """``x_l`` (this rank's points on dim -2: ``(n_local, C)`` or ``(B, n_local, C)``) with the
        halo points' rows appended, fetched from their owners. Collective: every domain rank
        calls it (an exchange of the requested rows over the domain ring, empty where nothing is
        needed); differentiable (the halo rows' gradients reach their owners)."""
        if x_l.dim() < 2 or x_l.shape[-2] != self.n_local:
            raise ValueError(
                f"HaloGraph.halo: expected this rank's {self.n_local} points on dim -2, got shape {tuple(x_l.shape)}."
            )
        rows = x_l.movedim(-2, 0)
        flat = rows.reshape(rows.shape[0], -1) if rows.dim() != 2 else rows
        got = exchange(flat.index_select(0, self._send), [list(c) for c in self._counts], self._ring)
        got = got.reshape(self.n_halo, *rows.shape[1:]).movedim(0, -2)
        return torch.cat([x_l, got], dim=-2)


def build_halo_graph(
    edge_index: torch.Tensor, all_index: torch.Tensor, sizes: list[int], ring: AxisPeers, flow: str
) -> HaloGraph:
    """The ``HaloGraph`` of this rank from the whole graph and the whole partition.

    ``all_index``: the original indices of every part's points, parts concatenated in rank order
    (each part ascending); ``sizes``: every part's size. No communication.
    """
    if flow not in ("source_to_target", "target_to_source"):
        raise ValueError(
            f"PointCloudPartition.graph: flow must be 'source_to_target' or 'target_to_source', got {flow!r}."
        )
    if edge_index.dim() != 2 or edge_index.shape[0] != 2 or edge_index.is_floating_point():
        raise ValueError(
            f"PointCloudPartition.graph: edge_index must be an integer tensor of shape (2, E), got "
            f"{edge_index.dtype} {tuple(edge_index.shape)}."
        )
    n = int(all_index.numel())
    edge_index = edge_index.to(torch.int64)
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
        raise ValueError(
            f"PointCloudPartition.graph: edge_index refers to points [{int(edge_index.min())}, "
            f"{int(edge_index.max())}], the cloud has {n} points."
        )
    src_row, dst_row = (0, 1) if flow == "source_to_target" else (1, 0)
    device = edge_index.device
    all_index = all_index.to(device)
    row_of = torch.empty(n, dtype=torch.int64, device=device)
    row_of[all_index] = torch.arange(n, device=device)  # original index -> row in the concatenation
    bounds = torch.tensor([sum(sizes[: r + 1]) for r in range(len(sizes))], device=device)
    me, p = ring.index, len(sizes)
    lo, hi = sum(sizes[:me]), sum(sizes[: me + 1])
    src, dst = row_of[edge_index[src_row]], row_of[edge_index[dst_row]]
    # Every rank's halo, from the whole graph (the same on every rank): the distinct (rank of the
    # target, source) pairs of the edges that cross parts, sorted, so each rank's halo points are
    # grouped by owner in rank order, as the exchange delivers them.
    owner_src, owner_dst = torch.bucketize(src, bounds, right=True), torch.bucketize(dst, bounds, right=True)
    cross = owner_src != owner_dst
    key = torch.unique(owner_dst[cross] * n + src[cross])
    need_by, need_row = key // n, key % n
    need_from = torch.bucketize(need_row, bounds, right=True)
    counts = torch.zeros(p * p, dtype=torch.int64, device=device)
    counts.index_add_(0, need_from * p + need_by, torch.ones_like(need_from))
    halo_rows = need_row[need_by == me]
    # This rank's in-edges, numbered locally: its points, then its halo points.
    mine = owner_dst == me
    edge_ids = mine.nonzero().flatten()
    src, dst = src[mine], dst[mine]
    outside = (src < lo) | (src >= hi)
    n_local = hi - lo
    local_src = src - lo
    local_src[outside] = n_local + torch.searchsorted(halo_rows, src[outside])
    pair = [local_src, dst - lo]
    local_edges = torch.stack(pair if flow == "source_to_target" else pair[::-1])
    return HaloGraph(
        edge_index=local_edges, edge_ids=edge_ids, halo_index=all_index[halo_rows],
        halo_owner=torch.bucketize(halo_rows, bounds, right=True), n_local=n_local,
        _send=need_row[need_from == me] - lo, _counts=tuple(tuple(r) for r in counts.view(p, p).tolist()), _ring=ring,
    )  # fmt: skip
