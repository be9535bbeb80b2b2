"""``F.grid_sample`` inside a converted model's forward (``sharded_nn/guard_sample.py``).

A registration network written for one device, the way VoxelMorph writes its warp (an identity
grid buffer of the whole image plus a predicted flow, normalised by sizes read from the flow,
coordinates reordered by ``[..., [1, 0]]``, then ``grid_sample``), 2-D and 3-D, against the same
model on one device (float64: output, input and parameter gradients), on uneven slabs of 2 and
3 ranks, flows of several rows (samples reaching past the neighbour's slab), every mode and
both paddings the guard computes, both ``align_corners``; a plain grid of its own size (a
regridding to a coarse grid: replicated output); and the refusals, alike on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.forward_guard import mark_guarded

from .harness import mesh
from .reference import compare_on_slabs, error_on_slab


@mark_guarded  # its forward is torch code the guard follows: convert(strict=True) does not report it
class Warp(nn.Module):
    """Warps ``src`` by ``flow`` (in positions), written as VoxelMorph's spatial transformer."""

    def __init__(self, size, mode="bilinear", padding="zeros", align=True):
        super().__init__()
        self.mode, self.padding, self.align = mode, padding, align
        grids = torch.meshgrid([torch.arange(0, s) for s in size], indexing="ij")
        self.register_buffer("grid", torch.stack(grids).unsqueeze(0).to(torch.float64))

    def forward(self, src, flow):
        locs = self.grid + flow
        shape = flow.shape[2:]
        for i in range(len(shape)):  # to [-1, 1] by the whole image's sizes (read from the flow)
            locs[:, i, ...] = 2 * (locs[:, i, ...] / (shape[i] - 1) - 0.5)
        if len(shape) == 2:
            locs = locs.permute(0, 2, 3, 1)[..., [1, 0]]
        else:
            locs = locs.permute(0, 2, 3, 4, 1)[..., [2, 1, 0]]
        return F.grid_sample(src, locs, mode=self.mode, padding_mode=self.padding, align_corners=self.align)


class Registration(nn.Module):
    """Moving and fixed images as two channels: a flow from both, the moving image warped by it."""

    def __init__(self, size, mode="bilinear", padding="zeros", align=True, reach=3.0):
        super().__init__()
        conv = nn.Conv2d if len(size) == 2 else nn.Conv3d
        self.enc = conv(2, 6, 3, padding=1)
        self.flow = conv(6, len(size), 3, padding=1)
        self.warp = Warp(size, mode, padding, align)
        self.reach = reach  # flows of up to about this many positions

    def forward(self, x):
        flow = self.flow(torch.tanh(self.enc(x))) * self.reach
        return torch.cat([self.warp(x[:, :1], flow), flow], 1)


class Regrid(nn.Module):
    """Resampling to a fixed coarse grid (a plain buffer of its own size), then a head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        gy, gx = torch.meshgrid(torch.linspace(-1.1, 0.9, 5), torch.linspace(-0.8, 1.0, 4), indexing="ij")
        self.register_buffer("coarse", torch.stack([gx, gy], -1).unsqueeze(0).to(torch.float64))
        self.head = nn.Linear(3 * 5 * 4, 2)

    def forward(self, x):
        h = self.conv(x)
        g = F.grid_sample(h, self.coarse.expand(h.shape[0], -1, -1, -1), align_corners=False)
        return self.head(g.flatten(1))


def _case(domain, sizes, width, options, depth=None):
    m = mesh(domain)
    torch.manual_seed(0)
    size = (sum(sizes), width) if depth is None else (sum(sizes), width, depth)
    ref = Registration(size, **options).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(2, 2, *size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


_OPTIONS = [
    dict(mode="bilinear", padding="zeros", align=True),
    dict(mode="bilinear", padding="border", align=False),
    dict(mode="nearest", padding="zeros", align=True, reach=2.3),
    dict(mode="bicubic", padding="zeros", align=False),
    dict(mode="bicubic", padding="border", align=True, reach=6.0),  # past the neighbour's slab
]


@pytest.mark.parametrize("options", _OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
@pytest.mark.parametrize("domain, sizes", [(2, [7, 5]), (3, [4, 2, 6])])
def test_registration_warp_2d_is_exact(run, domain, sizes, options):
    assert max(run(domain, _case, domain, sizes, 6, options)) < 1e-10


@pytest.mark.parametrize("options", _OPTIONS[:3], ids=["bilinear-zeros", "bilinear-border", "nearest"])
def test_registration_warp_3d_is_exact(run, options):
    assert max(run(3, _case, 3, [3, 5, 2], 4, options, 3)) < 1e-10


def _regrid(domain, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Regrid().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes, replicated=True)


@pytest.mark.parametrize("domain, sizes", [(2, [6, 3]), (3, [2, 5, 3])])
def test_regrid_to_a_plain_grid_is_replicated_and_exact(run, domain, sizes):
    assert max(run(domain, _regrid, domain, sizes)) < 1e-10


def _refused(domain, options):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Registration((8, 6), **options).double(), m)
    x = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    return error_on_slab(model, x, m, [5, 3])


def test_reflection_padding_is_refused_on_every_rank(run):
    out = run(2, _refused, 2, dict(padding="reflection"))
    assert len(set(out)) == 1 and "`grid_sample`" in out[0] and "reflects about the whole sample" in out[0], out
