"""Sharded pooling: max / average pooling, adaptive pooling and max unpooling, 1-D to 3-D.

Sharding contract (``ShardedMaxPool*``, ``ShardedAvgPool*``):
    input: ``(N, C, S0, ...)`` (or unbatched), sharded along ``dims`` by the domain axes in
        contiguous slabs that start at multiples of the stride.
    output: sharded along the same dims; as for a convolution, rank r holds the outputs whose
        windows start in its slab (the last rank also those that padding and ``ceil_mode`` add),
        so output slabs start at ``start / stride``.
    forward: one all-gather of local shapes, then a halo exchange with the two neighbours of each
        sharded dim (``window.extend``). Global padding is applied at the domain's edges only:
        ``-inf`` for max pooling (padding never wins) and zeros for average pooling, whose
        divisor is computed from the global position of every output exactly as torch does
        (``count_include_pad``, ``divisor_override``, ``ceil_mode`` windows clipped at the end).
        ``ceil_mode`` only changes the last rank, which gets the extra output.
        ``return_indices=True`` returns *global* indices, flattened over the full spatial extent,
        exactly those torch returns on the full tensor.
    backward: halo gradients go back to their owners; the input gradient is exact.

``ShardedAdaptiveAvgPool*`` / ``ShardedAdaptiveMaxPool*``: an output size of 1 along a sharded
dim is a global reduction over that mesh axis (an all-reduce of local sums, or of local maxima
with the gradient routed to the rank that holds the maximum; the output is then replicated along
that axis). Other output sizes are exact: bin ``i`` (``[floor(i*L/O), ceil((i+1)*L/O))``)
belongs to the rank whose slab holds its start, and the few positions a bin reads from the right
neighbour arrive by a halo exchange. Unsharded dims are pooled locally.

``ShardedMaxUnpool*``: the adjoint layout of a max pool: rank r's output slab starts at
``stride * (input start)``; values whose global index lies in a neighbour's slab are sent there
(``comm.halo_add``). Indices must be global, as ``ShardedMaxPool*(return_indices=True)`` gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.utils import _ntuple
from torch.autograd.function import once_differentiable

from ..comm import HaloSpec, all_reduce_max, all_reduce_sum, axis_ring, gather_layouts, halo_add, halo_cat
from ..errors import ShardingError, ShardingNotImplementedError
from ..layout import Layout
from ..registry import register
from .base import ShardedMixin
from .window import Window, extend, pad_unsharded, plan_window

_MAX_FN = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_FN = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_AMAX_FN = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
_AAVG_FN = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def _pool_out_size(length: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's ``pooling_output_shape``: a ceil-mode window must start inside input or left pad."""
    e = d * (k - 1) + 1
    out = (length + 2 * p - e + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= length + p:
        out -= 1
    return out


def _batched(forward):
    """Run ``forward`` on an unbatched ``(C, S...)`` input by adding and removing N."""

    def wrapper(self, x: torch.Tensor, *args, **kwargs):
        n = self._spatial_dims
        if x.dim() == n + 1:
            out = wrapper(self, x.unsqueeze(0), *(a.unsqueeze(0) if torch.is_tensor(a) else a for a in args), **kwargs)
            return tuple(o.squeeze(0) for o in out) if isinstance(out, tuple) else out.squeeze(0)
        if x.dim() != n + 2:
            raise ValueError(
                f"{type(self).__name__}: expected a {n + 2}-d (N, C, ...) or {n + 1}-d unbatched input, "
                f"got shape {tuple(x.shape)}."
            )
        return forward(self, x, *args, **kwargs)

    wrapper.__doc__ = forward.__doc__
    return wrapper


class _ShardedPoolNd(ShardedMixin):
    """Window bookkeeping shared by the sharded max and average pools."""

    def __init__(self, *args, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, dims)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)

    def _opts(self) -> tuple[tuple[int, ...], ...]:
        n = _ntuple(self._spatial_dims)
        stride = self.stride if self.stride is not None else self.kernel_size
        dilation = getattr(self, "dilation", 1)
        return n(self.kernel_size), n(stride), n(self.padding), n(dilation)

    def _windows(self, sizes: Sequence[int]) -> list[Window]:
        """Per spatial dim; the right padding also covers the extra ``ceil_mode`` output."""
        out = []
        for length, k, s, p, d in zip(sizes, *self._opts()):
            e = d * (k - 1) + 1
            if 2 * p > e:
                # torch checks this on the full tensor; windows inside the extended slab never would.
                raise ValueError(
                    f"{type(self).__name__}: padding {p} should be at most half of the effective kernel size {e}."
                )
            n_out = _pool_out_size(length, k, s, p, d, self.ceil_mode)
            out.append(Window(k, s, d, p, max(p, (n_out - 1) * s + e - length - p)))
        return out

    def _extend(self, x: torch.Tensor, value: float):
        """The halo-extended, edge-padded slab; also global sizes, windows and output starts."""
        name = type(self).__name__
        layouts = gather_layouts(x.shape, self.mesh, self.dims, what=name)
        sizes = list(x.shape[2:])
        for lay, d in zip(layouts, self.dims):
            sizes[d - 2] = lay.size
        windows = self._windows(sizes)
        starts = [0] * self._spatial_dims  # global position of the first local output
        offsets = [-w.pad_left for w in windows]  # global position of the extended slab's first element
        for lay, d, axis in zip(layouts, self.dims, self.mesh_axes):
            w = windows[d - 2]
            plan = plan_window(lay, w, d, mode="zeros", what=name)
            ring = axis_ring(self.mesh, axis)
            start = lay.starts[ring.index]
            starts[d - 2] = start // w.stride
            offsets[d - 2] = start - plan.halo.left[ring.index] - (plan.pad_left if ring.is_first else 0)
            x = extend(x, plan, ring, "zeros", value)
        pads = {2 + i: (w.pad_left, w.pad_right) for i, w in enumerate(windows) if 2 + i not in self.dims}
        x = pad_unsharded(x, pads, "zeros", value)
        return x, sizes, windows, starts, offsets

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, {self.sharding_repr()}"


class _ShardedMaxPoolNd(_ShardedPoolNd):
    @_batched
    def forward(self, x: torch.Tensor):  # noqa: D102
        n = self._spatial_dims
        ext, sizes, _, _, offsets = self._extend(x, float("-inf"))
        k, s, _, d = self._opts()
        y, idx = _MAX_FN[n](ext, k, s, 0, d, ceil_mode=False, return_indices=True)
        if not self.return_indices:
            return y
        # Local indices are flat over the extended slab; shift each coordinate to the global
        # tensor and flatten over the global extent, as torch does on the full tensor.
        ext_sizes = ext.shape[2:]
        coords = []
        rest = idx
        for size in reversed(ext_sizes):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        flat = torch.zeros_like(idx)
        for c, off, size in zip(coords, offsets, sizes):
            flat = flat * size + (c + off)
        return y, flat


class _ShardedAvgPoolNd(_ShardedPoolNd):
    @_batched
    def forward(self, x: torch.Tensor):  # noqa: D102
        n = self._spatial_dims
        ext, sizes, _, starts, _ = self._extend(x, 0.0)
        k, s, p, _ = self._opts()
        y = _AVG_FN[n](ext, k, s, 0)  # divides by prod(k): every window lies inside ext
        # Rescale each output from prod(k) to torch's divisor for its global position.
        override = getattr(self, "divisor_override", None)
        if override:
            factor = torch.tensor(math.prod(k) / override, dtype=torch.float64)
        else:
            factor = torch.ones((), dtype=torch.float64)
            for i in range(n):
                j = torch.arange(starts[i], starts[i] + y.shape[2 + i], dtype=torch.int64)
                lo = j * s[i] - p[i]
                hi = torch.clamp(lo + k[i], max=sizes[i] + p[i])
                div = hi - lo if self.count_include_pad else hi.clamp(max=sizes[i]) - lo.clamp(min=0)
                shape = [1] * n
                shape[i] = -1
                factor = factor * (k[i] / div.to(torch.float64)).view(shape)
        if bool((factor != 1).any()):
            y = y * factor.to(dtype=y.dtype, device=y.device)
        return y


def _mk(base, torch_cls, nd, doc):
    cls = type(f"Sharded{torch_cls.__name__}", (base, torch_cls), {"_spatial_dims": nd, "__doc__": doc})
    cls.__module__ = __name__
    return register(torch_cls)(cls)


_POOL_DOC = "``nn.{}`` with its input sharded along ``dims``; see the module docstring of ``sharded_nn.layers.pool``."
ShardedMaxPool1d = _mk(_ShardedMaxPoolNd, nn.MaxPool1d, 1, _POOL_DOC.format("MaxPool1d"))
ShardedMaxPool2d = _mk(_ShardedMaxPoolNd, nn.MaxPool2d, 2, _POOL_DOC.format("MaxPool2d"))
ShardedMaxPool3d = _mk(_ShardedMaxPoolNd, nn.MaxPool3d, 3, _POOL_DOC.format("MaxPool3d"))
ShardedAvgPool1d = _mk(_ShardedAvgPoolNd, nn.AvgPool1d, 1, _POOL_DOC.format("AvgPool1d"))
ShardedAvgPool2d = _mk(_ShardedAvgPoolNd, nn.AvgPool2d, 2, _POOL_DOC.format("AvgPool2d"))
ShardedAvgPool3d = _mk(_ShardedAvgPoolNd, nn.AvgPool3d, 3, _POOL_DOC.format("AvgPool3d"))


# --- adaptive pooling ---------------------------------------------------------------------------


def _bins(length: int, out: int) -> list[tuple[int, int]]:
    """torch's adaptive bins: ``[floor(i*L/O), ceil((i+1)*L/O))``."""
    return [(i * length // out, -(-(i + 1) * length // out)) for i in range(out)]


class _ShardedAdaptivePoolNd(ShardedMixin):
    _is_max = False

    def __init__(self, *args, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, dims)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)
        if getattr(self, "return_indices", False):
            raise ShardingNotImplementedError(
                f"{type(self).__name__}: return_indices=True is not supported for sharded adaptive max "
                "pooling; use return_indices=False (or ShardedMaxPool with return_indices)."
            )

    @_batched
    def forward(self, x: torch.Tensor):  # noqa: D102
        n = self._spatial_dims
        name = type(self).__name__
        layouts = gather_layouts(x.shape, self.mesh, self.dims, what=name)
        out_sizes = list(_ntuple(n)(self.output_size))
        for lay, d, axis in zip(layouts, self.dims, self.mesh_axes):
            o = out_sizes[d - 2] if out_sizes[d - 2] is not None else lay.size
            ring = axis_ring(self.mesh, axis)
            x = self._global(x, d, ring, lay.size) if o == 1 else self._binned(x, d, ring, lay, o)
            out_sizes[d - 2] = x.shape[d]  # already pooled: identity bins for the local pool below
        out_sizes = [x.shape[2 + i] if o is None else o for i, o in enumerate(out_sizes)]
        if tuple(out_sizes) == tuple(x.shape[2:]):
            return x
        return (_AMAX_FN if self._is_max else _AAVG_FN)[n](x, out_sizes)

    def _global(self, x: torch.Tensor, d: int, ring, length: int) -> torch.Tensor:
        """Output size 1 along sharded ``d``: an all-reduce over the mesh axis (replicated result)."""
        if not self._is_max:
            return all_reduce_sum(x.sum(d, keepdim=True), ring.group) / length
        local = x.max(d, keepdim=True).values  # gradient to one position, as torch's max
        best = all_reduce_max(local, ring.group)
        # Ties: the first rank holding the maximum owns it (torch takes the first in scan order).
        rank = torch.full_like(local, -float(ring.index))
        first = all_reduce_max(torch.where(local == best, rank, torch.full_like(local, -float(ring.size))), ring.group)
        return all_reduce_sum(torch.where(first == rank, local, torch.zeros_like(local)), ring.group)

    def _binned(self, x: torch.Tensor, d: int, ring, layout: Layout, out: int) -> torch.Tensor:
        """Bins along sharded ``d``: each rank pools the bins that start in its slab."""
        name = type(self).__name__
        bins = _bins(layout.size, out)
        owned = [[b for b in bins if a <= b[0] < a + n] for a, n in zip(layout.starts, layout.sizes)]
        if any(not o for o in owned):
            raise ShardingError(
                f"{name}: output size {out} along dim {d} leaves rank(s) "
                f"{[r for r, o in enumerate(owned) if not o]} without a bin (input slabs {layout.sizes}). Use "
                "fewer ranks, or output size 1 (a global reduction)."
            )
        ends = [a + n for a, n in zip(layout.starts, layout.sizes)]
        right = tuple(max(o[-1][1] - e, 0) for o, e in zip(owned, ends))
        spec = HaloSpec(d, (0,) * layout.parts, right)
        spec.check(layout.sizes, name)
        if ring.size > 1:
            x = halo_cat(x, spec, ring)
        a = layout.starts[ring.index]
        parts = []
        for lo, hi in owned[ring.index]:
            piece = x.narrow(d, lo - a, hi - lo)
            parts.append(piece.max(d, keepdim=True).values if self._is_max else piece.mean(d, keepdim=True))
        return torch.cat(parts, d)

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, {self.sharding_repr()}"


class _ShardedAdaptiveMaxPoolNd(_ShardedAdaptivePoolNd):
    _is_max = True


_ADOC = "``nn.{}`` with its input sharded along ``dims``; output size 1 along a sharded dim all-reduces."
ShardedAdaptiveAvgPool1d = _mk(_ShardedAdaptivePoolNd, nn.AdaptiveAvgPool1d, 1, _ADOC.format("AdaptiveAvgPool1d"))
ShardedAdaptiveAvgPool2d = _mk(_ShardedAdaptivePoolNd, nn.AdaptiveAvgPool2d, 2, _ADOC.format("AdaptiveAvgPool2d"))
ShardedAdaptiveAvgPool3d = _mk(_ShardedAdaptivePoolNd, nn.AdaptiveAvgPool3d, 3, _ADOC.format("AdaptiveAvgPool3d"))
ShardedAdaptiveMaxPool1d = _mk(_ShardedAdaptiveMaxPoolNd, nn.AdaptiveMaxPool1d, 1, _ADOC.format("AdaptiveMaxPool1d"))
ShardedAdaptiveMaxPool2d = _mk(_ShardedAdaptiveMaxPoolNd, nn.AdaptiveMaxPool2d, 2, _ADOC.format("AdaptiveMaxPool2d"))
ShardedAdaptiveMaxPool3d = _mk(_ShardedAdaptiveMaxPoolNd, nn.AdaptiveMaxPool3d, 3, _ADOC.format("AdaptiveMaxPool3d"))


# --- max unpooling ------------------------------------------------------------------------------


class _UnpoolPlan:
    """Along one sharded dim: the local buffer ``[lo, hi)`` (global) and the halo-add spec."""

    def __init__(self, layout: Layout, dim: int, k: int, s: int, p: int, total: int, index: int, what: str):
        core = [n * s for n in layout.sizes[:-1]]
        core.append(total - layout.starts[-1] * s)
        if min(core) < 1:
            raise ShardingError(f"{what}: input slabs {layout.sizes} along dim {dim} leave the last rank no output.")
        parts = layout.parts
        right = max(k - s - p, 0)
        self.spec = HaloSpec(
            dim, tuple(p if r else 0 for r in range(parts)), tuple(right if r < parts - 1 else 0 for r in range(parts))
        )
        self.spec.check(tuple(core), what)
        start = layout.starts[index] * s
        self.lo = start - self.spec.left[index]
        self.hi = start + core[index] + self.spec.right[index]


class _Unpool(torch.autograd.Function):
    """Scatter values to global positions (set, as torch), reducing neighbours' strips."""

    @staticmethod
    def forward(ctx, vals, flat_idx, buf_shape, plans, rings):  # noqa: D102
        n, c = vals.shape[:2]
        buf = vals.new_zeros(n, c, math.prod(buf_shape))
        hits = vals.new_zeros(n, c, math.prod(buf_shape))
        buf.scatter_(2, flat_idx.view(n, c, -1), vals.reshape(n, c, -1))
        hits.scatter_(2, flat_idx.view(n, c, -1), 1.0)
        buf, hits = buf.view(n, c, *buf_shape), hits.view(n, c, *buf_shape)
        with torch.no_grad():
            for plan, ring in zip(plans, rings):
                if ring.size > 1:
                    buf, hits = halo_add(buf, plan.spec, ring), halo_add(hits, plan.spec, ring)
        # A position written by several ranks (overlapping windows) got the same max value from each.
        out = torch.where(hits > 1, buf / hits.clamp(min=1), buf)
        ctx.save_for_backward(flat_idx)
        ctx.plans, ctx.rings, ctx.shape = plans, rings, vals.shape
        return out

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        (flat_idx,) = ctx.saved_tensors
        with torch.no_grad():
            for plan, ring in reversed(list(zip(ctx.plans, ctx.rings))):
                if ring.size > 1:
                    g = halo_cat(g.contiguous(), plan.spec, ring)
        n, c = ctx.shape[:2]
        return g.reshape(n, c, -1).gather(2, flat_idx.view(n, c, -1)).view(ctx.shape), None, None, None, None


class _ShardedMaxUnpoolNd(ShardedMixin):
    def __init__(self, *args, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, dims)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)

    @_batched
    def forward(self, x: torch.Tensor, indices: torch.Tensor, output_size: Sequence[int] | None = None):  # noqa: D102
        n = self._spatial_dims
        name = type(self).__name__
        layouts = gather_layouts(x.shape, self.mesh, self.dims, what=name)
        nt = _ntuple(n)
        k, s, p = nt(self.kernel_size), nt(self.stride), nt(self.padding)
        in_sizes = list(x.shape[2:])
        for lay, d in zip(layouts, self.dims):
            in_sizes[d - 2] = lay.size
        default = [(L - 1) * s_ - 2 * p_ + k_ for L, k_, s_, p_ in zip(in_sizes, k, s, p)]
        if output_size is None:
            total = default
        else:
            total = list(output_size)[-n:]
            if any(not dflt - s_ < t < dflt + s_ for t, dflt, s_ in zip(total, default, s)):
                raise ValueError(f"{name}: output_size {tuple(total)} must be within a stride of {tuple(default)}.")
        lo, hi = [0] * n, list(total)
        plans, rings = [], []
        for lay, d, axis in zip(layouts, self.dims, self.mesh_axes):
            i = d - 2
            ring = axis_ring(self.mesh, axis)
            plan = _UnpoolPlan(lay, d, k[i], s[i], p[i], total[i], ring.index, name)
            plans.append(plan)
            rings.append(ring)
            lo[i], hi[i] = plan.lo, plan.hi
        # Global flat index -> coordinates -> flat index into this rank's buffer.
        rest, coords = indices, []
        for size in reversed(total):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        buf_shape = [b - a for a, b in zip(lo, hi)]
        local = torch.zeros_like(indices)
        for cd, a, size in zip(coords, lo, buf_shape):
            local = local * size + (cd - a)
        return _Unpool.apply(x, local, tuple(buf_shape), tuple(plans), tuple(rings))

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, {self.sharding_repr()}"


_UDOC = "``nn.{}`` taking the global indices of ``ShardedMaxPool*(return_indices=True)``; sharded output."
ShardedMaxUnpool1d = _mk(_ShardedMaxUnpoolNd, nn.MaxUnpool1d, 1, _UDOC.format("MaxUnpool1d"))
ShardedMaxUnpool2d = _mk(_ShardedMaxUnpoolNd, nn.MaxUnpool2d, 2, _UDOC.format("MaxUnpool2d"))
ShardedMaxUnpool3d = _mk(_ShardedMaxUnpoolNd, nn.MaxUnpool3d, 3, _UDOC.format("MaxUnpool3d"))

__all__ = [
    "ShardedAdaptiveAvgPool1d",
    "ShardedAdaptiveAvgPool2d",
    "ShardedAdaptiveAvgPool3d",
    "ShardedAdaptiveMaxPool1d",
    "ShardedAdaptiveMaxPool2d",
    "ShardedAdaptiveMaxPool3d",
    "ShardedAvgPool1d",
    "ShardedAvgPool2d",
    "ShardedAvgPool3d",
    "ShardedMaxPool1d",
    "ShardedMaxPool2d",
    "ShardedMaxPool3d",
    "ShardedMaxUnpool1d",
    "ShardedMaxUnpool2d",
    "ShardedMaxUnpool3d",
]
