"""UNet (2-D and 3-D): single-device model code that ``sharded_nn.convert`` shards.

Reads top to bottom: padding helpers (per-dim padding modes), the far-edge pad/crop pair, blocks
(residual block, self-attention block, down and up steps), the model, the registered entry
points (``create_model("unet2d" | "unet3d")``).

Nothing here needs a mesh: ``UNet(2, 3, 2)`` is an ordinary ``nn.Module``. Every layer that
mixes positions is a registered torch module (convolutions, pools, transposed convolutions,
upsampling, norms, ``nn.MultiheadAttention``) or one of the three modules below that come with
their sharded class (``PerDimPadConv``, ``FarEdgePad``, ``FarEdgeCrop``; they belong in
``sharded_nn/layers`` and live here until they move), so ``convert`` swaps them all and the
sharded model computes exactly what this code computes on the full grid.

Sharding notes:
    - Slabs must start at multiples of ``2 ** depth`` (``depth = len(channels) - 1``) along every
      sharded dim: ``snn.alignment(model, dims)`` returns it, ``model.alignment`` holds it.
    - A grid whose size is not a multiple of ``2 ** depth`` is padded at its far edge (each dim
      with that dim's padding mode) and cropped back at the end. On aligned slabs only the last
      rank of an axis holds the far edge, so only it pads and crops.
    - Attention flattens each rank's slab row-major into tokens. With one domain axis sharding
      the first spatial dim these are contiguous runs of the global row-major token sequence.
      Otherwise (W sharded, 2-D meshes) a rank's tokens are not contiguous; the attention here
      is non-causal and unmasked, so each query's result depends only on the *set* of keys, and
      ring attention over all domain ranks is exact in every decomposition.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from sharded_nn.comm import axis_peers
from sharded_nn.comm.sizes import scope_declare
from sharded_nn.convert import convert
from sharded_nn.errors import ShardingError
from sharded_nn.forward_guard import mark_reviewed
from sharded_nn.layers.base import ShardedMixin, agree
from sharded_nn.layers.norm import grad_in_layout_of
from sharded_nn.layers.padding import pad as sharded_pad
from sharded_nn.layers.window import Window, extend, plan_window
from sharded_nn.layout import Layout
from sharded_nn.mesh import axis_index
from sharded_nn.registry import register, registered

from .factory import register_model

__all__ = [
    "FarEdgeCrop",
    "FarEdgePad",
    "PerDimPadConv",
    "ShardedFarEdgeCrop",
    "ShardedFarEdgePad",
    "ShardedPerDimPadConv",
    "UNet",
]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
NORMS = ("group", "batch", "instance", None)
DOWNS = ("conv", "maxpool", "avgpool")
UPS = ("transpose", "nearest", "linear")

# F.pad's name for each conv padding mode.
_F_PAD_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_MAXPOOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
_AVGPOOL = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
_BATCHNORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_INSTANCENORM = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_LINEAR_MODE = {1: "linear", 2: "bilinear", 3: "trilinear"}


def padding_modes(padding_mode: str | Sequence[str], spatial_dims: int) -> tuple[str, ...]:
    """One conv padding mode per spatial dim, validated (``"zeros"``, ``"reflect"``, ...)."""
    modes = (padding_mode,) * spatial_dims if isinstance(padding_mode, str) else tuple(padding_mode)
    if len(modes) != spatial_dims or any(m not in PADDING_MODES for m in modes):
        raise ValueError(
            f"UNet: padding_mode must be one of {PADDING_MODES} or a tuple of {spatial_dims} of them "
            f"(one per spatial dim, first to last), got {padding_mode!r}."
        )
    return modes


def conv_nd(
    spatial_dims: int, cin: int, cout: int, kernel: int, stride: int = 1, *, modes: Sequence[str]
) -> nn.Module:
    """A ``kernel``-wide convolution with ``kernel // 2`` padding in ``modes`` (one per spatial dim).

    One mode for every dim: a plain ``nn.ConvNd`` (its sharded class pads without copying the
    slab). Different modes: a ``PerDimPadConv``.
    """
    if len(set(modes)) == 1:
        return _CONV[spatial_dims](cin, cout, kernel, stride=stride, padding=kernel // 2, padding_mode=modes[0])
    return PerDimPadConv(spatial_dims, cin, cout, kernel, stride, modes=modes)


class PerDimPadConv(nn.Module):
    """A convolution whose padding mode differs per spatial dim (``nn.ConvNd`` has only one).

    Each dim is padded by ``kernel // 2`` on both sides with its own mode (``F.pad``), then the
    inner ``conv`` (``padding=0``) runs. Explicit pad modules followed by a ``padding=0`` conv
    would compute the same on one device, but on slabs they shift the layout (the first rank
    would own the rows its left padding adds), so the sharded class ``ShardedPerDimPadConv``
    plans halos and edge padding per dim instead.

    Args:
        spatial_dims: 1, 2 or 3.
        cin, cout, kernel, stride: as for ``nn.ConvNd``.
        modes: one of ``"zeros"``, ``"reflect"``, ``"replicate"``, ``"circular"`` per spatial dim.
    """

    def __init__(
        self, spatial_dims: int, cin: int, cout: int, kernel: int, stride: int = 1, *, modes: Sequence[str]
    ) -> None:
        super().__init__()
        self.modes = tuple(modes)
        self.pad = kernel // 2
        self.conv = _CONV[spatial_dims](cin, cout, kernel, stride=stride)

    def _padded(self, x: torch.Tensor, dims: Sequence[int] = ()) -> torch.Tensor:
        """``x`` padded along every spatial dim not in ``dims``, one ``F.pad`` per mode."""
        n = len(self.modes)
        for mode in dict.fromkeys(self.modes):
            widths: list[int] = []
            for i in reversed(range(n)):  # F.pad order: last dim first
                p = self.pad if self.modes[i] == mode and 2 + i not in dims else 0
                widths += [p, p]
            if any(widths):
                x = F.pad(x, widths, _F_PAD_MODE[mode])
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.conv(self._padded(x))

    def extra_repr(self) -> str:  # noqa: D102
        return f"padding={self.pad}, modes={self.modes}"


@register(PerDimPadConv)
class ShardedPerDimPadConv(ShardedMixin, PerDimPadConv):
    """``PerDimPadConv`` on slabs: each sharded dim extended with halos and its own edge padding.

    Sharding contract: as ``ShardedConvNd`` (input slabs aligned to the stride, output slabs
    owned by the rank where each window starts), with each dim's padding mode (circular wraps
    around the ring). Forward: one all-gather of local shapes (none inside the model's layout
    scope once the layout is known; the output layout is declared), then one synchronous halo exchange
    per sharded dim (``window.extend``), then the inner convolution on the extended slab; its
    backward returns the halo gradients to their owners. (Belongs in ``layers/conv.py`` as a
    per-dim ``padding_mode``, where it could reuse the copy-free path; it lives here until then.)
    """

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        self._spatial_dims = len(self.modes)
        super()._init_sharding(mesh, dims)
        self._plans: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        what = type(self).__name__
        # Scoped: the output's layout is declared below (as ShardedConvNd does).
        layouts = self._agree(x, scoped=True).layouts
        conv = self.conv
        if layouts not in self._plans:  # keyed by the global layouts: the same hit/miss on every rank
            self._plans[layouts] = tuple(
                plan_window(
                    lay,
                    Window(conv.kernel_size[d - 2], conv.stride[d - 2], conv.dilation[d - 2], self.pad, self.pad),
                    d,
                    mode=self.modes[d - 2],
                    what=what,
                )
                for lay, d in zip(layouts, self.dims)
            )
        scope_declare(self.mesh, self.dims, x.dim(), [plan.out for plan in self._plans[layouts]])
        for plan, d, axis in zip(self._plans[layouts], self.dims, self.mesh_axes):
            x = extend(x, plan, axis_peers(self.mesh, axis), self.modes[d - 2])
        return conv(self._padded(x, self.dims))

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, {self.sharding_repr()}"


def norm_nd(kind: str | None, spatial_dims: int, channels: int) -> nn.Module:
    """``"group"`` (up to 8 groups), ``"batch"``, ``"instance"`` (affine) or ``None`` (identity)."""
    if kind == "group":
        return nn.GroupNorm(math.gcd(8, channels), channels)
    if kind == "batch":
        return _BATCHNORM[spatial_dims](channels)
    if kind == "instance":
        return _INSTANCENORM[spatial_dims](channels, affine=True)
    if kind is None:
        return nn.Identity()
    raise ValueError(f"UNet: norm must be one of {NORMS}, got {kind!r}.")


# --------------------------------------------------------------------------------------------
# Far-edge padding and cropping: any grid size through a model that halves it `depth` times


class FarEdgePad(nn.Module):
    """Pad each spatial dim at its far (right) edge up to a multiple of ``multiple[i]``.

    Each dim is padded with its own mode (conv mode names: ``"zeros"``, ``"reflect"``,
    ``"replicate"``, ``"circular"``; circular appends the first positions). The amount depends on
    the global size, so the sharded class (``ShardedFarEdgePad``) learns it from the layout.

    Args:
        multiple: one multiple per spatial dim (first to last).
        modes: one padding mode per spatial dim.
    """

    def __init__(self, multiple: Sequence[int], modes: Sequence[str]) -> None:
        super().__init__()
        self.multiple = tuple(int(m) for m in multiple)
        self.modes = tuple(modes)
        if len(self.multiple) != len(self.modes) or min(self.multiple) < 1:
            raise ValueError(f"FarEdgePad: need one multiple >= 1 and one mode per dim, got {multiple}, {modes}.")
        # Read by snn.alignment: slabs must start at multiples of this along every dim, so that
        # only the last rank holds the far edge.
        self.alignment_multiple = self.multiple

    def amounts(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """Right padding of each spatial dim for the global ``sizes``."""
        return tuple(-s % m for s, m in zip(sizes, self.multiple))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self._pad(x, self.amounts(x.shape[2:]), lambda t, pad, mode: F.pad(t, pad, mode))

    def _pad(self, x, amounts, pad_fn):
        n = len(self.multiple)
        for i, (amount, mode) in enumerate(zip(amounts, self.modes)):
            if amount:
                widths = [0] * (2 * n)
                widths[2 * (n - 1 - i) + 1] = amount
                x = pad_fn(x, tuple(widths), _F_PAD_MODE[mode])
        return x

    def extra_repr(self) -> str:  # noqa: D102
        return f"multiple={self.multiple}, modes={self.modes}"


class FarEdgeCrop(nn.Module):
    """Crop ``x`` at its far edges to the spatial size of ``like``: ``x[..., :H, :W]``."""

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x[(..., *(slice(0, s) for s in like.shape[2:]))]


@register(FarEdgePad)
class ShardedFarEdgePad(ShardedMixin, FarEdgePad):
    """``FarEdgePad`` on slabs: only the last rank of a sharded dim pads (circular: from rank 0).

    Sharding contract: input sharded along ``dims`` in slabs that start at multiples of
    ``multiple`` (else a ``ShardingError`` on every rank); the amount comes from the global size
    (one all-gather of local shapes, which also checks the model's entry facts inside its
    layout scope; the padded layout is declared to the scope beside the input's: see ``forward``); the padding itself is
    ``sharded_nn.layers.padding.pad`` on the agreed layouts.
    Output: the same slabs, the last one longer. (A generic far-edge pad belongs in
    ``sharded_nn/layers/padding.py``; it lives here until it moves there.)
    """

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        self._spatial_dims = len(self.multiple)
        super()._init_sharding(mesh, dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        what = type(self).__name__
        # Scoped: inside the model's layout scope this (usually the model's first layer) agrees
        # on the input together with the model's entry facts, and the padded output's layout
        # is declared below, so the layers after it need no agreement of their own.
        layouts = self._agree(x, scoped=True).layouts
        sizes = list(x.shape[2:])
        for d, lay in zip(self.dims, layouts):
            m = self.multiple[d - 2]
            if not lay.is_aligned(m):
                raise ShardingError(
                    f"{what}: padding dim {d} to a multiple of {m} needs every slab to start at a multiple "
                    f"of {m}, but the slabs start at {lay.starts} (sizes {lay.sizes}). Shard the input with "
                    f"align=snn.alignment(model, dims={self.dims})."
                )
            sizes[d - 2] = lay.size
        amounts = self.amounts(sizes)
        out_layouts = tuple(
            Layout(lay.sizes[:-1] + (lay.sizes[-1] + amounts[d - 2],)) for d, lay in zip(self.dims, layouts)
        )
        # Declared beside the input's layout, which the scope keeps: the padded layout shares the
        # first slabs' sizes with it, so the scope answers neither at full resolution (those
        # layers agree; the coarser levels' layouts, derived from the padded one, are answered).
        # Forgetting the input's layout instead, as before session 63, answered a later slab of
        # it with the padded layout on the first ranks and not on the last: a hang, or a wrong
        # pairing of collectives.
        scope_declare(self.mesh, self.dims, x.dim(), out_layouts)
        # Each dim is padded after the ones before it: the layouts agreed above, updated per dim.
        current = list(layouts)

        def pad_fn(t: torch.Tensor, pad: tuple[int, ...], mode: str) -> torch.Tensor:
            out = sharded_pad(t, pad, self.mesh, mode, dims=self.dims, layouts=tuple(current))
            for k, d in enumerate(self.dims):
                if pad[2 * (t.dim() - 1 - d) + 1]:
                    current[k] = out_layouts[k]
            return out

        return self._pad(x, amounts, pad_fn)

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, {self.sharding_repr()}"


@register(FarEdgeCrop)
class ShardedFarEdgeCrop(ShardedMixin, FarEdgeCrop):
    """``FarEdgeCrop`` on slabs: ``x`` is cropped to the *global* size of ``like``.

    Sharding contract: ``x`` and ``like`` sharded along ``dims``; rank r keeps the part of its
    slab below the global size of ``like`` (the last rank crops its tail; a rank left with
    nothing raises a ``ShardingError`` on every rank). One all-gather of local shapes for each of
    ``x`` and ``like`` (inside a layout scope only for ``like``: ``x``'s is usually derived);
    the crop itself is a local view, its gradient local too. (Belongs in
    ``sharded_nn/layers/padding.py`` as negative far-edge padding; it lives here until then.)
    """

    _spatial_dims = 3

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        super()._init_sharding(mesh, dims)

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # noqa: D102
        what = type(self).__name__
        # ``x``'s layout is usually known in the model's layout scope (the output of declared
        # layers). ``like``'s is agreed: the model's input, whose layout the scope may not hold
        # (a lookup of a layout the scope does not hold could hit on some ranks only).
        have = agree(x, self.mesh, self.dims, what=what, scoped=True).layouts
        target = agree(like, self.mesh, self.dims, what=f"{what} (reference)").layouts
        idx: list[slice] = [slice(None)] * x.dim()
        out_layouts: list[Layout] = []
        for d in range(2, x.dim()):
            idx[d] = slice(0, like.shape[d])
        for k, (d, want, lay) in enumerate(zip(self.dims, target, have)):
            keep = [max(0, min(n, want.size - a)) for n, a in zip(lay.sizes, lay.starts)]
            if min(keep) == 0 or lay.size < want.size:
                raise ShardingError(
                    f"{what}: cropping dim {d} from {lay.size} (slabs {lay.sizes}) to {want.size} would leave "
                    f"ranks {[r for r, n in enumerate(keep) if n == 0]} empty or needs growing; crop only a tail "
                    "that lies on the last rank."
                )
            idx[d] = slice(0, keep[axis_index(self.mesh, self.mesh_axes[k])])
            out_layouts.append(Layout(tuple(keep)))
        scope_declare(self.mesh, self.dims, x.dim(), out_layouts)
        return x[tuple(idx)]

    def extra_repr(self) -> str:  # noqa: D102
        return self.sharding_repr()


# --------------------------------------------------------------------------------------------
# Blocks


class ResBlock(nn.Module):
    """Pre-activation residual block: norm, SiLU, conv3, norm, SiLU, conv3, plus a 1x1 shortcut."""

    def __init__(self, spatial_dims: int, cin: int, cout: int, *, norm: str | None, modes: Sequence[str]) -> None:
        super().__init__()
        self.norm1 = norm_nd(norm, spatial_dims, cin)
        self.conv1 = conv_nd(spatial_dims, cin, cout, 3, modes=modes)
        self.norm2 = norm_nd(norm, spatial_dims, cout)
        self.conv2 = conv_nd(spatial_dims, cout, cout, 3, modes=modes)
        self.act = nn.SiLU()
        self.shortcut = _CONV[spatial_dims](cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.act(self.norm2(h)))
        return self.shortcut(x) + h


@mark_reviewed  # its row-major token order is rank-local on W or 2-D meshes; unmasked attention ignores order
class AttentionBlock(nn.Module):
    """Self-attention over all grid positions: norm, multi-head attention over tokens, residual.

    The grid ``(N, C, *S)`` is flattened row-major into tokens ``(N, prod(S), C)``; on slabs
    ``convert`` turns the ``nn.MultiheadAttention`` into ring attention over the domain ranks
    (see the module docstring for why any decomposition is exact).
    """

    def __init__(self, spatial_dims: int, channels: int, *, num_heads: int, norm: str | None) -> None:
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"UNet: attention at {channels} channels needs num_heads dividing it, got {num_heads}.")
        self.norm = norm_nd("group" if norm is None else norm, spatial_dims, channels)
        self.attn = nn.MultiheadAttention(channels, num_heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        # The attention hands back its input gradient in (H, W, N, C) order, which torch 2.14's CPU
        # batch/instance-norm backward misreads (sharded_nn/layers/norm.py): the gradient gets the
        # norm output's own layout.
        h = self.norm(x)
        h = grad_in_layout_of(h, h, exact=True)
        tokens = h.flatten(2).transpose(1, 2)  # (N, L_local, C), L_local = this slab's positions
        out, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        return x + out.transpose(1, 2).reshape(x.shape)


def down_nd(kind: str, spatial_dims: int, channels: int, modes: Sequence[str]) -> nn.Module:
    """Halve every spatial dim: a 3x3 stride-2 conv, or a 2x2 max/avg pool."""
    if kind == "conv":
        return conv_nd(spatial_dims, channels, channels, 3, stride=2, modes=modes)
    if kind == "maxpool":
        return _MAXPOOL[spatial_dims](2)
    if kind == "avgpool":
        return _AVGPOOL[spatial_dims](2)
    raise ValueError(f"UNet: down must be one of {DOWNS}, got {kind!r}.")


def up_nd(kind: str, spatial_dims: int, cin: int, cout: int, modes: Sequence[str]) -> nn.Module:
    """Double every spatial dim: a 2x2 stride-2 transposed conv, or upsampling then a 3x3 conv."""
    if kind == "transpose":
        return _CONV_T[spatial_dims](cin, cout, 2, stride=2)
    if kind in ("nearest", "linear"):
        mode = "nearest" if kind == "nearest" else _LINEAR_MODE[spatial_dims]
        corners = None if kind == "nearest" else False
        return nn.Sequential(
            nn.Upsample(scale_factor=2, mode=mode, align_corners=corners),
            conv_nd(spatial_dims, cin, cout, 3, modes=modes),
        )
    raise ValueError(f"UNet: up must be one of {UPS}, got {kind!r}.")


class Level(nn.Module):
    """``num_res_blocks`` residual blocks, then optional self-attention."""

    def __init__(
        self, spatial_dims: int, cin: int, cout: int, *, blocks: int, norm, modes, attention: bool, num_heads: int
    ) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(ResBlock(spatial_dims, cin if i == 0 else cout, cout, norm=norm, modes=modes) for i in range(blocks))
        )
        self.attn = AttentionBlock(spatial_dims, cout, num_heads=num_heads, norm=norm) if attention else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.attn(self.blocks(x))


# --------------------------------------------------------------------------------------------
# Model


# Its forward's own calls are a channel concatenation and module calls; every position-mixing
# step is a sharded layer (or the reviewed attention block), so it is exact on slabs without the
# guard looking inside, and torch.compile may trace it as a whole.
@mark_reviewed
class UNet(nn.Module):
    """A 2-D or 3-D UNet with concatenation skips; single-device code, sharded by ``convert``.

    Layout: a 3x3 stem conv to ``channels[0]``; encoder level i runs ``num_res_blocks`` residual
    blocks at ``channels[i]`` (optional attention) and saves its output as the skip; a down step
    halves the grid between levels; the decoder doubles it back (``up``), concatenates the skip
    and runs ``num_res_blocks`` residual blocks; a norm, SiLU and 1x1 conv make the output.

    Args:
        spatial_dims: 1, 2 or 3.
        in_channels: input channels.
        out_channels: output channels.
        channels: widths per level; ``depth = len(channels) - 1`` halvings.
        num_res_blocks: residual blocks per level (encoder and decoder), >= 1.
        norm: ``"group"`` (GroupNorm with up to 8 groups), ``"batch"``, ``"instance"`` or ``None``.
        down: ``"conv"`` (3x3 stride-2), ``"maxpool"`` or ``"avgpool"`` (2x2).
        up: ``"transpose"`` (2x2 stride-2 transposed conv), ``"nearest"`` or ``"linear"``
            (upsampling by 2, then a 3x3 conv).
        attention_levels: level indices (0 = full resolution) with self-attention after the
            residual blocks, in the encoder and the decoder.
        num_heads: attention heads (must divide the level's width).
        padding_mode: conv padding, one mode for every spatial dim or one per dim, e.g.
            ``("replicate", "circular")`` for a latitude-longitude grid (latitude clamped,
            longitude periodic). Also used to pad a grid that is not a multiple of ``2 ** depth``.

    Input ``(N, in_channels, *S)`` of any spatial size; output ``(N, out_channels, *S)``.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        *,
        channels: Sequence[int] = (32, 64, 128, 256),
        num_res_blocks: int = 1,
        norm: str | None = "group",
        down: str = "conv",
        up: str = "transpose",
        attention_levels: Sequence[int] = (),
        num_heads: int = 1,
        padding_mode: str | Sequence[str] = "zeros",
    ) -> None:
        super().__init__()
        if spatial_dims not in (1, 2, 3):
            raise ValueError(f"UNet: spatial_dims must be 1, 2 or 3, got {spatial_dims}.")
        channels = tuple(int(c) for c in channels)
        if not channels or min(channels) < 1 or num_res_blocks < 1:
            raise ValueError(
                f"UNet: need channels >= 1 per level and num_res_blocks >= 1, got {channels}, {num_res_blocks}."
            )
        levels = len(channels)
        bad = [i for i in attention_levels if not 0 <= i < levels]
        if bad:
            raise ValueError(f"UNet: attention_levels {tuple(attention_levels)} name levels outside 0..{levels - 1}.")
        if norm not in NORMS or down not in DOWNS or up not in UPS:
            raise ValueError(
                f"UNet: norm must be one of {NORMS}, down one of {DOWNS}, up one of {UPS}; got "
                f"norm={norm!r}, down={down!r}, up={up!r}."
            )
        modes = padding_modes(padding_mode, spatial_dims)
        self.spatial_dims, self.channels, self.modes = spatial_dims, channels, modes
        self.depth = levels - 1
        #: Slabs must start at multiples of this along every sharded dim (snn.alignment reads the layers).
        self.alignment = 2**self.depth
        att = set(attention_levels)
        kw = dict(blocks=num_res_blocks, norm=norm, modes=modes, num_heads=num_heads)

        self.pad = FarEdgePad((self.alignment,) * spatial_dims, modes)
        self.stem = conv_nd(spatial_dims, in_channels, channels[0], 3, modes=modes)
        self.encoder = nn.ModuleList(
            Level(spatial_dims, channels[max(i - 1, 0)], channels[i], attention=i in att, **kw) for i in range(levels)
        )
        self.downs = nn.ModuleList(down_nd(down, spatial_dims, channels[i], modes) for i in range(self.depth))
        self.ups = nn.ModuleList(
            up_nd(up, spatial_dims, channels[i + 1], channels[i], modes) for i in range(self.depth)
        )
        self.decoder = nn.ModuleList(
            Level(spatial_dims, 2 * channels[i], channels[i], attention=i in att, **kw) for i in range(self.depth)
        )
        self.head = nn.Sequential(
            norm_nd(norm, spatial_dims, channels[0]), nn.SiLU(), _CONV[spatial_dims](channels[0], out_channels, 1)
        )
        self.crop = FarEdgeCrop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dim() != self.spatial_dims + 2:
            raise ValueError(
                f"UNet: expected a {self.spatial_dims + 2}-d (N, C, *S) input for spatial_dims={self.spatial_dims}, "
                f"got shape {tuple(x.shape)}."
            )
        h = self.stem(self.pad(x))
        skips = []
        for i, level in enumerate(self.encoder):
            h = level(h)
            if i < self.depth:
                skips.append(h)
                h = self.downs[i](h)
        for i in reversed(range(self.depth)):
            h = self.decoder[i](torch.cat([skips[i], self.ups[i](h)], dim=1))
        return self.crop(self.head(h), x)


# --------------------------------------------------------------------------------------------
# Registered entry points


def dims_plan(model: nn.Module, dims: Sequence[int] | int | None) -> dict[str, dict] | None:
    """A ``convert`` plan that gives ``dims`` to every layer whose sharded class takes ``dims``.

    Grid layers take ``dims``; token layers (attention) shard their sequence and do not.
    (``snn.convert(model, mesh, dims=...)`` does this for every model once it lands.)
    """
    if dims is None:
        return None
    plan = {}
    for name, module in model.named_modules():
        cls = registered(type(module))
        if cls is not None and "dims" in inspect.signature(cls._init_sharding).parameters:
            plan[name] = {"dims": dims}
    return plan


@register_model("unet2d", "unet3d")
def create_unet(
    name: str, *, mesh: DeviceMesh | None = None, dims: Sequence[int] | int | None = None, **kwargs
) -> nn.Module:
    """``UNet(2 or 3, ...)``, converted for ``mesh`` when one is given.

    Args:
        name: ``"unet2d"`` or ``"unet3d"``.
        mesh: a mesh with domain axes, or ``None`` for the plain model.
        dims: tensor dims the domain axes shard (default: the first spatial dims); e.g.
            ``dims=(3,)`` shards longitude (W) of a latitude-longitude grid.
        **kwargs: ``UNet`` arguments (``in_channels``, ``out_channels``, ``channels``, ...).

    Shard inputs with ``align=snn.alignment(model, dims)`` (``2 ** depth``).
    """
    model = UNet(2 if name == "unet2d" else 3, **kwargs)
    if mesh is None:
        return model
    return convert(model, mesh, plan=dims_plan(model, dims), strict=True)
