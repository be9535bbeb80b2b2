"""MeshGraphNet (Pfaff et al., 2021): single-device model code, sharded over a partitioned mesh.

Reads top to bottom: the MLP, the edge and node blocks, one processor step, the model, its
sharded class, the registered entry point (``create_model("meshgraphnet")``).

``MeshGraphNet(node_in, edge_in, out)`` is an ordinary ``nn.Module`` for one device:
``model(x, edge_attr, edge_index)`` with nodes ``(N, node_in)``, edges ``(E, edge_in)`` and PyG's
``edge_index`` (row 0 sources, row 1 targets). Encoders lift nodes and edges to ``hidden``
features; each processor step updates every edge from itself and its two end points, then every
node from itself and the sum of its incoming edges (both residual); a decoder maps nodes to
``out``.

Sharding (``snn.convert(model, mesh)`` or ``create_model("meshgraphnet", mesh=mesh, ...)``): the
nodes are split by a ``PointCloudPartition`` (mesh vertices by position), and each rank holds
its nodes and their **in-edges**; ``g = part.graph(edge_index)`` numbers them and the halo nodes
the in-edges reach (``sharded_nn/points/graph.py``). ``ShardedMeshGraphNet`` takes that graph in
place of ``edge_index``::

    pos_l, x_l = part(pos, x)
    g = part.graph(edge_index)
    y_l = model(x_l, edge_attr[g.edge_ids], g)       # this rank's nodes; part.restore(y_l): all

Each processor step first fetches the halo nodes' current features from their owners
(``g.halo``: only those rows travel), so every edge and node update is the single device's:
the output, the inputs' and the parameters' gradients (summed over ranks) match the plain model
on the whole graph. Per step and rank: one exchange of ``hidden`` features of the halo nodes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from sharded_nn.convert import convert
from sharded_nn.errors import ShardingError
from sharded_nn.mesh import domain_axes
from sharded_nn.points.graph import HaloGraph
from sharded_nn.registry import register

from .factory import register_model

__all__ = ["MeshGraphNet", "ShardedMeshGraphNet"]


class MeshGraphMLP(nn.Sequential):
    """``layers`` Linear layers with ``act`` between them, optionally a LayerNorm at the end."""

    def __init__(self, c_in: int, c_out: int, hidden: int, layers: int, act: type[nn.Module], norm: bool):
        mods: list[nn.Module] = []
        for i in range(layers):
            mods.append(nn.Linear(c_in if i == 0 else hidden, c_out if i == layers - 1 else hidden))
            if i < layers - 1:
                mods.append(act())
        if norm:
            mods.append(nn.LayerNorm(c_out))
        super().__init__(*mods)


class EdgeBlock(nn.Module):
    """``e + mlp([e, x_source, x_target])`` for every edge."""

    def __init__(self, hidden: int, layers: int, act: type[nn.Module]):
        super().__init__()
        self.mlp = MeshGraphMLP(3 * hidden, hidden, hidden, layers, act, norm=True)

    def forward(self, x: torch.Tensor, e: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        return e + self.mlp(torch.cat([e, x[src], x[dst]], dim=-1))


class NodeBlock(nn.Module):
    """``x + mlp([x, sum of incoming edges])`` for the first ``num_nodes`` nodes (default: all;
    fewer where the rows after them are other ranks' halo nodes, which receive nothing here)."""

    def __init__(self, hidden: int, layers: int, act: type[nn.Module]):
        super().__init__()
        self.mlp = MeshGraphMLP(2 * hidden, hidden, hidden, layers, act, norm=True)

    def forward(self, x, e, edge_index, num_nodes: int | None = None) -> torch.Tensor:
        n = x.shape[0] if num_nodes is None else num_nodes
        incoming = torch.zeros(n, e.shape[-1], dtype=e.dtype, device=e.device).index_add_(0, edge_index[1], e)
        return x[:n] + self.mlp(torch.cat([x[:n], incoming], dim=-1))


class ProcessorStep(nn.Module):
    """One message-passing step: the edges, then the nodes."""

    def __init__(self, hidden: int, layers: int, act: type[nn.Module]):
        super().__init__()
        self.edge = EdgeBlock(hidden, layers, act)
        self.node = NodeBlock(hidden, layers, act)

    def forward(self, x, e, edge_index, num_nodes: int | None = None):
        e = self.edge(x, e, edge_index)
        return self.node(x, e, edge_index, num_nodes), e


class MeshGraphNet(nn.Module):
    """Encode-process-decode graph network on a mesh.

    Args:
        node_in, edge_in: input node and edge features.
        out: output features per node.
        hidden: latent features of nodes and edges.
        steps: message-passing steps.
        mlp_layers: Linear layers per MLP.
        act: activation class.

    ``forward(x, edge_attr, edge_index)``: ``(N, node_in)``, ``(E, edge_in)``, ``(2, E)`` (sources
    in row 0) -> ``(N, out)``.
    """

    def __init__(self, node_in: int, edge_in: int, out: int, *, hidden: int = 128, steps: int = 15,
                 mlp_layers: int = 2, act: type[nn.Module] = nn.SiLU):  # fmt: skip
        super().__init__()
        if steps < 1 or mlp_layers < 1 or hidden < 1:
            raise ValueError(
                f"MeshGraphNet: steps, mlp_layers and hidden must be >= 1, got {steps}, {mlp_layers}, {hidden}."
            )
        self.node_encoder = MeshGraphMLP(node_in, hidden, hidden, mlp_layers, act, norm=True)
        self.edge_encoder = MeshGraphMLP(edge_in, hidden, hidden, mlp_layers, act, norm=True)
        self.processor = nn.ModuleList(ProcessorStep(hidden, mlp_layers, act) for _ in range(steps))
        self.decoder = MeshGraphMLP(hidden, out, hidden, mlp_layers, act, norm=False)

    def forward(self, x: torch.Tensor, edge_attr: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x, e = self.node_encoder(x), self.edge_encoder(edge_attr)
        for step in self.processor:
            x, e = step(x, e, edge_index)
        return self.decoder(x)


@register(MeshGraphNet)
class ShardedMeshGraphNet(MeshGraphNet):
    """``MeshGraphNet`` on a partitioned mesh: ``forward(x_l, edge_attr_l, graph)``.

    Sharding contract: ``x_l`` this rank's nodes ``(n_local, node_in)`` in the partition's order
    (``part(pos, x)``), ``edge_attr_l`` its in-edges' attributes ``edge_attr[graph.edge_ids]``,
    ``graph`` the ``HaloGraph`` of ``part.graph(edge_index)``; output this rank's nodes
    ``(n_local, out)``. Per processor step one halo exchange (``graph.halo``); parameters
    replicated, their gradients per-rank partial sums. Built by ``convert`` (or ``from_module``),
    which keeps every parameter (state-dict keys unchanged).
    """

    @classmethod
    def from_module(cls, module: MeshGraphNet, mesh: DeviceMesh, **options) -> ShardedMeshGraphNet:
        """A sharded copy of ``module`` that shares its parameters."""
        if options:
            raise TypeError(f"ShardedMeshGraphNet.from_module: unexpected options {sorted(options)}.")
        new = cls.__new__(cls)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new.mesh = mesh
        new.mesh_axes = domain_axes(mesh)
        return new

    def forward(self, x: torch.Tensor, edge_attr: torch.Tensor, graph: HaloGraph) -> torch.Tensor:  # type: ignore
        if not isinstance(graph, HaloGraph):
            raise ShardingError(
                f"ShardedMeshGraphNet: expected the HaloGraph of part.graph(edge_index) in place of edge_index, got "
                f"{type(graph).__name__}; build it with the PointCloudPartition that split the nodes."
            )
        if x.shape[0] != graph.n_local or edge_attr.shape[0] != graph.edge_index.shape[1]:
            raise ShardingError(
                f"ShardedMeshGraphNet: the graph has {graph.n_local} nodes and {graph.edge_index.shape[1]} in-edges "
                f"on this rank, got {x.shape[0]} nodes and {edge_attr.shape[0]} edge rows; pass part(pos, x)'s nodes "
                "and edge_attr[graph.edge_ids]."
            )
        x, e = self.node_encoder(x), self.edge_encoder(edge_attr)
        for step in self.processor:
            x, e = step(graph.halo(x), e, graph.edge_index, graph.n_local)
        return self.decoder(x)

    def extra_repr(self) -> str:  # noqa: D102
        return f"mesh_axes={self.mesh_axes}, nodes and in-edges per rank (HaloGraph)"


@register_model("meshgraphnet")
def _create_meshgraphnet(name: str, *, mesh: DeviceMesh | None = None, **kwargs) -> nn.Module:
    """``create_model("meshgraphnet", mesh=..., node_in=..., edge_in=..., out=..., **MeshGraphNet_kwargs)``."""
    model = MeshGraphNet(**kwargs)
    return model if mesh is None else convert(model, mesh, strict=True)
