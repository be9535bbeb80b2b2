"""Sliding blocks of a sharded image and their adjoint: ``ShardedUnfold`` and ``ShardedFold``.

``nn.Unfold`` / ``F.unfold`` (im2col) cut an image into its sliding blocks; ``nn.Fold`` /
``F.fold`` (col2im) sum blocks back into an image. VOLO's outlook attention, T2T-style soft
splits and hand-written patch operators use them.

Sharding contract (``ShardedUnfold``):
    input: ``(N, C, H, W)`` (or unbatched), sharded along ``dims`` (default H; H and W on a 2-D
        domain mesh) in slabs that start at multiples of the stride.
    output: ``(N, C * kh * kw, L_local)``: the blocks whose windows start in this rank's slab
        (as a convolution's outputs), in torch's row-major order: on a 1-D mesh whole block rows
        ``[start / stride, ...)``, i.e. this rank's slab of torch's ``L`` dim (its rows
        outermost); on a 2-D mesh this rank's block rows x block columns.
    forward: one agreement of the slab shapes, the halo exchange of ``window.extend`` (multi-hop
        where a neighbour's slab is thinner than the halo, or empty), then the local
        ``F.unfold`` of the extended slab: exact (values are copied).
    backward: the halo gradients return to their owners; exact.

Sharding contract (``ShardedFold``):
    input: ``(N, C * kh * kw, L_local)`` laid out as ``ShardedUnfold``'s output on a 1-D mesh:
        whole block rows per rank, in rank order.
    output: ``(N, C, H, W)`` (``output_size`` the whole image's), sharded along H: rank r holds
        the image rows ``[stride * b_r, stride * b_{r+1})`` for ``b_r`` its first block row (the
        last rank to the image's end): the layout whose unfold gives the input's.
    forward: the adjoint of the unfold of that layout (``torch.autograd.grad`` of it): the parts
        of overlapping blocks that fall on a neighbour's rows travel there and are added.
        Exact up to the order of those sums. Backward: the unfold of the gradient. First
        derivatives only; 1-D domain meshes only (a 2-D mesh's blocks are not whole rows of L).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..comm import axis_peers
from ..comm.sizes import gather_layouts, scope_forget
from ..errors import ShardingError, ShardingNotImplementedError
from ..layout import Layout
from ..registry import register
from .base import ShardedMixin, batched
from .window import Window, crop_empty, extend, pad_unsharded, plan_window


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _blocks_per_dim(length: int, k: int, d: int, p: int, s: int) -> int:
    """torch's number of sliding blocks along one dim."""
    return (length + 2 * p - d * (k - 1) - 1) // s + 1


class ShardedUnfold(ShardedMixin, nn.Unfold):
    """``nn.Unfold`` on a sharded image; see the module docstring for the contract."""

    _spatial_dims = 2
    _allow_empty = True

    @batched
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self._local_only:
            return super(ShardedMixin, self).forward(x)
        blocks = self.blocks(x)
        # A new layout (blocks, flattened): later layers agree again.
        scope_forget()
        return blocks.flatten(2)

    def _opts(self):
        return _pair(self.kernel_size), _pair(self.dilation), _pair(self.padding), _pair(self.stride)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C * kh * kw, block rows, block columns)`` of this rank (``forward`` before its
        flatten; the forward guard flattens it as a view of its own)."""
        name = type(self).__name__
        agreed = self._agree(x)
        sizes = list(agreed.global_shape(self.dims)[2:])
        k, d, p, s = self._opts()
        windows = []
        for i in range(2):
            n_out = _blocks_per_dim(sizes[i], k[i], d[i], p[i], s[i])
            if n_out < 1:
                # (torch raises on the whole image too; decided from global sizes: alike everywhere.)
                raise ShardingError(f"{name}: a {k} block (dilation {d}, padding {p}) does not fit the image "
                                    f"{tuple(sizes)}: no block along dim {2 + i}.")
            e = d[i] * (k[i] - 1) + 1
            windows.append(Window(k[i], s[i], d[i], p[i], max(p[i], (n_out - 1) * s[i] + e - sizes[i] - p[i])))
        layouts = agreed.layouts
        plans = [plan_window(lay, windows[dim - 2], dim, mode="zeros", what=name) for lay, dim in zip(layouts, self.dims)]
        rings = [axis_peers(self.mesh, a) for a in self.mesh_axes]
        for plan, ring in zip(plans, rings):
            x = extend(x, plan, ring, "zeros")
        pads = {2 + i: (w.pad_left, w.pad_right) for i, w in enumerate(windows) if 2 + i not in self.dims}
        x = pad_unsharded(x, pads, "zeros")
        rows = [_blocks_per_dim(x.shape[2 + i], k[i], d[i], 0, s[i]) for i in range(2)]
        y = F.unfold(x, k, d, 0, s).unflatten(2, rows)
        return crop_empty(y, plans, rings)


class _FoldFn(torch.autograd.Function):
    """``F.fold`` of whole block rows: the adjoint of ``unfold`` at an image slab of ``rows``
    rows; its backward is that unfold."""

    @staticmethod
    def forward(ctx, cols: torch.Tensor, unfold: ShardedUnfold, image_shape: tuple[int, ...]):  # noqa: D102
        ctx.unfold = unfold
        with torch.enable_grad():
            z = torch.zeros(image_shape, dtype=cols.dtype, device=cols.device, requires_grad=True)
            y = unfold.blocks(z)
            (out,) = torch.autograd.grad(y, z, cols)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        return ctx.unfold.blocks(g), None, None


class ShardedFold(ShardedMixin, nn.Fold):
    """``nn.Fold`` of a sharded block sequence; see the module docstring for the contract."""

    _spatial_dims = 2
    _allow_empty = True

    def forward(self, cols: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self._local_only:
            return super(ShardedMixin, self).forward(cols)
        name = type(self).__name__
        if self.dims != (2,):
            # (From the layer's options: raised alike on every rank.)
            raise ShardingNotImplementedError(
                f"{name}: only the image rows (dim 2) on a 1-D domain mesh are supported, got dims {self.dims}: on a "
                "2-D mesh a rank's blocks are not whole rows of the block sequence. Fold on a 1-D mesh, or gather "
                "the blocks first.")
        unbatched = cols.dim() == 2
        if unbatched:
            cols = cols.unsqueeze(0)
        if cols.dim() != 3:
            raise ShardingError(f"{name}: expected (N, C * kh * kw, L) or (C * kh * kw, L), got {tuple(cols.shape)}.")
        (h, w) = _pair(self.output_size)
        k, d, p, s = _pair(self.kernel_size), _pair(self.dilation), _pair(self.padding), _pair(self.stride)
        ow = _blocks_per_dim(w, k[1], d[1], p[1], s[1])
        oh = _blocks_per_dim(h, k[0], d[0], p[0], s[0])
        if cols.shape[1] % (k[0] * k[1]):
            raise ShardingError(f"{name}: {cols.shape[1]} channels (dim 1) are not a multiple of the block size "
                                f"{k[0]} x {k[1]}.")
        lay = gather_layouts(cols.shape, self.mesh, (2,), what=name, allow_empty=True)[0]
        if lay.size != oh * ow or any(n % ow for n in lay.sizes):
            raise ShardingError(
                f"{name}: the blocks' slabs {lay.sizes} (dim 2) must be whole rows of {ow} blocks, {oh * ow} in all, "
                f"for output_size {(h, w)}: shard the blocks as ShardedUnfold (or F.unfold under the guard) "
                "leaves them.")
        rows = Layout(tuple(n // ow for n in lay.sizes))
        # Image rows: from each rank's first block row on, the last rank to the image's end
        # (clipped there: trailing ranks without blocks hold no rows).
        starts = [min(b * s[0], h) for b in rows.starts]
        ends = starts[1:] + [h]
        r = axis_peers(self.mesh, self.mesh_axes[0]).index
        image = (cols.shape[0], cols.shape[1] // (k[0] * k[1]), ends[r] - starts[r], w)
        unfold = ShardedUnfold(k, d, p, s, mesh=self.mesh, dims=(2,))
        out = _FoldFn.apply(cols.unflatten(2, (rows.sizes[r], ow)), unfold, image)
        scope_forget()
        return out.squeeze(0) if unbatched else out


register(nn.Unfold)(ShardedUnfold)
register(nn.Fold)(ShardedFold)

__all__ = ["ShardedFold", "ShardedUnfold"]
