"""timm's own norm(+act) layers, converted: statistics over the whole sample, forward and backward.

timm models (EfficientNet, MobileNetV3, RegNet, ResNetV2, NFNet, ...) use subclasses of the
torch norms; each must be swapped (by exact type) for a sharded class, in training too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

timm_norm_act = pytest.importorskip("timm.layers.norm_act")
timm_norm = pytest.importorskip("timm.layers.norm")


def _layer(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "bn_act":
        m = timm_norm_act.BatchNormAct2d(6, act_layer=nn.SiLU)
    elif kind == "gn_act":
        m = timm_norm_act.GroupNormAct(6, num_groups=3, act_layer=nn.GELU)
    elif kind == "gn1_act":
        m = timm_norm_act.GroupNorm1Act(6, act_layer=nn.ReLU)
    elif kind == "gn":
        m = timm_norm.GroupNorm(6, num_groups=2)
    else:
        m = timm_norm.GroupNorm1(6)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(0.5, 1.5)
    return m.double()


def _compare(kind: str, train: bool, h: int):
    m = mesh(dist.get_world_size())
    ref = _layer(kind).train(train)
    x = torch.randn(2, 6, h, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    w = torch.randn(yr.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (yr * w).sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a swapped layer: no "no sharded version" warning
        sh = snn.convert(_layer(kind).train(train), m, strict=True)
    sl = snn.local_slices(x.shape, m, dims=(2,))
    xs = x[sl].clone().requires_grad_()
    ys = sh(xs)
    (ys * w[sl]).sum().backward()
    grads = [p.grad for p in sh.parameters()]
    for g in grads:
        dist.all_reduce(g)  # partial sums over the domain (gradient convention)
    out = {
        "y": (ys - yr[sl]).abs().max().item(),
        "dx": (xs.grad - xr.grad[sl]).abs().max().item(),
        "dp": max((g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())),
    }
    if kind == "bn_act" and train:
        out["running"] = (sh.running_var - ref.running_var).abs().max().item()
    return type(sh).__name__, out


@pytest.mark.parametrize("kind", ["bn_act", "gn_act", "gn1_act", "gn", "gn1"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_timm_norm_act_matches_single_device(run, world, kind):
    # world 1: the layers run torch's own norm there; timm's drop and act must run once.
    for train in (True, False):
        for name, errs in run(world, _compare, kind, train, 11):
            assert name.startswith("Sharded"), name
            assert max(errs.values()) < 1e-12, (kind, train, errs)


def _errors(kind: str):
    m = mesh(dist.get_world_size())
    layer = snn.convert(_layer(kind).train(), m, strict=True)
    c = 6 if dist.get_rank() == 0 else 5  # another channel count on one rank
    x = torch.randn(2, c, 4, 5, dtype=torch.float64)
    try:
        layer(x)
    except Exception as e:  # noqa: BLE001 - reported for comparison across ranks
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("kind", ["bn_act", "gn_act"])
def test_errors_raise_alike(run, kind):
    res = run(2, _errors, kind)
    assert res[0] is not None and res[0][0] == "ShardingError", res
    assert res[0] == res[1]
