"""Sharded max unpooling: ``ShardedMaxUnpool1d/2d/3d``.

``ShardedMaxUnpool*``: the adjoint layout of a max pool: rank r's output slab starts at
``stride * (input start)``; values whose global index lies in a neighbour's slab are sent there
(``comm.halo_add``). Indices must be global, as ``ShardedMaxPool*(return_indices=True)`` gives.
The halos are sized by how far the indices actually reach beyond each rank's output slab (a
gathered fact), so indices of dilated pools are exact, and indices outside the output raise on
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.utils import _ntuple

from ..comm import HaloSpec, axis_peers, halo_add, halo_cat
from ..errors import ShardingError
from ..layout import Layout
from ..registry import register
from .base import ShardedMixin, backward_communicates, batched, gather_facts, size_fact


def _unpool_cores(layout: Layout, dim: int, s: int, total: int, what: str) -> tuple[int, ...]:
    """Output positions each rank owns along ``dim``: ``[a*s, b*s)``, the last up to ``total``."""
    core = [n * s for n in layout.sizes[:-1]]
    core.append(total - layout.starts[-1] * s)
    if min(core) < 1:
        raise ShardingError(
            f"{what}: input slabs {layout.sizes} along dim {dim} leave the last rank no output of the "
            f"{total} positions. Use fewer ranks or a larger input."
        )
    return tuple(core)


class _Unpool(torch.autograd.Function):
    """Scatter values to global positions (set, as torch), reducing neighbours' strips."""

    @staticmethod
    def forward(ctx, vals, flat_idx, buf_shape, specs, rings):  # noqa: D102
        n, c = vals.shape[:2]
        buf = vals.new_zeros(n, c, math.prod(buf_shape))
        hits = vals.new_zeros(n, c, math.prod(buf_shape))
        buf.scatter_(2, flat_idx.view(n, c, -1), vals.reshape(n, c, -1))
        hits.scatter_(2, flat_idx.view(n, c, -1), 1.0)
        buf, hits = buf.view(n, c, *buf_shape), hits.view(n, c, *buf_shape)
        with torch.no_grad():
            for spec, ring in zip(specs, rings):
                if ring.size > 1:
                    buf, hits = halo_add(buf, spec, ring), halo_add(hits, spec, ring)
        # A position written by several ranks (overlapping windows) got the same max value from each.
        out = torch.where(hits > 1, buf / hits.clamp(min=1), buf)
        ctx.save_for_backward(flat_idx)
        ctx.specs, ctx.rings, ctx.shape = specs, rings, vals.shape
        return out

    @staticmethod
    @backward_communicates
    def backward(ctx, g):  # noqa: D102
        (flat_idx,) = ctx.saved_tensors
        with torch.no_grad():
            for spec, ring in reversed(list(zip(ctx.specs, ctx.rings))):
                if ring.size > 1:
                    g = halo_cat(g.contiguous(), spec, ring)
        n, c = ctx.shape[:2]
        return g.reshape(n, c, -1).gather(2, flat_idx.view(n, c, -1)).view(ctx.shape), None, None, None, None


class _ShardedMaxUnpoolNd(ShardedMixin):
    """Shared forward of the sharded max unpooling layers (mixed into the torch classes)."""

    @batched
    def forward(self, x: torch.Tensor, indices: torch.Tensor, output_size: Sequence[int] | None = None):  # noqa: D102
        n = self._spatial_dims
        name = type(self).__name__
        ok = indices.shape == x.shape and indices.dtype == torch.int64
        agreed = self._agree(x, same={"output_size": size_fact(output_size, n)}, local=(int(ok),))
        bad = agreed.ranks_where(lambda f: not f[0])
        if bad:
            raise ValueError(
                f"{name}: indices must be an int64 tensor of the input's shape (as ShardedMaxPool*(return_indices="
                f"True) returns), but domain ranks {bad} pass another dtype or shape."
            )
        layouts = agreed.layouts
        nt = _ntuple(n)
        k, s, p = nt(self.kernel_size), nt(self.stride), nt(self.padding)
        in_sizes = agreed.global_shape(self.dims)[2:]
        default = [(L - 1) * s_ - 2 * p_ + k_ for L, k_, s_, p_ in zip(in_sizes, k, s, p)]
        if output_size is None:
            total = default
        else:
            if len(output_size) not in (n, n + 2):
                raise ValueError(f"{name}: output_size must have {n} or {n + 2} entries, got {tuple(output_size)}.")
            total = [int(t) for t in list(output_size)[-n:]]
            if any(not dflt - s_ < t < dflt + s_ for t, dflt, s_ in zip(total, default, s)):
                raise ValueError(f"{name}: output_size {tuple(total)} must be within a stride of {tuple(default)}.")
        cores = [_unpool_cores(lay, d, s[d - 2], total[d - 2], name) for lay, d in zip(layouts, self.dims)]
        rings = [axis_peers(self.mesh, axis) for axis in self.mesh_axes]
        starts = [lay.starts[ring.index] * s[d - 2] for lay, ring, d in zip(layouts, rings, self.dims)]
        # Global flat index -> coordinates.
        rest, coords = indices, []
        for size in reversed(total):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        # How far this rank's indices reach beyond its own output slab along each sharded dim:
        # that, not the kernel, sizes the halos (a dilated pool reaches further than its kernel),
        # and it is gathered, so that every rank plans the same halos and validates the indices
        # alike (an index outside the output raises everywhere, not in one rank's scatter).
        valid = indices.numel() == 0 or bool(((indices >= 0) & (indices < math.prod(total))).all())
        reach_left, reach_right = [], []
        for a, core, d in zip(starts, [c[ring.index] for c, ring in zip(cores, rings)], self.dims):
            c = coords[d - 2]
            lo, hi = (int(c.min()), int(c.max())) if valid and c.numel() else (a, a)
            reach_left.append(max(a - lo, 0))
            reach_right.append(max(hi + 1 - (a + core), 0))
        my_coords = [ring.index for ring in rings]
        rows = gather_facts(self.mesh, name, local=(int(valid), *my_coords, *reach_left, *reach_right))
        bad = [r for r, row in enumerate(rows) if not row[0]]
        if bad:
            raise ValueError(
                f"{name}: indices must lie in [0, {math.prod(total)}) (the flattened output {tuple(total)}); "
                f"domain ranks {bad} pass indices outside it."
            )
        m = len(self.dims)
        lo, hi = [0] * n, list(total)
        specs = []
        for j, (layout, core, d, ring) in enumerate(zip(layouts, cores, self.dims, rings)):
            parts = layout.parts
            # Rank c's strip widths: the widest reach of the ranks at coordinate c of this axis.
            left = [max((r[1 + m + j] for r in rows if r[1 + j] == c), default=0) for c in range(parts)]
            right = [max((r[1 + 2 * m + j] for r in rows if r[1 + j] == c), default=0) for c in range(parts)]
            spec = HaloSpec(d, tuple(left), tuple(right))
            spec.check(core, name)
            specs.append(spec)
            lo[d - 2] = starts[j] - left[ring.index]
            hi[d - 2] = starts[j] + core[ring.index] + right[ring.index]
        buf_shape = [b - a for a, b in zip(lo, hi)]
        local = torch.zeros_like(indices)
        for cd, a, size in zip(coords, lo, buf_shape):
            local = local * size + (cd - a)
        return _Unpool.apply(x, local, tuple(buf_shape), tuple(specs), tuple(rings))


@register(nn.MaxUnpool1d)
class ShardedMaxUnpool1d(_ShardedMaxUnpoolNd, nn.MaxUnpool1d):
    """``nn.MaxUnpool1d`` taking the global indices of ``ShardedMaxPool*(return_indices=True)``; sharded output."""

    _spatial_dims = 1


@register(nn.MaxUnpool2d)
class ShardedMaxUnpool2d(_ShardedMaxUnpoolNd, nn.MaxUnpool2d):
    """``nn.MaxUnpool2d`` taking the global indices of ``ShardedMaxPool*(return_indices=True)``; sharded output."""

    _spatial_dims = 2


@register(nn.MaxUnpool3d)
class ShardedMaxUnpool3d(_ShardedMaxUnpoolNd, nn.MaxUnpool3d):
    """``nn.MaxUnpool3d`` taking the global indices of ``ShardedMaxPool*(return_indices=True)``; sharded output."""

    _spatial_dims = 3


__all__ = ["ShardedMaxUnpool1d", "ShardedMaxUnpool2d", "ShardedMaxUnpool3d"]
