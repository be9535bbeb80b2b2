"""Sharded transposed convolutions: ``ShardedConvTranspose1d``, ``2d``, ``3d``.

A transposed convolution scatters input ``i`` into the (uncropped) outputs ``[i*s, i*s + e)``
(stride ``s``, span ``e = dilation * (kernel - 1) + 1``); the global output is that buffer
cropped by ``padding`` ``p`` on both sides and extended by ``output_padding`` at the end. In
output coordinates input ``i`` lands in ``[i*s - p, i*s - p + e)``.

Sharding contract:
    input: ``(N, C_in, S0, ...)`` (or unbatched), sharded along ``dims`` by the domain axes in
        any contiguous slabs (no alignment is needed: every input position has its own outputs).
    output: sharded along the same dims; a rank whose input slab is ``[a, b)`` holds the outputs
        ``[a*s, b*s)`` (the last rank: up to the global end), so output slabs start at
        ``s * (input start)`` and stay aligned to ``s * align``.
    forward: one all-gather of local shapes, then the local transposed convolution with padding 0
        gives outputs ``[a*s - p, (b-1)*s - p + e)``. The ``p`` positions left of ``a*s`` belong
        to the left neighbour and the ``e - s - p`` right of ``b*s`` to the right one: they are
        sent there and *added* (``comm.halo_add``, the adjoint of a halo exchange). The first
        rank drops its left strip (it is the global crop), the last rank crops or zero-extends its
        tail to the global output size. The bias is added once, after the reduction. Where a
        strip is wider than the neighbour's output slab (thin slabs) it is added into every rank
        it spans (``comm.halo_scatter``, multi-hop, point-to-point); empty slabs pass through.
    backward: the input gradient is exact on every rank (``halo_add``'s backward is a halo
        exchange of the output gradient); weight and bias gradients are partial sums over the
        domain ranks (reduce them with ``sharded_nn.parallelize``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..comm import HaloSpec, axis_peers, halo_add
from ..comm.halo import HaloGather, halo_scatter
from ..comm.sizes import scope_declare
from ..errors import ShardingError, ShardingNotImplementedError
from ..layout import Layout
from ..registry import register
from .base import ShardedMixin, batched, size_fact

_CONVT_FN = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _narrow_or_pad(
    x: torch.Tensor, dim: int, start: int, length: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[start:start+length]`` along ``dim``; positions beyond ``x``'s end are zeros (``bias``
    per channel where ``x`` came from a convolution that added it: no input reaches them)."""
    have = x.shape[dim] - start
    if have >= length:
        return x.narrow(dim, start, length)
    shape = list(x.shape)
    shape[dim] = length - have
    fill = x.new_zeros(shape)
    if bias is not None:
        fill += bias.to(x.dtype).view(-1, *([1] * (x.dim() - 2)))
    return torch.cat([x.narrow(dim, start, have), fill], dim)


class _ShardedConvTransposeNd(ShardedMixin):
    """Shared forward of the sharded transposed convolutions (mixed into the torch classes)."""

    _allow_empty = True

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)
        if self.padding_mode != "zeros":
            raise ShardingNotImplementedError(
                f"{type(self).__name__}: padding_mode={self.padding_mode!r}; torch only supports 'zeros' for "
                "transposed convolutions."
            )

    def _plan(self, layout: Layout, dim: int, out_pad: int) -> tuple[HaloSpec, Layout, int, HaloGather | None]:
        """Halo-reduction spec, output layout, global output size and, where the strips reach
        past the direct neighbours, the multi-hop plan (``comm.halo_scatter``) along ``dim``."""
        i = dim - 2
        s, p = self.stride[i], self.padding[i]
        e = self.dilation[i] * (self.kernel_size[i] - 1) + 1
        sizes, n_ranks = layout.sizes, layout.parts
        # Outputs each rank owns: [a*s, b*s), the last one up to the global output size; clipped
        # to the global output where padding crops more than the last slab contributes.
        total = (layout.size - 1) * s - 2 * p + e + out_pad
        name = type(self).__name__
        if total < 1:
            raise ShardingError(
                f"{name}: along dim {dim} (kernel {self.kernel_size[i]}, stride {s}, padding {p}, output_padding "
                f"{out_pad}) the global output is empty (input size {layout.size}). Use a larger input."
            )
        ends = [min((a + n) * s, total) for a, n in zip(layout.starts[:-1], sizes[:-1])] + [total]
        core = [max(end - min(a * s, total), 0) for a, end in zip(layout.starts, ends)]
        right = max(e - s - p, 0)
        spec = HaloSpec(
            dim,
            tuple(p if r > 0 else 0 for r in range(n_ranks)),
            tuple(right if r < n_ranks - 1 else 0 for r in range(n_ranks)),
        )
        starts = [sum(core[:r]) for r in range(n_ranks)]
        out = Layout(tuple(core), math.gcd(layout.align * s, *starts))
        if spec.fits(tuple(core)) and min(core) >= 1:
            return spec, out, total, None
        # A strip wider than the neighbour's output slab (thin slabs), or an empty output slab:
        # every strip position goes to the rank owning it, however far; positions outside the
        # global output (the crop of ``padding``) are dropped (index -1).
        def idx(q: int) -> int:
            return q if 0 <= q < total else -1

        # A rank's strips lie around a*s, where its local buffer puts them, also where a*s is
        # past the global output (its outputs clipped away: its slab's start in the output,
        # sum(core[:r]), is then less than a*s; labelled from there, its strips were added one
        # or more positions off: found by tests/test_fuzz_thin.py).
        origins = [a * s for a in layout.starts]
        gather = HaloGather(
            dim,
            tuple(core),
            tuple(tuple(idx(q) for q in range(o - spec.left[r], o)) for r, o in enumerate(origins)),
            tuple((0, c) for c in core),
            tuple(
                tuple(idx(q) for q in range(o + c, o + c + spec.right[r]))
                for r, (o, c) in enumerate(zip(origins, core))
            ),
        )
        return spec, out, total, gather

    @batched
    def forward(self, x: torch.Tensor, output_size: Sequence[int] | None = None) -> torch.Tensor:  # noqa: D102
        n = self._spatial_dims
        name = type(self).__name__
        # output_size is a call argument every rank must pass alike (the *global* size): it is
        # checked in the agreement. Without it (the usual module call) the input's layout may come
        # from the forward's layout scope (no collective) and the output layout is declared to
        # it; a program that passes output_size on some ranks only breaks the single-program
        # contract (DESIGN.md section 4) and ends in the process group's timeout. The halo
        # reduction runs in backward when x or the weight takes part in it.
        agreed = self._agree(
            x,
            same=None if output_size is None else {"output_size": size_fact(output_size, n)},
            requires_grad=x.requires_grad or self.weight.requires_grad,
            scoped=output_size is None,
        )
        layouts = agreed.layouts
        global_shape = list(agreed.global_shape(self.dims))
        if x.shape[1] != self.in_channels:  # dim 1 is unsharded: the same on every rank
            raise ShardingError(
                f"{name}: expected {self.in_channels} input channels (dim 1), got global input shape "
                f"{tuple(global_shape)}."
            )
        # output_size names the *global* output size, as on one device; torch turns it into an
        # output_padding from the global input shape (a meta tensor: no data, same on every rank).
        out_pad = self._output_padding(
            torch.empty(global_shape, device="meta"), output_size, self.stride, self.padding, self.kernel_size,
            n, self.dilation,
        )
        padding, output_padding = list(self.padding), list(out_pad)
        for d in self.dims:
            padding[d - 2] = output_padding[d - 2] = 0
        # Every plan (and its validation) before any communication.
        plans = [self._plan(lay, d, out_pad[d - 2]) for lay, d in zip(layouts, self.dims)]
        # The output's layout, derived from the agreed input's: the next layer need not agree.
        scope_declare(self.mesh, self.dims, x.dim(), [plan[1] for plan in plans])
        for d in self.dims:
            if x.shape[d] == 0:
                # An empty slab (a deep stage on many ranks): one zero row stands in for it; it
                # scatters zeros, so the strips this rank sends and the outputs it keeps are exact.
                shape = list(x.shape)
                shape[d] = 1
                x = torch.cat([x, x.new_zeros(shape)], d)
        # The bias goes into the convolution itself (one pass less over the output) where no
        # output is a sum over ranks: no strips to or from the neighbours and no multi-hop
        # gather (rows appended past the buffer's end get the bias from _narrow_or_pad).
        fold_bias = self.bias is not None and all(
            gather is None and not any(spec.left) and not any(spec.right) for spec, _, _, gather in plans
        )
        bias = self.bias if fold_bias else None
        y = _CONVT_FN[n](x, self.weight, bias, self.stride, padding, output_padding, self.groups, self.dilation)
        for (spec, out_layout, _, gather), d, axis in zip(plans, self.dims, self.mesh_axes):
            i = d - 2
            ring = axis_peers(self.mesh, axis)
            r = ring.index
            p = self.padding[i]
            # Local buffer in output coordinates starts at a*s - p. Keep [a*s - left, a*s + core +
            # right): the first rank drops its left strip (the global crop), and every rank pads
            # with zeros where its buffer ends before the region it must cover (e < s + p, or
            # output_padding on the last rank).
            start = p - spec.left[r]
            y = _narrow_or_pad(y, d, start, spec.left[r] + out_layout.sizes[r] + spec.right[r], bias)
            if gather is not None:
                y = halo_scatter(y, gather, ring)
            elif ring.size > 1:
                y = halo_add(y, spec, ring)
        if self.bias is not None and not fold_bias:
            # In y's dtype: under autocast y is in the autocast dtype, as torch's own output.
            y = y + self.bias.to(y.dtype).view(-1, *([1] * n))
        return y


@register(nn.ConvTranspose1d)
class ShardedConvTranspose1d(_ShardedConvTransposeNd, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` over a length sharded on the domain axis; see the module docstring."""

    _spatial_dims = 1


@register(nn.ConvTranspose2d)
class ShardedConvTranspose2d(_ShardedConvTransposeNd, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` over an image sharded along H (1-D domain) or H and W (2-D domain)."""

    _spatial_dims = 2


@register(nn.ConvTranspose3d)
class ShardedConvTranspose3d(_ShardedConvTransposeNd, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` over a volume sharded along D (and H with a 2-D domain mesh)."""

    _spatial_dims = 3
