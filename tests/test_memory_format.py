"""Channels-last inputs: the sharded layers return the memory format torch's own layers return.

Values are checked everywhere else; here the layout. A layer that hands the next one a different
memory format than on one device changes which torch kernel runs there: a ConvNeXt's depthwise
convolutions once copied every slab to NCHW and ran the NCHW kernel, 3.4x slower (issue 16).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

# (layer, input channels); all take (N, 8, 16, 12) slabs sharded on H with align 2.
LAYERS = {
    "conv3x3": lambda: nn.Conv2d(8, 8, 3, padding=1),
    "conv1x1": lambda: nn.Conv2d(8, 4, 1),
    "depthwise7": lambda: nn.Conv2d(8, 8, 7, padding=3, groups=8),
    "conv_stride2": lambda: nn.Conv2d(8, 8, 3, stride=2, padding=1),
    "conv_transpose": lambda: nn.ConvTranspose2d(8, 4, 2, stride=2),
    "maxpool": lambda: nn.MaxPool2d(3, 2, 1),
    "avgpool": lambda: nn.AvgPool2d(2),
    "batchnorm": lambda: nn.BatchNorm2d(8),
    "groupnorm": lambda: nn.GroupNorm(2, 8),
    "upsample_nearest": lambda: nn.Upsample(scale_factor=2),
    "upsample_bilinear": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
}

# Layers whose torch version returns a contiguous (NCHW) tensor for a channels-last input.
NCHW_LAYERS = {
    "instancenorm": lambda: nn.InstanceNorm2d(8),
    "instancenorm_affine_running": lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
    "instancenorm_eval": lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True).eval(),
}


def _formats(name: str, batch: int):
    m = mesh(dist.get_world_size())
    torch.manual_seed(0)
    ref = {**LAYERS, **NCHW_LAYERS}[name]().double()
    sharded = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(batch, 8, 16, 12, dtype=torch.float64).to(memory_format=torch.channels_last)
    xs = x[snn.local_slices(x.shape, m, dims=(2,), align=2)].clone(memory_format=torch.channels_last)
    xs.requires_grad_()
    y = sharded(xs)
    y_ref = ref(x.detach().requires_grad_())
    # The layout torch's layer gives a channels-last input of the local shape, and the values
    # (the gathered output against the full one).
    want_cl = copy.deepcopy(ref)(xs.detach()).is_contiguous(memory_format=torch.channels_last)
    got_cl = y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(snn.gather(y, m, dims=(2,)), y_ref, rtol=1e-10, atol=1e-10)
    y.sum().backward()
    return want_cl, got_cl, xs.grad is not None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_channels_last_output_format_matches_torch(run, name, batch, world):
    for want_cl, got_cl, has_grad in run(world, _formats, name, batch):
        assert want_cl, f"{name}: torch's layer itself gave no channels-last output"
        assert got_cl == want_cl and has_grad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(NCHW_LAYERS))
def test_channels_last_input_gives_nchw_where_torch_does(run, name, batch, world):
    for want_cl, got_cl, has_grad in run(world, _formats, name, batch):
        assert not want_cl, f"{name}: torch's layer itself gave a channels-last output"
        assert got_cl == want_cl and has_grad
