"""The zoo MeshGraphNet (``create_model("meshgraphnet")``) on a partitioned graph against the
plain model on the whole graph: outputs, node and edge inputs' gradients, parameter gradients
summed over ranks (float64), world sizes 2 and 3, both partition methods; the wrong graph
argument refused."""

from __future__ import annotations

import pytest
import torch

import sharded_nn as snn
from sharded_nn.points import PointCloudPartition
from sharded_nn.zoo.meshgraphnet import MeshGraphNet, ShardedMeshGraphNet

from .harness import mesh
from .test_points_graph import _graph

OPTIONS = {"node_in": 5, "edge_in": 3, "out": 2, "hidden": 8, "steps": 3}


def _case(world: int, method: str):
    m = mesh(world)
    pos, x, e, edge_index = _graph(5)
    torch.manual_seed(0)
    ref = snn.zoo.create_model("meshgraphnet", **OPTIONS).double()
    model = snn.zoo.create_model("meshgraphnet", mesh=m, **OPTIONS).double()
    assert type(model) is ShardedMeshGraphNet
    model.load_state_dict(ref.state_dict())
    x, e = x.clone().requires_grad_(), e.clone().requires_grad_()
    y = ref(x, e, edge_index)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6), dtype=y.dtype)
    (y * gy).sum().backward()

    part = PointCloudPartition(m, method=method)
    xs, es = x.detach().clone().requires_grad_(), e.detach().clone().requires_grad_()
    _, x_l = part(pos, xs)
    g = part.graph(edge_index)
    y_l = model(x_l, es[g.edge_ids], g)
    torch.testing.assert_close(part.restore(y_l), y.detach(), atol=1e-12, rtol=1e-10)
    (y_l * gy[part.index]).sum().backward()
    for got, want in ((xs.grad, x.grad), (es.grad, e.grad)):
        got = got.clone()
        torch.distributed.all_reduce(got)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, atol=1e-12, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    errors = []
    for args in ((x_l, es[g.edge_ids], g.edge_index), (x_l[:-1], es[g.edge_ids], g)):
        try:
            model(*args)
        except snn.ShardingError as err:
            errors.append(str(err))
    return errors


@pytest.mark.parametrize("world,method", [(2, "rcb"), (3, "morton")])
def test_meshgraphnet_on_a_partitioned_graph_matches_the_whole_graph(run, world, method):
    for errors in run(world, _case, world, method):
        assert len(errors) == 2
        assert "expected the HaloGraph" in errors[0] and "in-edges on this rank" in errors[1]


def test_meshgraphnet_options_are_checked():
    with pytest.raises(ValueError, match="steps"):
        MeshGraphNet(2, 2, 1, steps=0)
    assert sum(1 for _ in MeshGraphNet(2, 2, 1, steps=2).processor) == 2


def _parallelized():
    """``snn.parallelize`` (convert + DDP with the domain-sum hook) of the plain model: after the
    backward every rank holds the single device's parameter gradients."""
    from sharded_nn.demo import mesh_graph

    m = mesh(2)
    pos, x, e, edge_index = mesh_graph(12)
    torch.manual_seed(0)
    ref = MeshGraphNet(4, 3, 2, hidden=8, steps=2).double()
    model = MeshGraphNet(4, 3, 2, hidden=8, steps=2).double()
    model.load_state_dict(ref.state_dict())
    model = snn.parallelize(model, m)
    y = ref(x, e, edge_index)
    torch.nn.functional.mse_loss(y, torch.zeros_like(y)).backward()
    part = PointCloudPartition(m)
    _, x_l = part(pos, x)
    g = part.graph(edge_index)
    y_l = model(x_l, e[g.edge_ids], g)
    snn.losses.mse_loss(y_l, torch.zeros_like(y_l), m).backward()
    torch.testing.assert_close(part.restore(y_l.detach()), y.detach(), atol=1e-12, rtol=1e-10)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10)
    return True


def test_meshgraphnet_trains_under_parallelize(run):
    assert all(run(2, _parallelized))
