"""torchvision's Swin Transformers (``swin_t/s/b``, ``swin_v2_*``) on a sharded image.

torchvision computes a block's shifted-window attention in one function
(``shifted_window_attention``): it pads the slab to whole windows, rolls it, partitions windows,
builds the shift mask and adds it to the attention logits, all from the local sizes. Its
attention modules (``ShiftedWindowAttention``, ``ShiftedWindowAttentionV2``) are registered here
and do the parts that see other ranks themselves, then call torchvision's own function on the
slab with no shift of its own:

1. pad at the image's end only (the last rank along each sharded dim) and clip the shift where
   the window covers the padded image, both on the global sizes, as torchvision does;
2. roll the padded slab over the ranks (``swin.roll_slab``: periodic shifts on sharded dims);
3. this rank's windows of the shift mask (``swin.local_shift_mask`` over the mask torchvision
   builds: the same region slices), added to the relative position bias per window and batch
   entry, which torchvision's function adds to the logits (``attn + relative_position_bias``);
   masked logits differ from torchvision's by the rounding of ``bias + (-100)``, a weight of
   ``e**-100`` after the softmax;
4. ``shifted_window_attention(..., shift_size=[0, 0])`` on the slab beside the forward guard
   (its dropout from this rank's own stream in training), then the roll back and the crop.

Sharding contract:
    input: ``(B, H, W, C)`` tokens, H sharded (a mesh with one domain axis) or H and W (two);
    every slab starts on a window boundary (``snn.alignment(model, input_shape=...)``). Output:
    the same layout. forward: two periodic shifts per sharded dim for a shifted block.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..errors import ShardingError
from ..mesh import domain_axes
from .squeeze_excite import GuardedAsIs
from .swin import attend_windows, local_shift_mask, roll_slab, window_starts

__all__ = ["ShardedTvWindowAttentionMixin", "register_loaded"]

_MODULE = "torchvision.models.swin_transformer"


def _shift_mask(sizes, ws, ss, like: torch.Tensor) -> torch.Tensor:
    """The ``(windows, N, N)`` shift mask of a padded grid of ``sizes``, with torchvision's region slices."""
    regions = like.new_zeros(tuple(sizes))
    count = 0
    for h in ((0, -ws[0]), (-ws[0], -ss[0]), (-ss[0], None)):
        for w in ((0, -ws[1]), (-ws[1], -ss[1]), (-ss[1], None)):
            regions[h[0] : h[1], w[0] : w[1]] = count
            count += 1
    nh, nw = sizes[0] // ws[0], sizes[1] // ws[1]
    regions = regions.view(nh, ws[0], nw, ws[1]).permute(0, 2, 1, 3).reshape(nh * nw, ws[0] * ws[1])
    mask = regions.unsqueeze(1) - regions.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


class ShardedTvWindowAttentionMixin(GuardedAsIs):
    """torchvision ``ShiftedWindowAttention(V2)``: the shift, padding and mask over the sharded image."""

    #: For ``snn.alignment``: windows along the tokens' dims 1 and 2 must not span two slabs.
    alignment_dims = (1, 2)

    @property
    def alignment_multiple(self) -> tuple[int, int]:
        return tuple(self.window_size)

    def sharding_repr(self) -> str:
        return f"shifted windows over the domain axes {domain_axes(self.mesh)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        from ..forward_guard import keep_layout

        if x.is_meta:  # the shape-only probe of ``snn.alignment``
            return super().forward(x)
        return keep_layout(x, self._sharded(x))

    def _sharded(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if x.dim() != 4:
            raise ShardingError(f"{name}: expected (B, H, W, C) tokens, got shape {tuple(x.shape)}.")
        ws = tuple(self.window_size)
        dims = tuple(range(1, 1 + len(domain_axes(self.mesh))))
        slab = window_starts(x, self.mesh, dims, ws, name)
        b, h, w, _ = x.shape
        # torchvision pads to whole windows, then drops the shift where a window covers the
        # padded image: both decided on the global sizes.
        end = slab.end_pads(ws)
        ss = [0 if k >= g + p else s for k, g, p, s in zip(ws, slab.sizes, end, self.shift_size)]
        pads = slab.my_pads(ws)
        y = F.pad(x, (0, 0, 0, pads[1], 0, pads[0]))
        bias = self.get_relative_position_bias()
        if any(ss):
            y = roll_slab(y, [-s for s in ss], self.mesh, slab, name, pads=end)
            mask = local_shift_mask(lambda s: _shift_mask(s, ws, ss, y), y.shape[1:3], ws, slab.last)
            # torchvision adds one bias to every window, then the mask per window: one bias per
            # (batch entry, window) here, in its window order (batch-major).
            bias = (bias + mask.unsqueeze(1).to(bias.dtype)).repeat(b, 1, 1, 1)
        fn = sys.modules[_MODULE].shifted_window_attention

        def attention(t, mask=None):  # torchvision's own function, with no shift of its own
            return fn(
                t, self.qkv.weight, self.proj.weight, bias, list(ws), self.num_heads, shift_size=[0, 0],
                attention_dropout=self.attention_dropout, dropout=self.dropout, qkv_bias=self.qkv.bias,
                proj_bias=self.proj.bias, logit_scale=getattr(self, "logit_scale", None), training=self.training,
            )  # fmt: skip

        draws = self.training and (self.attention_dropout > 0 or self.dropout > 0)
        out = attend_windows(attention, y, None, draws=draws)
        if any(ss):
            out = roll_slab(out, ss, self.mesh, slab, name, pads=end)
        return out[:, :h, :w].contiguous()


def register_loaded() -> None:
    """Register the sharded torchvision window attentions when torchvision's Swin module is loaded."""
    from ..registry import register, registered

    mod = sys.modules.get(_MODULE)
    for name in ("ShiftedWindowAttention", "ShiftedWindowAttentionV2") if mod else ():
        cls = getattr(mod, name, None)
        if isinstance(cls, type) and registered(cls) is None:
            register(cls)(type(f"Sharded{name}", (ShardedTvWindowAttentionMixin, cls), {"__module__": __name__}))
