"""Shifted-window attention (timm's Swin Transformer V1, V2 and V2-CR blocks) on a sharded image.

A Swin block attends within windows of ``ws`` tokens along each image dim; every other block
first rolls the token grid by ``-shift`` (cyclically, over the whole image), masks the windows
that the roll wrapped around, and rolls back afterwards. On a slab that whole-image roll and the
mask are the only parts that see other ranks' tokens: once every slab starts on a window
boundary, each window lies on one rank, so the attention itself is local.

The sharded block keeps timm's own ``forward`` (norms, MLP, drop-path, residuals; timm's code
runs under the forward guard, which keeps drop-path decisions identical on every rank) and
replaces ``_attn`` (V2-CR: ``_shifted_window_attn``), the shifted-window attention, with:

1. the roll along the sharded dim as a periodic shift over the ranks (``comm.periodic_shift``:
   each rank sends its first ``shift`` rows to its left neighbour, the first rank to the last);
   unsharded dims roll locally;
2. the padding to whole windows at the image's end only (the last rank along a sharded dim);
3. window partition, timm's ``WindowAttention`` (relative position bias, V2's cosine attention
   and continuous position bias alike) and window reverse on the slab, the attention run beside
   the forward guard (``attend_windows``: each window is on one rank; its dropout in training
   draws from this rank's own stream, independent of the other ranks', as one device's
   element-wise dropout is);
4. the shift mask of this rank's windows (``local_shift_mask``): rows of timm's ``attn_mask``
   buffer, or, for ``dynamic_mask`` blocks, timm's ``get_attn_mask`` on this rank's windows
   plus one window past its end (so the mask costs a slab's worth, not the image's);
5. the crop and the roll back.

The helpers (``window_starts``, ``roll_slab``, ``local_shift_mask``) serve MONAI's Swin blocks
too (``layers/swin_monai.py``).

Sharding contract:
    input: ``(B, H, W, C)`` tokens (timm's NHWC Swin layout), H sharded by a mesh with one
    domain axis, or H and W by a mesh with two (the image's ``dims=(2,)`` or ``(2, 3)`` before
    the patch embedding's permute; timm's block flattens H and W into one token dim around its
    MLP, which the forward guard follows as a merged dim). Every slab starts on a window
    boundary: ``starts % window == 0`` along each sharded dim, so every slab but the last spans
    whole windows (the last may end in a partial window, padded as timm pads the image). Shard
    the image with ``align = snn.alignment(model, input_shape=...)`` (patch x 2**stage x window
    for the deepest stage whose windows are smaller than its grid).
    output: the same layout. forward: two periodic shifts per sharded dim for a shifted block
    (there and back), none for a plain one, plus the layouts' agreement; backward: the shifts'
    adjoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import gather_layouts
from ..comm.shift import periodic_shift
from ..errors import ShardingError, ShardingNotImplementedError
from ..layout import Layout
from ..mesh import axis_index, domain_axes
from .squeeze_excite import GuardedAsIs

__all__ = [
    "ShardedSwinBlockMixin", "SlabWindows", "attend_windows", "local_shift_mask", "register_loaded", "roll_slab",
    "window_starts",
]


@dataclass(frozen=True)
class SlabWindows:
    """Where this rank's slab sits in the token grid, per token dim (identical facts on all ranks).

    Attributes:
        sizes: global sizes of the token dims (``(H, W)`` or ``(D, H, W)``).
        first: this rank's first position along each token dim (0 where not sharded).
        last: whether this rank holds the grid's end along each token dim (True where not sharded).
        sharded: the tensor dims that are sharded (token dims count from 1).
        layouts: the agreed layout of each sharded dim.
    """

    sizes: tuple[int, ...]
    first: tuple[int, ...]
    last: tuple[bool, ...]
    sharded: tuple[int, ...]
    layouts: tuple[Layout, ...]

    def end_pads(self, windows: Sequence[int]) -> list[int]:
        """Positions that pad the grid to whole windows along each token dim (the same on every rank)."""
        return [(w - g % w) % w for w, g in zip(windows, self.sizes)]

    def my_pads(self, windows: Sequence[int]) -> list[int]:
        """What this rank pads: the end padding where it holds the grid's end, else nothing."""
        return [p if end else 0 for p, end in zip(self.end_pads(windows), self.last)]


def window_starts(x: torch.Tensor, mesh, token_dims: Sequence[int], windows: Sequence[int] | None, what: str) -> SlabWindows:
    """Agree on the slab layout of ``x`` (channels-last tokens) and check that windows stay on one rank.

    ``token_dims[k]`` is sharded by the k-th domain axis. ``windows`` gives the window size of each
    token dim ``1 .. n`` (``None``: no check, e.g. before the window is known). Raises on every
    rank alike when a slab starts off a window boundary.
    """
    axes = domain_axes(mesh)
    layouts = gather_layouts(x.shape, mesh, token_dims, what=what, scoped=True)
    n = x.dim() - 2
    sizes, first, last = list(x.shape[1 : 1 + n]), [0] * n, [True] * n
    for lay, d, a in zip(layouts, token_dims, axes):
        lay.require_nonempty(f"{what} along dim {d}")
        i = axis_index(mesh, a)
        sizes[d - 1], first[d - 1], last[d - 1] = lay.size, lay.starts[i], i == len(lay.sizes) - 1
    out = SlabWindows(tuple(sizes), tuple(first), tuple(last), tuple(token_dims), tuple(layouts))
    if windows is not None:
        check_windows(out, windows, what)
    return out


def check_windows(slab: SlabWindows, windows: Sequence[int], what: str) -> None:
    """Every slab along a sharded token dim starts on a multiple of that dim's window."""
    for lay, d in zip(slab.layouts, slab.sharded):
        w = windows[d - 1]
        if any(s % w for s in lay.starts):
            raise ShardingError(
                f"{what}: along token dim {d} the slabs {lay.sizes} (starting at {lay.starts}) must start on window "
                f"boundaries of {w} tokens, so that no window spans two ranks. Shard the input with the alignment "
                "snn.alignment(model, input_shape=...) gives (patch size x 2**stage x window), on an image whose size "
                "is a multiple of it."
            )


def roll_slab(
    y: torch.Tensor, shifts: Sequence[int], mesh, slab: SlabWindows, what: str, pads: Sequence[int] | None = None
) -> torch.Tensor:
    """``torch.roll(y_full, shifts, dims=(1, ..., n))`` on this rank's slab (periodic shifts on sharded dims).

    ``pads``: the grid's end padding along each token dim when ``y`` is padded (``end_pads``);
    the layouts come from ``slab`` (agreed once), so the shifts gather nothing.
    """
    local_s, local_d = [], []
    for k, s in enumerate(shifts):
        if not s:
            continue
        if k + 1 in slab.sharded:
            lay = slab.layouts[slab.sharded.index(k + 1)]
            if pads and pads[k]:
                lay = Layout((*lay.sizes[:-1], lay.sizes[-1] + pads[k]))
            y = periodic_shift(y, s, k + 1, mesh, slab.sharded, what=what, layout=lay)
        else:
            local_s.append(s)
            local_d.append(k + 1)
    return torch.roll(y, local_s, local_d) if local_s else y


def local_shift_mask(
    make: Callable[[list[int]], torch.Tensor], local: Sequence[int], windows: Sequence[int], last: Sequence[bool]
) -> torch.Tensor:
    """This rank's windows of a Swin shift mask, from the library's own mask function ``make``.

    ``make(sizes)`` builds the ``(windows, N, N)`` mask of a padded grid of ``sizes`` (timm's
    ``get_attn_mask``, MONAI's ``compute_mask``). A window's mask depends only on whether it is
    among the last along each dim (the wrapped-around regions sit in the grid's last window), so
    the mask of this rank's windows is that of its own padded extent ``local``, extended by one
    window along each dim where the grid goes on past the slab, with the extra windows dropped.
    """
    ext = [n + (0 if end else w) for n, w, end in zip(local, windows, last)]
    mask = make(ext)
    grid = [e // w for e, w in zip(ext, windows)]
    keep = tuple(slice(0, n // w) for n, w in zip(local, windows))
    mask = mask.view(*grid, *mask.shape[1:])[keep]
    return mask.reshape(-1, *mask.shape[len(grid) :])


def attend_windows(
    attn: Callable, windows: torch.Tensor, mask: torch.Tensor | None, draws: bool | None = None
) -> torch.Tensor:
    """``attn(windows, mask=mask)`` on this rank's windows, beside the forward guard.

    Each window lies on one rank, so nothing in the library's window attention mixes ranks; its
    dropout in training (attention and projection dropout) draws from this rank's own stream, as
    element-wise dropout of a slab does (independent of the other ranks' windows). ``draws``:
    whether ``attn`` draws random numbers; ``None``: an ``nn.Module`` in training with a
    ``nn.Dropout`` of ``p > 0``.
    """
    from ..forward_guard import run_local

    if draws is None:
        draws = attn.training and any(getattr(m, "p", 0) > 0 for m in attn.modules() if isinstance(m, nn.Dropout))
    return run_local(attn, windows, mask=mask, draws_on=windows.device if draws else None)


class ShardedSwinBlockMixin(GuardedAsIs):
    """Mixin for timm Swin blocks: ``_attn`` over a sharded token grid (see the module doc)."""

    #: For ``snn.alignment``: windows of ``window_size`` tokens along the tokens' dims 1 and 2
    #: (the image's H and W) must not span two slabs.
    alignment_dims = (1, 2)

    @property
    def alignment_multiple(self) -> tuple[int, int]:
        return tuple(self.window_size)

    @classmethod
    def from_module(cls, module, mesh, **options):
        """A copy of ``module`` (same parameters) whose children stay unconverted; meshes with one
        or two domain axes (H, or H and W)."""
        axes = domain_axes(mesh)
        if len(axes) > 2:
            raise ShardingNotImplementedError(
                f"{cls.__name__}: a Swin block's tokens have two grid dims (H, W), got a mesh with {len(axes)} "
                f"domain axes {axes}. Use one domain axis (H) or two (H and W)."
            )
        return super().from_module(module, mesh, **options)

    def sharding_repr(self) -> str:
        along = "H" if len(domain_axes(self.mesh)) == 1 else "H and W"
        return f"shifted windows over the domain ranks along {along}; MLP and norms under the forward guard"

    def _attn(self, x: torch.Tensor) -> torch.Tensor:  # V1, V2
        return self._windowed(x, super()._attn)

    def _shifted_window_attn(self, x: torch.Tensor) -> torch.Tensor:  # V2-CR: the same method, named so
        return self._windowed(x, super()._shifted_window_attn)

    def _windowed(self, x: torch.Tensor, timms: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        from ..forward_guard import keep_layout

        if x.is_meta:  # the shape-only probe of ``snn.alignment``: timm's own attention
            return timms(x)
        return keep_layout(x, self._shifted_window_attention(x))

    def _shifted_window_attention(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if x.dim() != 4:
            raise ShardingError(f"{name}: expected (B, H, W, C) tokens, got shape {tuple(x.shape)}.")
        ws, shift = tuple(self.window_size), tuple(self.shift_size)
        slab = window_starts(x, self.mesh, tuple(range(1, 1 + len(domain_axes(self.mesh)))), ws, name)
        b, h, w, c = x.shape
        has_shift = any(shift)
        y = roll_slab(x, [-s for s in shift], self.mesh, slab, name) if has_shift else x
        # timm rolls, then pads to whole windows at the image's end: only the rank holding it pads.
        pads = slab.my_pads(ws)
        y = F.pad(y, (0, 0, 0, pads[1], 0, pads[0]))
        hp, wp = y.shape[1], y.shape[2]
        nh, nw = hp // ws[0], wp // ws[1]
        win = y.view(b, nh, ws[0], nw, ws[1], c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws[0] * ws[1], c)
        mask = self._local_mask(y, slab, (hp, wp), ws) if has_shift else None
        out = attend_windows(self.attn, win, mask)
        out = out.view(b, nh, nw, ws[0], ws[1], c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        out = out[:, :h, :w, :].contiguous()
        return roll_slab(out, shift, self.mesh, slab, name) if has_shift else out

    def _local_mask(self, y, slab: SlabWindows, local, ws) -> torch.Tensor:
        """This rank's windows of timm's shift mask of the whole padded image."""
        if getattr(self, "dynamic_mask", False) or self.attn_mask is None:
            return local_shift_mask(lambda s: self.get_attn_mask(y.new_empty((1, *s, 1))), local, ws, slab.last)
        gnh = -(-slab.sizes[0] // ws[0])
        gnw = -(-slab.sizes[1] // ws[1])
        mask = self.attn_mask
        if mask.shape[0] != gnh * gnw:
            raise ShardingError(
                f"{type(self).__name__}: the block's shift mask holds {mask.shape[0]} windows, the image has "
                f"{gnh} x {gnw}: build the model for this image size (img_size=...), or with strict_img_size=False."
            )
        r0, c0 = slab.first[0] // ws[0], slab.first[1] // ws[1]
        mask = mask.view(gnh, gnw, *mask.shape[1:])[r0 : r0 + local[0] // ws[0], c0 : c0 + local[1] // ws[1]]
        return mask.reshape(-1, *mask.shape[2:])


_TARGETS = (
    ("timm.models.swin_transformer", "SwinTransformerBlock"),
    ("timm.models.swin_transformer_v2", "SwinTransformerV2Block"),
    ("timm.models.swin_transformer_v2_cr", "SwinTransformerV2CrBlock"),
)


def register_loaded() -> None:
    """Register sharded versions of the Swin blocks whose modules are loaded (see ``convert``)."""
    import sys

    from ..registry import register, registered

    for mod_name, name in _TARGETS:
        mod = sys.modules.get(mod_name)
        cls = getattr(mod, name, None) if mod else None
        if isinstance(cls, type) and issubclass(cls, nn.Module) and registered(cls) is None:
            sharded = type(f"Sharded{name}", (ShardedSwinBlockMixin, cls), {"__module__": __name__})
            register(cls)(sharded)
    from . import swin_monai, swin_torchvision

    swin_monai.register_loaded()
    swin_torchvision.register_loaded()
