"""Errors inside a converted model name the module and the model-level fix (issue 15, item 4)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference


class Net(nn.Module):
    """Three 1-d convs; two of stride 2, so the model input needs align=4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Conv1d(1, 2, 3, stride=2, padding=1),
            nn.Conv1d(2, 2, 3, stride=2, padding=1),
            nn.Conv1d(2, 1, 3, padding=1),
        )

    def forward(self, x):
        return self.layers(x)


def _misaligned_inner(length: int):
    m = mesh(torch.distributed.get_world_size())
    model = snn.convert(copy.deepcopy(Net().double()), m)  # deepcopy: the record survives copies
    x = torch.randn(1, 1, length, dtype=torch.float64)
    try:
        model(snn.shard(x, m, dims=(2,), align=2))  # the model needs 4: layers.1 sees odd starts
    except snn.ShardingError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world,length", [(2, 60), (3, 66)])
def test_inner_layer_error_names_module_and_model_fix(run, world, length):
    msgs = run(world, _misaligned_inner, length)
    assert msgs[0] is not None and len(set(msgs)) == 1, msgs  # every rank raised the same error
    msg = msgs[0]
    assert "in module 'layers.1' (ShardedConv1d) of Net" in msg
    assert "the slabs start at" in msg  # the layout it saw
    assert "the model input needs align=4 along dims (2,)" in msg
    assert "snn.local_slices(shape, mesh, dims=(2,), align=4)" in msg
    # The layer's own advice ("align a multiple of 2") was followed by the user: it is replaced.
    assert "align a multiple of 2" not in msg
    assert "drifted" in msg and "snn.reshard" in msg


def _standalone():
    m = mesh(torch.distributed.get_world_size())
    conv = snn.ShardedConv1d(1, 1, 3, stride=2, padding=1, mesh=m).double()
    x = torch.randn(1, 1, 30, dtype=torch.float64)
    try:
        conv(snn.shard(x, m, dims=(2,), align=1))  # 15/15: start 15 is odd
    except snn.ShardingError as e:
        return str(e)
    return None


def test_standalone_layer_error_unchanged(run):
    msgs = run(2, _standalone)
    assert msgs[0] is not None and len(set(msgs)) == 1
    assert "in module" not in msgs[0] and "align a multiple of 2" in msgs[0]


def _aligned_runs():
    m = mesh(torch.distributed.get_world_size())
    return check_against_reference(Net().double(), torch.randn(2, 1, 44, dtype=torch.float64), m, dims=(2,), align=4)


def test_recorded_context_changes_no_result(run):
    run(3, _aligned_runs)


def _mse(kind: str):
    m = mesh(torch.distributed.get_world_size())
    r = torch.distributed.get_rank()
    full = torch.arange(60, dtype=torch.float64).view(1, 1, 60)
    target = full[snn.local_slices(full.shape, m, dims=(2,))]
    if kind == "drift":
        pred = full[..., :33] if r == 0 else full[..., 33:]  # 33/27: same total, other split
    else:
        pred = full[..., :28] if r == 0 else full[..., 30:58]  # a model output 4 shorter
    try:
        snn.losses.mse_loss(pred, target, m)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["drift", "shorter"])
def test_mse_loss_says_what_differs(run, kind):
    msgs = run(2, _mse, kind)
    assert msgs[0] is not None and len(set(msgs)) == 1, msgs
    msg = msgs[0]
    assert "Shard both with the same dims" not in msg  # they were
    if kind == "drift":
        assert "along dim 2 the slab sizes differ (pred [33, 27], target [30, 30] by rank)" in msg
        assert "split differently" in msg and "snn.reshard(pred, mesh, dims=(2,))" in msg
    else:
        assert "pred has size 28 and target 30" in msg and "does not have the target's size" in msg


def _reconverted():
    m = mesh(torch.distributed.get_world_size())
    model = snn.convert(snn.convert(Net().double(), m), m)  # the second convert sees the guard
    try:
        model(snn.shard(torch.randn(1, 1, 60, dtype=torch.float64), m, dims=(2,), align=2))
    except snn.ShardingError as e:
        return str(e)
    return None


def test_converting_twice_keeps_the_record(run):
    msgs = run(2, _reconverted)
    assert len(set(msgs)) == 1 and "in module 'layers.1' (ShardedConv1d) of Net" in msgs[0]
    assert "the model input needs align=4" in msgs[0]
