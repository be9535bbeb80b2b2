"""Hypothesis fuzzing of the forward guard: random user forwards made of position-mixing calls.

``tests/test_forward_calls.py`` checks each hazard alone; real forwards chain them, and the guard
must carry each intermediate's layout (which dims are slabs, which values are replicated, which
numbers are local sizes) from one call to the next. Each example draws a program of 2-7 steps,
each a piece of plain torch code as a model's own ``forward`` writes it (squeeze-excite means,
vector norms, variances, softmax over rows, interpolation there and back, pads and global crops,
rolls, pools, sizes used as values and in branches, position grids from ``arange``, running
sums, ``F.group_norm``, TF-"same" pads, window partitions (attention in windows, convolutions on
windows folded into the batch, window-row-major and batch-major), token
flattening with attention over all tokens (fused, written out, einsum, linear, keys of a pooled
grid; on the 2x2 mesh the guard's merged tokens), Fourier transforms (FNO-style mode crops and
assignments, shifted spectra), strided phases, class-token style concatenation and
removal, tables looked up at positions computed on the rows, ...), interleaved with 3x3 convolutions, and a head that keeps the slab, pools it, or (since session 61) returns a loss of it (cross entropy against its own argmax with label smoothing, or a Huber loss).
The converted model (``snn.convert``: the convolutions swapped, the guard installed) runs on
uneven slabs of the image rows at 1-4 ranks (or rows and columns on a 2x2 mesh), and its output, input gradient and summed
parameter gradients must equal the plain model's on the whole image (float64, 1e-9). A
``ShardingError`` raised alike on every rank counts as a refusal, apart; any mismatch fails.

- ``test_fuzz_guard_fast``: the CI subset (derandomized, a dozen examples).
- ``test_fuzz_guard_campaign`` (``pytest -m slow``): ``SNN_FUZZ_GUARD_EXAMPLES`` examples
  (default 500), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .reference import assert_param_grads

C = 3  # channels of every step's input and output


def _se(m, x):  # squeeze-excite
    return x * torch.sigmoid(x.mean((2, 3), keepdim=True))


def _adaptive(m, x):
    return x * torch.sigmoid(F.adaptive_avg_pool2d(x, 1))


def _sum_over_size(m, x):  # a size used as a value: the global number
    h, w = x.shape[2], x.shape[3]
    return x - x.sum((2, 3), keepdim=True) / (h * w)


def _numel(m, x):
    return x * (x.numel() / 100.0)


def _norm(m, x):
    return x / (1 + x.norm(dim=(2, 3), keepdim=True))


def _normalize_rows(m, x):
    return F.normalize(x, dim=2)


def _var(m, x):
    return (x - x.mean(2, keepdim=True)) / torch.sqrt(x.var(2, keepdim=True, unbiased=False) + 1)


def _softmax_rows(m, x):
    return x.softmax(2) * x.shape[2]


def _amax(m, x):
    return x - torch.amax(x, dim=(2, 3), keepdim=True)


def _interp_round_trip(m, x):  # up by 2, back by a 2x2 average
    return F.avg_pool2d(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False), 2)


def _interp_to_size(m, x):  # down, then back to the slab's own size (taken from its shape)
    y = F.max_pool2d(x, 2, ceil_mode=True)
    return x + F.interpolate(y, size=x.shape[2:], mode="nearest")


def _pad_crop(m, x):  # pad every side, then crop the rows back by global position
    y = F.pad(x, (1, 1, 2, 2), mode="replicate")
    return y[:, :, 2:-2, 1:-1] * 0.5 + x


def _differences(m, x):  # finite differences of neighbouring rows, padded back (physics losses)
    d = x[:, :, 1:] - x[:, :, :-1]
    return x + F.pad(d, (0, 0, 1, 0)) * 0.5 - F.pad(d, (0, 0, 0, 1)) * 0.25


def _pad_valid_pool(m, x):  # a pad, then a window without padding (a ResnetBlock, MONAI's pad-pool)
    return x + F.avg_pool2d(F.pad(x, (1, 0, 2, 1), mode="replicate"), (4, 2), stride=1)


def _roll(m, x):
    return torch.roll(x, shifts=(1, -1), dims=(2, 3))


def _max_pool(m, x):
    return F.max_pool2d(x, 3, stride=1, padding=1)


def _branch(m, x):  # a branch on a size: every rank takes the single device's
    if x.shape[2] % 2 == 0:
        return x + 0.25
    return x - 0.5


def _positions(m, x):  # a position grid over the rows
    rows = torch.arange(x.shape[2], dtype=x.dtype).view(1, 1, -1, 1)
    return x + 0.05 * rows


def _linspace(m, x):
    return x * torch.linspace(0.5, 1.5, x.shape[2], dtype=x.dtype).view(1, 1, -1, 1)


def _tokens_attention(m, x):  # tokens of the grid, attention over all of them, back to the grid
    b, c, h, w = x.shape
    t = x.flatten(2).transpose(1, 2).unsqueeze(1)  # (B, 1, N, C)
    a = F.scaled_dot_product_attention(t, t, t)
    return x + a.squeeze(1).transpose(1, 2).reshape(b, c, h, w)


def _explicit_attention(m, x):  # attention written out: scores, softmax, values
    b, c, h, w = x.shape
    t = x.flatten(2).transpose(1, 2)  # (B, N, C)
    probs = torch.softmax(t @ t.transpose(-2, -1) * c**-0.5, dim=-1)
    return x + (probs @ t).transpose(1, 2).reshape(b, c, h, w)


def _linear_attention(m, x):  # k^T v summed over all tokens, a softmax over them (EfficientViT-MIT)
    b, c, h, w = x.shape
    t = x.flatten(2).transpose(1, 2)
    kv = torch.softmax(t, dim=1).transpose(1, 2) @ t / t.shape[1]
    return x + (t @ kv).transpose(1, 2).reshape(b, c, h, w)


def _reduced_keys(m, x):  # PVT's spatial-reduction attention: keys and values of a pooled grid
    b, c, h, w = x.shape
    q = x.flatten(2).transpose(1, 2).unsqueeze(1)
    k = F.avg_pool2d(x, 2).flatten(2).transpose(1, 2).unsqueeze(1)
    return x + F.scaled_dot_product_attention(q, k, k).squeeze(1).transpose(1, 2).reshape(b, c, h, w)


def _class_token(m, x):  # a token in front of the sequence, used, then dropped
    b, c, h, w = x.shape
    t = x.flatten(2).transpose(1, 2)
    t = torch.cat([m.cls.expand(b, -1, -1), t], 1)
    t = t + t[:, :1] * 0.5  # the class token's value reaches every token
    return t[:, 1:].transpose(1, 2).reshape(b, c, h, w)


def _phases(m, x):  # space-to-depth phases of the rows (slabs start on even rows)
    return x + torch.repeat_interleave(x[:, :, 0::2] - x[:, :, 1::2], 2, dim=2) * 0.5


def _permute_back(m, x):  # channels-last and back (einops-style)
    return torch.tanh(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()


def _whole_rows_bias(m, x):  # a parameter sized for the whole domain
    return x + m.row_bias


def _repeat_rows(m, x):  # every row twice, then a 2x1 average back
    return F.avg_pool2d(x.repeat_interleave(2, dim=2), (2, 1))


def _first_row(m, x):  # one position of the whole domain, kept as a dim, broadcast
    return x - 0.5 * x[:, :, :1]


def _last_row(m, x):
    return x * torch.sigmoid(x.narrow(2, x.shape[2] - 1, 1))


def _select_row(m, x):
    return x + x[:, :, 0].unsqueeze(2) * 0.25


def _shift_rows(m, x):  # rows shifted down by one, the first repeated
    return torch.cat([x[:, :, :1], x[:, :, :-1]], 2) * 0.5 + x


def _std(m, x):
    return x / (1 + x.std((2, 3), keepdim=True))


def _logsumexp(m, x):
    return x - torch.logsumexp(x, dim=2, keepdim=True)


def _where(m, x):
    return torch.where(x > 0, x, 0.1 * x)


def _avg_pool_same(m, x):
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


def _pixel_round_trip(m, x):  # rows and columns into channels and back (even sizes)
    return x + 0.5 * F.pixel_shuffle(torch.tanh(F.pixel_unshuffle(x, 2)), 2)


def _einsum_attention(m, x):
    b, c, h, w = x.shape
    t = x.flatten(2)  # (B, C, N)
    probs = torch.einsum("bcn,bcm->bnm", t, t).softmax(-1)
    return x + torch.einsum("bnm,bcm->bcn", probs, t).reshape(b, c, h, w)


def _rearranged(m, x):  # einops round trip through tokens
    from einops import rearrange

    b, c, h, w = x.shape
    t = rearrange(x, "b c h w -> b (h w) c")
    t = t * torch.sigmoid(t.mean(1, keepdim=True))  # a mean over all tokens
    return rearrange(t, "b (h w) c -> b c h w", h=h, w=w)


def _chunks(m, x):  # channel split, per-part mixing, stack and mean over the parts
    a, b, c = torch.chunk(x, 3, dim=1)
    return torch.cat([a, torch.stack([b, torch.roll(c, 1, 2)]).mean(0), c], 1)


def _cumsum_rows(m, x):  # a running sum over the rows (routed: snn.reductions.cumsum)
    return x + 0.1 * torch.cumsum(x, 2)


def _group_norm_fn(m, x):  # group/instance norms written as F calls (routed: snn.functional.group_norm)
    return F.group_norm(x, 1, m.gn_w, None, 1e-5) + 0.5 * F.instance_norm(x, weight=m.gn_w)


def _same_pool(m, x):  # timm's TF-"same" max pool (pad amounts from sizes), then back to the size
    from timm.layers.padding import pad_same

    y = F.max_pool2d(pad_same(x, (3, 3), (2, 2), value=-float("inf")), 3, 2)
    return x + F.interpolate(y, size=x.shape[2:], mode="nearest")


def _offset_positions(m, x):  # arange bounds from the slab's rows, and a tiled column grid
    h, w = x.shape[2], x.shape[3]
    rows = torch.arange(1, h + 1, dtype=x.dtype).view(1, 1, -1, 1)
    cols = torch.arange(1, w + 1, dtype=x.dtype).repeat(1, h, 1).unsqueeze(1)  # (1, 1, H, W)
    return x + rows / rows[:, :, -1:] + 0.1 * cols


# Windows folded into the batch with the window rows outermost (a slab of windows), and in
# timm's batch-major order (``batch_*``: this fuzzer draws batches of 2, so each rank's windows
# are two blocks of dim 0, the guard's ``Fold``; refused before session 54).
def _windows(m, x):  # window attention with DaViT's pad to whole windows, views and crop
    t = x.permute(0, 2, 3, 1)
    b, h, w, c = t.shape
    t = F.pad(t, (0, 0, 0, (2 - w % 2) % 2, 0, (4 - h % 4) % 4))
    hp, wp = t.shape[1], t.shape[2]
    win = t.view(b, hp // 4, 4, wp // 2, 2, c).permute(1, 3, 0, 2, 4, 5).reshape(-1, 8, c)
    y = F.scaled_dot_product_attention(win, win, win)
    y = y.view(hp // 4, wp // 2, b, 4, 2, c).permute(2, 0, 3, 1, 4, 5).reshape(b, hp, wp, c)
    return x + y[:, :h, :w].permute(0, 3, 1, 2)


def _conv_windows(m, x):  # a convolution on 2x2 windows folded into the batch (EfficientViT-M)
    b, c, h, w = x.shape
    win = x.view(b, c, h // 2, 2, w // 2, 2).permute(2, 4, 0, 1, 3, 5).reshape(-1, c, 2, 2)
    y = m.win_conv(win).view(h // 2, w // 2, b, c, 2, 2).permute(2, 3, 0, 4, 1, 5).reshape(b, c, h, w)
    return x + y


def _batch_windows(m, x):  # DaViT's window attention in timm's batch-major order, written out
    t = x.permute(0, 2, 3, 1)
    b, h, w, c = t.shape
    t = F.pad(t, (0, 0, 0, (2 - w % 2) % 2, 0, (4 - h % 4) % 4))
    hp, wp = t.shape[1], t.shape[2]
    win = t.view(b, hp // 4, 4, wp // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 8, c)
    n = win.shape[0]
    a = torch.softmax(win @ win.transpose(-2, -1) * c**-0.5, dim=-1) @ win
    y = F.layer_norm(a.reshape(n, 8, c), (c,)).view(-1, hp // 4, wp // 2, 4, 2, c)
    y = y.permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
    return x + y[:, :h, :w].permute(0, 3, 1, 2)


def _batch_conv_windows(m, x):  # a convolution on 2x2 windows in timm's batch-major order
    b, c, h, w = x.shape
    win = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, c, 2, 2)
    y = m.win_conv(win).view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
    return x + y


def _spectral_modes(m, x):  # FNO style: keep the lowest modes of the 2-D spectrum, assigned by position
    h, w = x.shape[2], x.shape[3]
    f = torch.fft.fft2(x, norm="ortho")
    out = torch.zeros_like(f)
    out[:, :, :2, :2] = f[:, :, :2, :2] * 2
    out[:, :, -1:, :2] = f[:, :, -1:, :2]
    return x + torch.fft.ifft2(out, s=(h, w), norm="ortho").real


def _fft_rows(m, x):  # a centred spectrum along the rows, weighted by its frequency
    f = torch.fft.fftshift(torch.fft.fft(x, dim=2), dim=2)
    k = torch.fft.fftshift(torch.fft.fftfreq(x.shape[2], dtype=x.dtype))
    return torch.fft.ifft(torch.fft.ifftshift(f * (1 + k.abs()).view(-1, 1), dim=2), dim=2).real


def _table_lookup(m, x):  # a learned table read at positions computed on the rows (a row embedding)
    rows = torch.arange(x.shape[2])
    idx = (rows * 3 + 1) % m.table.shape[0]
    bias = m.table[idx].t()[None, :, :, None] + F.embedding(idx.unsqueeze(0), m.table).permute(0, 2, 1)[..., None]
    return x + bias + m.table[:, idx % 2].sum(0)[None, None, :, None]


def _nan_check(m, x):  # a routine check on the values (any/all over the rows), and counts of them
    if torch.isnan(x).any() or not torch.isfinite(x).all():
        x = x * 0
    return x * (1 + torch.count_nonzero(x > 0, dim=(2, 3)).to(x.dtype)[:, :, None, None] / 50)


def _peak_rows(m, x):  # torch.max along the rows: values (gradient to the one element) and where
    top, at = x.max(dim=2, keepdim=True)
    low = torch.min(x.round(), 2, keepdim=True).values
    return x + top * 0.5 + low * 0.2 + at.to(x.dtype) / 20 + x.round().argmax().to(x.dtype) / 500


def _lp_pool(m, x):  # a power-average pool (of positive values), back to the size
    return x + F.interpolate(F.lp_pool2d(F.softplus(x), 2, 2), scale_factor=2)


def _crop_pad(m, x):  # crop a row at the start by a negative pad, pad it back at the end
    return x + F.pad(F.pad(x, (0, 0, -1, 0)), (0, 0, 0, 1), mode="replicate")


def _column_stats(m, x):  # statistics of what a mean over the rows leaves (the columns)
    cols = x.mean(2)  # (N, C, W)
    return x + torch.softmax(cols, -1).unsqueeze(2) + cols.std(-1)[:, :, None, None] * 0.1 + cols.amax()


def _sample_stats(m, x):  # per-sample statistics of the sample flattened with its channels (since session 62)
    flat = x.flatten(1)
    scale = flat.norm(dim=1) + flat.std(1) + flat.amax(1).abs() + x.reshape(x.shape[0], -1).mean(1).abs()
    return x / (1 + scale.view(-1, 1, 1, 1)) + flat.softmax(1).view_as(x)


def _boundaries(m, x):  # boundary conditions written by integer position (since session 62)
    y = x.clone()
    y[:, :, 0] = 0.5
    y[..., -1, :] = y[:, :, 1] * 2
    y[:, 1, y.shape[2] // 2] = torch.linspace(-1, 1, y.shape[3], dtype=y.dtype)
    return y


def _coordinates(m, x):  # coordinate channels from a meshgrid of the rows and columns (since session 62)
    gy, gx = torch.meshgrid(torch.linspace(-1, 1, x.shape[2], dtype=x.dtype),
                            torch.linspace(0, 2, x.shape[3], dtype=x.dtype), indexing="ij")
    return x * (1 + 0.1 * gy) + 0.2 * gx


def _similarity(m, x):  # cosine similarity along channels and the rows, distances (since session 63)
    proto = torch.linspace(-1, 1, x.shape[1], dtype=x.dtype).view(1, -1, 1, 1)
    x = x * (1 + 0.5 * F.cosine_similarity(x, proto, dim=1).unsqueeze(1))
    x = x + 0.3 * F.cosine_similarity(x, x * x + 0.1, dim=2, eps=1e-6).unsqueeze(2)
    rows = x.transpose(2, 3)  # the rows last: pairwise_distance reduces the last dim
    x = x + 0.1 * F.pairwise_distance(rows, rows.flip(1)).unsqueeze(-1).transpose(2, 3)
    return x + 0.01 * torch.dist(x, x * 0.5)


def _one_hot(m, x):  # one-hot classes of a label slab, the count read from the whole sample (since session 63)
    labels = (x.sum(1) > 0).long() + (x[:, 0] > 1).long()
    hot = F.one_hot(labels).permute(0, 3, 1, 2).to(x.dtype)
    return x * (1 + 0.1 * hot.shape[1]) + hot[:, :1]


def _total_variation(m, x):  # crops of the first and last row beside a crop of the columns (since session 63)
    tv = (x[:, :, 1:] - x[:, :, :-1]).abs().mean() + (x[..., 1:] - x[..., :-1]).abs().mean()
    return x * (1 + 0.1 * tv) + x.mean((2, 3), keepdim=True)


def _probes(m, x):  # readings at fixed rows and columns by index tensors (since session 63)
    h, w = x.shape[2], x.shape[3]
    iy = torch.tensor([0, -1, 1, -2])
    ix = torch.tensor([0, 1, -1, 0])
    reading = x[:, :, iy, ix].sum(-1)[:, :, None, None] + x[:, :, [-1, 0]].amax(2, keepdim=True)
    return x + 0.1 * reading + (h + w) * 0.01  # (the size first: 0.01 * (h + w) is a plain float, see the README)


def _unfold_windows(m, x):  # patches of row pairs and overlapping windows by Tensor.unfold (since session 63)
    n = x.shape[2] - x.shape[2] % 2
    pairs = x[:, :, :n].unfold(2, 2, 2).mean(-1).repeat_interleave(2, 2)
    x = x + F.pad(pairs, (0, 0, 0, x.shape[2] - n))
    if x.shape[2] < 3:  # (torch refuses windows of 3 rows on fewer; a branch on the global size)
        return x
    return x + 0.5 * F.pad(x.unfold(2, 3, 1).amax(-1), (0, 0, 1, 1), mode="replicate")


def _pieces(m, x):  # pieces put back, rows rolled by hand, crops padded, chunks (since session 64)
    n = x.shape[2]
    k = n // 3 + 1  # a cut inside the rows (a size read from the slab: the global rows' third)
    x = x + torch.cat([x[:, :, :k], x[:, :, k:]], 2)
    x = x * torch.cat([x[:, :, k:], x[:, :, :k]], 2).tanh()
    x = x + F.pad(x[:, :, 1:], (0, 0, 0, 1)) - torch.stack([x, F.pad(x[:, :, :-1], (0, 0, 1, 0))]).mean(0)
    x = x + 0.5 * torch.cat(x.chunk(3, 2)[::-1], 2)  # chunks of the rows (refused before session 64)
    return torch.cat([x, x.flip(2)], 2)[:, :, n // 2 : n // 2 + n]


STEPS = {f.__name__[1:]: f for f in (
    _se, _adaptive, _sum_over_size, _numel, _norm, _normalize_rows, _var, _softmax_rows, _amax,
    _interp_round_trip, _interp_to_size, _pad_crop, _roll, _max_pool, _branch, _positions, _linspace,
    _tokens_attention, _explicit_attention, _class_token, _phases, _permute_back, _whole_rows_bias,
    _repeat_rows, _first_row, _last_row, _select_row, _shift_rows, _std, _logsumexp, _where, _avg_pool_same,
    _pixel_round_trip, _einsum_attention, _rearranged, _chunks, _differences, _pad_valid_pool,
    _cumsum_rows, _group_norm_fn, _same_pool, _offset_positions, _windows, _conv_windows, _batch_windows,
    _batch_conv_windows, _linear_attention, _reduced_keys, _spectral_modes, _fft_rows, _table_lookup,
    _nan_check, _peak_rows, _lp_pool, _crop_pad, _column_stats, _sample_stats, _boundaries, _coordinates,
    _similarity, _one_hot, _total_variation, _probes, _unfold_windows, _pieces,
)}  # fmt: skip


#: Steps that also run on the transposed image (``x.transpose(2, 3)``: the sharded rows become the
#: last dim), named ``T:<step>``.
TRANSPOSABLE = ("se", "roll", "max_pool", "tokens_attention", "softmax_rows", "norm", "first_row", "branch",
                "differences", "pad_valid_pool", "cumsum_rows", "same_pool", "offset_positions", "windows",
                "batch_windows", "fft_rows", "table_lookup", "peak_rows", "crop_pad", "column_stats", "sample_stats",
                "boundaries", "coordinates", "similarity", "one_hot", "total_variation", "probes",
                "unfold_windows", "pieces")


class Program(nn.Module):
    """A model whose forward is ``steps`` (names of ``STEPS``, or ``conv``), then a head."""

    def __init__(self, steps: list[str], head: str, height: int) -> None:
        super().__init__()
        self.steps, self.head = steps, head
        self.ce = False  # the "loss" head: cross entropy (set per example) or a Huber loss
        self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1) for s in steps if s == "conv")
        self.cls = nn.Parameter(torch.randn(1, 1, C))
        self.row_bias = nn.Parameter(torch.randn(1, C, height, 1) * 0.3)
        self.gn_w = nn.Parameter(1 + torch.randn(C) * 0.3)
        self.win_conv = nn.Conv2d(C, C, 3, padding=1)
        self.out = nn.Conv2d(C, 2, 1)
        self.table = nn.Parameter(torch.randn(7, C) * 0.3)  # last: the earlier draws stay as they were

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        convs = iter(self.convs)
        for s in self.steps:
            if s == "conv":
                x = next(convs)(x)
            elif s.startswith("T:"):
                x = STEPS[s[2:]](self, x.transpose(2, 3)).transpose(2, 3)
            else:
                x = STEPS[s](self, x)
        x = self.out(x)
        if self.head == "loss":  # (since session 61) a loss of the map, as a model that returns its loss
            return F.cross_entropy(x, x.detach().argmax(1), label_smoothing=0.1) if self.ce else F.huber_loss(
                x, 0.5 * x.detach() + 0.1, delta=0.3)
        return x.mean((2, 3)) if self.head == "pool" else x


def _case(cfg: dict):
    """One example on this rank: ``"ok"`` or ``("refused", message)``; raises on a mismatch."""
    m = mesh(cfg["domain"])
    torch.manual_seed(cfg["seed"])
    h = sum(cfg["sizes"])
    ref = Program(cfg["steps"], cfg["head"], h).double()
    ref.ce = cfg["seed"] % 2 == 1
    x = torch.randn(2, C, h, cfg["width"], dtype=torch.float64, generator=torch.Generator().manual_seed(cfg["seed"]))
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    g = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(cfg["seed"] + 1))
    (y_ref * g).sum().backward()
    grid = isinstance(cfg["domain"], tuple)  # a 2x2 mesh: rows and columns sharded, balanced slabs
    dims = (2, 3) if grid else (2,)
    if grid:
        x_local = snn.shard(x, m, dims=dims, align=2).requires_grad_()
    else:
        r = m.get_local_rank("domain")
        x_local = x.narrow(2, sum(cfg["sizes"][:r]), cfg["sizes"][r]).clone().requires_grad_()
    try:
        model = snn.convert(copy.deepcopy(ref), m)
        y = model(x_local)
        if cfg["head"] in ("pool", "loss"):
            snn.losses.share((y * g).sum(), m).backward()
        else:
            y = snn.gather(y, m, dims=dims)
            snn.losses.share((y * g).sum(), m).backward()
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", str(e).split(":")[0][:40] + ": " + str(e)[:160])
    tol = dict(atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(y, y_ref.detach(), **tol, msg=lambda s: f"output: {s}")
    gx = snn.gather(x_local.grad, m, dims=dims)
    torch.testing.assert_close(gx, xr.grad, **tol, msg=lambda s: f"input grad: {s}")
    assert_param_grads(ref, model, m, **tol)
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    # Even slab sizes (strided phases and 2x2 pools need slabs starting on even rows), uneven;
    # on the 2x2 mesh the rows of two slabs (snn.shard balances them).
    sizes = [2 * draw(st.integers(1, 3)) for _ in range(domain if isinstance(domain, int) else 2)]
    if isinstance(domain, int) and domain > 1 and draw(st.integers(0, 3)) == 0:
        # One empty slab in about a quarter of the examples: its zero-length dims group with any
        # size, so every decision mapped by shapes must still be taken as on the other ranks (a
        # view of an empty slab refused on its rank alone was a hang; sessions 66-67).
        sizes[draw(st.integers(0, domain - 1))] = 0
    names = sorted(STEPS) + [f"T:{n}" for n in TRANSPOSABLE] + ["conv"] * 4
    steps = draw(st.lists(st.sampled_from(names), min_size=2, max_size=7))
    width = 2 * draw(st.integers(1 if isinstance(domain, int) else 2, 3))  # two aligned column slabs on 2x2
    return dict(domain=domain, sizes=sizes, width=width, steps=steps,
                head=draw(st.sampled_from(["slab", "pool", "loss"])), seed=draw(st.integers(0, 2**16)))


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)




# Fixed cases the fast run always includes: one row of the whole domain broadcast and a slab
# re-assembled by ``cat`` after a crop (``_relayout``), and a routed logsumexp after class tokens.
EXAMPLES = [
    dict(domain=3, sizes=[2, 6, 4], width=4, steps=["shift_rows", "first_row", "conv", "last_row", "select_row"],
         head="slab", seed=3),
    dict(domain=4, sizes=[4, 2, 6, 2], width=2, steps=["class_token", "logsumexp", "phases", "repeat_rows"],
         head="pool", seed=5),
    # 2x2 mesh: the row of the whole domain stays sharded along the columns (broadcast, and `cat`).
    dict(domain=(2, 2), sizes=[4, 2], width=6, steps=["shift_rows", "first_row", "T:first_row", "last_row"],
         head="slab", seed=7),
    # Crops, pads and windows without padding keep the slab boundaries, so their results line up.
    dict(domain=3, sizes=[2, 1, 4], width=5, steps=["differences", "pad_crop", "pad_valid_pool", "T:differences",
                                                    "class_token"], head="slab", seed=11),
    # Calls routed since session 52: running sums, F.group_norm, TF-"same" pads, offset grids.
    dict(domain=3, sizes=[4, 2, 6], width=4, steps=["cumsum_rows", "group_norm_fn", "same_pool", "T:same_pool",
                                                    "offset_positions", "T:cumsum_rows"], head="slab", seed=13),
    # 2x2 mesh: the column grid (a slab of the columns) tiled by the rows' local length.
    dict(domain=(2, 2), sizes=[6, 6], width=6, steps=["offset_positions", "T:differences", "interp_round_trip"],
         head="pool", seed=187),
    # Session 53: windows of 4 rows on slabs of whole windows, the last one padded; a convolution
    # on windows folded into the batch.
    dict(domain=3, sizes=[4, 4, 2], width=4, steps=["windows", "conv_windows", "conv", "T:windows"], head="slab",
         seed=19),
    # Session 54: the same in timm's batch-major order (a batch of 2: each rank's windows are two
    # blocks of dim 0), with one window row on the first rank and a padded last slab.
    dict(domain=3, sizes=[4, 8, 2], width=4, steps=["batch_windows", "batch_conv_windows", "T:batch_windows"],
         head="slab", seed=23),
    # Session 56: Fourier transforms, mode crops assigned by global positions, shifted spectra,
    # on uneven slabs and on the 2x2 mesh (both dims sharded).
    dict(domain=3, sizes=[2, 6, 4], width=4, steps=["spectral_modes", "conv", "fft_rows", "T:fft_rows"],
         head="slab", seed=29),
    dict(domain=(2, 2), sizes=[4, 4], width=6, steps=["spectral_modes", "fft_rows", "T:fft_rows"], head="pool",
         seed=31),
    # Session 59: a whole table read at positions computed on the rows (and on the columns of a 2x2 mesh).
    dict(domain=3, sizes=[2, 5, 1], width=4, steps=["table_lookup", "conv", "T:table_lookup"], head="slab", seed=37),
    dict(domain=(2, 2), sizes=[4, 2], width=5, steps=["T:table_lookup", "table_lookup"], head="pool", seed=41),
    # Session 62: per-sample statistics over the flattened sample, boundary rows written by
    # integer position, meshgrid coordinates; one-row slabs and the 2x2 mesh.
    dict(domain=3, sizes=[1, 5, 2], width=4, steps=["sample_stats", "boundaries", "coordinates", "T:boundaries"],
         head="slab", seed=43),
    dict(domain=(2, 2), sizes=[3, 4], width=5, steps=["T:sample_stats", "boundaries", "coordinates"], head="pool",
         seed=47),
    # Session 63: similarities and distances, one-hot labels, a total variation's crops (whose
    # new layouts made the layout scope answer an old one on some ranks only: a hang).
    dict(domain=3, sizes=[2, 5, 1], width=4, steps=["similarity", "one_hot", "total_variation", "conv"], head="slab",
         seed=53),
    dict(domain=(2, 2), sizes=[3, 4], width=5,
         steps=["T:similarity", "T:total_variation", "one_hot", "probes", "T:probes"], head="pool", seed=59),
    dict(domain=4, sizes=[1, 3, 2, 2], width=4, steps=["probes", "conv", "T:probes"], head="slab", seed=61),
    dict(domain=3, sizes=[4, 2, 2], width=4, steps=["unfold_windows", "conv", "T:unfold_windows"], head="slab",
         seed=67),
    # Session 64: slabs of one global length laid out differently (a cat of pieces, a crop padded
    # at the other end) meeting in pointwise calls: a hang before; an empty slab, the 2x2 mesh.
    dict(domain=3, sizes=[4, 2, 3], width=4, steps=["pieces", "conv", "T:pieces"], head="slab", seed=71),
    dict(domain=3, sizes=[3, 0, 4], width=3, steps=["pieces", "total_variation"], head="pool", seed=73),
    dict(domain=(2, 2), sizes=[3, 4], width=5, steps=["T:pieces", "pieces", "crop_pad"], head="pool", seed=79),
    # Session 67: an empty slab through per-sample statistics of the flattened sample (a fold of
    # the columns' slab behind the channels: lost on that rank alone, a hang), token attention
    # and the reductions (refused there before).
    dict(domain=4, sizes=[6, 6, 2, 0], width=6,
         steps=["T:sample_stats", "tokens_attention", "T:total_variation", "T:column_stats", "max_pool"],
         head="loss", seed=165),
]


test_fuzz_guard_fast, test_fuzz_guard_campaign = fuzz_tests(
    "guard fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_GUARD_FAST_EXAMPLES", 12), campaign=("SNN_FUZZ_GUARD_EXAMPLES", 500), every=50,
)
