"""A 3-D shifted-window transformer written for one device, converted (Pangu-Weather's layout).

Weather models attend in 3-D windows over pressure levels, latitude and longitude: a ``Conv3d``
patch embedding, blocks on channels-last maps ``(B, Z, H, W, C)`` (a ``LayerNorm`` over the
channels, windows cut by ``view``/``permute`` in all three dims, attention with a learned bias
per window position, shifted windows by ``torch.roll`` over the three dims), a ``Conv3d`` head.
Converted with ``dims`` naming the sharded grid dim of the ``(B, C, Z, H, W)`` input, its
forward, input gradient and parameter gradients must equal the plain model's (float64): Z, H or
W sharded at P = 2, H on uneven slabs at P = 3, and H and W on a 2x2 mesh. Refused before
session 58: ``convert(dims=(3,))`` gives every ``LayerNorm`` those dims, and the guard refused
the channels-last maps' layout (sharded along dim 2 there), though a LayerNorm over the
channels normalises each position alone whatever is sharded. The block class is marked
``mark_guarded`` (its forward is torch code the guard follows), so that ``convert(strict=True)``
does not take its ``Linear`` layers over the channels for layers over W, the last dim of the
rank-5 input, when W is sharded.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.forward_guard import mark_guarded

from .harness import mesh, world_of
from .reference import check_against_reference


def _partition(x, w):
    b, z, h, wd, c = x.shape
    x = x.view(b, z // w[0], w[0], h // w[1], w[1], wd // w[2], w[2], c)
    return x.permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, w[0] * w[1] * w[2], c)


def _reverse(win, w, b, z, h, wd):
    x = win.view(b, z // w[0], h // w[1], wd // w[2], w[0], w[1], w[2], win.shape[-1])
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, z, h, wd, win.shape[-1])


@mark_guarded  # channels-last: its Linear layers act on C, not on W (the static check's rank-5 guess)
class Block3d(nn.Module):
    def __init__(self, dim: int, heads: int, window: tuple[int, int, int], shift: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.heads, self.window, self.shift = heads, window, shift
        n = window[0] * window[1] * window[2]
        self.bias = nn.Parameter(torch.randn(heads, n, n) * 0.1)

    def forward(self, x):  # (B, Z, H, W, C)
        b, z, h, w, c = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=tuple(-s // 2 for s in self.window), dims=(1, 2, 3))
        win = _partition(y, self.window)
        qkv = self.qkv(win).reshape(win.shape[0], win.shape[1], 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (qkv[0] @ qkv[1].transpose(-2, -1)) * (c // self.heads) ** -0.5 + self.bias
        out = (attn.softmax(-1) @ qkv[2]).transpose(1, 2).reshape(win.shape[0], win.shape[1], c)
        y = _reverse(self.proj(out), self.window, b, z, h, w)
        if self.shift:
            y = torch.roll(y, shifts=tuple(s // 2 for s in self.window), dims=(1, 2, 3))
        x = x + y
        return x + self.mlp(self.norm2(x))


class EarthNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv3d(2, 8, 2, stride=2)
        self.blocks = nn.Sequential(Block3d(8, 2, (2, 4, 4), False), Block3d(8, 2, (2, 4, 4), True))
        self.head = nn.Conv3d(8, 1, 1)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 4, 1)
        return self.head(self.blocks(x).permute(0, 4, 1, 2, 3))


def _case(domain, dims, shape):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = EarthNet().double()
    model = snn.convert(copy.deepcopy(ref), m, dims=dims, strict=True)
    x = torch.randn(shape, dtype=torch.float64)
    errs = check_against_reference(ref, x, m, dims=dims, align=snn.alignment(ref, dims=dims), sharded=model,
                                   atol=1e-10, rtol=1e-10)  # fmt: skip
    return max(errs.values())


@pytest.mark.parametrize(
    "domain,dims,shape",
    [
        (2, (2,), (1, 2, 8, 16, 16)),  # levels (windows of 2 at 1/2: slabs of 4)
        (2, (3,), (1, 2, 4, 32, 16)),  # latitude
        (2, (4,), (1, 2, 4, 16, 32)),  # longitude
        (3, (3,), (1, 2, 4, 40, 16)),  # latitude, uneven: 5 window rows over 3 ranks
        ((2, 2), (3, 4), (1, 2, 4, 32, 32)),  # latitude and longitude
    ],
)
def test_3d_shifted_windows_written_for_one_device_are_exact(run, domain, dims, shape):
    assert max(run(world_of(domain), _case, domain, dims, shape)) < 1e-10
