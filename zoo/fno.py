"""Fourier neural operator (2-D and 3-D): single-device model code that ``sharded_nn.convert`` shards.

Reads top to bottom: the spectral convolution and its sharded class, the FNO block, the model,
the registered entry points (``create_model("fno2d" | "fno3d")``).

Nothing here needs a mesh: ``FNO(2, 3, 1)`` is an ordinary ``nn.Module``, written as FNOs are
written for one device (``torch.fft.rfftn``, a tensor of zeros for the output spectrum, the kept
modes cropped and assigned corner by corner, ``torch.fft.irfftn`` back to the grid). Converted,
the 1x1 convolutions are swapped for sharded ones and ``SpectralConv`` for
``ShardedSpectralConv``, which makes only the kept modes (``sharded_nn/fft_modes.py``: each rank
transforms its own rows for them, one small all-reduce of the modes; each rank's rows made back
from them), so no all-to-all moves the activation. The same single-device code also runs
exactly without the sharded class, under the forward guard (``sharded_nn/guard_fft.py``: whole
transforms through all-to-alls, mode crops and assignments by global positions). The sharded
model computes exactly what this code computes on the whole grid. (``ShardedSpectralConv``
belongs in ``sharded_nn/layers``; it lives here beside its model, as the UNet's pad classes do.)

Sharding notes:
    - Shard any grid dims, the last one (halved by the real transform) included: H on a 1-D
      mesh, H and W on a 2x2 mesh, D and H (or H and W) of a volume.
    - Slabs need no alignment (``snn.alignment(model) == (1,)``) and may be uneven.
    - Per spectral layer: one all-reduce of ``N * C * prod(kept modes)`` complex numbers (2-D,
      16 modes, 32 channels, float32: 128 KiB per sample); the weights are applied on every rank alike
      (small next to the transforms). Where a dim keeps more than half its length as modes (the
      two ends overlap), the layer takes the whole spectrum's route (all-to-alls over the
      sharded dims; the last grid dim must then be whole).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from sharded_nn.comm import axis_peers
from sharded_nn.convert import convert
from sharded_nn.errors import ShardingError
from sharded_nn.fft import transform
from sharded_nn.fft_modes import check_modes, fits, from_kept_spectrum, kept_spectrum
from sharded_nn.layers.base import ShardedMixin
from sharded_nn.layout import slab_overlap
from sharded_nn.mesh import axis_index, group_over
from sharded_nn.registry import register

from .factory import register_model

__all__ = ["FNO", "FNOBlock", "ShardedSpectralConv", "SpectralConv"]


def _to_tuple(v: int | Sequence[int], n: int, what: str) -> tuple[int, ...]:
    out = (v,) * n if isinstance(v, int) else tuple(v)
    if len(out) != n or any(not isinstance(m, int) or m < 1 for m in out):
        raise ValueError(f"FNO: {what} must be a positive int or {n} positive ints, got {v!r}.")
    return out


class SpectralConv(nn.Module):
    """A linear map of the lowest Fourier modes, per channel pair (Li et al., 2021).

    ``x`` (N, C_in, *grid) -> (N, C_out, *grid): ``rfftn`` over the grid dims, the ``modes[d]``
    lowest frequencies of each dim multiplied by a complex weight (both ends of each dim's
    spectrum but the last, whose spectrum is halved: ``2 ** (k - 1)`` corners of weights), the
    other modes set to zero, ``irfftn`` back to the grid's size. Weights are stored as real
    tensors with a trailing (re, im) pair, so ``.double()``/``.half()`` and optimisers treat them
    as ordinary parameters.

    Sharding contract: ``convert`` swaps it for ``ShardedSpectralConv`` (any grid dims). The same
    code in a class of a user's own (not registered) runs under the forward guard: input and
    output slabs along any grid dim but the last, same layout; exact on uneven slabs.
    """

    def __init__(self, spatial_dims: int, in_channels: int, out_channels: int, modes: int | Sequence[int]):
        super().__init__()
        if spatial_dims not in (1, 2, 3):
            raise ValueError(f"SpectralConv: spatial_dims must be 1, 2 or 3, got {spatial_dims!r}.")
        self.spatial_dims = spatial_dims
        self.in_channels, self.out_channels = in_channels, out_channels
        self.modes = _to_tuple(modes, spatial_dims, "modes")
        corners = 2 ** (spatial_dims - 1)
        scale = 1.0 / (in_channels * out_channels)
        self.weight = nn.Parameter(scale * torch.rand(corners, in_channels, out_channels, *self.modes, 2))

    def corners(self) -> list[tuple[slice, ...]]:
        """The kept modes: low and high ends of every grid dim but the last, the low end of the last."""
        ends = [(slice(None, m), slice(-m, None)) for m in self.modes[:-1]]
        return [(*c, slice(None, self.modes[-1])) for c in itertools.product(*ends)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-self.spatial_dims, 0))
        x_ft = torch.fft.rfftn(x, dim=dims)
        out_ft = torch.zeros(x.shape[0], self.out_channels, *x_ft.shape[2:], dtype=x_ft.dtype, device=x.device)
        weight = torch.view_as_complex(self.weight)
        for i, corner in enumerate(self.corners()):
            idx = (slice(None), slice(None), *corner)
            out_ft[idx] = torch.einsum("bi...,io...->bo...", x_ft[idx], weight[i].to(x_ft.dtype))
        return torch.fft.irfftn(out_ft, s=x.shape[2:], dim=dims)

    def extra_repr(self) -> str:
        return f"{self.spatial_dims}d, {self.in_channels}, {self.out_channels}, modes={self.modes}"


@register(SpectralConv)
class ShardedSpectralConv(ShardedMixin, SpectralConv):
    """``SpectralConv`` on slabs, usable on its own (``ShardedSpectralConv(2, 32, 32, 16, mesh=mesh)``)
    and what ``convert`` swaps ``SpectralConv`` for.

    Sharding contract: input ``(N, C_in, *grid)`` sharded along ``dims`` (any grid dims, the
    last included; uneven slabs, no alignment); output ``(N, C_out, *grid)`` in the same layout.
    Only the kept modes are made (``sharded_nn.fft_modes``): each rank transforms its own rows
    for them and one all-reduce of the modes sums the parts, so every rank holds all kept modes,
    applies the weights to them and makes its own rows back (no all-to-all). Modes whose two
    ends overlap on a dim (``2 * modes > length``) take the whole spectrum's route
    (``sharded_nn.fft``, two all-to-alls per sharded dim each way, the spectrum in the input's
    layout, each rank multiplying the kept modes it holds by its rows of the weights); there the
    last grid dim must be whole. One agreement of the input layout (scoped: the output keeps
    it).
    """

    _scoped_agree = True

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        self._spatial_dims = self.spatial_dims
        super()._init_sharding(mesh, dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        what = type(self).__name__
        layouts = self._agree(x).layouts
        grid = list(range(2, 2 + self.spatial_dims))
        rows = {d: (0, x.shape[d], x.shape[d]) for d in grid}  # (slab start, length, global length)
        for k, (d, lay) in enumerate(zip(self.dims, layouts)):
            r = axis_index(self.mesh, self.mesh_axes[k])
            rows[d] = (lay.starts[r], lay.sizes[r], lay.size)
        sizes = [rows[d][2] for d in grid]
        check_modes(sizes, self.modes, grid, what)
        if not fits(sizes, self.modes):  # the two ends of a dim's modes overlap: the whole spectrum
            return self._whole_spectrum(x, layouts, grid, what)
        # Only the kept modes: each rank's rows' part of them, summed (one small all-reduce);
        # the weights applied on every rank alike; each rank's rows made from them.
        z = kept_spectrum(x, rows, grid, self.modes, group_over(self.mesh, self.mesh_axes))
        out = torch.zeros(z.shape[0], self.out_channels, *z.shape[2:], dtype=z.dtype, device=z.device)
        weight = torch.view_as_complex(self.weight)
        for i, corner in enumerate(self.corners()):
            # A corner's block of the compact spectrum: [:m] (low) or [m:] (high) per dim, all of the last.
            block = [slice(None), slice(None)]
            for sl, m in zip(corner[:-1], self.modes[:-1]):
                block.append(slice(0, m) if sl.start is None else slice(m, 2 * m))
            block = tuple(block)
            out[block] = torch.einsum("bi...,io...->bo...", z[block], weight[i].to(z.dtype))
        return from_kept_spectrum(out, rows, grid, self.modes)

    def _whole_spectrum(self, x: torch.Tensor, layouts, grid: list[int], what: str) -> torch.Tensor:
        """The whole spectrum's route (``sharded_nn.fft``: all-to-alls over the sharded dims),
        for modes whose two ends overlap on some dim (``2m > n``): the corners are assigned one
        after another there, as on one device."""
        if grid[-1] in self.dims:
            raise ShardingError(
                f"{what}: modes {self.modes} overlap at the two ends of a grid dim of {[x.shape[d] for d in grid]} "
                f"(2 * modes > length), which needs the whole spectrum, and the last grid dim (dim {grid[-1]}) is "
                "sharded, whose spectrum the real transform halves; keep at most half of each dim's length as "
                "modes, or shard the other grid dims."
            )
        sharded = {d: (axis_peers(self.mesh, a), lay.sizes) for d, a, lay in zip(self.dims, self.mesh_axes, layouts)}
        x_ft = transform("rfft", x, sharded, grid, [None] * len(grid), None, what)
        out_ft = torch.zeros(x.shape[0], self.out_channels, *x_ft.shape[2:], dtype=x_ft.dtype, device=x.device)
        weight = torch.view_as_complex(self.weight)
        for i, corner in enumerate(self.corners()):
            idx, widx = [slice(None), slice(None)], [slice(None), slice(None)]
            for d, sl in zip(grid, corner):
                if d not in sharded:
                    idx.append(sl)
                    widx.append(slice(None))
                    continue
                # This rank's part of the corner's global range [a, b), and the weights' rows for it.
                k = self.dims.index(d)
                lay, r = layouts[k], axis_index(self.mesh, self.mesh_axes[k])
                a, b, _ = sl.indices(lay.size)
                s0, n = lay.starts[r], lay.sizes[r]
                lo, hi = slab_overlap(a, b, s0, n)
                idx.append(slice(lo, hi))
                widx.append(slice(s0 + lo - a, s0 + hi - a))
            idx, w = tuple(idx), weight[i][tuple(widx)].to(x_ft.dtype)
            out_ft[idx] = torch.einsum("bi...,io...->bo...", x_ft[idx], w)
        sizes = [sum(sharded[d][1]) if d in sharded else x.shape[d] for d in grid]
        return transform("irfft", out_ft, sharded, grid, sizes, None, what)


class FNOBlock(nn.Module):
    """``act(spectral(x) + conv1x1(x))``: the global (spectral) and local (pointwise) paths."""

    def __init__(self, spatial_dims: int, width: int, modes: int | Sequence[int], act: type[nn.Module] = nn.GELU):
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[spatial_dims - 1]
        self.spectral = SpectralConv(spatial_dims, width, width, modes)
        self.pointwise = conv(width, width, 1)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.spectral(x) + self.pointwise(x))


class FNO(nn.Module):
    """Fourier neural operator: lift to ``width`` channels, ``depth`` FNO blocks, project.

    Args:
        spatial_dims: 1, 2 or 3.
        in_channels, out_channels: input and output channels (append coordinate channels to the
            input yourself where the operator needs positions).
        width: channels of the blocks.
        modes: kept Fourier modes per grid dim (an int for all); at most the grid's size (and,
            for the last dim, half of it plus one).
        depth: number of FNO blocks.
        projection: hidden channels of the two-layer pointwise projection.

    Input ``(N, in_channels, *grid)``, output ``(N, out_channels, *grid)`` at any grid size.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        *,
        width: int = 32,
        modes: int | Sequence[int] = 12,
        depth: int = 4,
        projection: int = 128,
    ):
        super().__init__()
        if spatial_dims not in (1, 2, 3):
            raise ValueError(f"FNO: spatial_dims must be 1, 2 or 3, got {spatial_dims!r}.")
        if depth < 1:
            raise ValueError(f"FNO: depth must be >= 1, got {depth!r}.")
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[spatial_dims - 1]
        self.spatial_dims = spatial_dims
        self.lift = conv(in_channels, width, 1)
        self.blocks = nn.Sequential(*(FNOBlock(spatial_dims, width, modes) for _ in range(depth)))
        self.proj = nn.Sequential(conv(width, projection, 1), nn.GELU(), conv(projection, out_channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.blocks(self.lift(x)))


@register_model("fno2d", "fno3d")
def create_fno(
    name: str, *, mesh: DeviceMesh | None = None, dims: Sequence[int] | int | None = None, **kwargs
) -> nn.Module:
    """``FNO(2 or 3, ...)``, converted for ``mesh`` when one is given.

    Args:
        name: ``"fno2d"`` or ``"fno3d"``.
        mesh: a mesh with domain axes, or ``None`` for the plain model.
        dims: tensor dims the domain axes shard (default: the first spatial dims); any grid dims.
        **kwargs: ``FNO`` arguments (``in_channels``, ``out_channels``, ``width``, ``modes``, ...).
    """
    k = 2 if name == "fno2d" else 3
    model = FNO(k, **kwargs)
    if mesh is None:
        return model
    return convert(model, mesh, dims=dims, strict=True)
