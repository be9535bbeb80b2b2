"""Attention written out in a converted model's own forward, over tokens of an H-sharded grid.

Many models compute attention without ``F.scaled_dot_product_attention``: ``q @ k.transpose(-2,
-1)``, a softmax, ``probs @ v`` (timm without fused attention, CaiT's talking heads), the same by
``torch.einsum`` (MONAI's ``SABlock``), a relative-position bias added to the scores, or an
``attn_mask`` passed to ``scaled_dot_product_attention``. The forward guard gathers the keys and
values whole where the product needs them and keeps each rank's query rows: forward, input
gradient and parameter gradients equal the single device, P = 2 and 3, uneven slabs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference, compare_on_slabs, error_on_slab


class Written(nn.Module):
    """Conv stem, one attention over the grid's tokens (written as ``kind`` says), conv head."""

    def __init__(self, kind: str, h: int, w: int, heads: int = 2, c: int = 8) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.head = nn.Conv2d(c, 3, 1)
        n = h * w
        g = torch.Generator().manual_seed(3)
        if kind in ("relpos_bias", "sdpa_bias", "sdpa_bias_dropout"):
            self.bias = nn.Parameter(torch.randn(heads, n, n, generator=g) * 0.5)  # (H, N, N): whole sequence
        if kind == "talking_heads":
            self.proj_l = nn.Linear(heads, heads)
            self.proj_w = nn.Linear(heads, heads)
        if kind == "sdpa_mask":  # a window mask: tokens attend within their band of rows
            rows = torch.arange(n) // w
            self.register_buffer("mask", (rows[:, None] - rows[None, :]).abs() <= 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.stem(x))
        b, c, hh, ww = y.shape
        t = y.flatten(2).transpose(1, 2)  # (B, N, C): N sharded (blocks of rows)
        q, k, v = self.qkv(t).reshape(b, -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        scale = (c // self.heads) ** -0.5
        kind = self.kind
        if kind == "matmul":
            a = (q * scale) @ k.transpose(-2, -1)
            o = a.softmax(-1) @ v
        elif kind == "relpos_bias":
            a = (q @ k.transpose(-2, -1)) * scale + self.bias.unsqueeze(0)
            o = a.softmax(dim=-1) @ v
        elif kind == "talking_heads":  # CaiT: heads mixed before and after the softmax
            a = (q * scale) @ k.transpose(-2, -1)
            a = self.proj_l(a.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).softmax(-1)
            o = self.proj_w(a.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) @ v
        elif kind == "einsum":  # MONAI SABlock without flash attention
            a = torch.einsum("blxd,blyd->blxy", q, k) * scale
            o = torch.einsum("bhxy,bhyd->bhxd", a.softmax(dim=-1), v)
        elif kind == "einsum_bmm":
            qq, kk, vv = (z.flatten(0, 1) for z in (q, k, v))
            a = torch.einsum("bid,bjd->bij", qq * scale, kk).softmax(-1)
            o = torch.bmm(a, vv).reshape(q.shape)
        elif kind == "sdpa_bias":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        elif kind == "sdpa_mask":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        elif kind == "sdpa_bias_dropout":  # refused: no mask law for it on gathered keys
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.2)
        else:
            raise AssertionError(kind)
        t = t + self.proj(o.transpose(1, 2).reshape(b, -1, c))
        return self.head(t.transpose(1, 2).reshape(b, c, hh, ww))


KINDS = ["matmul", "relpos_bias", "talking_heads", "einsum", "einsum_bmm", "sdpa_bias", "sdpa_mask"]
H, W = 7, 3


def _exact(kind: str, domain: int, sizes, shape):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Written(kind, shape[2], shape[3]).double()
    x = torch.randn(*shape, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    errs = check_against_reference(ref, x, m, sharded=model, sizes=sizes)
    return max(errs.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("domain,sizes", [(2, (4, 3)), (3, (3, 1, 3))])
def test_attention_written_out_is_exact(run, kind, domain, sizes):
    errs = run(domain, _exact, kind, domain, sizes, (2, 2, H, W))
    assert max(errs) < 1e-10


def _refused(kind: str, domain: int):
    m = mesh(domain)
    model = snn.convert(Written(kind, H, W).double(), m, strict=True)
    r = m.get_local_rank("domain")
    x = torch.randn(1, 2, H, W, dtype=torch.float64).narrow(2, (0, 4)[r], (4, 3)[r])
    try:
        model(x)
    except snn.ShardingError as e:
        return str(e)
    return "no error"


def test_attention_dropout_with_a_mask_is_refused_on_every_rank(run):
    out = run(2, _refused, "sdpa_bias_dropout", 2)
    assert len(set(out)) == 1 and "attention dropout with an attn_mask" in out[0], out


def _timm_relpos(domain: int, sizes):
    # timm's relative-position ViT (no class token, average pooling): a bias over every pair of
    # tokens, sized for the whole image, passed as the attention mask (fused) or added to the
    # written-out scores; both are exact.
    import timm

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model("vit_relpos_small_patch16_224", pretrained=False, img_size=(sum(sizes), 32), depth=2,
                            embed_dim=32, num_heads=2, num_classes=3).double()  # fmt: skip
    for blk in ref.blocks:
        blk.attn.fused_attn = blk is ref.blocks[0]  # one block each way
        # Its bias MLP has dropout (0.125) in training: a draw of the same law, not the same
        # bits, so off for an exact comparison (tests/test_random_draws.py checks the laws).
        blk.attn.rel_pos.mlp.drop1.p = 0.0
        torch.nn.init.uniform_(blk.ls1.gamma, 0.5, 1.5)  # (1e-6 by default: it would hide the attention)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    return compare_on_slabs(ref, model, m, torch.randn(2, 3, sum(sizes), 32, dtype=torch.float64), sizes)


@pytest.mark.parametrize("domain,sizes", [(2, (32, 16)), (3, (16, 32, 16))])
def test_timm_relative_position_vit_is_exact(run, domain, sizes):
    assert max(run(domain, _timm_relpos, domain, sizes)) < 1e-10


class FoldRows(nn.Module):
    """A view to constant sizes that folds the rows of the whole grid into blocks of two."""

    def __init__(self, rows: int, w: int) -> None:
        super().__init__()
        self.rows, self.w = rows, w
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return h.view(1, 2, self.rows // 2, 2 * self.w).sum()


def _fold_misaligned(sizes):
    m = mesh(len(sizes))
    model = snn.convert(FoldRows(sum(sizes), 3).double(), m)
    return error_on_slab(model, torch.randn(1, 2, sum(sizes), 3, dtype=torch.float64), m, sizes)


class Deblockify(nn.Module):
    """timm NesT's ``deblockify``: blocks back to a square grid whose side is ``int(math.sqrt(T))``
    of the block count T, a number ``math`` computes from a slab's size: the whole sample's grid
    side since session 56 (``int()``/``float()`` of a size read from a slab). ``off``: a side
    that many blocks short, which the whole sample does not have."""

    def __init__(self, off: int = 0) -> None:
        super().__init__()
        self.proj = nn.Conv2d(2, 2, 1)
        self.off = off

    def forward(self, x):
        x = self.proj(x)
        b, c, h, w = x.shape
        t = (h // 2) * (w // 2)  # 2x2 blocks, rows of blocks outermost
        blocks = x.permute(0, 2, 3, 1).reshape(b, h // 2, 2, w // 2, 2, c).transpose(2, 3).reshape(b, t, 4, c)
        g = int(math.sqrt(t)) - self.off
        return blocks.reshape(b, g, g, 2, 2, c).transpose(2, 3).reshape(b, 2 * g, 2 * g, c).permute(0, 3, 1, 2)


def _deblockify(sizes, off):
    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = Deblockify(off).double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 2, sum(sizes), 8, dtype=torch.float64)
    if off:
        return error_on_slab(model, x, m, sizes)
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


def test_constant_view_that_does_not_fit_the_whole_sample_is_refused_on_every_rank(run):
    # 8 rows of a 4x4 grid of blocks over 3 ranks: slabs of 2, 2 and 4 rows hold 4, 4 and 8
    # blocks. A grid side of 3 fits no slab and not the whole sample: refused alike. (Before
    # session 56 the side came from each slab's own count, 2, 2 and 2: the first two ranks' views
    # fit their slabs with the wrong grid and ran on while the third raised torch's size error, a
    # hang; that became a refusal in session 52.)
    out = run(3, _deblockify, (2, 2, 4), 1)
    assert len(set(out)) == 1 and "does not fit the whole sample" in out[0], out


def test_nest_deblockify_grid_side_from_math_sqrt_is_exact(run):
    # ``int(math.sqrt(T))`` of the slab's block count is the whole sample's grid side (4): exact.
    assert max(run(3, _deblockify, (2, 2, 4), 0)) < 1e-10


def test_constant_view_of_misaligned_slabs_is_refused_on_every_rank(run):
    # Slabs of 4, 3 and 3 rows folded into blocks of 2: the first rank's slab fits, the others'
    # do not. Before session 40 only those two raised, and the first ran on alone.
    out = run(3, _fold_misaligned, (4, 3, 3))
    assert len(set(out)) == 1 and "not whole numbers of the" in out[0], out
