"""One default for the sharded dims: shard -> converted layers -> gather with no dims given."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.sharding import default_dims

from .harness import mesh, world_of


def _net(spatial: int) -> nn.Module:
    torch.manual_seed(0)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[spatial]
    return nn.Sequential(conv(2, 3, 3, padding=1), nn.Tanh(), conv(3, 2, 3, padding=1, padding_mode="circular")).double()


def _defaults_case(domain, shape):
    """Only defaults: shard(x, mesh), convert(model, mesh), gather(y, mesh), local_slices(shape, mesh)."""
    m = mesh(domain)
    n_axes = 1 if isinstance(domain, int) else len(domain)
    assert default_dims(m) == tuple(range(2, 2 + n_axes))
    ref = _net(len(shape) - 2)
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(shape[:1] + (2,) + shape[2:], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * g).sum().backward()

    x_local = snn.shard(x, m).requires_grad_()
    assert torch.equal(x_local, x[snn.local_slices(x.shape, m)])
    y = snn.gather(model(x_local), m)
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-12, rtol=1e-12)
    snn.losses.share((y * g).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), xr.grad, atol=1e-12, rtol=1e-12)
    return True


@pytest.mark.parametrize(
    "domain,shape",
    [((2, 2), (1, 2, 9, 7)), (2, (1, 2, 9, 7)), (3, (2, 2, 10)), (4, (1, 2, 9, 4, 3))],
    ids=["2x2-conv2d", "2-conv2d", "3-conv1d", "4-conv3d"],
)
def test_defaults_match_single_device(run, domain, shape):
    # On a 2x2 mesh the old default dims=(2,) sharded H only while the converted Conv2d sharded
    # H and W: the gathered output was silently wrong.
    assert all(run(world_of(domain), _defaults_case, domain, shape))


def _reductions_default_case():
    # reductions and losses read the same default: a 2x2 mesh shards (2, 3).
    m = mesh((2, 2))
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x_local = snn.shard(x, m)
    torch.testing.assert_close(snn.reductions.mean(x_local, m, (2, 3)), x.mean((2, 3)), atol=1e-13, rtol=0)
    torch.testing.assert_close(snn.reductions.max(x_local, m), x.amax(), atol=0, rtol=0)
    return True


def test_reductions_use_the_same_default(run):
    assert all(run(4, _reductions_default_case))


def test_functional_forms_live_in_functional():
    """``snn.functional`` holds every functional form a reader looks for: attention, interpolate, pad."""
    import sharded_nn as snn
    from sharded_nn.layers.padding import pad
    from sharded_nn.layers.upsample import interpolate

    assert snn.functional.interpolate is interpolate is snn.interpolate
    assert snn.functional.pad is pad
    assert {"interpolate", "pad", "ring_attention", "ulysses_attention"} <= set(snn.functional.__all__)
