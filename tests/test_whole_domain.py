"""Tensors sized for the whole domain inside a converted model's own forward.

A model built for one sample size often holds tensors with one entry per global position: a
fixed-size position embedding, a per-pixel bias, a land-sea mask, static fields (orography,
latitude) concatenated as input channels. On a slab each rank must use its own rows of them;
the forward guard gives it them (forward, input gradient and the parameter gradient after the
domain sum equal the single device), and refuses any other size on every rank alike.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference


class StaticFields(nn.Module):
    """A small weather-style model for one fixed grid ``(h, w)``; ``kind`` picks how the whole-grid
    tensors meet the slab."""

    def __init__(self, kind: str, h: int, w: int) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 3, 1)
        g = torch.Generator().manual_seed(1)
        # Only what ``kind`` uses is a parameter (the reference check compares every gradient).
        if kind in ("bias", "bias_inplace", "wrong_size"):
            self.bias = nn.Parameter(torch.randn(1, 4, h, w, generator=g) * 0.3)  # per-pixel bias
        self.register_buffer("mask", (torch.rand(h, w, generator=g) > 0.4).to(torch.float32))  # land-sea
        self.register_buffer("orography", torch.randn(1, 2, h, w, generator=g))
        if kind == "nhwc_pos":
            self.pos = nn.Parameter(torch.randn(1, h, w, 4, generator=g) * 0.3)  # NHWC position embedding
        if kind == "token_pos":
            self.tokens = nn.Parameter(torch.randn(1, h * w, 4, generator=g) * 0.3)  # (1, N, C) embedding
        if kind == "row_weight":
            self.rows = nn.Parameter(torch.randn(h, 1, generator=g) * 0.3)  # one weight per row
        if kind.startswith("static"):
            self.mix = nn.Conv2d(6, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        k = self.kind
        if k == "bias":
            h = h + self.bias
        elif k == "bias_inplace":
            h = h * 1.0
            h += self.bias
        elif k == "mask_where":
            h = torch.where(self.mask.bool(), h, -h)
        elif k == "mask_mul":
            h = h * self.mask
        elif k == "static_cat":
            n = h.shape[0]
            h = self.mix(torch.cat([h, self.orography.expand(n, -1, -1, -1)], dim=1))
        elif k == "static_stack":
            n = h.shape[0]
            s = torch.stack([h[:, :2], self.orography.expand(n, -1, -1, -1)], dim=1)
            h = self.mix(torch.cat([h, s.sum(1)], 1))
        elif k == "nhwc_pos":
            h = (h.permute(0, 2, 3, 1) + self.pos).permute(0, 3, 1, 2)
        elif k == "token_pos":  # tokens of an H-sharded grid: each rank's rows are one block of tokens
            n, c, hh, ww = h.shape
            t = h.flatten(2).transpose(1, 2) + self.tokens
            h = t.transpose(1, 2).reshape(n, c, hh, ww)
        elif k == "row_weight":
            h = h * self.rows
        elif k == "wrong_size":  # one row short of the whole grid: refused
            h = h + self.bias[:, :, 1:]
        else:
            raise AssertionError(k)
        return self.head(h)


EXACT = ["bias", "bias_inplace", "mask_where", "mask_mul", "static_cat", "static_stack", "nhwc_pos", "row_weight"]
H, W = 10, 6


def _exact(kind: str, domain, sizes, shape):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = StaticFields(kind, shape[2], shape[3]).double()
    x = torch.randn(*shape, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    errs = check_against_reference(ref, x, m, sharded=model, sizes=sizes)
    return max(errs.values())


@pytest.mark.parametrize("kind", EXACT)
@pytest.mark.parametrize("domain,sizes", [(2, (6, 4)), (3, (5, 1, 4))])
def test_whole_domain_tensor_gives_each_rank_its_rows(run, kind, domain, sizes):
    errs = run(domain, _exact, kind, domain, sizes, (2, 2, H, W))
    assert max(errs) < 1e-10


@pytest.mark.parametrize("kind", ["bias", "static_cat", "nhwc_pos"])
def test_whole_domain_tensor_on_a_2x2_mesh(run, kind):
    errs = run(4, _exact, kind, (2, 2), None, (1, 2, 8, 6))
    assert max(errs) < 1e-10


def test_token_embedding_of_a_row_sharded_grid(run):
    # Flattened (h, W) tokens of H slabs are contiguous blocks of the global token sequence.
    errs = run(3, _exact, "token_pos", 3, (4, 2, 4), (2, 2, H, W))
    assert max(errs) < 1e-10


def test_one_rank_holding_every_row(run):
    # The rank with every row broadcasts without an error, the empty one does not: both still
    # take the same gather (no hang) and agree with the single device.
    errs = run(2, _exact, "bias", 2, (H, 0), (1, 2, H, W))
    assert max(errs) < 1e-10


def _refused(kind: str, domain: int, sizes, shape):
    m = mesh(domain)
    ref = StaticFields(kind, shape[2], shape[3]).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    r = m.get_local_rank("domain")
    x = torch.randn(*shape, dtype=torch.float64).narrow(2, sum(sizes[:r]), sizes[r]).clone()
    try:
        model(x)
    except snn.ShardingError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("sizes", [(6, 4), (9, 1)])
def test_other_sizes_are_refused_on_every_rank(run, sizes):
    out = run(2, _refused, "wrong_size", 2, sizes, (1, 2, H, W))
    assert len(set(out)) == 1, out
    name, msg = out[0]
    assert name == "ShardingError", out[0]
    assert re.search(r"`add`.*has 9 positions there: neither one position.*nor the whole domain", msg), msg
    assert "test_whole_domain.py" in msg and "'<root>' (StaticFields)" in msg, msg
