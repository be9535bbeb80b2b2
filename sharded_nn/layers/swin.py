"""Shifted-window attention (timm's Swin Transformer V1 and V2 blocks) on a sharded image.

A Swin block attends within windows of ``ws`` tokens along each image dim; every other block
first rolls the token grid by ``-shift`` (cyclically, over the whole image), masks the windows
that the roll wrapped around, and rolls back afterwards. On a slab that whole-image roll and the
mask are the only parts that see other ranks' tokens: once every slab starts on a window
boundary, each window lies on one rank, so the attention itself is local.

The sharded block keeps timm's own ``forward`` (norms, MLP, drop-path, residuals; timm's code
runs under the forward guard, which keeps drop-path decisions identical on every rank) and
replaces ``_attn``, the shifted-window attention, with:

1. the roll along each sharded dim as a periodic shift over the ranks (``comm.periodic_shift``:
   each rank sends its first ``shift`` rows to its left neighbour, the first rank to the last);
   unsharded dims roll locally;
2. the padding to whole windows at the image's end only (the last rank along a sharded dim);
3. window partition, timm's ``WindowAttention`` (relative position bias, V2's cosine attention
   and continuous position bias alike) and window reverse on the slab;
4. the shift mask: timm's mask of the whole padded image (its ``attn_mask`` buffer, or
   ``get_attn_mask`` at the global size for ``dynamic_mask`` blocks), this rank's windows taken
   out of it by their global window row and column;
5. the crop and the roll back.

Sharding contract:
    input: ``(B, H, W, C)`` tokens (timm's NHWC Swin layout), H sharded by a mesh with one
    domain axis (the image's ``dims=(2,)`` after the patch embedding's permute; meshes with two
    domain axes are refused at ``convert``: timm's block flattens H and W into one token dim
    around its MLP, which the forward guard cannot follow when both are sharded). Every slab starts on a window boundary: ``starts % window == 0``, so every slab but
    the last spans whole windows (the last may end in a partial window, padded as timm pads the
    image). Shard the image with ``align = patch * 2**stage * window`` for the deepest stage
    whose windows are smaller than its grid, or ``snn.alignment(model)``.
    output: the same layout. forward: two periodic shifts along H for a shifted block (there and
    back), none for a plain one, plus the layouts' agreement; backward: the shifts' adjoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import gather_layouts
from ..comm.shift import periodic_shift
from ..errors import ShardingError, ShardingNotImplementedError
from ..mesh import axis_index, domain_axes
from .squeeze_excite import GuardedAsIs

__all__ = ["ShardedSwinBlockMixin", "register_loaded"]


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
        """A copy of ``module`` (same parameters) whose children stay unconverted; 1-D domain meshes only."""
        axes = domain_axes(mesh)
        if len(axes) != 1:
            raise ShardingNotImplementedError(
                f"{cls.__name__}: Swin blocks are sharded along H only (a mesh with one domain axis), got domain "
                f"axes {axes}. timm's block flattens H and W into one token dim around its MLP, a layout the forward "
                "guard cannot follow when both are sharded. Use snn.init_mesh(domain=P) and shard the image's H."
            )
        return super().from_module(module, mesh, **options)

    def sharding_repr(self) -> str:
        return f"shifted windows over the domain axes {domain_axes(self.mesh)}; MLP and norms under the forward guard"

    def _check(self, layouts, dims, ws) -> None:
        name = type(self).__name__
        for lay, d, w in zip(layouts, dims, ws):
            lay.require_nonempty(f"{name} along dim {d}")
            if any(s % w for s in lay.starts):
                raise ShardingError(
                    f"{name}: along token dim {d} the slabs {lay.sizes} (starting at {lay.starts}) must start on "
                    f"window boundaries of {w} tokens, so that no window spans two ranks. Shard the image with "
                    f"align = patch size x 2**stage x {w} (snn.alignment(model) computes it) on an image whose "
                    "size is a multiple of it."
                )

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        from ..forward_guard import keep_layout

        if x.is_meta:  # the shape-only probe of ``snn.alignment``: timm's own attention
            return super()._attn(x)
        return keep_layout(x, self._shifted_window_attention(x))

    def _shifted_window_attention(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.mesh
        axes = domain_axes(mesh)
        dims = (1,) if len(axes) == 1 else (1, 2)
        name = type(self).__name__
        if x.dim() != 4:
            raise ShardingError(f"{name}: expected (B, H, W, C) tokens, got shape {tuple(x.shape)}.")
        ws = tuple(self.window_size)
        shift = tuple(self.shift_size)
        layouts = gather_layouts(x.shape, mesh, dims, what=name, scoped=True)
        self._check(layouts, dims, tuple(ws[d - 1] for d in dims))
        b, h, w, c = x.shape
        glob = [h, w]
        first = [0, 0]
        last = [True, True]
        for lay, d, a in zip(layouts, dims, axes):
            i = axis_index(mesh, a)
            glob[d - 1] = lay.size
            first[d - 1] = lay.starts[i]
            last[d - 1] = i == len(lay.sizes) - 1
        has_shift = any(shift)
        y = x
        if has_shift:
            local = [(-shift[k], k + 1) for k in range(2) if shift[k] and (k + 1) not in dims]
            for k in range(2):
                if shift[k] and (k + 1) in dims:
                    y = periodic_shift(y, -shift[k], k + 1, mesh, dims, what=name)
            if local:
                y = torch.roll(y, [s for s, _ in local], [d for _, d in local])
        # Pad to whole windows at the image's end: only the rank holding it pads.
        pads = [(ws[k] - glob[k] % ws[k]) % ws[k] if last[k] else 0 for k in range(2)]
        y = F.pad(y, (0, 0, 0, pads[1], 0, pads[0]))
        hp, wp = y.shape[1], y.shape[2]
        nh, nw = hp // ws[0], wp // ws[1]
        win = y.view(b, nh, ws[0], nw, ws[1], c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws[0] * ws[1], c)
        out = self.attn(win, mask=self._local_mask(y, glob, first, (nh, nw), ws) if has_shift else None)
        out = out.view(b, nh, nw, ws[0], ws[1], c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        out = out[:, :h, :w, :].contiguous()
        if has_shift:
            local = [(shift[k], k + 1) for k in range(2) if shift[k] and (k + 1) not in dims]
            for k in range(2):
                if shift[k] and (k + 1) in dims:
                    out = periodic_shift(out, shift[k], k + 1, mesh, dims, what=name)
            if local:
                out = torch.roll(out, [s for s, _ in local], [d for _, d in local])
        return out

    def _local_mask(self, y, glob, first, n_local, ws) -> torch.Tensor:
        """This rank's windows of timm's shift mask of the whole padded image."""
        gh = -(-glob[0] // ws[0]) * ws[0]
        gw = -(-glob[1] // ws[1]) * ws[1]
        if getattr(self, "dynamic_mask", False) or self.attn_mask is None:
            mask = self.get_attn_mask(y.new_empty((1, gh, gw, 1)))
        else:
            mask = self.attn_mask
        gnh, gnw = gh // ws[0], gw // ws[1]
        if mask.shape[0] != gnh * gnw:
            raise ShardingError(
                f"{type(self).__name__}: the block's shift mask holds {mask.shape[0]} windows, the image has "
                f"{gnh} x {gnw}: build the model for this image size (img_size=...), or with strict_img_size=False."
            )
        r0, c0 = first[0] // ws[0], first[1] // ws[1]
        mask = mask.view(gnh, gnw, *mask.shape[1:])[r0 : r0 + n_local[0], c0 : c0 + n_local[1]]
        return mask.reshape(-1, *mask.shape[2:])


_TARGETS = (
    ("timm.models.swin_transformer", "SwinTransformerBlock"),
    ("timm.models.swin_transformer_v2", "SwinTransformerV2Block"),
)


def register_loaded() -> None:
    """Register sharded versions of the Swin blocks whose timm modules are loaded (see ``convert``)."""
    import sys

    import torch.nn as nn

    from ..registry import register, registered

    for mod_name, name in _TARGETS:
        mod = sys.modules.get(mod_name)
        cls = getattr(mod, name, None) if mod else None
        if isinstance(cls, type) and issubclass(cls, nn.Module) and registered(cls) is None:
            sharded = type(f"Sharded{name}", (ShardedSwinBlockMixin, cls), {"__module__": __name__})
            register(cls)(sharded)
