"""Second derivatives through sharded_nn: exact, or PyTorch's "differentiate twice" error.

``create_graph=True`` backs gradient penalties, physics-informed losses on input derivatives
and Hessian-vector products. A custom backward whose communication autograd does not record
gives, under ``create_graph``, a first derivative that is a constant where it should depend on
the other ranks' values: the second derivative then silently misses their terms (measured
before session 62: off by 0.9 through ``reductions.var``, 170 through ``reductions.cumsum``, 33
through ``HaloGraph.halo``). Every case here computes a Hessian-vector product of a nonlinear
loss in float64, ``d/dx <dL/dx, v>``, on the whole tensor with plain torch and on uneven slabs
(2 and 3 ranks) with sharded_nn, and compares both derivatives once assembled. Each case states
its outcome (EXACT, or RAISES where the backward is marked ``once_differentiable``), so a
backward that stops recording its communication fails here either way.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.points import PointCloudPartition
from sharded_nn.points.knn import gather_neighbours, knn

from .harness import mesh
from .test_points_graph import E_DIM, MeshGraphNetBlock, _graph
from .test_points_graph import C as GRAPH_C

TWICE = "differentiate twice"
RAISES = "raises"


def _hvp(loss_fn, x: torch.Tensor, v: torch.Tensor):
    """(dL/dx, d/dx <dL/dx, v>) at ``x``; the second is RAISES where torch refuses it."""
    x = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(loss_fn(x), x, create_graph=True)
    try:
        (g * v).sum().backward()
    except RuntimeError as err:
        if TWICE not in str(err):
            raise
        return g.detach(), RAISES
    return g.detach(), x.grad


def _compare(whole, sharded, x, split, join) -> tuple[float, float | str]:
    """Max differences of the first and second derivatives (or RAISES for the second)."""
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    g, h = _hvp(whole, x, v)
    x_l, v_l = split(x), split(v)
    g_l, h_l = _hvp(sharded, x_l, v_l)
    first = float((join(g_l) - g).abs().max())
    if isinstance(h_l, str):
        return first, h_l
    return first, float((join(h_l) - h).abs().max() / (1 + h.abs().max()))


def _slabs(m, dim: int = 2):
    return (lambda t: snn.shard(t, m, dims=(dim,))), (lambda t: snn.gather(t, m, dims=(dim,)))


def _slab_of(w: torch.Tensor, y_l: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """This rank's rows of ``w`` where the slabs are ``y_l``'s (a layer's output layout)."""
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, y_l.shape[dim])
    r = dist.get_rank()
    return w.narrow(dim, sum(sizes[:r]), sizes[r])


def _weights(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- reductions and losses over sharded dims ---------------------------------------------------


def _reductions_case(world: int) -> dict:
    m = mesh(world)
    x = _weights((2, 3, 7, 5), 0)
    split, join = _slabs(m)
    R = snn.reductions
    replicated = {  # name: (torch on the whole tensor, sharded_nn on slabs); replicated results
        "sum": (lambda t: t.sum((2, 3)), lambda t: R.sum(t, m, (2, 3), sharded_dims=2)),
        "mean": (lambda t: t.mean(2), lambda t: R.mean(t, m, 2, sharded_dims=2)),
        "max": (lambda t: t.amax(2), lambda t: R.max(t, m, 2, sharded_dims=2)),
        "max_dim": (lambda t: t.max(2).values, lambda t: R.max_dim(t, m, 2, sharded_dims=2)[0]),
        "norm1": (lambda t: torch.linalg.vector_norm(t, 1, 2), lambda t: R.norm(t, m, 2, 1, sharded_dims=2)),
        "norm2": (lambda t: torch.linalg.vector_norm(t, 2, 2), lambda t: R.norm(t, m, 2, 2, sharded_dims=2)),
        "norm3": (lambda t: torch.linalg.vector_norm(t, 3, (2, 3)), lambda t: R.norm(t, m, (2, 3), 3, sharded_dims=2)),
        "var": (lambda t: t.var(2), lambda t: R.var(t, m, 2, sharded_dims=2)),
        "std": (lambda t: t.std((2, 3)), lambda t: R.std(t, m, (2, 3), sharded_dims=2)),
        "var_mean": (lambda t: sum(torch.var_mean(t, 2, correction=0)),
                     lambda t: sum(R.var_mean(t, m, 2, correction=0, sharded_dims=2))),
        "std_mean": (lambda t: torch.std_mean(t, (2, 3))[0] * torch.std_mean(t, (2, 3))[1],
                     lambda t: R.std_mean(t, m, (2, 3), sharded_dims=2)[0] * R.std_mean(t, m, (2, 3), sharded_dims=2)[1]),
        "logsumexp": (lambda t: t.logsumexp(2), lambda t: R.logsumexp(t, m, 2, sharded_dims=2)),
    }  # fmt: skip
    out = {}
    for name, (whole, sharded) in replicated.items():
        w = _weights(whole(x).shape, 1)
        out[name] = _compare(
            lambda t: (w * whole(t) ** 3).sum(),
            lambda t: snn.losses.share((w * sharded(t) ** 3).sum(), m),  # one device's loss, shared
            x, split, join,
        )  # fmt: skip
    slabbed = {  # results laid out as the input
        "softmax": (lambda t: t.softmax(2), lambda t: R.softmax(t, m, 2, sharded_dims=2)),
        "log_softmax": (lambda t: t.log_softmax(2), lambda t: R.log_softmax(t, m, 2, sharded_dims=2)),
        "cumsum": (lambda t: t.cumsum(2), lambda t: R.cumsum(t, m, 2, sharded_dims=2)),
    }
    w = _weights(x.shape, 1)
    w_l = split(w)
    for name, (whole, sharded) in slabbed.items():
        out[name] = _compare(lambda t: (w * whole(t) ** 3).sum(), lambda t: (w_l * sharded(t) ** 3).sum(), x, split, join)
    target = _weights(x.shape, 2)
    t_l = split(target)
    losses = {
        "losses.mse_loss": (lambda t: F.mse_loss(t**2, target), lambda t: snn.losses.mse_loss(t**2, t_l, m)),
        "losses.relative_l2": (
            lambda t: ((t**2 - target).flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1)).mean(),
            lambda t: snn.losses.relative_l2(t**2, t_l, m),
        ),
        "losses.global_mean": (lambda t: (t**3).mean(), lambda t: snn.losses.global_mean(t**3, m)),
    }
    for name, (whole, sharded) in losses.items():
        out[name] = _compare(whole, sharded, x, split, join)
    return out


REDUCTIONS = ["sum", "mean", "max", "max_dim", "norm1", "norm2", "norm3", "var", "std", "var_mean", "std_mean",
              "logsumexp", "softmax", "log_softmax", "cumsum", "losses.mse_loss", "losses.relative_l2",
              "losses.global_mean"]  # fmt: skip


# -- converted models: layers and calls inside forward -----------------------------------------


class _Call(nn.Module):
    """A 1x1 convolution, then a call in the model's own forward (the guard routes it)."""

    def __init__(self, op):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.op = op

    def forward(self, x):
        return self.op(self.conv(x))


class _OwnLoss(nn.Module):
    """A model that computes its own loss (routed by the guard)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x, target):
        y = self.conv(x)
        return F.mse_loss(y**2, target) + F.smooth_l1_loss(y, target)


CALLS = {  # name: (module factory, expected second derivative)
    "conv 1x1": (lambda: nn.Conv2d(3, 3, 1), "exact"),
    "conv 3x3": (lambda: nn.Conv2d(3, 3, 3, padding=1), RAISES),  # halo exchange
    "max pool": (lambda: nn.MaxPool2d(3, 1, 1), RAISES),
    "upsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), RAISES),
    "transposed conv": (lambda: nn.ConvTranspose2d(3, 3, 2, stride=2), "exact"),
    "group norm": (lambda: nn.GroupNorm(1, 3), "exact"),
    "batch norm": (lambda: nn.BatchNorm2d(3), "exact"),
    "instance norm": (lambda: nn.InstanceNorm2d(3, affine=True), "exact"),
    "guard: mean gate": (lambda: _Call(lambda y: y * y.mean((2, 3), keepdim=True).sigmoid()), "exact"),
    "guard: var": (lambda: _Call(lambda y: y * y.var((2, 3), keepdim=True)), "exact"),
    "guard: std": (lambda: _Call(lambda y: y / (y.std(2, keepdim=True) + 1)), "exact"),
    "guard: softmax": (lambda: _Call(lambda y: y.softmax(2)), "exact"),
    "guard: cumsum": (lambda: _Call(lambda y: y.cumsum(2)), "exact"),
    "guard: normalize": (lambda: _Call(lambda y: F.normalize(y, dim=2)), "exact"),
    "guard: fft filter": (
        lambda: _Call(lambda y: torch.fft.irfft2(torch.fft.rfft2(y, norm="ortho") * 1.5, s=y.shape[-2:], norm="ortho")),
        "exact",
    ),
    "guard: roll": (lambda: _Call(lambda y: torch.roll(y, 1, 2)), RAISES),
    "guard: cosine similarity": (lambda: _Call(lambda y: y * F.cosine_similarity(y, y * y + 1, dim=2).unsqueeze(2)),
                                 "exact"),
    "guard: picked rows": (lambda: _Call(lambda y: y * y[:, :, torch.tensor([0, 6, 3])].sum(2, keepdim=True)), "exact"),
    "guard: unfold windows": (lambda: _Call(lambda y: F.pad(y.unfold(2, 2, 1).prod(-1), (0, 0, 0, 1))), RAISES),  # halo
    # Pieces put back along the rows: their rows move to the result's layout, then to the slab's (session 64).
    "guard: pieces rejoined": (lambda: _Call(lambda y: torch.cat([y[:, :, :3], y[:, :, 3:]], 2) * y), RAISES),
}


def _calls_case(world: int) -> dict:
    m = mesh(world)
    x = _weights((2, 3, 7, 5), 0)
    split, join = _slabs(m)
    out = {}
    for name, (factory, _) in CALLS.items():
        torch.manual_seed(3)
        ref = nn.Sequential(factory(), nn.Tanh()).double()
        model = snn.convert(copy.deepcopy(ref), m)
        w = _weights(ref(x).shape, 4)
        w_l = _slab_of(w, model(split(x)).detach())
        out[name] = _compare(lambda t: (w * ref(t) ** 3).sum(), lambda t: (w_l * model(t) ** 3).sum(), x, split, join)
    torch.manual_seed(3)
    ref = _OwnLoss().double()
    model = snn.convert(copy.deepcopy(ref), m)
    target = _weights(x.shape, 2)
    t_l = split(target)
    out["guard: loss in forward"] = _compare(
        lambda t: ref(t, target), lambda t: snn.losses.share(model(t, t_l), m), x, split, join
    )
    return out


# -- point clouds, graphs, attention -----------------------------------------------------------


def _points_case(world: int) -> dict:
    m = mesh(world)
    pos, x, e, edge_index = _graph()
    part = PointCloudPartition(m)
    part(pos, x)
    idx = part.index

    def join(t_l):  # this rank's points' rows -> the whole cloud's (each row owned by one rank)
        full = t_l.new_zeros(x.shape[0], *t_l.shape[1:])
        full[idx] = t_l
        dist.all_reduce(full)
        return full

    def split(t):
        return t[idx]

    w = _weights(x.shape, 1)
    w_l = split(w)
    out = {}
    torch.manual_seed(3)
    block = MeshGraphNetBlock(GRAPH_C, E_DIM).double()
    g = part.graph(edge_index)
    out["HaloGraph.halo"] = _compare(
        lambda t: (w * block(t, e, edge_index)[0] ** 3).sum(),
        lambda t: (w_l * block(g.halo(t), e[g.edge_ids], g.edge_index, n_out=g.n_local)[0] ** 3).sum(),
        x, split, join,
    )  # fmt: skip
    _, nbr = knn(split(pos), split(pos), 4, mesh=m)
    nbr_full = torch.cdist(pos, pos).topk(4, largest=False).indices
    out["gather_neighbours"] = _compare(
        lambda t: (w.unsqueeze(1) * t[nbr_full] ** 3).sum(),
        lambda t: (w_l.unsqueeze(1) * gather_neighbours(t, nbr, mesh=m) ** 3).sum(),
        x, split, join,
    )  # fmt: skip
    # repartition (chunks in, parts out) and to_chunks (back): two exchanges
    chunks = snn.Layout.balanced(x.shape[0], world)
    lo, n = chunks.starts[dist.get_rank()], chunks.sizes[dist.get_rank()]
    moved = PointCloudPartition(m)

    def join_chunks(t_l):
        full = t_l.new_zeros(x.shape)
        full[lo : lo + n] = t_l
        dist.all_reduce(full)
        return full

    out["repartition, to_chunks"] = _compare(
        lambda t: (w * t**4).sum(),
        lambda t: (w[lo : lo + n] * moved.to_chunks(moved.repartition(pos[lo : lo + n], t)[1] ** 2) ** 2).sum(),
        x, lambda t: t[lo : lo + n], join_chunks,
    )  # fmt: skip
    return out


def _attention_case(world: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .test_transolver import CONFIGS, _reference

    m = mesh(world)
    r = dist.get_rank()
    out = {}
    # torch's fused CPU attention kernels have no second derivative: the math kernel on both sides.
    with sdpa_kernel(SDPBackend.MATH):
        ref = _reference(CONFIGS["unstructured"])
        model = snn.convert(copy.deepcopy(ref), m)
        fx, emb = _weights((2, 23, 3), 1), _weights((2, 23, 3), 2)
        rows = snn.Layout.balanced(23, world)
        lo, n = rows.starts[r], rows.sizes[r]
        w = _weights(ref(fx, embedding=emb).shape, 3)

        def join(t_l):
            full = t_l.new_zeros(fx.shape)
            full[:, lo : lo + n] = t_l
            dist.all_reduce(full)
            return full

        out["transolver"] = _compare(
            lambda t: (w * ref(t, embedding=emb) ** 3).sum(),
            lambda t: (w[:, lo : lo + n] * model(t, embedding=emb[:, lo : lo + n]) ** 3).sum(),
            fx, lambda t: t[:, lo : lo + n], join,
        )  # fmt: skip
        q = _weights((1, world, 9, 4), 4)  # heads divisible by the ranks (Ulysses)
        split, join = _slabs(m)
        w = _weights(q.shape, 5)
        w_l = split(w)
        for name, layer in (("UlyssesAttention", snn.UlyssesAttention(m)), ("RingAttention", snn.RingAttention(m))):
            out[name] = _compare(
                lambda t: (w * F.scaled_dot_product_attention(t, t * 0.5, t.tanh()) ** 3).sum(),
                lambda t, layer=layer: (w_l * layer(t, t * 0.5, t.tanh()) ** 3).sum(),
                q, split, join,
            )  # fmt: skip
    return out


EXPECTED = {
    **{name: "exact" for name in REDUCTIONS},
    **{name: expected for name, (_, expected) in CALLS.items()},
    "guard: loss in forward": "exact",
    "HaloGraph.halo": "exact",
    "gather_neighbours": "exact",
    "repartition, to_chunks": "exact",
    "transolver": "exact",
    "UlyssesAttention": "exact",
    "RingAttention": RAISES,
}


@pytest.mark.parametrize("case", [_reductions_case, _calls_case, _points_case, _attention_case],
                         ids=["reductions", "converted", "points", "attention"])  # fmt: skip
@pytest.mark.parametrize("world", [2, 3])
def test_second_derivatives_are_exact_or_refused(run, case, world):
    problems = []
    for rank, seen in enumerate(run(world, case, world)):
        assert seen and set(seen) <= set(EXPECTED), sorted(set(seen) - set(EXPECTED))
        for name, (first, second) in seen.items():
            where = f"rank {rank}, {name}"
            if first > 1e-10:
                problems.append(f"{where}: first derivative off by {first:.2e}")
            if EXPECTED[name] == RAISES:
                if second != RAISES:
                    problems.append(f"{where}: expected the 'differentiate twice' error, got a value ({second})")
            elif second == RAISES:
                problems.append(f"{where}: expected an exact second derivative, got the 'differentiate twice' error")
            elif second > 1e-10:
                problems.append(f"{where}: second derivative off by {second:.2e} (relative)")
    assert not problems, "\n".join(problems)
