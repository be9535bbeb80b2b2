"""Graph network layers across the parts of a cloud: ``PointCloudPartition.graph`` (``HaloGraph``).

PyG layers (GraphConv, SAGEConv with mean aggregation, GATConv with edge features, GINEConv,
TransformerConv) and a MeshGraphNet processor written in plain torch (edge block on the edge
and its end points' features, node block on the summed messages), stacked so that the halo is
refreshed between layers, on each rank's in-edges and halo points, against the layers on the
whole graph (float64): the restored outputs, the full input's gradient, the edge features'
gradient and the parameters' gradients (summed over ranks). The graph holds a kNN graph and
random long edges (across the parts), self-loops and duplicate edges; world sizes 2 and 3, both
partition methods, a batch of samples on one cloud, the ``target_to_source`` flow, a part with
no halo. GCNConv needs the whole graph's normalisation: passed precomputed, it is exact; the
test also shows the local normalisation is not (why the docs say so).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.points import HaloGraph, PointCloudPartition

from .harness import mesh

N, C, E_DIM = 40, 5, 3


def _graph(seed: int = 0):
    """Positions, node and edge features, and edges: each point's 3 nearest neighbours, 15
    random long edges, two self-loops and a duplicated edge (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.rand(N, 2, generator=g, dtype=torch.float64)
    d = torch.cdist(pos, pos)
    d.fill_diagonal_(float("inf"))
    nbr = d.topk(3, largest=False).indices
    src = torch.cat([nbr.flatten(), torch.randint(0, N, (15,), generator=g), torch.tensor([4, 9])])
    dst = torch.cat([torch.arange(N).repeat_interleave(3), torch.randint(0, N, (15,), generator=g),
                     torch.tensor([4, 9])])  # fmt: skip
    src, dst = torch.cat([src, src[:1]]), torch.cat([dst, dst[:1]])  # a duplicated edge
    edge_index = torch.stack([src, dst])
    x = torch.randn(N, C, generator=g, dtype=torch.float64)
    e = torch.randn(edge_index.shape[1], E_DIM, generator=g, dtype=torch.float64)
    return pos, x, e, edge_index


class MeshGraphNetBlock(nn.Module):
    """MeshGraphNet's processor step, written for one device: edges from (edge, source, target),
    nodes from (node, sum of incoming edges), both residual. ``flow`` as PyG's: under
    ``target_to_source`` row 0 of ``edge_index`` holds the targets."""

    def __init__(self, c: int, e: int, flow: str = "source_to_target"):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(e + 2 * c, 16), nn.SiLU(), nn.Linear(16, e))
        self.node_mlp = nn.Sequential(nn.Linear(c + e, 16), nn.SiLU(), nn.Linear(16, c))
        self.flow = flow

    def forward(self, x, edge_attr, edge_index, n_out: int | None = None):
        src, dst = edge_index if self.flow == "source_to_target" else edge_index.flip(0)
        e = edge_attr + self.edge_mlp(torch.cat([edge_attr, x[src], x[dst]], -1))
        n_out = x.shape[0] if n_out is None else n_out  # the local version aggregates into its own nodes
        agg = torch.zeros(n_out, e.shape[-1], dtype=e.dtype).index_add_(0, dst, e)
        return x[:n_out] + self.node_mlp(torch.cat([x[:n_out], agg], -1)), e


def _layers():
    from torch_geometric import nn as gnn

    torch.manual_seed(0)
    return nn.ModuleDict({
        "graph": gnn.GraphConv(C, C, aggr="add"),
        "sage": gnn.SAGEConv(C, C, aggr="mean"),
        "gat": gnn.GATConv(C, C, heads=2, concat=False, edge_dim=E_DIM, add_self_loops=False),
        "gine": gnn.GINEConv(nn.Sequential(nn.Linear(C, C), nn.Tanh()), edge_dim=E_DIM),
        "transformer": gnn.TransformerConv(C, C, heads=2, concat=False, edge_dim=E_DIM),
        "mgn": MeshGraphNetBlock(C, E_DIM),
    }).double()  # fmt: skip


def _whole(layers, x, e, edge_index):
    """The stack on the whole graph: every PyG layer in turn, then two MeshGraphNet steps."""
    for name in ("graph", "sage", "gat", "gine", "transformer"):
        kw = {} if name in ("graph", "sage") else {"edge_attr": e}
        x = torch.tanh(layers[name](x, edge_index, **kw))
    for _ in range(2):
        x, e = layers["mgn"](x, e, edge_index)
    return x


def _local(layers, g: HaloGraph, x_l, e_l):
    """The same stack on this rank's in-edges: the halo refreshed before every layer."""
    n = g.n_local
    for name in ("graph", "sage", "gat", "gine", "transformer"):
        kw = {} if name in ("graph", "sage") else {"edge_attr": e_l}
        x_l = torch.tanh(layers[name](g.halo(x_l), g.edge_index, **kw)[:n])
    for _ in range(2):
        x_l, e_l = layers["mgn"](g.halo(x_l), e_l, g.edge_index, n_out=n)
    return x_l


def _stack_case(world: int, method: str, batched: bool):
    m = mesh(world)
    pos, x, e, edge_index = _graph()
    ref = _layers()
    model = copy.deepcopy(ref)
    x = x.clone().requires_grad_()
    e = e.clone().requires_grad_()
    y = _whole(ref, x, e, edge_index)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    (y * gy).sum().backward()

    part = PointCloudPartition(m, method=method)
    xs = x.detach().clone().requires_grad_()
    es = e.detach().clone().requires_grad_()
    pos_l, x_l = part(pos, xs)
    g = part.graph(edge_index)
    assert g.edge_index.shape[1] == int(torch.isin(edge_index[1], part.index).sum())  # every in-edge kept
    assert g.n_halo > 0 and bool((g.halo_owner != snn.domain_group(m).rank()).all())
    y_l = _local(model, g, x_l, es[g.edge_ids])
    full = part.restore(y_l)
    torch.testing.assert_close(full, y.detach(), atol=1e-12, rtol=1e-10)
    (y_l * gy[part.index]).sum().backward()
    xs_grad, es_grad = xs.grad.clone(), es.grad.clone()
    torch.distributed.all_reduce(xs_grad)  # each rank's part of the full inputs' gradient
    torch.distributed.all_reduce(es_grad)
    torch.testing.assert_close(xs_grad, x.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(es_grad, e.grad, atol=1e-12, rtol=1e-10)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, atol=1e-12, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    if batched:  # samples sharing the cloud: (B, n_local, C) through halo()
        xb = torch.randn(2, N, C, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        xb_l = xb[:, part.index]
        got = g.halo(xb_l)
        assert got.shape == (2, g.n_local + g.n_halo, C)
        torch.testing.assert_close(got[:, g.n_local :], xb[:, g.halo_index], rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world,method,batched", [(2, "rcb", True), (3, "morton", False)])
def test_graph_layers_across_parts_match_the_whole_graph(run, world, method, batched):
    assert all(run(world, _stack_case, world, method, batched))


def _gcn_case(world: int):
    from torch_geometric.nn import GCNConv
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    m = mesh(world)
    pos, x, _, edge_index = _graph(1)
    torch.manual_seed(0)
    ref = GCNConv(C, C).double()
    y = ref(x, edge_index)
    part = PointCloudPartition(m)
    _, x_l = part(pos, x)
    g = part.graph(edge_index)
    # The whole graph's normalisation (self-loops added there), sliced to this rank's in-edges.
    full_ei, w = gcn_norm(edge_index, None, N, add_self_loops=True, dtype=x.dtype)
    gw = part.graph(full_ei)
    local = GCNConv(C, C, normalize=False).double()
    local.load_state_dict(ref.state_dict())
    y_l = local(gw.halo(x_l), gw.edge_index, w[gw.edge_ids])[: gw.n_local]
    torch.testing.assert_close(part.restore(y_l), y.detach(), atol=1e-12, rtol=1e-10)
    # GCNConv's own normalisation on the local edges counts a halo point's degree from its
    # edges into this rank only: not the whole graph's (hence the recipe above).
    naive = ref(g.halo(x_l), g.edge_index)[: g.n_local]
    return (part.restore(naive) - y).abs().max().item()


def test_gcn_with_the_whole_graphs_normalisation_is_exact(run):
    errors = run(2, _gcn_case, 2)
    assert all(err > 1e-6 for err in errors)  # the naive local normalisation differs


def _flow_and_refusals():
    m = mesh(2)
    pos, x, e, edge_index = _graph(2)
    part = PointCloudPartition(m)
    _, x_l = part(pos, x)
    # target_to_source: row 0 holds the targets; the same edges reversed give the same graph.
    g1 = part.graph(edge_index)
    g2 = part.graph(edge_index.flip(0), flow="target_to_source")
    assert torch.equal(g1.edge_index, g2.edge_index.flip(0)) and torch.equal(g1.edge_ids, g2.edge_ids)
    # A graph whose edges stay within the parts: no halo, nothing fetched (halo() still takes
    # part in the ring pass, so ranks with and without halo points can call it together).
    owner = torch.empty(N, dtype=torch.int64)
    parts = [None] * 2
    torch.distributed.all_gather_object(parts, part.index)
    for r, idx in enumerate(parts):
        owner[idx] = r
    g0 = part.graph(edge_index[:, owner[edge_index[0]] == owner[edge_index[1]]])
    no_halo = g0.n_halo == 0 and torch.equal(g0.halo(x_l), x_l)
    errors = []
    for bad, kw in ((edge_index.double(), {}), (edge_index[:1], {}), (edge_index + N, {}),
                    (edge_index, {"flow": "both"})):  # fmt: skip
        try:
            part.graph(bad, **kw)
        except ValueError as err:
            errors.append(str(err))
    try:
        g1.halo(x_l[:-1])
    except ValueError as err:
        errors.append(str(err))
    return no_halo, errors


def test_graph_flow_and_bad_input(run):
    for ok, errors in run(2, _flow_and_refusals):
        assert ok
        assert len(errors) == 5
        assert "integer tensor of shape (2, E)" in errors[0] and "(2, E)" in errors[1]
        assert "the cloud has 40 points" in errors[2] and "flow must be" in errors[3]
        assert "expected this rank's" in errors[4]


def _no_partition():
    part = PointCloudPartition(mesh(2))
    try:
        part.graph(torch.zeros(2, 1, dtype=torch.int64))
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_graph_needs_a_partition_first(run):
    assert all("call part(...)" in out for out in run(2, _no_partition))
