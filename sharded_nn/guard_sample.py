"""``F.grid_sample`` inside a converted model's forward: sampling a slab at given positions.

A spatial transformer written for one device (VoxelMorph's registration warp, a flow warp, a
regridding) samples its input at positions a grid names in the whole sample's normalised
coordinates (-1 and 1 the first and last positions). On a slab the local call reads those
coordinates against the slab's own extent and samples the wrong rows, silently. The guard
routes the call: every rank works out, from its grid, the block of whole-sample rows along the
sharded dim that its samples touch (their bilinear, nearest or bicubic taps; clipped to the
sample), the ranks agree on every block (one small all-gather of two numbers), each rank fetches
its block from whichever ranks own it (``comm.halo_gather``: point-to-point, the gradient returns
to the owners), and samples the block with the sharded coordinate mapped onto it (an affine map
of the grid, so the grid's gradient is the single device's). The output is laid out as the grid:
a slab along the grid's sharded dims, or replicated for a plain grid.

Exact where every tap the single device reads lies in the block, which it does by construction,
with ``padding_mode="zeros"`` or ``"border"`` (out-of-range taps exist only at the sample's own
edges, where the block ends too). Refused alike on every rank: ``"reflection"`` padding (it
reflects about the whole sample's edges), an input sharded along more than one dim (a multi-axis
mesh) or along its batch or channel dim, a grid sharded along its coordinates. ``nearest`` picks
the single device's row except where a coordinate lies within rounding of a half-way point (the
affine map moves it by an ulp).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import forward_guard as fg
from .comm import axis_peers
from .comm.halo import HaloGather, halo_gather

__all__ = ["SampleCalls"]

#: Taps below and above ``floor(position)`` that each mode reads along a dim.
_TAPS = {"bilinear": (0, 1), "nearest": (0, 1), "bicubic": (1, 2)}


class SampleCalls:
    """The forward guard's ``grid_sample`` handler (mixed into ``_GuardMode``)."""

    def _h_grid_sample(self, func, base, args, kwargs, stateful):
        x = fg._arg(args, kwargs, 0, "input")
        grid = fg._arg(args, kwargs, 1, "grid")
        mode = fg._arg(args, kwargs, 2, "mode", "bilinear")
        padding = fg._arg(args, kwargs, 3, "padding_mode", "zeros")
        align = bool(fg._arg(args, kwargs, 4, "align_corners", None))
        xst, gst = self._st(x), self._st(grid)
        out_state = self._sampled_layout(grid, gst)
        if xst is None:  # a plain input at this rank's points of the grid: local
            out = func(*args, **kwargs)
            self._set(out, out_state)
            return out
        sharded = [(k, d) for k, d in enumerate(xst) if d is not None] if type(xst) is tuple else None
        why = None
        if sharded is None:
            why = f"its input is sharded along {self.describe(xst)}"
        elif any(d < 2 for _, d in sharded):
            why = "its input is sharded along its batch or channel dim"
        elif len(sharded) > 1:
            why = "its input is sharded along more than one dim (a multi-axis mesh)"
        elif padding not in ("zeros", "border"):
            why = f"padding_mode={padding!r} reflects about the whole sample's edges"
        elif mode not in _TAPS:
            why = f"mode={mode!r}"
        if why:
            self.fail("`grid_sample`", why, "sample on one axis of the mesh with zeros or border padding")
        ((k, d),) = sharded
        self._routing("`grid_sample`")
        nsp = x.dim() - 2
        comp = nsp - 1 - (d - 2)  # the grid's coordinate of dim d (x, y, z: the last spatial dim first)
        (lens,) = self._lengths([(k, int(x.shape[d]))], "forward guard: `grid_sample` (slab lengths)")
        total = sum(lens)
        lo, hi = self._rows_touched(grid[..., comp].detach(), total, align, mode)
        blocks = [(int(a), int(b)) for a, b in self._along_axis(
            self._gather_with_coords([lo, hi], "forward guard: `grid_sample` (rows each rank samples)"), k)]
        block = halo_gather(x, HaloGather.of_blocks(d, lens, blocks), axis_peers(self.guard.mesh, self.guard.axes[k]))
        n = hi - lo + 1
        # The coordinate on the block: the same position, normalised by the block's extent (the
        # whole dim: the grid as it is, bitwise one device's call).
        c = grid[..., comp]
        if n == total:
            local = c
        elif align:
            local = (c + 1) * ((total - 1) / (n - 1)) - (1 + 2 * lo / (n - 1))
        else:
            local = (c + 1) * (total / n) - (1 + 2 * lo / n)
        parts = list(grid.unbind(-1))
        parts[comp] = local
        out = F.grid_sample(block, torch.stack(parts, -1), mode=mode, padding_mode=padding, align_corners=align)
        self._set(out, out_state)
        return out

    def _sampled_layout(self, grid, gst):
        """The output's layout: the grid's points (dims 1.. of the grid are dims 2.. of the output)."""
        if gst is None:
            return None
        if type(gst) is not tuple or grid.dim() - 1 in gst or 0 in gst:
            self.fail("`grid_sample`", f"its grid is sharded along {self.describe(gst)}, not along its points",
                      "shard the grid along its spatial dims, as the input")
        return tuple(None if g is None else g + 1 for g in gst)

    @staticmethod
    def _rows_touched(c: torch.Tensor, total: int, align: bool, mode: str) -> tuple[int, int]:
        """The whole-sample rows ``[lo, hi]`` that the taps of coordinates ``c`` read (at least
        two rows where the sample has them, so that the block's normalisation is defined)."""
        pix = (c + 1) / 2 * (total - 1) if align else ((c + 1) * total - 1) / 2
        pix = pix[torch.isfinite(pix)]
        below, above = _TAPS[mode]
        if pix.numel():
            lo = math.floor(max(float(pix.min()), -2.0)) - below
            hi = math.floor(min(float(pix.max()), total + 1.0)) + above
        else:
            lo = hi = 0
        lo, hi = min(max(lo, 0), total - 1), min(max(hi, 0), total - 1)
        if hi == lo and total > 1:
            hi, lo = (hi + 1, lo) if hi + 1 < total else (hi, lo - 1)
        return lo, hi
