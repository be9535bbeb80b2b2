"""Physics-Attention (Transolver) and its sharded form.

Single-device classes first (the same parameters, state-dict keys and arithmetic as NVIDIA
PhysicsNeMo 2.2's ``physicsnemo.nn.module.physics_attention`` with ``use_te=False``), then the
sharded subclasses that ``convert`` swaps in.

Physics-Attention on points ``x`` of shape ``(B, N, C)``, per head ``h``:

1. slice weights ``w[n, s] = softmax_s(proj(x_n) / temperature)`` (Transolver++: a Gumbel softmax
   with a per-point temperature): pointwise, local on every slab;
2. slice tokens ``t[s] = sum_n w[n, s] fx[n] / (sum_n w[n, s] + eps)``: two sums over points;
3. attention among the S slice tokens: small, replicated;
4. deslice ``out[n] = sum_s w[n, s] t'[s]``: pointwise, local.

Sharding contract (``ShardedPhysicsAttention*``):
    input ``(B, N_local, C)``: points (dim 1) sharded over all domain ranks of the mesh, any
        partition (sizes may differ, parts need not be contiguous in any order). The structured
        variants need slabs of whole rows of their first spatial dim (``N_local`` a multiple of
        ``W`` or ``W * D``) and a mesh with one domain axis.
    output ``(B, N_local, C)``, the same points.
    forward: the two sums over points travel in ONE all-reduce of ``B * H * S * (D + 1)``
        numbers (the weighted feature sums and the weight sums packed together). The structured
        variants also run their k3 projections as sharded convolutions (one halo row exchanged
        with each neighbour).
    backward: the all-reduce's backward sums the partial gradients of the replicated slice
        tokens (DESIGN.md section 3); input gradients are exact, parameter gradients are partial
        sums over the domain ranks.
    The output equals the single-device layer on the gathered points for every partition (up to
    floating-point summation order), except the Gumbel noise of ``plus=True`` in ``"always"`` /
    ``"train"`` mode: each rank draws its own points' noise, so a sharded run is a different
    sample of the same distribution. Turn the noise off (``gumbel_noise="never"``) to compare.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import einsum, rearrange
from torch.distributed.device_mesh import DeviceMesh

from ..comm import all_reduce_sum, domain_peers, gather_ints
from ..comm.sizes import scope_active
from ..errors import ShardingError
from ..mesh import domain_axes, domain_group, domain_size
from ..registry import register
from ..weights import VALUES_FACT, VALUES_HINT, rearm_checked, take_digest, values_shown
from ..weights import arm as arm_values_check
from .conv import ShardedConv2d, ShardedConv3d

__all__ = [
    "GUMBEL_NOISE_MODES",
    "PhysicsAttention",
    "PhysicsAttentionIrregularMesh",
    "PhysicsAttentionStructuredMesh2D",
    "PhysicsAttentionStructuredMesh3D",
    "ShardedPhysicsAttentionIrregularMesh",
    "ShardedPhysicsAttentionStructuredMesh2D",
    "ShardedPhysicsAttentionStructuredMesh3D",
    "gumbel_softmax",
]

#: ``"always"``: Gumbel noise in every forward (PhysicsNeMo's behaviour); ``"train"``: only in
#: training mode (``model.eval()`` turns it off); ``"never"``: a plain softmax with the per-point
#: temperature (deterministic).
GUMBEL_NOISE_MODES = ("always", "train", "never")


def gumbel_softmax(logits: torch.Tensor, tau: torch.Tensor | float = 1.0, *, noise: bool = True) -> torch.Tensor:
    """Transolver++'s Gumbel softmax over the last dim (PhysicsNeMo's formula and RNG use).

    With ``noise=False`` the Gumbel term is dropped: ``softmax(logits / tau)``.
    """
    if noise:
        u = torch.rand_like(logits)
        logits = logits - torch.log(-torch.log(u + 1e-8) + 1e-8)
    return F.softmax(logits / tau, dim=-1)


class PhysicsAttention(nn.Module):
    """Physics-Attention shared part; subclasses define the input projections.

    Args:
        dim: input and output channels C.
        heads: attention heads H.
        dim_head: channels per head D.
        dropout: dropout of the output projection.
        slice_num: physics slices S.
        use_te: must be False (Transformer Engine layers are not supported); kept for
            PhysicsNeMo's signature.
        plus: Transolver++ (one shared projection, per-point temperature, Gumbel softmax).
        temperature_clamp: ``(min, max)`` applied to the learned temperature of the plain softmax
            (PhysicsNeMo: ``(0.5, 5.0)``; thuml's structured models ``(0.1, 5.0)``; thuml's
            irregular-mesh model ``None``, no clamp).
        slice_norm_eps: added to the slice weight sums before dividing (PhysicsNeMo ``1e-2``,
            thuml ``1e-5``).
        gumbel_noise: one of ``GUMBEL_NOISE_MODES`` (Transolver++ only).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        dim_head: int,
        dropout: float,
        slice_num: int,
        use_te: bool = False,
        plus: bool = False,
        *,
        temperature_clamp: tuple[float, float] | None = (0.5, 5.0),
        slice_norm_eps: float = 1e-2,
        gumbel_noise: str = "always",
    ) -> None:
        super().__init__()
        if use_te:
            raise ValueError(
                f"{type(self).__name__}: use_te=True (Transformer Engine layers) is not supported; "
                "pass use_te=False. Checkpoints of use_te=False models load unchanged."
            )
        if gumbel_noise not in GUMBEL_NOISE_MODES:
            raise ValueError(
                f"{type(self).__name__}: gumbel_noise must be one of {GUMBEL_NOISE_MODES}, got {gumbel_noise!r}."
            )
        inner_dim = dim_head * heads
        self.dim, self.dim_head, self.heads, self.slice_num = dim, dim_head, heads, slice_num
        self.plus = plus
        self.scale = dim_head**-0.5
        self.use_te = False
        self.temperature_clamp = None if temperature_clamp is None else tuple(temperature_clamp)
        self.slice_norm_eps = slice_norm_eps
        self.gumbel_noise = gumbel_noise
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        # Registration order follows PhysicsNeMo, so state_dict() lists the keys in its order.
        self.temperature = nn.Parameter(torch.ones([1, 1, heads, 1]) * 0.5)
        if plus:
            self.proj_temperature = nn.Sequential(
                nn.Linear(dim_head, slice_num), nn.GELU(), nn.Linear(slice_num, 1), nn.GELU()
            )
        self.in_project_slice = nn.Linear(dim_head, slice_num)
        nn.init.orthogonal_(self.in_project_slice.weight)
        self.qkv_project = nn.Linear(dim_head, 3 * dim_head, bias=False)
        self.out_linear = nn.Linear(inner_dim, dim)
        self.out_dropout = nn.Dropout(dropout)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_mid, fx_mid)``, each ``(B, N, H, D)``; Transolver++ returns the same tensor twice."""
        raise NotImplementedError

    def slice_weights(self, x_mid: torch.Tensor) -> torch.Tensor:
        """Per-point slice weights ``(B, N, H, S)`` (pointwise: local on a slab)."""
        logits = self.in_project_slice(x_mid)
        if self.plus:
            temp = torch.clamp(self.temperature + self.proj_temperature(x_mid), min=0.01).to(logits.dtype)
            noise = self.gumbel_noise == "always" or (self.gumbel_noise == "train" and self.training)
            w = gumbel_softmax(logits, temp, noise=noise)
        else:
            temp = self.temperature
            if self.temperature_clamp is not None:
                temp = torch.clamp(temp, min=self.temperature_clamp[0], max=self.temperature_clamp[1])
            w = F.softmax(logits / temp.to(logits.dtype), dim=-1)
        return w.to(logits.dtype)

    def reduce_points(self, sums: torch.Tensor) -> torch.Tensor:
        """Sum over all points of the packed per-part sums; the identity on one device."""
        return sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, C) -> (B, N, C)``."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{type(self).__name__}: expected input (B, N, {self.dim}), got shape {tuple(x.shape)}."
            )
        x_mid, fx_mid = self.project(x)
        w = self.slice_weights(x_mid)
        # The two sums over points, packed so that a sharded layer reduces them in one message:
        # (B, H, S, D) weighted features and (B, H, S, 1) weight sums.
        sums = torch.cat([einsum(w, fx_mid, "b n h s, b n h d -> b h s d"), w.sum(1).unsqueeze(-1)], dim=-1)
        sums = self.reduce_points(sums)
        tokens = sums[..., :-1] / (sums[..., -1:] + self.slice_norm_eps)
        q, k, v = rearrange(self.qkv_project(tokens), "b h s (t d) -> t b h s d", t=3)
        out_tokens = F.scaled_dot_product_attention(q, k, v)
        out = einsum(w, out_tokens, "b n h s, b h s d -> b n h d")
        return self.out_dropout(self.out_linear(rearrange(out, "b n h d -> b n (h d)")))

    def extra_repr(self) -> str:  # noqa: D102
        s = f"heads={self.heads}, dim_head={self.dim_head}, slice_num={self.slice_num}, plus={self.plus}"
        if self.plus:
            return s + f", gumbel_noise={self.gumbel_noise!r}"
        return s + f", temperature_clamp={self.temperature_clamp}, slice_norm_eps={self.slice_norm_eps}"


class PhysicsAttentionIrregularMesh(PhysicsAttention):
    """Physics-Attention on unstructured points: linear input projections."""

    def __init__(
        self,
        dim: int,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        slice_num: int = 64,
        use_te: bool = False,
        plus: bool = False,
        **options,
    ) -> None:
        super().__init__(dim, heads, dim_head, dropout, slice_num, use_te, plus, **options)
        self.in_project_x = nn.Linear(dim, dim_head * heads)
        if not plus:
            self.in_project_fx = nn.Linear(dim, dim_head * heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        x_mid = rearrange(self.in_project_x(x), "b n (h d) -> b n h d", h=self.heads)
        if self.plus:
            return x_mid, x_mid
        return x_mid, rearrange(self.in_project_fx(x), "b n (h d) -> b n h d", h=self.heads)


class _StructuredMesh(PhysicsAttention):
    """Physics-Attention on a row-major flattened grid: k-by-k convolutions project the input.

    The grid's first spatial extent is read from the input (``N / prod(spatial_shape[1:])``), so
    the same code runs on a slab of whole rows.
    """

    _conv: type[nn.Module] = nn.Conv2d
    _ndim = 2

    def __init__(
        self,
        dim: int,
        spatial_shape: Sequence[int],
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        slice_num: int = 64,
        kernel: int = 3,
        use_te: bool = False,
        plus: bool = False,
        **options,
    ) -> None:
        super().__init__(dim, heads, dim_head, dropout, slice_num, use_te, plus, **options)
        if len(spatial_shape) != self._ndim:
            raise ValueError(f"{type(self).__name__}: spatial_shape must have {self._ndim} sizes, got {spatial_shape}.")
        self.spatial_shape = tuple(int(s) for s in spatial_shape)
        self.in_project_x = self._conv(dim, dim_head * heads, kernel, 1, kernel // 2)
        if not plus:
            self.in_project_fx = self._conv(dim, dim_head * heads, kernel, 1, kernel // 2)

    def _row_size(self) -> int:
        n = 1
        for s in self.spatial_shape[1:]:
            n *= s
        return n

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        b, n, c = x.shape
        row = self._row_size()
        if n % row:
            raise ValueError(
                f"{type(self).__name__}: {n} points are not whole rows of the grid {self.spatial_shape} "
                f"({row} points per row of the first spatial dim)."
            )
        # (B, N, C) -> (B, C, S0, S1, ...): the points are the grid in row-major order.
        grid = x.reshape(b, n // row, *self.spatial_shape[1:], c).movedim(-1, 1)
        x_mid = rearrange(self.in_project_x(grid), "b (h d) ... -> b (...) h d", h=self.heads)
        if self.plus:
            return x_mid, x_mid
        return x_mid, rearrange(self.in_project_fx(grid), "b (h d) ... -> b (...) h d", h=self.heads)

    def extra_repr(self) -> str:  # noqa: D102
        return f"spatial_shape={self.spatial_shape}, " + super().extra_repr()


class PhysicsAttentionStructuredMesh2D(_StructuredMesh):
    """Physics-Attention on a 2-D grid ``(H, W)`` flattened to ``N = H * W`` points (Conv2d)."""

    _conv, _ndim = nn.Conv2d, 2


class PhysicsAttentionStructuredMesh3D(_StructuredMesh):
    """Physics-Attention on a 3-D grid ``(H, W, D)`` flattened to ``N = H * W * D`` points (Conv3d)."""

    _conv, _ndim = nn.Conv3d, 3

    def __init__(
        self,
        dim: int,
        spatial_shape: Sequence[int],
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        slice_num: int = 32,
        kernel: int = 3,
        use_te: bool = False,
        plus: bool = False,
        **options,
    ) -> None:
        super().__init__(dim, spatial_shape, heads, dim_head, dropout, slice_num, kernel, use_te, plus, **options)


# ---------------------------------------------------------------------------------------------
# Sharded forms


class _ShardedPhysicsAttention:
    """Mixin: the sums over points become one all-reduce over the domain ranks."""

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, **options):
        """A sharded copy of ``module`` sharing its parameters (state-dict keys unchanged)."""
        if options:
            raise TypeError(f"{cls.__name__}.from_module: unexpected options {sorted(options)}.")
        new = cls.__new__(cls)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new._init_sharding(mesh)
        return new

    def _init_sharding(self, mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{type(self).__name__}: mesh must be a torch DeviceMesh, got {type(mesh).__name__}.")
        self.mesh = mesh
        self.mesh_axes = domain_axes(mesh)
        arm_values_check(self)  # its weights are compared at its first call (``point_counts``)

    def reduce_points(self, sums: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if domain_size(self.mesh) == 1:
            return sums
        # Under autocast the per-rank sums are fp16/bf16: add the ranks' partials in float32 and
        # round once, as one device's matmul accumulates the whole sum in float32 (DESIGN.md 4).
        low = sums.dtype in (torch.float16, torch.bfloat16)
        total = all_reduce_sum(sums.float() if low else sums, domain_group(self.mesh))
        return total.to(sums.dtype)

    def point_counts(self, x: torch.Tensor) -> list[int]:
        """Every domain rank's point count, after checking that the ranks agree on B and C.

        One all-gather of four integers; every rank runs the same checks on the same numbers, so
        a bad input raises the same error everywhere instead of leaving ranks in the all-reduce.
        Used on its own (outside a converted model's layout scope, whose entry checks every
        weight), the layer's weights ride along: a value digest at its first call and after each
        ``load_state_dict`` (``sharded_nn.weights``; 0 otherwise, so the width is fixed).
        """
        own = domain_size(self.mesh) > 1 and not scope_active() and not torch.compiler.is_compiling()
        mine = [x.dim(), *(list(x.shape[:3]) + [-1] * 3)[:3], take_digest(self) if own else 0]
        rows = gather_ints(mine, domain_peers(self.mesh))
        if len({r[4] for r in rows}) != 1:
            rearm_checked()  # (every rank alike): checked again at the next call until they agree
            raise ShardingError(
                f"{type(self).__name__}: the domain ranks hold different {VALUES_FACT}: "
                f"{values_shown([r[4] for r in rows])}. {VALUES_HINT}"
            )
        if any(r[0] != 3 or r[1] != rows[0][1] or r[3] != self.dim for r in rows):
            raise ShardingError(
                f"{type(self).__name__}: every rank needs a (B, N_local, {self.dim}) input with the same B; "
                f"the ranks hold shapes {[tuple(r[1:1 + r[0]]) for r in rows]}."
            )
        return [r[2] for r in rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        self._counts = self.point_counts(x)
        return super().forward(x)

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, mesh_axes={self.mesh_axes}, dims=(1,)"


@register(PhysicsAttentionIrregularMesh)
class ShardedPhysicsAttentionIrregularMesh(_ShardedPhysicsAttention, PhysicsAttentionIrregularMesh):
    """``PhysicsAttentionIrregularMesh`` on points sharded over the domain ranks (any partition).

    ``ShardedPhysicsAttentionIrregularMesh(dim, ..., mesh=mesh)`` builds one directly.
    """

    def __init__(self, *args, mesh: DeviceMesh, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh)


class _ShardedStructured(_ShardedPhysicsAttention):
    """Grid slabs of whole rows of the first spatial dim; the k3 projections are sharded convs."""

    _sharded_conv: type[nn.Module] = ShardedConv2d

    def __init__(self, *args, mesh: DeviceMesh, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh)

    def _init_sharding(self, mesh: DeviceMesh) -> None:
        super()._init_sharding(mesh)
        if len(self.mesh_axes) != 1:
            raise ShardingError(
                f"{type(self).__name__}: the structured variant shards its grid's first spatial dim only, "
                f"so it needs a mesh with one domain axis; got domain axes {self.mesh_axes}."
            )
        for name in ("in_project_x", "in_project_fx"):
            conv = self._modules.get(name)
            if conv is not None and not isinstance(conv, self._sharded_conv):
                self._modules[name] = self._sharded_conv.from_module(conv, mesh, dims=(2,))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        # Checked on every rank's point count (gathered by forward), so that a bad slab raises
        # the same error on every rank instead of leaving the others in a collective.
        row = self._row_size()
        if any(n % row for n in self._counts):
            raise ShardingError(
                f"{type(self).__name__}: every rank must hold whole rows of the grid {self.spatial_shape} "
                f"({row} points per row of the first spatial dim); the ranks hold {self._counts} points. "
                "Shard the (B, S0, ...) grid along S0 (snn.shard(x, mesh, dims=(1,))) before flattening."
            )
        return super().project(x)


@register(PhysicsAttentionStructuredMesh2D)
class ShardedPhysicsAttentionStructuredMesh2D(_ShardedStructured, PhysicsAttentionStructuredMesh2D):
    """``PhysicsAttentionStructuredMesh2D`` on slabs of whole grid rows (first spatial dim sharded)."""

    _sharded_conv = ShardedConv2d


@register(PhysicsAttentionStructuredMesh3D)
class ShardedPhysicsAttentionStructuredMesh3D(_ShardedStructured, PhysicsAttentionStructuredMesh3D):
    """``PhysicsAttentionStructuredMesh3D`` on slabs of whole grid planes (first spatial dim sharded)."""

    _sharded_conv = ShardedConv3d
