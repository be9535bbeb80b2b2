"""A slab cut by ``snn.shard`` along other dims than the converted model takes it raises.

Before session 61, ``model(snn.shard(x, mesh, dims=[3]))`` on a model sharded along H (dim 2)
ran without error: each rank took its W-half for rows of H, exchanged halos with the wrong
neighbour and returned a plausible, silently wrong output (0.42 off on a two-conv model). Now
``shard`` marks its slab with the dims it cut, and the model's entry facts compare the mark with
the dims the model takes that input along: a mismatch raises the same ``ShardingError`` on every
rank, naming both. Checked on 2 and 3 ranks and a 2x2 mesh (axes swapped), through ``shard``'s
scatter form (``src=``), and for an input the model takes whole; matching dims run exactly.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

TOL = {"atol": 1e-10, "rtol": 1e-10}


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 2, 3, padding=1)).double()


class Biased(nn.Module):
    """A conv plus a bias passed in whole (``input_dims={"bias": None}``)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x, bias):
        return self.conv(x) + bias


def _case(domain, model_dims, shard_dims, how: str):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = _net()
    x = torch.randn(1, 3, 9, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model = snn.convert(copy.deepcopy(ref), m, dims=model_dims)
    if how == "scatter":
        first = all(m.get_local_rank(a) == 0 for a in snn.domain_axes(m))
        local = snn.shard(x if first else None, m, dims=shard_dims, src=0)
    else:
        local = snn.shard(x, m, dims=shard_dims)
    try:
        y = model(local)
    except snn.ShardingError as e:
        msg = str(e)
    else:
        torch.testing.assert_close(snn.gather(y, m, dims=shard_dims), ref(x), **TOL)
        msg = "ran exactly"
    # The refusal leaves the model usable: the input cut as the model takes it runs exactly.
    y = model(snn.shard(x, m, dims=model_dims))
    torch.testing.assert_close(snn.gather(y, m, dims=model_dims), ref(x), **TOL)
    return msg


@pytest.mark.parametrize("how", ["shard", "scatter"])
@pytest.mark.parametrize("domain", [2, 3])
def test_slab_cut_along_another_dim_raises_on_every_rank(run, domain, how):
    out = run(domain, _case, domain, [2], [3], how)
    assert len(set(out)) == 1, out
    assert "input 0 was cut by sharded_nn.shard along dims (3,), but the model takes it along dims (2,)" in out[0]
    assert "silently wrong" in out[0]
    # The same dims on both sides: exact, no error.
    assert run(domain, _case, domain, [3], [3], how) == ["ran exactly"] * domain


def test_swapped_axes_on_a_2x2_mesh_raise(run):
    # dims[k] is sharded by mesh axis k: (3, 2) puts W on the first axis, where the model has H.
    out = run(4, _case, (2, 2), [2, 3], [3, 2], "shard")
    assert len(set(out)) == 1 and "along dims (3, 2), but the model takes it along dims (2, 3)" in out[0], out
    assert run(4, _case, (2, 2), [2, 3], [2, 3], "shard") == ["ran exactly"] * 4


def _whole(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Biased().double(), m, input_dims={"bias": None})
    x = snn.shard(torch.randn(1, 3, 8, 5, dtype=torch.float64), m)
    bias = torch.randn(1, 2, 8, 5, dtype=torch.float64)
    try:
        model(x, snn.shard(bias, m))
    except snn.ShardingError as e:
        return str(e)
    return "no error"


def test_slab_of_an_input_taken_whole_raises(run):
    out = run(2, _whole, 2)
    assert len(set(out)) == 1 and "input 1 was cut by sharded_nn.shard along dims (2,), but the model takes it whole" \
        in out[0], out



class Tokens(nn.Module):
    """Tokens (B, L, C) sharded along L, through a norm and an MLP."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.mlp = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _gathered_along_another_dim(domain):
    """A converted model's slab output carries its dims: gathering or reducing it along the
    default dims (2,) of a grid, where its tokens are sharded along dim 1, raises instead of
    assembling it along the channels (equal slab sizes: no other error would show)."""
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Tokens().double()
    x = torch.randn(2, 4 * domain, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model = snn.convert(copy.deepcopy(ref), m, dims=(1,))
    y = model(snn.shard(x, m, dims=(1,)))
    out = []
    for call in (lambda: snn.gather(y, m), lambda: snn.reductions.mean(y, m, dims=(1,)),
                 lambda: snn.gather(snn.shard(x, m, dims=(1,)), m)):
        try:
            call()
        except snn.ShardingError as e:
            out.append(str(e))
        else:
            out.append("no error")
    torch.testing.assert_close(snn.gather(y, m, dims=(1,)), ref(x), **TOL)  # (its own dims: exact)
    torch.testing.assert_close(snn.reductions.mean(y, m, dims=(1,), sharded_dims=(1,)), ref(x).mean(1), **TOL)
    return out


def test_gather_and_reductions_along_another_dim_than_the_slabs_raise(run):
    for domain in (2, 3):
        out = run(domain, _gathered_along_another_dim, domain)
        assert len({tuple(o) for o in out}) == 1, out
        for msg in out[0]:
            assert "this slab was cut along dims (1,)" in msg and "dims (2,) were asked" in msg, msg


def _sources(domain, data: int, per_rank: bool):
    """Slabs cut by shard from a tensor drawn on each rank (per_rank: a random crop or a loader
    shuffled per rank) raise alike; data replicas may hold different samples."""
    m = mesh(domain, data=data)
    torch.manual_seed(0)
    ref = _net()
    model = snn.convert(copy.deepcopy(ref), m)
    rank = torch.distributed.get_rank()
    replica = m.get_local_rank("data") if data > 1 else 0
    seed = 10 + (rank if per_rank else replica)
    x = torch.randn(1, 3, 9, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = model(snn.shard(x, m))
    said = [str(w.message) for w in caught if issubclass(w.category, snn.ShardingWarning)]
    if said:
        return said[0]
    torch.testing.assert_close(snn.gather(y, m), ref(x), **TOL)
    return "ran exactly"


def test_slabs_cut_from_different_tensors_warn(run):
    # A warning, not an error: a timing run feeds random inputs drawn on each rank on purpose.
    out = run(2, _sources, 2, 1, True)
    assert len(set(out)) == 1 and "input slabs were cut from different tensors" in out[0], out
    assert "DistributedSampler" in out[0] and "src=0" in out[0]
    out = run(3, _sources, 3, 1, True)
    assert len(set(out)) == 1 and "cut from different tensors" in out[0], out
    # Each data replica its own sample, the same on its domain ranks: exact, no warning.
    assert run(4, _sources, 2, 2, False) == ["ran exactly"] * 4


def _device_keeps_marks(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(_net(), m)
    x = torch.randn(1, 3, 9, 7, dtype=torch.float64)
    local = snn.shard(x, m, dims=[3], device="cpu")  # (on a GPU: device="cuda"; .to() would drop the marks)
    out = []
    try:
        model(local)
    except snn.ShardingError as e:
        out.append("along dims (3,), but the model takes it along dims (2,)" in str(e))
    try:
        snn.shard(x, m, src=0, device="cpu")
    except ValueError as e:
        out.append("needs src=None" in str(e))
    return out


def test_shard_to_a_device_keeps_the_marks(run):
    assert run(2, _device_keeps_marks, 2) == [[True, True]] * 2
