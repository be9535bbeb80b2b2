"""Every domain rank must hold the same weights (``sharded_nn/weights.py``).

This torch seeds every process differently: a model built on each rank without a common
``torch.manual_seed`` holds other weights on every rank, and each slab was computed with its own
(a silently wrong answer before session 60). The first forward after ``convert`` (or after a
sharded layer is made, used on its own) and after each ``load_state_dict`` now checks a value
digest in the agreement it makes anyway, and raises alike on every rank; ``sync_weights`` copies
the first rank's weights to every rank. Compared with the single-device model built from the
first rank's weights, forward and backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.weights import value_digest

from .harness import mesh, world_of
from .reference import check_against_reference


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.GELU(), nn.Conv2d(4, 2, 3, padding=1)
    ).double()


def _slab(x: torch.Tensor, m, sizes) -> torch.Tensor:
    r = m.get_local_rank("domain")
    return x.narrow(2, sum(sizes[:r]), sizes[r]).clone()


def _unseed(seed: int) -> None:
    """Each rank's own random state, as a fresh process of this torch has it."""
    torch.manual_seed(seed + 1000 * torch.distributed.get_rank())


def _outcome(fn) -> str:
    try:
        fn()
    except snn.ShardingError as e:
        return str(e)
    return "ran"


# --------------------------------------------------------------------------- worker side


def _converted_model(domain, how: str):
    m = mesh(domain)
    sizes = {2: (7, 5), 3: (5, 4, 3)}.get(domain)
    dims = (2,) if isinstance(domain, int) else (2, 3)
    _unseed(1)
    model = _net()
    if how == "buffer":  # same parameters, other running statistics
        torch.manual_seed(0)
        model = _net()
        _unseed(2)
        model[1].running_mean.normal_()
    if how == "nonpersistent":  # random Fourier features registered persistent=False
        torch.manual_seed(0)
        model = _net()
        _unseed(2)
        model.register_buffer("features", torch.randn(3), persistent=False)
    x = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    sharded = snn.convert(copy.deepcopy(model), m)
    local = _slab(x, m, sizes) if sizes else snn.shard(x, m, dims=dims)
    return _outcome(lambda: sharded(local))


def _synced_model(domain):
    m = mesh(domain)
    _unseed(3)
    model = _net()
    snn.sync_weights(model, m)  # before convert: the reference is the synced single-device model
    x = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    sizes = {2: (7, 5), 3: (5, 4, 3)}.get(domain)
    check_against_reference(model, x, m, dims=(2,) if sizes else (2, 3), sizes=sizes)
    # After convert too: the converted model's own weights are synced in place.
    _unseed(4)
    other = snn.convert(_net(), m)
    snn.sync_weights(other, m)
    group, n = snn.domain_group(m), snn.domain_size(m)
    rows = [snn.comm.all_gather_uneven(p.detach(), group, [tuple(p.shape)] * n) for p in other.parameters()]
    return all(torch.equal(r[0], t) for r in rows for t in r)


def _loaded(how: str):
    m = mesh(2)
    torch.manual_seed(0)
    model = snn.convert(_net(), m)
    x = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    local = _slab(x, m, (7, 5))
    model(local)  # checked once: same weights
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    rank = m.get_local_rank("domain")
    if how == "rank0" and rank == 0:
        model.load_state_dict(sd)
    if how == "every":
        model.load_state_dict(sd)
    if how == "rank1_other":  # every rank loads, rank 1 another checkpoint
        model.load_state_dict(sd if rank == 0 else {k: v + 2 for k, v in model.state_dict().items()})
    if how == "submodule_rank0" and rank == 0:  # a new last layer, loaded on rank 0 only
        model[3].load_state_dict({k: v + 1 for k, v in model[3].state_dict().items()})
    if how == "deepcopy_submodule":  # a deep copy's submodule, loaded on rank 0: the copy re-checks
        model = copy.deepcopy(model)
        if rank == 0:
            model[1].load_state_dict({k: v + 1 for k, v in model[1].state_dict().items()})
    first = _outcome(lambda: model(local))
    second = _outcome(lambda: model(local))  # a failed check is repeated (a passed one is not)
    snn.sync_weights(model, m)
    third = _outcome(lambda: model(local))
    return first, second, third


def _standalone(kind: str, seeded: bool):
    m = mesh(2)
    if seeded:
        torch.manual_seed(0)
    else:
        _unseed(6)
    x = torch.randn(1, 2, 8, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    if kind == "conv3d":
        layer = snn.ShardedConv3d(2, 3, 3, padding=1, mesh=m).double()
        local = _slab(x, m, (5, 3))
        return _outcome(lambda: layer(local))
    if kind == "groupnorm":
        layer = snn.ShardedGroupNorm(1, 2, mesh=m).double()
        with torch.no_grad():
            layer.weight.normal_()
        local = _slab(x, m, (5, 3))
        return _outcome(lambda: layer(local))
    if kind.startswith("physics"):
        from sharded_nn.layers.physics_attention import (
            ShardedPhysicsAttentionIrregularMesh,
            ShardedPhysicsAttentionStructuredMesh2D,
        )

        points = torch.randn(2, 9 * 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
        if kind == "physics":
            layer = ShardedPhysicsAttentionIrregularMesh(8, heads=2, dim_head=4, slice_num=3, mesh=m).double()
        else:  # the structured form (its projections are sharded convolutions of their own)
            layer = ShardedPhysicsAttentionStructuredMesh2D(8, heads=2, dim_head=4, slice_num=3, spatial_shape=(9, 4),
                                                            mesh=m).double()
        rows = (5, 4)[m.get_local_rank("domain")] * 4
        local = points.narrow(1, 5 * 4 * m.get_local_rank("domain"), rows)
        return _outcome(lambda: layer(local))
    layer = snn.ShardedMultiheadAttention(8, 2, batch_first=True, mesh=m).double()
    tokens = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    local = tokens.narrow(1, 5 * m.get_local_rank("domain"), (5, 4)[m.get_local_rank("domain")])
    return _outcome(lambda: layer(local, local, local, need_weights=False))


def _parallelize(mode: str):
    m = mesh(2, data=2)
    _unseed(9)
    model = snn.parallelize(_net(), m, mode=mode)
    x = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    out = _outcome(lambda: model(_slab(x, m, (7, 5))))
    # Every rank of the mesh (domain ranks and data replicas) holds the same whole parameters.
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    world = torch.distributed.group.WORLD
    rows = [snn.comm.all_gather_uneven(p.detach(), world, [tuple(p.shape)] * 4) for p in full]
    return out, all(torch.equal(r[0], t) for r in rows for t in r)


def _zoo():
    from sharded_nn.zoo import create_model

    m = mesh(2)
    _unseed(12)
    model = create_model("unet2d", mesh=m, in_channels=1, out_channels=1, channels=(4, 8)).double()
    x = torch.randn(1, 1, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    out = _outcome(lambda: model(snn.shard(x, m, align=2)))
    rows = [snn.comm.all_gather_uneven(p.detach(), snn.domain_group(m), [tuple(p.shape)] * 2)
            for p in model.parameters()]
    return out, all(torch.equal(a, b) for a, b in rows)


def _one_rank_domain():
    m = mesh(1, data=2)
    _unseed(11)  # data replicas differ: no domain rank to compare with (DDP's business)
    model = snn.convert(_net(), m)
    return _outcome(lambda: model(torch.randn(1, 2, 6, 4, dtype=torch.float64)))


# --------------------------------------------------------------------------- tests


MESSAGE = "hold different parameter and buffer values"


@pytest.mark.parametrize("domain", [2, 3, (2, 2)])
def test_model_built_differently_on_each_rank_raises_on_every_rank(run, domain):
    res = run(world_of(domain), _converted_model, domain, "params")
    assert all(MESSAGE in r and "sync_weights" in r for r in res), res
    assert len(set(res)) == 1, res


@pytest.mark.parametrize("how", ["buffer", "nonpersistent"])
def test_buffers_are_checked_too(run, how):
    res = run(2, _converted_model, 2, how)
    assert all(MESSAGE in r for r in res), res


@pytest.mark.parametrize("domain", [2, 3, (2, 2)])
def test_sync_weights_makes_the_sharded_model_exact(run, domain):
    assert all(run(world_of(domain), _synced_model, domain))


def test_load_state_dict_rechecks(run):
    # rank 0 alone loads other weights: the next forward raises on every rank (once).
    res = run(2, _loaded, "rank0")
    assert all(MESSAGE in r[0] and "load_state_dict ran on the other ranks only" in r[0] for r in res), res
    # A caller that catches the error does not go on silently: the next forward raises again,
    # until the weights agree (here after sync_weights).
    assert all(MESSAGE in r[1] and r[2] == "ran" for r in res), res
    # every rank loads the same weights: no error.
    assert all(r == ("ran", "ran", "ran") for r in run(2, _loaded, "every"))
    # every rank loads, not the same weights.
    res = run(2, _loaded, "rank1_other")
    assert all(MESSAGE in r[0] and MESSAGE in r[1] and r[2] == "ran" for r in res), res


@pytest.mark.parametrize("how", ["submodule_rank0", "deepcopy_submodule"])
def test_load_state_dict_on_a_submodule_rechecks(run, how):
    """Before session 61 only a load on the converted root re-armed the check: a new head loaded
    on rank 0 alone (``model.head.load_state_dict``) computed on with other weights, silently."""
    res = run(2, _loaded, how)
    assert all(MESSAGE in r[0] and MESSAGE in r[1] and r[2] == "ran" for r in res), res


@pytest.mark.parametrize("kind", ["conv3d", "groupnorm", "mha", "physics", "physics_structured"])
def test_standalone_layers_check_their_own_weights(run, kind):
    res = run(2, _standalone, kind, False)
    assert all(MESSAGE in r for r in res) and len(set(res)) == 1, res
    assert run(2, _standalone, kind, True) == ["ran", "ran"]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_parallelize_starts_from_the_first_ranks_weights(run, mode):
    # DDP broadcasts at construction; FSDP2 does not: parallelize copies the first rank's first.
    assert run(4, _parallelize, mode) == [("ran", True)] * 4


def test_zoo_models_start_from_the_first_ranks_weights(run):
    assert run(2, _zoo) == [("ran", True)] * 2


def test_one_domain_rank_compares_nothing(run):
    assert run(2, _one_rank_domain) == ["ran", "ran"]


def test_value_digest_is_exact():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64,
                  torch.int8, torch.bool):
        t = (torch.randn(300, generator=g) * 5).to(dtype) if dtype != torch.bool else torch.rand(300, generator=g) > 0.5
        d = value_digest([t])
        assert d == value_digest([t.clone()]) and 0 < d < 2**61, dtype
        flipped = t.clone()
        if dtype == torch.bool:
            flipped[7] = ~flipped[7]
        else:
            flipped.view(torch.uint8)[13] ^= 1  # one bit
        assert value_digest([flipped]) != d, dtype
        swapped = t.clone()
        swapped[[3, 200]] = t[[200, 3]]
        if not torch.equal(swapped, t):
            assert value_digest([swapped]) != d, dtype
    big = torch.randn(2**22 + 5, generator=g)  # beyond one slice of the digest
    d = value_digest([big])
    big[-1] += 1
    assert value_digest([big]) != d
    strided = torch.randn(6, 8, generator=g).t()
    assert value_digest([strided]) == value_digest([strided.contiguous()])
    assert value_digest([torch.ones(3), torch.zeros(3)]) != value_digest([torch.zeros(3), torch.ones(3)])
    assert value_digest([torch.zeros(2, 3)]) != value_digest([torch.zeros(3, 2)])
    assert value_digest([torch.zeros(3)]) != value_digest([torch.zeros(3, dtype=torch.float64)])
