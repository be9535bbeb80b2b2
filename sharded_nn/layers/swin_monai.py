"""MONAI's Swin stages (``SwinUNETR``'s encoder, 2-D and 3-D) on a sharded volume.

MONAI builds its shifted-window attention in two places: the stage (``BasicLayer``) clips the
window to the volume (``get_window_size``), computes the shift mask of the padded volume
(``compute_mask``) and moves channels last; each block (``SwinTransformerBlock.forward_part1``)
pads the volume to whole windows, rolls it, attends within windows and rolls back. Every one of
those steps reads the local sizes on a slab, so both classes are registered here (``convert``
swaps them) and keep MONAI's own code for everything else:

- the stage agrees on the global sizes once, clips the window with MONAI's ``get_window_size`` on
  them, builds the mask of this rank's windows only (``swin.local_shift_mask`` over MONAI's
  ``compute_mask``), and runs MONAI's blocks and patch merging on the channels-last slab under
  the forward guard (drop-path decisions alike on every rank; the merging's ``x[:, 0::2]``
  phases are exact because slabs start on even rows);
- the block's ``forward_part1`` pads at the volume's end only (the last rank along each sharded
  dim), rolls the padded volume with periodic shifts over the ranks (MONAI pads first, then
  rolls: the roll is over the padded extent, as on one device), and runs MONAI's
  ``window_partition``, ``WindowAttention`` and ``window_reverse`` on the slab.

Sharding contract:
    stage input: ``(B, C, D, H, W)`` or ``(B, C, H, W)`` sharded along the model's sharded spatial
    dims (``(2,)``, or ``(2, 3)`` on a mesh with two domain axes); every slab starts on a multiple
    of the stage's window (and of 2 where the stage merges patches): ``snn.alignment(model,
    input_shape=...)`` gives the alignment at the model's input. Output: the same dims, sharded.
    forward: one agreement of the layouts per stage (scoped), two periodic shifts per shifted
    block along each sharded dim; backward: their adjoints.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ShardingError, ShardingNotImplementedError
from ..mesh import domain_axes
from .squeeze_excite import GuardedAsIs
from .swin import attend_windows, check_windows, local_shift_mask, roll_slab, window_starts

__all__ = ["ShardedMonaiSwinBlockMixin", "ShardedMonaiSwinStageMixin", "register_loaded"]

_MODULE = "monai.networks.nets.swin_unetr"


def _monai():
    import sys

    return sys.modules[_MODULE]


def _token_dims(mesh) -> tuple[int, ...]:
    """Channels-last token dims sharded by the domain axes: the image's (2, 3) become (1, 2)."""
    return tuple(range(1, 1 + len(domain_axes(mesh))))


class ShardedMonaiSwinStageMixin(GuardedAsIs):
    """MONAI ``BasicLayer``: the window clipped on the global volume, this rank's windows of the mask."""

    @property
    def alignment_multiple(self) -> tuple[int, ...]:
        # Windows must not span two slabs; patch merging halves the grid after the blocks.
        merge = 2 if self.downsample is not None else 1
        return tuple(math.lcm(int(w), merge) for w in self.window_size)

    @classmethod
    def from_module(cls, module, mesh, **options):  # noqa: D102
        if getattr(module, "use_hyena", False):
            raise ShardingNotImplementedError(
                f"{cls.__name__}: Hyena stages (use_hyena=True) have no sharded version (their long convolutions run "
                "FFTs over the whole volume). Build the model without Hyena stages."
            )
        new = super().from_module(module, mesh, **options)
        # The stage's children stay as they are (patch merging runs under the guard) but its
        # blocks, whose window attention reads local sizes: the sharded block, same parameters.
        from ..registry import registered

        new.blocks = type(module.blocks)(
            [registered(type(b)).from_module(b, mesh) if registered(type(b)) else b for b in module.blocks]
        )
        return new

    def sharding_repr(self) -> str:
        return "shifted windows over the domain ranks; blocks and patch merging under the forward guard"

    def forward(self, x):  # noqa: D102
        from ..forward_guard import keep_layout, mark_layout

        if x.is_meta:  # the shape-only probe of ``snn.alignment``: MONAI's own stage
            return super().forward(x)
        name = type(self).__name__
        if x.dim() not in (4, 5):
            raise ShardingError(f"{name}: expected a (B, C, H, W) or (B, C, D, H, W) input, got {tuple(x.shape)}.")
        m = _monai()
        dims = _token_dims(self.mesh)
        t = mark_layout(x.movedim(1, -1), dims)  # b c d h w -> b d h w c, as MONAI's rearrange
        slab = window_starts(t, self.mesh, dims, None, name)
        ws, ss = m.get_window_size(slab.sizes, self.window_size, self.shift_size)
        check_windows(slab, ws, name)  # the window is known only now: clipped on the global sizes
        mask = None
        if any(ss):
            padded = [n + p for n, p in zip(t.shape[1:-1], slab.my_pads(ws))]
            mask = local_shift_mask(lambda s: m.compute_mask(s, ws, ss, t.device), padded, ws, slab.last)
        for blk in self.blocks:
            t = blk(t, mask)
        if self.downsample is not None:
            t = self.downsample(t)
        return keep_layout(x, t.movedim(-1, 1))


class ShardedMonaiSwinBlockMixin(GuardedAsIs):
    """MONAI ``SwinTransformerBlock``: ``forward_part1`` (window attention) over the sharded volume."""

    def sharding_repr(self) -> str:
        return "shifted windows over the domain ranks; MLP and norms under the forward guard"

    def forward_part1(self, x, mask_matrix):  # noqa: D102
        from ..forward_guard import keep_layout

        if x.is_meta:
            return super().forward_part1(x, mask_matrix)
        return keep_layout(x, self._shifted_window_attention(x, mask_matrix))

    def _shifted_window_attention(self, x, mask_matrix):
        m = _monai()
        name = type(self).__name__
        dims = _token_dims(self.mesh)
        slab = window_starts(x, self.mesh, dims, None, name)
        ws, ss = m.get_window_size(slab.sizes, self.window_size, self.shift_size)
        check_windows(slab, ws, name)
        local = x.shape[1:-1]
        c = x.shape[-1]
        y = self.norm1(x)
        # MONAI pads to whole windows first (at the volume's end: only the rank holding it), then
        # rolls the padded volume.
        flat = [0, 0]
        for p in reversed(slab.my_pads(ws)):
            flat += [0, p]
        y = F.pad(y, flat)
        grid = [y.shape[0], *y.shape[1:-1]]
        shifted = any(ss)
        end = slab.end_pads(ws)
        if shifted:
            y = roll_slab(y, [-s for s in ss], self.mesh, slab, name, pads=end)
        windows = attend_windows(self.attn, m.window_partition(y, ws), mask_matrix if shifted else None)
        y = m.window_reverse(windows.view(-1, *(tuple(ws) + (c,))), ws, grid)
        if shifted:
            y = roll_slab(y, ss, self.mesh, slab, name, pads=end)
        crop = (slice(None), *(slice(0, n) for n in local))
        return y[crop].contiguous()


def register_loaded() -> None:
    """Register the sharded MONAI Swin stage and block when MONAI's module is loaded (see ``convert``)."""
    import sys

    from ..registry import register, registered

    mod = sys.modules.get(_MODULE)
    if mod is None:
        return
    for name, mixin in (("BasicLayer", ShardedMonaiSwinStageMixin), ("SwinTransformerBlock", ShardedMonaiSwinBlockMixin)):
        cls = getattr(mod, name, None)
        if isinstance(cls, type) and registered(cls) is None:
            register(cls)(type(f"ShardedMonai{name}", (mixin, cls), {"__module__": __name__}))
