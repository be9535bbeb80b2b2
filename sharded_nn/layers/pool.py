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
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.utils import _ntuple

from ..comm import HaloSpec, all_reduce_max, all_reduce_sum, axis_ring, halo_add, halo_cat
from ..errors import ShardingError, ShardingNotImplementedError
from ..layout import Layout
from ..registry import register
from .base import ShardedMixin, batched, gather_facts, size_fact
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
        agreed = self._agree(x)
        layouts = agreed.layouts
        sizes = list(agreed.global_shape(self.dims)[2:])
        windows = self._windows(sizes)
        # Every plan (and its validation) before any communication.
        plans = [plan_window(lay, windows[d - 2], d, mode="zeros", what=name) for lay, d in zip(layouts, self.dims)]
        starts = [0] * self._spatial_dims  # global position of the first local output
        offsets = [-w.pad_left for w in windows]  # global position of the extended slab's first element
        for lay, plan, d, axis in zip(layouts, plans, self.dims, self.mesh_axes):
            w = windows[d - 2]
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
    @batched
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
    @batched
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16 (sums of half values round), else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


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

    @batched
    def forward(self, x: torch.Tensor):  # noqa: D102
        n = self._spatial_dims
        layouts = self._agree(x).layouts
        # Averages of fp16/bf16 inputs are summed in float32 (as torch's adaptive average
        # accumulates) and rounded to the input dtype once, after every dim is pooled.
        in_dtype = x.dtype
        out_sizes = list(_ntuple(n)(self.output_size))
        for lay, d, axis in zip(layouts, self.dims, self.mesh_axes):
            o = out_sizes[d - 2] if out_sizes[d - 2] is not None else lay.size
            ring = axis_ring(self.mesh, axis)
            x = self._global(x, d, ring, lay.size) if o == 1 else self._binned(x, d, ring, lay, o)
            out_sizes[d - 2] = x.shape[d]  # already pooled: identity bins for the local pool below
        out_sizes = [x.shape[2 + i] if o is None else o for i, o in enumerate(out_sizes)]
        if tuple(out_sizes) != tuple(x.shape[2:]):
            x = (_AMAX_FN if self._is_max else _AAVG_FN)[n](x, out_sizes)
        return x.to(in_dtype)

    def _global(self, x: torch.Tensor, d: int, ring, length: int) -> torch.Tensor:
        """Output size 1 along sharded ``d``: an all-reduce over the mesh axis (replicated result)."""
        if not self._is_max:
            return all_reduce_sum(x.sum(d, keepdim=True, dtype=_acc_dtype(x.dtype)), ring.group) / length
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
            if self._is_max:
                parts.append(piece.max(d, keepdim=True).values)
            else:
                parts.append(piece.mean(d, keepdim=True, dtype=_acc_dtype(piece.dtype)))
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

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        (flat_idx,) = ctx.saved_tensors
        with torch.no_grad():
            for spec, ring in reversed(list(zip(ctx.specs, ctx.rings))):
                if ring.size > 1:
                    g = halo_cat(g.contiguous(), spec, ring)
        n, c = ctx.shape[:2]
        return g.reshape(n, c, -1).gather(2, flat_idx.view(n, c, -1)).view(ctx.shape), None, None, None, None


class _ShardedMaxUnpoolNd(ShardedMixin):
    def __init__(self, *args, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, dims)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)

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
        rings = [axis_ring(self.mesh, axis) for axis in self.mesh_axes]
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
