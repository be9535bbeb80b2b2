"""Window attention written with views inside a model's own ``forward`` (the guard's business).

timm's DaViT, TinyViT, Twins-SVT and EfficientViT-M partition channels-last tokens into windows
with ``x.view(b, h // ws, ws, w // ws, ws, c)``, pad to whole windows by amounts read from the
tensor (``(ws - h % ws) % ws``) and crop back with ``x[:, :h]``. On slabs that start on window
boundaries every window lies on one rank, so the converted model must equal the single-device
one (forward, input and parameter gradients, float64) at P = 2 and 3, whatever the slab sizes:
one window per slab (a local size of 1 in the windows' dims), a padded last slab, many windows.
Slabs that cut a window are refused on every rank with the same message (ranks that fit went on
alone before: a hang).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.forward_guard import LocalLength, _map_reshape

from .harness import mesh
from .reference import compare_on_slabs, error_on_slab

WS = 4


class WindowBlock(nn.Module):
    """A convolution, then window attention over channels-last tokens written as timm's DaViT
    writes it (pad, partition, attend, reverse, crop), then a convolution. ``crop``: how the
    padding is taken off (``slice`` as DaViT, ``narrow``, or ``assign``: ``out[:, :h] = y[:, :h]``
    into zeros of the padded shape, by global positions)."""

    def __init__(self, crop: str = "slice", dim: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.crop, self.heads = crop, heads
        self.stem = nn.Conv2d(2, dim, 3, padding=1)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Conv2d(dim, 3, 3, padding=1)

    def attend(self, windows: torch.Tensor) -> torch.Tensor:
        b, n, c = windows.shape
        qkv = self.qkv(windows).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x)).permute(0, 2, 3, 1)  # (B, H, W, C)
        b, h, w, c = x.shape
        pad_b = (WS - h % WS) % WS
        pad_r = (WS - w % WS) % WS
        x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        _, hp, wp, _ = x.shape
        win = x.view(b, hp // WS, WS, wp // WS, WS, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, WS, WS, c)
        y = self.attend(win.view(-1, WS * WS, c)).view(-1, WS, WS, c)
        y = y.view(-1, hp // WS, wp // WS, WS, WS, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, hp, wp, c)
        if self.crop == "slice":
            y = y[:, :h, :w, :].contiguous()
        elif self.crop == "narrow":
            y = y.narrow(1, 0, h).narrow(2, 0, w)
        else:
            out = torch.zeros_like(y)
            out[:, :h, :w] = y[:, :h, :w]
            y = out[:, :h, :w]
        return self.head(y.permute(0, 3, 1, 2))


def _converted(make, domain, sizes, width):
    """(mesh, single-device model, converted copy, a 2-channel input of ``sum(sizes)`` rows)."""
    m = mesh(domain)
    torch.manual_seed(0)
    ref = make().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 2, sum(sizes), width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return m, ref, model, x


def _exact(domain, sizes, crop):
    m, ref, model, x = _converted(lambda: WindowBlock(crop), domain, sizes, 6)
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


# Slab rows per rank: whole windows on every rank but the last, which the model pads.
_ALIGNED = {
    2: [[4, 4], [4, 6], [8, 3], [4, 9], [12, 1]],
    3: [[4, 4, 2], [8, 4, 5], [4, 8, 1], [4, 4, 4]],
}


@pytest.mark.parametrize("domain, sizes", [(d, s) for d, ss in _ALIGNED.items() for s in ss])
def test_window_views_on_window_aligned_slabs_are_exact(run, domain, sizes):
    assert max(run(domain, _exact, domain, sizes, "slice")) < 1e-10


@pytest.mark.parametrize("domain, sizes", [(2, [4, 6]), (3, [4, 4, 2])])
def test_narrow_by_a_length_read_before_the_pad_is_exact(run, domain, sizes):
    # The last slab is padded and cropped; the others are not: the crop is decided on the global
    # bounds on every rank (a rank that skipped it while another gathered its bounds was a hang).
    assert max(run(domain, _exact, domain, sizes, "narrow")) < 1e-10


def _refused(domain, sizes, crop="slice"):
    m, _ref, model, x = _converted(lambda: WindowBlock(crop), domain, sizes, 6)
    return error_on_slab(model, x, m, sizes)


@pytest.mark.parametrize("domain, sizes", [(2, [4, 6]), (3, [4, 4, 2])])
def test_assignment_to_rows_read_before_the_pad_is_exact(run, domain, sizes):
    # ``out[:, :h] = ...`` keeps whole slabs where nothing was padded, and on the padded last slab
    # writes the rows of the whole sample's ``[0, h)`` it holds (index assignment by global
    # positions, session 56; refused alike on every rank before, the last rank alone earlier).
    assert max(run(domain, _exact, domain, [4] * domain, "assign")) < 1e-10
    assert max(run(domain, _exact, domain, sizes, "assign")) < 1e-10


@pytest.mark.parametrize("domain, sizes, misfits", [(2, [5, 7], [0, 1]), (3, [4, 6, 2], [1, 2]), (3, [3, 5, 8], [0, 1])])
def test_window_views_that_cut_a_window_are_refused_on_every_rank(run, domain, sizes, misfits):
    out = run(domain, _refused, domain, sizes)
    assert len(set(out)) == 1, out  # the same error on every rank, the fitting ones included
    assert f"does not fit the slabs of domain ranks {misfits}" in out[0] and "module '<root>' (WindowBlock)" in out[0], out[0]


def test_a_one_window_slab_maps_its_windows_as_the_larger_slabs_do():
    # Local size 1 along the sharded dim groups with either neighbour; the -1 (or the size read
    # from the slab) names the sharded output dim, as on a rank with two windows.
    c = 8
    assert _map_reshape((1, 1, 1, 7, 7, c), (1, 7, 7, c), (1,), [-1, 7, 7, c]) == (0,)
    assert _map_reshape((1, 2, 1, 7, 7, c), (2, 7, 7, c), (1,), [-1, 7, 7, c]) == (0,)
    one, two = LocalLength(7, 0) // 7, LocalLength(14, 0) // 7
    assert _map_reshape((1, 7, 7, c), (1, 1, 1, 7, 7, c), (0,), [-1, one, 1, 7, 7, c]) == (1,)
    assert _map_reshape((2, 7, 7, c), (1, 2, 1, 7, 7, c), (0,), [-1, two, 1, 7, 7, c]) == (1,)
    assert one._lossy and not LocalLength(7, 0)._lossy and (LocalLength(7, 0) * 2)._lossy is False


# --------------------------------------------------------------------------------------------
# timm's window-attention models, converted as a user would (refused on every rank before)

# name: (constructor options: small and with windows of 4 tokens, rows the slabs align to:
# the window size times the downsampling of the deepest windowed stage)
_TIMM_WINDOWED = {
    "davit_tiny": (dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8), window_size=4), 128),
    "tiny_vit_5m_224": (dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8),
                             window_sizes=(4, 4, 4, 4)), 128),
    "twins_svt_small": (dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8),
                             wss=(4, 4, 4, 4), sr_ratios=(8, 4, 2, 1)), 128),
}  # fmt: skip


def _timm_windowed(name, domain, sizes):
    import timm

    from bench.compat import randomise_norms

    m = mesh(domain)
    torch.manual_seed(0)
    kwargs, _align = _TIMM_WINDOWED[name]
    ref = timm.create_model(name, pretrained=False, num_classes=5, **kwargs).double().eval()
    randomise_norms(ref)
    model = snn.convert(copy.deepcopy(ref), m)
    # 64 columns: 2 at the 1/32 stage. At 1 column torch's own CPU batch-norm backward (the
    # single-device reference's) misreads the gradient TinyViT's head hands its last BatchNorm
    # (strides (128, 1, 128, 128) against a contiguous input): the reference is then wrong,
    # while sharded_nn's BatchNorm lays the two out alike first (``norm.matched_layouts``).
    x = torch.randn(1, 3, sum(sizes), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes)


@pytest.mark.parametrize("name", sorted(_TIMM_WINDOWED))
@pytest.mark.parametrize("domain, slabs", [(2, [1, 0.75]), (3, [1, 1, 0.25])])
def test_timm_window_attention_models_are_exact(run, name, domain, slabs):
    # Slabs of whole windows at every stage but the last rank's, whose slab the model pads (at
    # its 1/32 stage: a window of 4 rows, then of 3 rows and a padded one, or a single row).
    pytest.importorskip("timm")
    align = _TIMM_WINDOWED[name][1]
    sizes = [int(s * align) for s in slabs]
    assert max(run(domain, _timm_windowed, name, domain, sizes)) < 1e-9


# --------------------------------------------------------------------------------------------
# Sharded layers on windows folded into the batch: each rank's windows are whole samples


class ConvOnWindows(nn.Module):
    """Windows folded into the batch (channels first, as timm's EfficientViT-M), then sharded
    layers that compute each sample on its own: a depthwise convolution, a group norm, a max
    pool and an adaptive pool that broadcasts back; ``norm``: ``batch_train`` puts a training
    BatchNorm there instead (batch statistics over every rank's windows: refused)."""

    def __init__(self, norm: str = "group") -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode="reflect")
        self.norm = nn.GroupNorm(2, 4) if norm == "group" else nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.gate = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        b, c, h, w = x.shape
        win = x.view(b, c, h // WS, WS, w // WS, WS).permute(0, 2, 4, 1, 3, 5).reshape(-1, c, WS, WS)
        y = self.pool(self.norm(self.dw(win)))
        y = y * torch.sigmoid(self.gate(y))
        y = y.view(b, h // WS, w // WS, c, WS, WS).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return self.head(y + x)


def _conv_on_windows(domain, sizes, norm):
    m, ref, model, x = _converted(lambda: ConvOnWindows(norm), domain, sizes, 8)
    if norm == "group":
        return compare_on_slabs(ref, model, m, x, sizes, replicated=False)
    return error_on_slab(model, x, m, sizes)


@pytest.mark.parametrize("domain, sizes", [(2, [4, 8]), (2, [8, 4]), (3, [4, 4, 8]), (3, [8, 4, 4])])
def test_sharded_layers_on_windows_in_the_batch_are_exact(run, domain, sizes):
    assert max(run(domain, _conv_on_windows, domain, sizes, "group")) < 1e-10


def test_batch_statistics_over_windows_in_the_batch_are_refused_on_every_rank(run):
    out = run(2, _conv_on_windows, 2, [4, 8], "batch_train")
    assert len(set(out)) == 1 and "shards dims (2,) but its input is sharded along dim 0" in out[0], out


def _efficientvit_m(domain, batch=1, width=None):
    import timm

    from bench.compat import randomise_norms

    m = mesh(domain)
    torch.manual_seed(0)
    size = 256 * domain  # windows of 4 tokens at 1/64: slabs of 256 rows
    ref = timm.create_model("efficientvit_m0", pretrained=False, num_classes=5, img_size=size, embed_dim=(16, 32, 48),
                            depth=(1, 1, 1), num_heads=(2, 2, 2), window_size=(4, 4, 4), kernels=(3, 3, 3, 3))
    ref = ref.double().eval()
    randomise_norms(ref)
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(batch, 3, size, width or size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, [256] * domain)


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_efficientvit_m_is_exact(run, domain):
    # Its window attention runs depthwise convolutions on windows folded into the batch.
    pytest.importorskip("timm")
    assert max(run(domain, _efficientvit_m, domain)) < 1e-9


def _hooks_on_windows(domain):
    m, ref, model, x = _converted(lambda: ConvOnWindows("group"), domain, [4] * domain, 8)
    seen = []
    model.dw.register_forward_hook(lambda mod, args, out: seen.append((tuple(args[0].shape), tuple(out.shape))))
    r = m.get_local_rank("domain")
    model(x.narrow(2, 4 * r, 4))
    return seen, type(model.dw).__name__, "forward" in model.dw.__dict__


def test_a_layer_on_windows_keeps_its_hooks_and_its_own_forward(run):
    # The torch counterpart's forward stands in for this call only, through the layer's own
    # __call__: a user's forward hook sees the call, and the sharded forward is back afterwards.
    for seen, name, patched in run(2, _hooks_on_windows, 2):
        assert seen == [((2, 4, 4, 4), (2, 4, 4, 4))] and name == "ShardedConv2d" and not patched, (seen, name, patched)
