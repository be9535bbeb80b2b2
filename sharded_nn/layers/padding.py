"""Sharded padding: ``pad`` (``F.pad`` on slabs) and the ``nn.*Pad1d/2d/3d`` layers.

Sharding contract:
    input: ``(N, C, S0, S1, ...)`` sharded along ``dims`` (default: the first spatial dims, one
        per domain axis), any slab sizes.
    output: sharded along the same dims, with the input's slab boundaries: padding ``(pl, pr)``
        of a sharded dim is global, and rank r holds the padded positions ``[a_r, b_r)`` where
        its input slab held ``[a_r, b_r)`` (the first rank starts with the ``pl`` padding rows,
        every rank's rows move ``pl`` positions on to the next rank, the last rank also holds
        the ``pr`` right padding rows). So a window without padding after it (``ReflectionPad2d(1)``
        then ``Conv2d(3, padding=0)``, MONAI's pad-then-pool) computes its outputs on the input's
        layout, exactly as the layer with the padding inside it does, and ``x + conv(pad(x))``
        adds slabs of one layout. (Keeping the rows where they were, the first rank would hold
        ``pl`` more outputs than its input rows: found by tests/test_fuzz_unet.py.) Unsharded
        dims are padded locally, exactly as ``F.pad`` does.
    communication: right padding only (``pl = 0``): none for ``constant``/``replicate``/
        ``reflect`` (the last rank pads its own rows), one periodic halo for ``circular``. Left
        padding: each rank receives ``pl`` rows from the rank before it (the first rank's
        padding rows mirror, repeat or wrap rows as the mode says, circular from the last rank),
        one ``comm.halo_gather`` (multi-hop where slabs are thinner than the padding, autograd-
        aware: the gradients flow back to the rows' owners). Several sharded dims are padded one
        after another on the already padded tensor, which fills the corners. Empty slabs pass
        through.
    negative padding (cropping): on unsharded dims locally; on a sharded dim (since session 60)
        with the same boundaries, the output's positions mapped onto the input's as torch maps
        them, so the last ranks hold fewer rows (or none) after a right crop and every rank reads
        its rows from the ranks after it after a left crop; circular padding with a negative side
        raises ``ShardingNotImplementedError`` (torch crops first and wraps around the cropped dim).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..comm import HaloSpec, axis_peers, halo_cat
from ..comm.halo import halo_gather
from ..compile_boundary import eager_under_compile
from ..errors import ShardingError, ShardingNotImplementedError
from ..layout import Layout
from ..mesh import default_dims, domain_axes
from ..registry import register
from .base import ShardedMixin, agree, batched
from .window import edge_pad, gather_plan

MODES = ("constant", "reflect", "replicate", "circular")


@eager_under_compile
def pad(
    x: torch.Tensor,
    pad: Sequence[int],
    mesh: DeviceMesh,
    mode: str = "constant",
    value: float | None = None,
    *,
    dims: int | Sequence[int] | None = None,
    layouts: tuple[Layout, ...] | None = None,
) -> torch.Tensor:
    """``F.pad(x_full, pad, mode, value)`` on this rank's slab; see the module docstring.

    Args:
        x: this rank's slab.
        pad: ``(left_last, right_last, left_second_to_last, ...)`` as in ``F.pad``.
        mesh: mesh with domain axes.
        mode: ``"constant"``, ``"reflect"``, ``"replicate"`` or ``"circular"``.
        value: fill value for ``"constant"`` (default 0).
        dims: sharded dims of ``x`` (default: the first spatial dims, one per domain axis).
        layouts: ``x``'s layouts along ``dims`` when the caller has agreed on them already (with
            ``gather_layouts`` or ``agree``, the same on every rank): no agreement of its own.
            Default: one all-gather of the local shapes.

    Raises:
        ShardingError: bad ``pad`` or mode, inconsistent slabs, or reflect/circular padding wider
            than the global dim (as torch; same error on every rank).
        ShardingNotImplementedError: circular padding with a negative side on a sharded dim.
    """
    return _pad(x, pad, mesh, mode, value, dims=dims, what="pad", layouts=layouts)


def _pad(
    x: torch.Tensor,
    pad: Sequence[int],
    mesh: DeviceMesh,
    mode: str,
    value: float | None,
    *,
    dims: int | Sequence[int] | None,
    what: str,
    ndims: Sequence[int] | None = None,
    expected: str = "",
    layouts: tuple[Layout, ...] | None = None,
) -> torch.Tensor:
    """``pad``; ``layouts``: the input's layouts along ``dims`` when the caller agreed on them already."""
    axes = domain_axes(mesh)
    if dims is None:
        dims = default_dims(mesh)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if layouts is None:
        layouts = agree(x, mesh, dims, what=what, ndims=ndims, expected=expected, allow_empty=True).layouts
    pad = tuple(int(p) for p in pad)
    if mode not in MODES:
        raise ShardingError(f"{what}: unknown mode {mode!r}; expected one of {MODES}.")
    if len(pad) % 2 or len(pad) // 2 > x.dim():
        raise ShardingError(
            f"{what}: pad must hold (left, right) pairs for at most {x.dim()} dims, got {pad} for shape "
            f"{tuple(x.shape)}."
        )
    if mode != "constant" and value not in (None, 0, 0.0):
        raise ShardingError(f"{what}: value={value} is only valid with mode='constant', got mode={mode!r}.")
    per_dim = {x.dim() - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
    sharded = {d: (a, lay) for d, a, lay in zip(dims, axes, layouts)}
    for d, (pl, pr) in per_dim.items():
        if d in sharded and min(pl, pr) < 0 and mode == "circular":
            # torch crops first and wraps around the cropped dim (and refuses a wrap wider than it).
            raise ShardingNotImplementedError(
                f"{what}: circular padding with a negative (cropping) side {pl, pr} of sharded dim {d} is not "
                "supported; crop with a slice (x[..., a:b, ...]) and then pad."
            )
        if d in sharded and sharded[d][1].size + pl + pr < 0:
            raise ShardingError(
                f"{what}: padding {pl, pr} crops more than the {sharded[d][1].size} positions of sharded dim {d} "
                "(torch refuses it on one device too)."
            )
        if d in sharded and mode in ("reflect", "circular"):
            # torch's own limits on the full tensor; thin edge slabs are fine (multi-hop).
            n = sharded[d][1].size
            limit = n - 1 if mode == "reflect" else n
            if max(pl, pr) > limit:
                raise ShardingError(
                    f"{what}: {mode} padding {pl, pr} along sharded dim {d} must be at most {limit} for a "
                    f"global size of {n} (torch refuses it on one device too). Use a larger input or less padding."
                )
    # Unsharded dims first, in one local F.pad call (zeros for the sharded dims' pairs).
    local = list(pad)
    for d in sharded:
        if d in per_dim:
            i = x.dim() - 1 - d
            local[2 * i : 2 * i + 2] = [0, 0]
    if any(local):
        x = _pad_local(x, local, mode, value)
    fill = 0.0 if value is None else value
    for d in dims:
        pl, pr = per_dim.get(d, (0, 0))
        if not (pl or pr):
            continue
        axis, layout = sharded[d]
        ring = axis_peers(mesh, axis)
        if pl or pr < 0 or _needs_gather(layout.sizes, pl, pr, mode):
            # The output keeps the input's slab boundaries (module docstring): rank r holds the
            # padded positions [a_r, b_r), i.e. the input rows [a_r - pl, b_r - pl) with the
            # padding where they fall outside [0, n), and the last rank also the right padding.
            # Every rank reads exactly that range from whichever ranks own its rows (multi-hop
            # where slabs are thinner than the padding; circular padding wraps around the ring).
            # A negative side crops (torch maps the output positions onto the input's as with
            # padding): the ranges end at the output's size, so the last ranks hold fewer rows,
            # or none.
            p, n = layout.parts, layout.size
            end = n + pl + pr
            ranges = [
                (min(a, end) - pl, (end if r == p - 1 else min(a + m, end)) - pl)
                for r, (a, m) in enumerate(zip(layout.starts, layout.sizes))
            ]
            spec = gather_plan(d, layout, ranges, "zeros" if mode == "constant" else mode)
            x = halo_gather(x, spec, ring, value=fill)
            continue
        # Right padding only: the last rank adds it (reading its own rows, or, circular, the
        # first rank's: a periodic halo).
        if mode == "circular":
            p = layout.parts
            spec = HaloSpec(d, (0,) * p, (0,) * (p - 1) + (pr,), periodic=True)
            spec.check(layout.sizes, what)
            x = halo_cat(x, spec, ring)
            continue
        if ring.is_last:
            x = edge_pad(x, d, pr, False, mode, fill)
    return x


def _pad_local(x: torch.Tensor, local: Sequence[int], mode: str, value: float | None) -> torch.Tensor:
    """``F.pad`` of this slab's unsharded dims. torch's reflect, replicate and circular kernels
    refuse a tensor with an empty dim, which an empty slab has (its sharded dim holds no rows):
    its padded block is as empty, so only its shape changes (found by tests/test_fuzz_padding.py:
    that rank raised alone while the others went on to the exchange)."""
    if mode == "constant":
        return F.pad(x, local, mode, value)
    if x.numel():
        return F.pad(x, local, mode)
    shape = list(x.shape)
    for i in range(len(local) // 2):
        shape[x.dim() - 1 - i] += local[2 * i] + local[2 * i + 1]
    return x.new_zeros(shape) + x.sum() * 0  # still connected to x: its backward runs as the others'


def _needs_gather(sizes: tuple[int, ...], pl: int, pr: int, mode: str) -> bool:
    """Whether padding one sharded dim reads beyond what the edge ranks (or their neighbours) hold."""
    if mode == "constant":
        return False
    if mode == "circular":
        return pl > sizes[-1] or pr > sizes[0] or (len(sizes) > 1 and min(sizes) == 0)
    return 0 in sizes or (mode == "reflect" and (pl >= sizes[0] or pr >= sizes[-1]))


class _ShardedPadNd(ShardedMixin):
    """Shared forward of the sharded padding layers (mixed into the torch classes)."""

    _mode = "constant"

    @batched
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        n = self._spatial_dims
        return _pad(
            x, self.padding, self.mesh, self._mode, getattr(self, "value", None), dims=self.dims,
            what=type(self).__name__, ndims=(n + 2,), expected=f"a {n + 2}-d (N, C, ...) or {n + 1}-d unbatched",
        )


@register(nn.ZeroPad1d)
class ShardedZeroPad1d(_ShardedPadNd, nn.ZeroPad1d):
    """``nn.ZeroPad1d`` on slabs: constant padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 1
    _mode = "constant"


@register(nn.ZeroPad2d)
class ShardedZeroPad2d(_ShardedPadNd, nn.ZeroPad2d):
    """``nn.ZeroPad2d`` on slabs: constant padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 2
    _mode = "constant"


@register(nn.ZeroPad3d)
class ShardedZeroPad3d(_ShardedPadNd, nn.ZeroPad3d):
    """``nn.ZeroPad3d`` on slabs: constant padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 3
    _mode = "constant"


@register(nn.ConstantPad1d)
class ShardedConstantPad1d(_ShardedPadNd, nn.ConstantPad1d):
    """``nn.ConstantPad1d`` on slabs: constant padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 1
    _mode = "constant"


@register(nn.ConstantPad2d)
class ShardedConstantPad2d(_ShardedPadNd, nn.ConstantPad2d):
    """``nn.ConstantPad2d`` on slabs: constant padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 2
    _mode = "constant"


@register(nn.ConstantPad3d)
class ShardedConstantPad3d(_ShardedPadNd, nn.ConstantPad3d):
    """``nn.ConstantPad3d`` on slabs: constant padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 3
    _mode = "constant"


@register(nn.ReflectionPad1d)
class ShardedReflectionPad1d(_ShardedPadNd, nn.ReflectionPad1d):
    """``nn.ReflectionPad1d`` on slabs: reflect padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 1
    _mode = "reflect"


@register(nn.ReflectionPad2d)
class ShardedReflectionPad2d(_ShardedPadNd, nn.ReflectionPad2d):
    """``nn.ReflectionPad2d`` on slabs: reflect padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 2
    _mode = "reflect"


@register(nn.ReflectionPad3d)
class ShardedReflectionPad3d(_ShardedPadNd, nn.ReflectionPad3d):
    """``nn.ReflectionPad3d`` on slabs: reflect padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 3
    _mode = "reflect"


@register(nn.ReplicationPad1d)
class ShardedReplicationPad1d(_ShardedPadNd, nn.ReplicationPad1d):
    """``nn.ReplicationPad1d`` on slabs: replicate padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 1
    _mode = "replicate"


@register(nn.ReplicationPad2d)
class ShardedReplicationPad2d(_ShardedPadNd, nn.ReplicationPad2d):
    """``nn.ReplicationPad2d`` on slabs: replicate padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 2
    _mode = "replicate"


@register(nn.ReplicationPad3d)
class ShardedReplicationPad3d(_ShardedPadNd, nn.ReplicationPad3d):
    """``nn.ReplicationPad3d`` on slabs: replicate padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 3
    _mode = "replicate"


@register(nn.CircularPad1d)
class ShardedCircularPad1d(_ShardedPadNd, nn.CircularPad1d):
    """``nn.CircularPad1d`` on slabs: circular padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 1
    _mode = "circular"


@register(nn.CircularPad2d)
class ShardedCircularPad2d(_ShardedPadNd, nn.CircularPad2d):
    """``nn.CircularPad2d`` on slabs: circular padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 2
    _mode = "circular"


@register(nn.CircularPad3d)
class ShardedCircularPad3d(_ShardedPadNd, nn.CircularPad3d):
    """``nn.CircularPad3d`` on slabs: circular padding at the domain's edges only (see the module docstring)."""

    _spatial_dims = 3
    _mode = "circular"


__all__ = [
    "ShardedCircularPad1d",
    "ShardedCircularPad2d",
    "ShardedCircularPad3d",
    "ShardedConstantPad1d",
    "ShardedConstantPad2d",
    "ShardedConstantPad3d",
    "ShardedReflectionPad1d",
    "ShardedReflectionPad2d",
    "ShardedReflectionPad3d",
    "ShardedReplicationPad1d",
    "ShardedReplicationPad2d",
    "ShardedReplicationPad3d",
    "ShardedZeroPad1d",
    "ShardedZeroPad2d",
    "ShardedZeroPad3d",
    "pad",
]
