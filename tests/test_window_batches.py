"""Windows of a batch over one sample folded into one dim (the guard's ``Fold`` layout).

With a batch of ``b > 1``, timm's window partition ``x.view(b, h // ws, ws, w // ws, ws, c)``,
permute, ``.view(-1, ws, ws, c)`` puts ``b`` blocks of this rank's windows into dim 0, with the
other ranks' windows between them on one device. Every window still lies on one rank, so
attention inside the windows, linear layers, per-sample convolutions and norms, and the reverse
view are exact on it: the converted model must equal the single-device one (forward, input and
parameter gradients, float64) at P = 2 and 3, at batches of 2 and 3, with slabs of one window
and padded last slabs. What would need the folded rows in the single device's order (a
reduction or an index along the folded dim, a tensor or positions sized by it, a folded model
output) is refused with the same message on every rank.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.forward_guard import UNKNOWN, LocalLength, _map_reshape
from sharded_nn.guard_folds import Fold, fold_of_reshape, map_folded_reshape

from .harness import mesh
from .reference import compare_on_slabs, error_on_slab
from .test_window_views import _TIMM_WINDOWED, WS, ConvOnWindows, WindowBlock, _efficientvit_m


def _batched(make, domain, sizes, batch, width, replicated=False):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = make().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(batch, 2, sum(sizes), width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes, replicated=replicated)


def _window_block(domain, sizes, batch, crop):
    return _batched(lambda: WindowBlock(crop), domain, sizes, batch, 6)  # (made on the rank: a closure is fine)


# Rows per rank: whole windows (of 4 rows) on every rank but the last, which the model pads; a
# rank of one window row next to ranks of two (local sizes 1 and 2 along the folded factor).
_CASES = [(2, [4, 6], 2), (2, [12, 1], 2), (2, [4, 8], 3), (3, [4, 4, 2], 2), (3, [8, 4, 5], 3)]


@pytest.mark.parametrize("domain, sizes, batch", _CASES)
@pytest.mark.parametrize("crop", ["slice", "narrow"])
def test_window_attention_on_a_batch_is_exact(run, domain, sizes, batch, crop):
    assert max(run(domain, _window_block, domain, sizes, batch, crop)) < 1e-10


def _conv_on_windows():
    return ConvOnWindows("group")


@pytest.mark.parametrize("domain, sizes", [(2, [4, 8]), (3, [8, 4, 4])])
def test_per_sample_layers_on_windows_of_a_batch_are_exact(run, domain, sizes):
    # Convolutions, a group norm and pools on windows folded into the batch dim with the samples.
    assert max(run(domain, _batched, _conv_on_windows, domain, sizes, 2, 8)) < 1e-10


def _timm_windowed(name, domain, sizes, batch):
    import timm

    from bench.compat import randomise_norms

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=5, **_TIMM_WINDOWED[name][0]).double().eval()
    randomise_norms(ref)
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(batch, 3, sum(sizes), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes)


@pytest.mark.parametrize("name", sorted(_TIMM_WINDOWED))
@pytest.mark.parametrize("domain, slabs, batch", [(2, [1, 0.75], 2), (3, [1, 1, 0.25], 3)])
def test_timm_window_attention_models_on_a_batch_are_exact(run, name, domain, slabs, batch):
    # DaViT, TinyViT, Twins-SVT at a batch over one sample (refused on every rank before).
    pytest.importorskip("timm")
    align = _TIMM_WINDOWED[name][1]
    assert max(run(domain, _timm_windowed, name, domain, [int(s * align) for s in slabs], batch)) < 1e-9


def test_timm_efficientvit_m_on_a_batch_is_exact(run):
    pytest.importorskip("timm")
    # Depthwise convolutions and batch norms with running statistics on windows of two samples.
    assert max(run(2, _efficientvit_m, 2, 2, 128)) < 1e-9


# --------------------------------------------------------------------------------------------
# The number of elements of a folded tensor, used as a value


class NumelOfFlatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        u = h.flatten()  # channels before the sharded rows: a fold (refused as a lost layout before)
        return h / u.numel() + u.view_as(h) * 0.5


def test_the_size_of_a_flattened_slab_is_the_global_one(run):
    assert max(run(2, _batched, NumelOfFlatten, 2, [2, 4], 1, 5)) < 1e-10


# --------------------------------------------------------------------------------------------
# Refusals: what needs the folded rows in one device's order (and, below it, the reductions
# over the whole folded dim, which do not: every position on one rank, order-free)


class Misuse(nn.Module):
    """A window partition of a batch of two, then one call that reads the folded dim by position."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)
        b, h, w, c = x.shape
        win = x.view(b, h // WS, WS, w // WS, WS, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, WS * WS, c)
        k = self.kind
        if k == "cumsum_over_windows":
            win = win - win.cumsum(0)
        elif k == "index_window":
            win = win - win[0]
        elif k == "created_by_size":
            win = win + torch.zeros(win.shape[0], 1, 1)
        elif k == "positions":
            win = win + torch.arange(win.shape[0]).view(-1, 1, 1)
        elif k == "plain_per_window":
            win = win + torch.ones(win.shape[0] // 1, 1, 1).cumsum(0)
        elif k == "output":
            return win
        elif k == "contract":
            win = (win.transpose(0, 2) @ win.transpose(0, 2).transpose(1, 2)).transpose(0, 2)[:, :, :1].expand_as(win)
        y = win.view(b, h // WS, w // WS, WS, WS, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return self.head(y.permute(0, 3, 1, 2))


class ReducedOverFold(Misuse):  # (its stem and head)
    """Reductions and softmaxes over the whole folded dim: the windows of a batch (a mean
    window subtracted, windows weighted by a softmax over all of them), and a sample flattened
    with its channels in front of the sharded rows (per-sample statistics: ``x.flatten(1)``,
    LpLoss's ``x.reshape(b, -1)``), each computed on the dim written out as its factors (refused
    before session 62: "acts along the folded dim")."""

    def forward(self, x):
        h = self.stem(x)
        k = self.kind
        if k == "per_sample":
            flat = h.flatten(1)
            scale = flat.norm(dim=1) + flat.var(1) + flat.amax(1) - flat.mean(1) + torch.std_mean(flat, 1)[0]
            weights = flat.softmax(1).view_as(h) * flat.shape[1]
            return self.head(h * weights / scale.view(-1, 1, 1, 1)) + h.reshape(h.shape[0], -1).logsumexp(1).view(-1, 1, 1, 1)
        x = h.permute(0, 2, 3, 1)
        b, hh, w, c = x.shape
        win = x.view(b, hh // WS, WS, w // WS, WS, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, WS * WS, c)
        if k == "windows":
            win = win - win.mean(0) + win.softmax(0) * win.var(0, keepdim=True) / win.abs().amax((0, 1))
            win = win + torch.nansum(win, 0) / win.norm(dim=0) + win.sum()
        y = win.view(b, hh // WS, w // WS, WS, WS, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, w, c)
        return self.head(y.permute(0, 3, 1, 2))


@pytest.mark.parametrize("kind", ["windows", "per_sample"])
@pytest.mark.parametrize("domain, sizes, batch", [(2, [4, 8], 2), (3, [8, 4, 4], 3)])
def test_reductions_over_the_whole_folded_dim_are_exact(run, kind, domain, sizes, batch):
    assert max(run(domain, _batched, partial(ReducedOverFold, kind), domain, sizes, batch, 8)) < 1e-10


_MISUSE = {
    "cumsum_over_windows": "`cumsum`.*acts along the folded dim",
    "index_window": "indexing.*along the folded dim",
    "created_by_size": "`zeros`.*folds windows of several samples",
    "positions": "`arange`.*local size",
    "plain_per_window": "`zeros`|`ones`.*folds windows",
    "output": "output of Misuse.*could not follow",
    "contract": "`matmul`.*contracts or attends along the folded dim",
}


def _misuse(kind, domain, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Misuse(kind).double(), m)
    x = torch.randn(2, 2, sum(sizes), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return error_on_slab(model, x, m, sizes)


@pytest.mark.parametrize("kind", sorted(_MISUSE))
def test_calls_along_the_folded_dim_are_refused_on_every_rank(run, kind):
    import re

    out = run(2, _misuse, kind, 2, [4, 8])
    assert len(set(out)) == 1, out  # the same message on every rank (a rank of one window row, one of two)
    assert re.search(_MISUSE[kind], out[0]), out[0]


def _batch_norm_on_windows(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(ConvOnWindows("batch_train").double(), m)
    x = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    return error_on_slab(model, x, m, [4, 8])


def test_batch_statistics_over_windows_of_a_batch_are_refused_on_every_rank(run):
    out = run(2, _batch_norm_on_windows, 2)
    assert len(set(out)) == 1 and "ShardedBatchNorm2d" in out[0] and "folding 2 blocks" in out[0], out


class UnpackedWindows(WindowBlock):
    """WindowBlock whose attention unpacks q, k, v by iterating (``q, k, v = qkv``), attends with
    the product written out, and splits heads with ``chunk``: calls along other dims of a fold."""

    def attend(self, windows: torch.Tensor) -> torch.Tensor:
        b, n, c = windows.shape
        q, k, v = self.qkv(windows).reshape(b, n, 3, c).permute(2, 0, 1, 3)
        attn = (q @ k.transpose(-2, -1) * c**-0.5).softmax(dim=-1)
        halves = torch.cat([h.amax(-1, keepdim=True) - h for h in (attn @ v).chunk(2, dim=-1)], dim=-1)
        return self.proj(F.layer_norm(halves, (c,)))


def _unpacked(domain, sizes, batch):
    return _batched(UnpackedWindows, domain, sizes, batch, 6)


@pytest.mark.parametrize("domain, sizes, batch", [(2, [4, 6], 2), (3, [4, 8, 1], 3)])
def test_unpacked_attention_on_windows_of_a_batch_is_exact(run, domain, sizes, batch):
    assert max(run(domain, _unpacked, domain, sizes, batch)) < 1e-10


# --------------------------------------------------------------------------------------------
# Dropout on windows of a batch


class DropWindows(nn.Module):
    def forward(self, x):
        b, c, h, w = x.shape
        win = x.view(b, c, h // WS, WS, w).permute(0, 2, 1, 3, 4).reshape(-1, c, WS, w)
        win = F.dropout(win, 0.5, training=True)
        return win.view(b, h // WS, c, WS, w).permute(0, 2, 1, 3, 4).reshape(b, c, h, w)


def _dropout(domain, sizes):
    m = mesh(domain)
    model = snn.convert(DropWindows(), m)
    x = torch.ones(2, 3, sum(sizes), 64)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    a = model(x.narrow(2, sum(sizes[:r]), sizes[r]))
    torch.manual_seed(0)
    b = model(x.narrow(2, sum(sizes[:r]), sizes[r]))
    return snn.gather(a, m, dims=(2,)), torch.equal(a, b)


def test_dropout_on_windows_of_a_batch_draws_every_window_once(run):
    # Each window is drawn by the rank that holds it, from the slab's stream: a valid mask of
    # the right rate, repeatable under a seed, and different on the two ranks' windows.
    for y, repeatable in run(2, _dropout, 2, [4, 8]):
        assert repeatable
        assert set(y.unique().tolist()) <= {0.0, 2.0}
        assert 0.45 < (y == 0).float().mean().item() < 0.55
        assert not torch.equal(y[:, :, :4], y[:, :, 4:8])


# --------------------------------------------------------------------------------------------
# The mapping itself, on every local size


def test_a_fold_is_mapped_alike_whatever_the_slab_length():
    # (b, rows, cols, ws, ws, c) sharded along the window rows, folded by ``view(-1, ws, ws, c)``
    # and unfolded by ``view(-1, hp // ws, cols, ws, ws, c)``: the same Fold on every local length
    # (a length of 1 groups with either neighbour by sizes alone), and the slab back.
    c = 8
    for b in (2, 3):
        for rows in (1, 2, 3, 5):
            n = b * rows * 3
            fold = fold_of_reshape((b, rows, 3, 4, 4, c), (n, 4, 4, c), (1,), [-1, 4, 4, c])
            assert fold == Fold(0, 0, b, 3, 1), (b, rows, fold)
            assert _map_reshape((b, rows, 3, 4, 4, c), (n, 4, 4, c), (1,), [-1, 4, 4, c]) is UNKNOWN
            assert map_folded_reshape((n, 4, 4, c), (n, 16, c), fold, [-1, 16, c]) == fold
            qkv = map_folded_reshape((n, 16, 3 * c), (n, 16, 3, 2, c // 2), fold, [-1, 16, 3, 2, c // 2])
            assert qkv == fold
            hp = LocalLength(rows * 4, 0) // 4  # the rows as a model reads them: from the padded slab
            back = map_folded_reshape((n, 4, 4, c), (b, rows, 3, 4, 4, c), fold, [-1, hp, 3, 4, 4, c])
            assert back == (1,), (b, rows, back)
            if rows > 1:
                # The rows as a constant: no size names the sharded factor, and the -1 would not
                # hold it on every rank.
                assert map_folded_reshape((n, 4, 4, c), (b, rows, 3, 4, 4, c), fold, [-1, rows, 3, 4, 4, c]) is UNKNOWN


def test_views_that_split_the_folded_dim_by_constants():
    fold = Fold(0, 0, 2, 3, 1)  # 2 samples x (this rank's rows) x 3 window columns
    # The batch split off: each sample's windows are then a slab of the sample's windows.
    assert map_folded_reshape((12, 16, 8), (2, 6, 16, 8), fold, [2, -1, 16, 8]) == (1,)
    # Merged with the trailing dims: still folded (inner grows), then split again by constants.
    wide = map_folded_reshape((12, 16, 8), (12 * 16, 8), fold, [-1, 8])
    assert wide == Fold(0, 0, 2, 3 * 16, 1)
    assert map_folded_reshape((12 * 16, 8), (12, 16, 8), wide, [-1, 16, 8]) == fold
    # A constant that cuts the window columns apart from the rows: not one rank-independent view.
    assert map_folded_reshape((12, 16, 8), (4, 3, 16, 8), fold, [4, -1, 16, 8]) is UNKNOWN


# --------------------------------------------------------------------------------------------
# Patches folded with the channels (timm MobileViT's unfold)


def _mobilevit(domain, sizes, batch):
    import timm

    from bench.compat import randomise_norms

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model("mobilevit_xxs", pretrained=False, num_classes=5).double().eval()
    randomise_norms(ref)
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(batch, 3, sum(sizes), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes)


@pytest.mark.parametrize("domain, sizes, batch", [(2, [64, 64], 1), (2, [128, 64], 2), (3, [64, 128, 64], 1)])
def test_timm_mobilevit_unfold_is_exact(run, domain, sizes, batch):
    # ``x.reshape(b * c * (h // 2), 2, w // 2, 2)`` folds the channels with the patch rows of the
    # slab (and splits off the rows inside a patch), then ``reshape(b, c, n, 4)`` unfolds it into
    # a slab of patches: tokens sharded for ring attention, folded back the same way. Slabs of
    # whole patches at 1/32 (64 rows); refused as a lost layout before session 54.
    pytest.importorskip("timm")
    assert max(run(domain, _mobilevit, domain, sizes, batch)) < 1e-9


def test_a_view_by_a_slab_length_equal_to_a_neighbour_size_maps_as_longer_slabs_do():
    # (1, c, 2, w) viewed as (c * (2 // 2), 2, w // 2, 2): sizes alone pair the slab's 2 rows with
    # the patch's 2 rows (a slab along dim 1), while a slab of 4 rows merges them with the
    # channels. The size read from the slab names the dim that takes them on every rank.
    c, w = 8, 4
    for rows in (2, 4, 6):
        nh = LocalLength(rows, 0) // 2
        got = _map_reshape((1, c, rows, w), (c * (rows // 2), 2, w // 2, 2), (2,), [c * nh, 2, w // 2, 2])
        assert got is UNKNOWN, (rows, got)  # then followed as a fold (``fold_of_reshape``)
        assert fold_of_reshape((1, c, rows, w), (c * (rows // 2), 2, w // 2, 2), (2,),
                               [c * nh, 2, w // 2, 2]) == Fold(0, 0, c, 1, 1)
