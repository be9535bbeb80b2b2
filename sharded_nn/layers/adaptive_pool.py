"""Sharded adaptive pooling: ``ShardedAdaptiveAvgPool1d/2d/3d``, ``ShardedAdaptiveMaxPool1d/2d/3d``.

``ShardedAdaptiveAvgPool*`` / ``ShardedAdaptiveMaxPool*``: an output size of 1 along a sharded
dim is a global reduction over that mesh axis (an all-reduce of local sums, or of local maxima
with the gradient routed to the rank that holds the maximum; the output is then replicated along
that axis). Other output sizes are exact: bin ``i`` (``[floor(i*L/O), ceil((i+1)*L/O))``)
belongs to the rank whose slab holds its start, and the few positions a bin reads from the right
neighbour arrive by a halo exchange (from ranks further right where the neighbour's slab is
thin or empty, point to point); a rank whose slab holds no bin start (more ranks than output
positions, an empty slab) holds an empty slab of the output. Unsharded dims are pooled locally.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.utils import _ntuple

from ..comm import HaloGather, HaloSpec, all_reduce_max, all_reduce_sum, axis_peers, halo_cat, halo_gather
from ..comm.sizes import scope_forget
from ..errors import ShardingNotImplementedError
from ..layout import Layout
from ..registry import register
from .base import ShardedMixin, batched

_AMAX_FN = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
_AAVG_FN = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16 (sums of half values round), else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _bins(length: int, out: int) -> list[tuple[int, int]]:
    """torch's adaptive bins: ``[floor(i*L/O), ceil((i+1)*L/O))``."""
    return [(i * length // out, -(-(i + 1) * length // out)) for i in range(out)]


class _ShardedAdaptivePoolNd(ShardedMixin):
    """Shared forward of the sharded adaptive pools (mixed into the torch classes)."""

    _is_max = False
    #: An empty slab (a deep stage on many ranks) takes part: in a global pool (output size 1)
    #: with the sum's zeros or the maximum's identity, in binned ones as a rank without a bin.
    _allow_empty = True

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)
        if getattr(self, "return_indices", False):
            raise ShardingNotImplementedError(
                f"{type(self).__name__}: return_indices=True is not supported for sharded adaptive max "
                "pooling; use return_indices=False (or ShardedMaxPool with return_indices)."
            )

    @batched
    def forward(self, x: torch.Tensor):  # noqa: D102
        n = self._spatial_dims
        # Answered by a layout scope where it can (the input is an ordinary slab), but the output
        # (replicated, or new bins) is not declared: later layers agree again.
        layouts = self._agree(x, scoped=True).layouts
        scope_forget()
        # Averages of fp16/bf16 inputs are summed in float32 (as torch's adaptive average
        # accumulates) and rounded to the input dtype once, after every dim is pooled.
        in_dtype = x.dtype
        out_sizes = list(_ntuple(n)(self.output_size))
        for lay, d, axis in zip(layouts, self.dims, self.mesh_axes):
            o = out_sizes[d - 2] if out_sizes[d - 2] is not None else lay.size
            ring = axis_peers(self.mesh, axis)
            x = self._global(x, d, ring, lay.size) if o == 1 else self._binned(x, d, ring, lay, o)
            out_sizes[d - 2] = x.shape[d]  # already pooled: identity bins for the local pool below
        out_sizes = [x.shape[2 + i] if o is None else o for i, o in enumerate(out_sizes)]
        if tuple(out_sizes) != tuple(x.shape[2:]):
            if x.numel():
                x = (_AMAX_FN if self._is_max else _AAVG_FN)[n](x, out_sizes)
            else:  # no bin here (torch's adaptive pools refuse empty inputs): zeros, still in the graph
                x = x.new_zeros((*x.shape[:2], *out_sizes)) + x.sum() * 0
        return x.to(in_dtype)

    def _global(self, x: torch.Tensor, d: int, ring, length: int) -> torch.Tensor:
        """Output size 1 along sharded ``d``: an all-reduce over the mesh axis (replicated result)."""
        if not self._is_max:
            return all_reduce_sum(x.sum(d, keepdim=True, dtype=_acc_dtype(x.dtype)), ring.group) / length
        if x.shape[d]:
            local = x.max(d, keepdim=True).values  # gradient to one position, as torch's max
        else:  # an empty slab: the identity of a maximum, which never owns it (below)
            low = -float("inf") if x.is_floating_point() else torch.iinfo(x.dtype).min
            local = x.sum(d, keepdim=True, dtype=x.dtype) + low
        best = all_reduce_max(local, ring.group)
        # Ties: the first rank holding the maximum owns it (torch takes the first in scan order).
        rank = torch.full_like(local, -float(ring.index))
        nobody = torch.full_like(local, -float(ring.size))
        first = all_reduce_max(torch.where(local == best, rank, nobody) if x.shape[d] else nobody, ring.group)
        return all_reduce_sum(torch.where(first == rank, local, torch.zeros_like(local)), ring.group)

    def _binned(self, x: torch.Tensor, d: int, ring, layout: Layout, out: int) -> torch.Tensor:
        """Bins along sharded ``d``: each rank pools the bins that start in its slab (a rank
        whose slab holds no bin start holds an empty slab of the output)."""
        bins = _bins(layout.size, out)
        owned = [[b for b in bins if a <= b[0] < a + n] for a, n in zip(layout.starts, layout.sizes)]
        ends = [a + n for a, n in zip(layout.starts, layout.sizes)]
        right = tuple(max(o[-1][1] - e, 0) if o else 0 for o, e in zip(owned, ends))
        spec = HaloSpec(d, (0,) * layout.parts, right)
        mine = owned[ring.index]
        # (Decided from the layout: alike on every rank.)
        if all(owned) and spec.fits(layout.sizes):
            # The common case: the rows a bin reads past the slab lie in the right neighbour's.
            if ring.size > 1:
                x = halo_cat(x, spec, ring)
            a = layout.starts[ring.index]
        else:
            # More ranks than output positions, an empty slab, or a bin reaching past the right
            # neighbour's thin slab (refused before session 67): each rank fetches its bins' rows
            # from wherever they live (multi-hop, point to point).
            blocks = [(o[0][0], o[-1][1] - 1) if o else (0, -1) for o in owned]
            x = halo_gather(x, HaloGather.of_blocks(d, layout.sizes, blocks), ring)
            a = mine[0][0] if mine else 0
        if not mine:
            return x.narrow(d, 0, 0)  # no bin here: zero rows of the output, still part of the graph
        parts = []
        for lo, hi in mine:
            piece = x.narrow(d, lo - a, hi - lo)
            if self._is_max:
                parts.append(piece.max(d, keepdim=True).values)
            else:
                parts.append(piece.mean(d, keepdim=True, dtype=_acc_dtype(piece.dtype)))
        return torch.cat(parts, d)


class _ShardedAdaptiveMaxPoolNd(_ShardedAdaptivePoolNd):
    """Adaptive max pooling: the maximum's gradient goes to one position, as torch's."""

    _is_max = True


@register(nn.AdaptiveAvgPool1d)
class ShardedAdaptiveAvgPool1d(_ShardedAdaptivePoolNd, nn.AdaptiveAvgPool1d):
    """``nn.AdaptiveAvgPool1d`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."""

    _spatial_dims = 1


@register(nn.AdaptiveAvgPool2d)
class ShardedAdaptiveAvgPool2d(_ShardedAdaptivePoolNd, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."""

    _spatial_dims = 2


@register(nn.AdaptiveAvgPool3d)
class ShardedAdaptiveAvgPool3d(_ShardedAdaptivePoolNd, nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."""

    _spatial_dims = 3


@register(nn.AdaptiveMaxPool1d)
class ShardedAdaptiveMaxPool1d(_ShardedAdaptiveMaxPoolNd, nn.AdaptiveMaxPool1d):
    """``nn.AdaptiveMaxPool1d`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."""

    _spatial_dims = 1


@register(nn.AdaptiveMaxPool2d)
class ShardedAdaptiveMaxPool2d(_ShardedAdaptiveMaxPoolNd, nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."""

    _spatial_dims = 2


@register(nn.AdaptiveMaxPool3d)
class ShardedAdaptiveMaxPool3d(_ShardedAdaptiveMaxPoolNd, nn.AdaptiveMaxPool3d):
    """``nn.AdaptiveMaxPool3d`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."""

    _spatial_dims = 3


__all__ = [
    "ShardedAdaptiveAvgPool1d",
    "ShardedAdaptiveAvgPool2d",
    "ShardedAdaptiveAvgPool3d",
    "ShardedAdaptiveMaxPool1d",
    "ShardedAdaptiveMaxPool2d",
    "ShardedAdaptiveMaxPool3d",
]
