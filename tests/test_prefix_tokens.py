"""Class and register tokens concatenated to a token slab, and slices by global position.

Under the forward guard, ``torch.cat((cls_token, x), dim=1)`` along the sharded token dim gives
the first rank the prefix (the last rank a suffix): the whole sequence is an ordinary uneven slab
layout. ``x[:, 0]`` picks the owner's token, replicated; ``x[:, 1:]`` and other constant bounds
crop by global position, as on one device. So timm's BEiT, CaiT and class-token ViTs that have no
sharded class convert with plain ``snn.convert``: logits, input gradient and parameter gradients
equal the single device, P = 2 and 3, uneven slabs (one of a single patch row).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference, compare_on_slabs


class Prefixed(nn.Module):
    """Conv stem, tokens with a class token, two register tokens and a trailing token, a fixed-size
    position embedding, one attention, and a head reading the class token, the mean of the patch
    tokens and the trailing token."""

    def __init__(self, h: int, w: int, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.cls_token = nn.Parameter(torch.randn(1, 1, c) * 0.5)
        self.reg_tokens = nn.Parameter(torch.randn(1, 2, c) * 0.5)
        self.end_token = nn.Parameter(torch.randn(1, 1, c) * 0.5)
        self.pos = nn.Parameter(torch.randn(1, 3 + h * w + 1, c) * 0.5)
        self.qkv = nn.Linear(c, 3 * c)
        self.norm = nn.LayerNorm(c)
        self.head = nn.Linear(3 * c, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(self.stem(x)).flatten(2).transpose(1, 2)  # (B, N, C): N sharded
        b = t.shape[0]
        t = torch.cat([self.cls_token.expand(b, -1, -1), self.reg_tokens.expand(b, -1, -1), t,
                       self.end_token.expand(b, -1, -1)], dim=1) + self.pos  # fmt: skip
        q, k, v = self.qkv(t).reshape(b, t.shape[1], 3, 2, -1).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t.shape)
        t = self.norm(t)
        return self.head(torch.cat([t[:, 0], t[:, 3:-1].mean(dim=1), t[:, -1]], dim=-1))


def _prefixed(domain: int, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Prefixed(sum(sizes), 3).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    return compare_on_slabs(ref, model, m, torch.randn(2, 2, sum(sizes), 3, dtype=torch.float64), sizes)


@pytest.mark.parametrize("domain,sizes", [(2, (4, 3)), (3, (3, 1, 3))])
def test_class_register_and_trailing_tokens_are_exact(run, domain, sizes):
    assert max(run(domain, _prefixed, domain, sizes)) < 1e-10


def _timm(name: str, domain: int, sizes, kw: dict):
    import timm

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, img_size=(sum(sizes), 32), num_classes=3, **kw).double()
    for mod in ref.modules():  # dropout (the relative-position MLP's): the same law, not the same bits
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    for p in ref.parameters():  # layer scales start at 1e-5 / 1e-6: they would hide the blocks
        if p.dim() == 1 and bool((p.abs() < 1e-4).all()):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    return compare_on_slabs(ref, model, m, torch.randn(2, 3, sum(sizes), 32, dtype=torch.float64), sizes)


_BEIT = dict(depth=2, embed_dim=32, num_heads=2)


@pytest.mark.parametrize("domain,sizes", [(2, (32, 16)), (3, (16, 32, 16))])
def test_timm_beit_is_exact(run, domain, sizes):
    # Class token, relative-position bias over (1 + N) tokens sized for the whole image.
    assert max(run(domain, _timm, "beitv2_base_patch16_224", domain, sizes, _BEIT)) < 1e-10


def test_timm_cait_is_exact(run):
    # Talking-heads attention over the patch tokens, then class attention of the replicated
    # class token over the whole sequence (class token prefixed on the first rank).
    assert max(run(2, _timm, "cait_xxs24_224", 2, (32, 16), dict(depth=2, embed_dim=32, num_heads=2))) < 1e-10


def test_timm_class_token_relative_position_vit_is_exact(run):
    assert max(run(3, _timm, "vit_relpos_base_patch16_clsgap_224", 3, (16, 32, 16), _BEIT)) < 1e-10


class Cropped(nn.Module):
    """A grid model that crops rows by constant bounds in its own forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if self.kind == "head_rows":  # 8 of 10 rows: the last rank loses rows, or all of its slab
            h = h[:, :, :8]
        elif self.kind == "both_ends":
            h = h[:, :, 1:-2]
        elif self.kind == "narrow":  # rows 2..6 of the whole grid
            h = h.narrow(2, 2, 5)
        elif self.kind == "select_row":  # one row of the whole grid, replicated, added back
            h = h + h[:, :, -3].unsqueeze(2) * 0.5
        return self.head(h)


def _cropped(kind: str, domain: int, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Cropped(kind).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(2, 2, sum(sizes), 5, dtype=torch.float64)
    if kind == "select_row":
        return max(check_against_reference(ref, x, m, sharded=model, sizes=sizes).values())
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


@pytest.mark.parametrize("kind", ["head_rows", "both_ends", "narrow", "select_row"])
@pytest.mark.parametrize("domain,sizes", [(2, (6, 4)), (3, (5, 4, 1))])
def test_constant_bounds_crop_by_global_position(run, kind, domain, sizes):
    # Before session 39, ``h[:, :, :8]`` kept every row of slabs shorter than 8 (a constant stop
    # beyond the local length was taken for "the whole slab"): the output had 10 rows, not 8.
    assert max(run(domain, _cropped, kind, domain, sizes)) < 1e-10


class CutAndRejoin(nn.Module):
    """CoaT's convolutional position encoding: the class token is cut off the sequence
    (``x[:, :1]``, a slab of one row held by the first rank), the image tokens go through a
    depthwise convolution on their grid, and the two are concatenated again; then attention and
    a head on the class token and the mean of the image tokens. ``kind="interleave"`` joins two
    full slabs instead (the rows of each lie on every rank: refused before session 64)."""

    def __init__(self, c: int = 6, kind: str = "rejoin", grid: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.kind, self.grid = kind, grid
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.cls_token = nn.Parameter(torch.randn(1, 1, c) * 0.5)
        self.cpe = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.qkv = nn.Linear(c, 3 * c)
        self.head = nn.Linear(2 * c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.tanh(self.stem(x))
        b, c, gh, gw = s.shape
        t = torch.cat([self.cls_token.expand(b, -1, -1), s.flatten(2).transpose(1, 2)], dim=1)
        cls_token, img = t[:, :1], t[:, 1:]
        if self.grid is None:
            feat = img.transpose(1, 2).reshape(b, c, gh, gw)
        else:  # CoaT's form: the whole sample's grid as constants beside a -1
            feat = img.reshape(b, *self.grid, -1).permute(0, 3, 1, 2)
        img = (self.cpe(feat) + feat).flatten(2).transpose(1, 2)
        t = torch.cat((cls_token, img), dim=1) if self.kind == "rejoin" else torch.cat((img, img), dim=1)
        q, k, v = self.qkv(t).reshape(b, t.shape[1], 3, 2, -1).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t.shape)
        return self.head(torch.cat([t[:, 0], t[:, 1:].mean(dim=1)], dim=-1))


def _cut_and_rejoin(domain: int, sizes, kind: str = "rejoin", grid: bool = False):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = CutAndRejoin(kind=kind, grid=(sum(sizes), 4) if grid else None).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(2, 2, sum(sizes), 4, dtype=torch.float64)
    return compare_on_slabs(ref, model, m, x, sizes)


@pytest.mark.parametrize("grid", [False, True])
@pytest.mark.parametrize("domain,sizes", [(2, (4, 3)), (3, (3, 1, 3))])
def test_class_token_cut_and_rejoined_is_exact(run, domain, sizes, grid):
    # Before session 40 the second concatenation (two slabs: the one-row class token and the
    # image tokens) was refused, and with it timm's CoaT; so was (grid=True) CoaT's
    # ``reshape(b, h, w, -1)`` with the whole sample's grid as constants (the layout was lost).
    assert max(run(domain, _cut_and_rejoin, domain, sizes, "rejoin", grid)) < 1e-10


@pytest.mark.parametrize("domain,sizes", [(2, (4, 3)), (3, (3, 1, 3))])
def test_slabs_interleaving_across_ranks_are_exact(run, domain, sizes):
    # ``torch.cat((img, img), 1)``: the rows of each operand lie on every rank. Refused on every
    # rank before session 64; now each operand's rows move to the rank holding their part of the
    # result first (``_cat_slabs``).
    assert max(run(domain, _cut_and_rejoin, domain, sizes, "interleave")) < 1e-10
