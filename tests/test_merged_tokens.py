"""Tokens of a 2-D domain mesh: slabs of several mesh axes flattened into one dim (``Merged``).

A single-device model flattens its grid into tokens (``x.flatten(2).transpose(1, 2)``). On a
2x2 mesh sharding H and W, each rank's tokens are its (h, w) block, not one run of the single
device's sequence. The guard follows that layout: per-token calls, sums and means over the
tokens, attention over them (ring attention over the domain), attention written out (the keys
and values gathered into the single device's order), einsum attention, views back into the
grid. The converted model must equal the single-device one (float64, forward, input and
parameter gradients) on uneven blocks, including blocks of one row or column; class and
register tokens in front are held by the first rank; what needs the single device's order
along the tokens (a crop of them, a token behind them, positions counted by them) is refused
with the same message on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.forward_guard import UNKNOWN, _map_reshape
from sharded_nn.guard_merged import Merged, map_merged_reshape, merged_of_reshape

from .harness import mesh
from .reference import reduce_param_grads


def _block(x, m, rows, cols):
    """This rank's (rows, cols) block of ``x`` (dims 2, 3) on the 2-D domain mesh ``m``."""
    i, j = m.get_local_rank("domain0"), m.get_local_rank("domain1")
    return x.narrow(2, sum(rows[:i]), rows[i]).narrow(3, sum(cols[:j]), cols[j])


def _gather_block(t, m, rows, cols):
    """The whole of a (rows, cols) block tensor, from every rank (no gradient)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()  # (the 2x2 mesh is the whole world)
    dist.all_gather_object(parts, (m.get_local_rank("domain0"), m.get_local_rank("domain1"), t.detach()))
    grid = [[None] * len(cols) for _ in rows]
    for i, j, p in parts:
        grid[i][j] = p
    return torch.cat([torch.cat(r, 3) for r in grid], 2)


def compare_on_blocks(ref, model, m, x, rows, cols, replicated=False, tol=1e-10):
    """``ref`` on ``x`` against ``model`` on (rows, cols) blocks: forward, input gradient, summed
    parameter gradients. Returns the largest error."""
    x = x.detach().requires_grad_()
    y_ref = ref(x)
    g = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(5))
    (y_ref * g).sum().backward()
    x_local = _block(x.detach(), m, rows, cols).clone().requires_grad_()
    y = model(x_local)
    if replicated:
        loss = (y * g).sum()
    else:
        loss = (y * _block(g, m, rows, cols)).sum()
        y = _gather_block(y, m, rows, cols)
    # The loss on each rank is its part (a block) or a share (a replicated output) of one sum.
    (snn.losses.share(loss, m) if replicated else loss).backward()
    errs = [(y - y_ref).abs().max().item()]
    torch.testing.assert_close(y, y_ref.detach(), atol=tol, rtol=tol)
    gx = _gather_block(x_local.grad, m, rows, cols)
    torch.testing.assert_close(gx, x.grad, atol=tol, rtol=tol)
    errs.append((gx - x.grad).abs().max().item())
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[name], expected, atol=tol, rtol=tol, msg=lambda s, n=name: f"{n}: {s}")
        errs.append((grads[name] - expected).abs().max().item())
    return max(errs)


# ------------------------------------------------------------------------------- models


class TokenBlock(nn.Module):
    """A pre-norm transformer block on the grid's tokens, written as timm writes it, with a
    choice of attention: ``sdpa`` (fused), ``explicit`` (scores, softmax, values), ``einsum``,
    ``linear`` (``k^T v`` contracted over the tokens), ``channel`` (DaViT's channel attention)."""

    def __init__(self, c=8, heads=2, attn="sdpa", pool=False):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.norm = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.mlp = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.out = nn.Conv2d(c, 3, 3, padding=1)
        self.head = nn.Linear(c, 4)
        self.heads, self.attn, self.pool = heads, attn, pool

    def attend(self, t):
        b, n, c = t.shape
        qkv = self.qkv(self.norm(t)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.attn == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v)
        elif self.attn == "explicit":
            a = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
            o = a.softmax(dim=-1) @ v
        elif self.attn == "einsum":
            a = torch.einsum("bhnd,bhmd->bhnm", q, k).softmax(-1)
            o = torch.einsum("bhnm,bhmd->bhnd", a, v)
        elif self.attn == "channel":  # DaViT's channel attention: channels attend, summed over tokens
            a = ((k * n**-0.5).transpose(-1, -2) @ v).softmax(dim=-1)
            o = (a @ q.transpose(-1, -2)).transpose(-1, -2)
        else:  # linear attention (EfficientViT-MIT, LambdaNet): contracted over the tokens
            kv = F.softmax(k, dim=-1).transpose(-2, -1) @ v / n
            o = q @ kv
        return self.proj(o.transpose(1, 2).reshape(b, n, c))

    def forward(self, x):
        x = self.conv(x)
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.attend(t)
        t = t + self.mlp(t)
        if self.pool:
            return self.head(t.mean(dim=1))
        return self.out(t.transpose(1, 2).reshape(b, c, h, w))


class ReducedKeys(nn.Module):
    """PVT-v2's spatial-reduction attention: queries of every token, keys and values from a
    strided convolution of the grid (fewer tokens per rank, ring attention over both)."""

    def __init__(self, c=8):
        super().__init__()
        self.q = nn.Linear(3, c)
        self.sr = nn.Conv2d(3, c, 2, stride=2)
        self.kv = nn.Linear(c, 2 * c)
        self.out = nn.Linear(c, 3)

    def forward(self, x):
        b, _, h, w = x.shape
        q = self.q(x.flatten(2).transpose(1, 2)).unsqueeze(1)
        r = self.sr(x).flatten(2).transpose(1, 2)
        k, v = self.kv(r).unsqueeze(1).chunk(2, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        return self.out(o).transpose(1, 2).reshape(b, 3, h, w) + x


class Statistics(nn.Module):
    """Sums, means, amax, var, norms and softmaxes over the tokens (einops round trip); since
    session 62 on the tokens written out as the blocks' rows and columns (each a slab), not
    gathered whole."""

    def forward(self, x):
        from einops import rearrange

        b, c, h, w = x.shape
        t = rearrange(x, "b c h w -> b (h w) c")
        t = t * torch.sigmoid(t.mean(1, keepdim=True)) + t.amax(1, keepdim=True) * 0.1
        t = t + t.var(dim=1, keepdim=True) + t.softmax(dim=1) + t.sum(1, keepdim=True) * 0.01
        t = t + t.log_softmax(1) * 0.1 + t.norm(dim=1, keepdim=True) + t.logsumexp(1, keepdim=True) * 0.1
        t = t / (t.nanmean(1, keepdim=True).abs() + 1) + torch.std_mean(t, (1, 2))[0].view(-1, 1, 1)
        return rearrange(t, "b (h w) c -> b c h w", h=h, w=w)


class WholeSequence(nn.Module):
    """Tensors sized for every token of the single device's sequence: a position embedding
    added to the tokens (each rank takes its block) and a relative-position bias of all token
    pairs as the attention mask (each rank its query rows, the keys gathered whole)."""

    def __init__(self, n, c=6, heads=2):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, n, c) * 0.5)
        self.bias = nn.Parameter(torch.randn(heads, n, n) * 0.5)
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, 3)
        self.heads = heads

    def forward(self, x):
        b, _, h, w = x.shape
        t = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        n, c = t.shape[1], t.shape[2]
        q, k, v = self.qkv(t).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.unsqueeze(0))
        return x + self.out(o.transpose(1, 2).reshape(b, n, c)).transpose(1, 2).reshape(b, 3, h, w)


class ClassTokens(nn.Module):
    """A class and a register token in front of the tokens (timm's ViT, BEiT, XCiT, CaiT): a
    position embedding of every token, attention with a relative-position bias over all of
    them, CaiT's class attention written out (the class token's query over every token), then
    the tokens back into the grid, scaled by a head on the class token."""

    def __init__(self, n, c=6, heads=2):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 3, padding=1)
        self.cls = nn.Parameter(torch.randn(1, 1, c))
        self.reg = nn.Parameter(torch.randn(1, 1, c))
        self.pos = nn.Parameter(torch.randn(1, n + 2, c) * 0.5)
        self.bias = nn.Parameter(torch.randn(heads, n + 2, n + 2) * 0.5)
        self.qkv = nn.Linear(c, 3 * c)
        self.q = nn.Linear(c, c)
        self.kv = nn.Linear(c, 2 * c)
        self.out = nn.Linear(c, 3)
        self.head = nn.Linear(c, 1)
        self.heads = heads

    def forward(self, x):
        b, _, h, w = x.shape
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(b, -1, -1), self.reg.expand(b, -1, -1), t], dim=1) + self.pos
        n, c = t.shape[1], t.shape[2]
        q, k, v = self.qkv(t).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.unsqueeze(0)).transpose(1, 2).reshape(
            b, n, c)
        kc, vc = self.kv(t).chunk(2, dim=-1)
        a = (self.q(t[:, 0]).unsqueeze(1) @ kc.transpose(-2, -1) * c**-0.5).softmax(-1)
        cls = t[:, :1] + a @ vc
        y = self.out(t[:, 2:]).transpose(1, 2).reshape(b, 3, h, w) + x
        return y * torch.sigmoid(self.head(cls[:, 0]))[:, :, None, None]


class Volume(nn.Module):
    """A volume's voxels as tokens (D and H sharded by the 2x2 mesh, W whole: a merged dim with
    an unsharded inner factor), attention fused and written out, back into the volume."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv3d(3, c, 3, padding=1)
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Conv3d(c, 3, 1)

    def forward(self, x):
        y = self.conv(x)
        b, c, d, h, w = y.shape
        t = y.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        a = (q @ k.transpose(-2, -1)).softmax(-1) @ v + F.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(b, c, d, h, w))


class NormHead(nn.Module):
    """EfficientViT-M's head: tokens pooled, then a ``BatchNorm1d`` (with running statistics) and
    a ``Linear``. On a 2x2 mesh ``convert`` gives the 1-d layer the first of the mesh's dims (it
    was refused at convert: two dims for a layer of one)."""

    def __init__(self, c=6):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.norm = nn.BatchNorm1d(c)
        self.fc = nn.Linear(c, 4)
        self.norm.running_mean.normal_()
        self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        t = self.conv(x).flatten(2).transpose(1, 2)
        return self.fc(self.norm(t.mean(1)))


def _windows():
    from .test_window_views import WindowBlock

    return WindowBlock("slice")


_MODELS = {
    "sdpa": lambda: TokenBlock(attn="sdpa"),
    "explicit": lambda: TokenBlock(attn="explicit"),
    "einsum": lambda: TokenBlock(attn="einsum"),
    "linear": lambda: TokenBlock(attn="linear"),
    "channel": lambda: TokenBlock(attn="channel"),
    "pool": lambda: TokenBlock(attn="sdpa", pool=True),
    "reduced_keys": ReducedKeys,
    "statistics": Statistics,
    # Window attention in timm's batch-major order at a batch of 2: each rank's windows are two
    # blocks of dim 0 (a merged dim with ``outer`` = 2); windows of 4, the last blocks padded.
    "windows": _windows,
    "volume": Volume,
    "whole_sequence": None,  # (built for the case's grid: ``WholeSequence``)
    "class_tokens": None,  # (likewise: ``ClassTokens``)
    "norm_head": lambda: NormHead().eval(),
}

# Rows and columns per rank: uneven, blocks of one row or column, one of a single token.
_BLOCKS = [([3, 5], [4, 2]), ([1, 6], [2, 3]), ([2, 2], [1, 1])]


def _case(name, rows, cols, batch):
    m = mesh((2, 2))
    torch.manual_seed(0)
    n = sum(rows) * sum(cols)
    ref = {"whole_sequence": WholeSequence, "class_tokens": ClassTokens}.get(name, lambda n: _MODELS[name]())(n)
    ref = ref.double()
    model = snn.convert(copy.deepcopy(ref), m)
    shape = {"windows": (batch, 2, sum(rows), sum(cols)), "volume": (batch, 3, sum(rows), sum(cols), 3)}.get(
        name, (batch, 3, sum(rows), sum(cols)))
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_blocks(ref, model, m, x, rows, cols, replicated=name in ("pool", "norm_head"))


@pytest.mark.parametrize("rows, cols", _BLOCKS)
@pytest.mark.parametrize("name", sorted(_MODELS))
def test_tokens_of_a_2d_mesh_are_exact(run, name, rows, cols):
    if name == "reduced_keys" and any(n % 2 for n in rows + cols):
        rows, cols = [2 * n for n in rows], [2 * n for n in cols]  # (blocks on the stride)
    if name == "windows":
        rows, cols = [4 * rows[0], rows[1] + 1], [4 * cols[0], cols[1] + 2]  # (whole windows but the last)
    assert max(run(4, _case, name, rows, cols, 2)) < 1e-10


# ------------------------------------------------------------------------------- refusals


class TrailingToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 3))

    def forward(self, x):
        b, c, h, w = x.shape
        t = torch.cat([x.flatten(2).transpose(1, 2), self.cls.expand(b, -1, -1)], 1)
        return t[:, :-1].transpose(1, 2).reshape(b, c, h, w)


class TokenCrop(nn.Module):
    def forward(self, x):
        t = x.flatten(2)
        return t[..., :4].sum()


class Positions(nn.Module):
    def forward(self, x):
        t = x.flatten(2)
        return (t * torch.arange(t.shape[-1], dtype=t.dtype)).sum()


def _refusal(make, rows, cols):
    m = mesh((2, 2))
    model = snn.convert(make(), m)
    x = torch.randn(1, 3, sum(rows), sum(cols), dtype=torch.float64)
    try:
        model.double()(_block(x, m, rows, cols))
    except snn.ShardingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("make, says", [(TrailingToken, "other than in front of its tokens"),
                                        (TokenCrop, "indexes along the folded dim"),
                                        (Positions, "grid of positions from a slab's local size")],
                         ids=["trailing_token", "crop", "positions"])
def test_order_dependent_calls_on_tokens_are_refused_alike(run, make, says):
    msgs = run(4, _refusal, make, [1, 4], [3, 2])
    assert says in msgs[0] and len(set(msgs)) == 1, msgs


# ------------------------------------------------------------------------------- mapping


def test_views_map_alike_for_every_block_size():
    from sharded_nn.forward_guard import LocalLength

    for h, w in [(1, 1), (1, 4), (3, 1), (2, 5)]:
        # (B, C, h, w) flattened: the tokens, then the heads split off and the grid restored.
        m = merged_of_reshape((2, 8, h, w), (2, 8, h * w), (2, 3), [2, 8, -1])
        assert m == Merged((0, 1), 2, (h, w), 1, 1, 2) and m.lengths == (h, w), (h, w, m)
        t = m.at(1)
        split = map_merged_reshape((2, h * w, 8), (2, h * w, 2, 4), t, [2, t.length(h * w), 2, 4])
        assert split == t
        back = map_merged_reshape((2, h * w, 8), (2, h, w, 8), t, [2, LocalLength(h, 0), LocalLength(w, 1), 8])
        assert back == (1, 2), (h, w, back)
        # A view that splits the tokens by constants: not followed.
        assert map_merged_reshape((2, h * w, 8), (2, h * w, 8), t, [2, h * w, 8]) is UNKNOWN
        # Windows of a batch: (b, nh, nw, ws, ws, c) -> (-1, ws, ws, c) merges the batch in front.
        win = merged_of_reshape((3, h, w, 2, 2, 4), (3 * h * w, 2, 2, 4), (1, 2), [-1, 2, 2, 4])
        assert win == Merged((0, 1), 0, (h, w), 3, 1, 2) and win.lengths == (h, w) and not win.tokens
        # A 3-D volume's voxels: D and H sharded, W whole behind them.
        vox = merged_of_reshape((2, 4, h, w, 5), (2, 4, h * w * 5), (2, 3), [2, 4, -1])
        assert vox == Merged((0, 1), 2, (h, w), 1, 5, 2) and vox.tokens
        # ``x.reshape(b, -1, c)`` of ``(b, h, w, c)``: both axes name the -1, so their dims merge
        # (by sizes alone a block of one column put it with the channels).
        assert _map_reshape((2, h, w, 8), (2, h * w, 8), (1, 2), [2, -1, 8]) is UNKNOWN
        assert merged_of_reshape((2, h, w, 8), (2, h * w, 8), (1, 2), [2, -1, 8]) == Merged((0, 1), 1, (h, w), 1, 1, 2)
