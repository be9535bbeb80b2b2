"""Transolver (and Transolver++): single-device model code, PhysicsNeMo-compatible, then sharding.

``Transolver`` has the constructor arguments, state-dict keys and ``forward(fx, embedding=None,
time=None)`` of NVIDIA PhysicsNeMo 2.2's ``physicsnemo.models.transolver.Transolver`` with
``use_te=False``: a PhysicsNeMo checkpoint loads with ``strict=True`` and gives the same output.
Checkpoints of the original thuml/Transolver models load through
``sharded_nn.converters.transolver_from_thuml``.

Sharding (``snn.convert(model, mesh)`` or ``create_model("transolver", mesh=mesh, ...)``): the
points (dim 1 of ``fx`` and ``embedding``) are sharded over the domain ranks. Unstructured
models take any partition (``sharded_nn.points.PointCloudPartition`` makes spatially coherent,
balanced ones); structured models take slabs of whole rows of the grid's first spatial dim,
``(B, H_local, W, C)`` or flattened ``(B, H_local * W, C)``. Everything except Physics-Attention's
two sums over points is pointwise (LayerNorm over channels, MLPs), so each block costs one
all-reduce of ``B * heads * slice_num * (dim_head + 1)`` numbers (plus one halo row per k3
convolution for structured grids). The output is this rank's points; the single-device output
restricted to them, for any partition.

Layout: blocks (MLP, time embedding, TransolverBlock), the model, the sharded model, the
registered factory entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from sharded_nn.comm import domain_peers, gather_ints
from sharded_nn.convert import convert
from sharded_nn.errors import ShardingError
from sharded_nn.layers.physics_attention import (
    GUMBEL_NOISE_MODES,
    PhysicsAttentionIrregularMesh,
    PhysicsAttentionStructuredMesh2D,
    PhysicsAttentionStructuredMesh3D,
)
from sharded_nn.mesh import domain_axes
from sharded_nn.registry import register

from .factory import register_model

__all__ = ["ShardedTransolver", "Transolver", "TransolverBlock"]

_ACTIVATIONS = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "prelu": nn.PReLU,
    "relu6": nn.ReLU6,
    "elu": nn.ELU,
    "celu": nn.CELU,
    "selu": nn.SELU,
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
    "logsigmoid": nn.LogSigmoid,
    "softplus": nn.Softplus,
    "softshrink": nn.Softshrink,
    "softsign": nn.Softsign,
    "tanh": nn.Tanh,
    "tanhshrink": nn.Tanhshrink,
    "hardtanh": nn.Hardtanh,
    "identity": nn.Identity,
}


def _activation(name: str) -> nn.Module:
    """PhysicsNeMo's activation names (case-insensitive), the stateless ones."""
    try:
        return _ACTIVATIONS[name.lower()]()
    except KeyError:
        raise ValueError(f"Transolver: unknown activation {name!r}; known: {sorted(_ACTIVATIONS)}.") from None


class TransolverMlp(nn.Module):
    """``Linear -> act -> Linear`` with PhysicsNeMo's keys (``layers.0``, ``layers.2``).

    Older PhysicsNeMo/thuml checkpoints name them ``linear_pre.0`` / ``linear_pre`` and
    ``linear_post``; those keys are remapped on load, as PhysicsNeMo does.
    """

    _OLD_TO_NEW = {
        "linear_pre.0.weight": "layers.0.weight",
        "linear_pre.0.bias": "layers.0.bias",
        "linear_pre.weight": "layers.0.weight",
        "linear_pre.bias": "layers.0.bias",
        "linear_post.weight": "layers.2.weight",
        "linear_post.bias": "layers.2.bias",
    }

    def __init__(self, in_features: int, hidden_features: int, out_features: int, act: str = "gelu") -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden_features), _activation(act), nn.Linear(hidden_features, out_features)
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: D102
        for old, new in self._OLD_TO_NEW.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.layers(x)


class TimeEmbedding(nn.Module):
    """Sinusoidal embedding of the per-sample time ``(B,) -> (B, C)`` (``cos`` then ``sin``).

    PhysicsNeMo's ``PositionalEmbedding(C, max_positions=10000, endpoint=False,
    embed_fn="cos_sin")``; its ``freqs`` buffer is part of the state dict.
    """

    def __init__(self, num_channels: int, max_positions: int = 10000) -> None:
        super().__init__()
        half = num_channels // 2
        freqs = (1 / max_positions) ** (torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs)

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = torch.outer(t, self.freqs.to(t.dtype))
        return torch.cat([x.cos(), x.sin()], dim=1)

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, **options) -> nn.Module:
        """Unchanged when sharding: it acts on the per-sample time, replicated on every rank."""
        return module


# Registered as its own sharded form, so that convert neither warns about it nor swaps it.
register(TimeEmbedding)(TimeEmbedding)


class TransolverBlock(nn.Module):
    """Pre-norm block: ``x + Attn(LN(x))``, ``x + MLP(LN(x))``; the last one projects to ``out_dim``."""

    def __init__(
        self,
        num_heads: int,
        hidden_dim: int,
        dropout: float,
        act: str = "gelu",
        mlp_ratio: int = 4,
        last_layer: bool = False,
        out_dim: int = 1,
        slice_num: int = 32,
        spatial_shape: tuple[int, ...] | None = None,
        use_te: bool = False,
        plus: bool = False,
        **attn_options,
    ) -> None:
        super().__init__()
        self.last_layer = last_layer
        self.ln_1 = nn.LayerNorm(hidden_dim)
        common = dict(heads=num_heads, dim_head=hidden_dim // num_heads, dropout=dropout, slice_num=slice_num,
                      use_te=use_te, plus=plus, **attn_options)  # fmt: skip
        if spatial_shape is None:
            self.Attn = PhysicsAttentionIrregularMesh(hidden_dim, **common)
        elif len(spatial_shape) == 2:
            self.Attn = PhysicsAttentionStructuredMesh2D(hidden_dim, spatial_shape, **common)
        elif len(spatial_shape) == 3:
            self.Attn = PhysicsAttentionStructuredMesh3D(hidden_dim, spatial_shape, **common)
        else:
            raise ValueError(f"TransolverBlock: spatial_shape must have 2 or 3 sizes, got {spatial_shape}.")
        self.ln_mlp1 = nn.Sequential(
            nn.LayerNorm(hidden_dim), TransolverMlp(hidden_dim, hidden_dim * mlp_ratio, hidden_dim, act)
        )
        if last_layer:
            self.ln_mlp2 = nn.Sequential(nn.LayerNorm(hidden_dim), nn.Linear(hidden_dim, out_dim))

    def forward(self, fx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        fx = self.Attn(self.ln_1(fx)) + fx
        fx = self.ln_mlp1(fx) + fx
        return self.ln_mlp2(fx) if self.last_layer else fx


class Transolver(nn.Module):
    """Transolver / Transolver++ (PhysicsNeMo 2.2 ``Transolver`` with ``use_te=False``).

    Args:
        functional_dim: channels of ``fx`` (the input fields, without embeddings).
        out_dim: output channels.
        embedding_dim: channels of ``embedding`` (e.g. 3 for xyz). Required unless ``unified_pos``.
        n_layers, n_hidden, dropout, n_head, act, mlp_ratio, slice_num: as in PhysicsNeMo.
        unified_pos: replace the embedding by the distances of each grid point to a ``ref^d``
            reference grid (structured grids only). PhysicsNeMo supports 2-D grids; 3-D grids
            use ``ref^3`` reference points here.
        ref: reference grid size of ``unified_pos``.
        structured_shape: ``(H, W)`` or ``(H, W, D)`` for grids (k3 convolutions project the
            attention inputs); ``None`` for unstructured points.
        use_te: must be False (Transformer Engine is not supported).
        time_input: add a sinusoidal embedding of ``time`` ``(B,)`` passed through an MLP.
        plus: Transolver++ (per-point temperature, Gumbel softmax).
        temperature_clamp: keyword only; clamp of the plain-softmax temperature (PhysicsNeMo
            ``(0.5, 5.0)``). ``transolver_from_thuml`` checkpoints need thuml's values, see
            ``sharded_nn.converters.thuml_transolver_kwargs``.
        slice_norm_eps: keyword only; epsilon of the slice normalisation (PhysicsNeMo ``1e-2``).
        gumbel_noise: keyword only; ``"always"`` (PhysicsNeMo), ``"train"`` (off in ``eval()``)
            or ``"never"``. Change it later with ``set_gumbel_noise``.

    Forward:
        fx: ``(B, N, functional_dim)``, or ``(B, H, W[, D], functional_dim)`` for grids.
        embedding: ``(B, N, embedding_dim)`` or spatially shaped like ``fx``; ignored (replaced
            by the unified positions) when ``unified_pos``.
        time: ``(B,)`` when ``time_input``.

    Returns:
        ``(B, N, out_dim)``, or the spatial shape of ``fx`` with ``out_dim`` channels.
    """

    def __init__(
        self,
        functional_dim: int,
        out_dim: int,
        embedding_dim: int | None = None,
        n_layers: int = 4,
        n_hidden: int = 256,
        dropout: float = 0.0,
        n_head: int = 8,
        act: str = "gelu",
        mlp_ratio: int = 4,
        slice_num: int = 32,
        unified_pos: bool = False,
        ref: int = 8,
        structured_shape: Sequence[int] | None = None,
        use_te: bool = False,
        time_input: bool = False,
        plus: bool = False,
        *,
        temperature_clamp: tuple[float, float] | None = (0.5, 5.0),
        slice_norm_eps: float = 1e-2,
        gumbel_noise: str = "always",
    ) -> None:
        super().__init__()
        if use_te:
            raise ValueError(
                "Transolver: use_te=True (Transformer Engine layers) is not supported; pass use_te=False. "
                "Checkpoints of PhysicsNeMo models built with use_te=False load unchanged."
            )
        if n_hidden % n_head:
            raise ValueError(f"Transolver: n_hidden={n_hidden} must be divisible by n_head={n_head}.")
        if structured_shape is not None:
            structured_shape = tuple(int(s) for s in structured_shape)
            if len(structured_shape) not in (2, 3) or any(s <= 0 for s in structured_shape):
                raise ValueError(
                    f"Transolver: structured_shape must be 2 or 3 positive sizes, got {structured_shape}."
                )
        elif unified_pos:
            raise ValueError("Transolver: unified_pos=True needs structured_shape (a grid).")
        self.use_te = False
        self.structured_shape = structured_shape
        self.unified_pos = unified_pos
        self.n_hidden = n_hidden
        self.time_input = time_input
        if unified_pos:
            self.register_buffer("embedding", self.get_grid(ref))
            self.embedding_dim = ref ** len(structured_shape)
        else:
            if embedding_dim is None:
                raise ValueError("Transolver: embedding_dim is required when unified_pos=False.")
            self.embedding_dim = embedding_dim
        self.preprocess = TransolverMlp(functional_dim + self.embedding_dim, n_hidden * 2, n_hidden, act)
        if time_input:
            self.time_embed = TimeEmbedding(n_hidden)
            self.time_fc = nn.Sequential(nn.Linear(n_hidden, n_hidden), nn.SiLU(), nn.Linear(n_hidden, n_hidden))
        attn_options = dict(
            temperature_clamp=temperature_clamp, slice_norm_eps=slice_norm_eps, gumbel_noise=gumbel_noise
        )
        self.blocks = nn.ModuleList(
            TransolverBlock(n_head, n_hidden, dropout, act, mlp_ratio, i == n_layers - 1, out_dim, slice_num,
                            structured_shape, False, plus, **attn_options)  # fmt: skip
            for i in range(n_layers)
        )
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def get_grid(self, ref: int, batchsize: int = 1) -> torch.Tensor:
        """Unified positions ``(batchsize, N, ref^d)``: distances to a ``ref^d`` grid on ``[0, 1]^d``.

        For 2-D grids the same float32 values as PhysicsNeMo (numpy ``linspace``, then torch).
        """
        axes = [torch.tensor(np.linspace(0, 1, s), dtype=torch.float) for s in self.structured_shape]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(axes))
        ref_axis = torch.tensor(np.linspace(0, 1, ref), dtype=torch.float)
        grid_ref = torch.stack(torch.meshgrid(*[ref_axis] * len(axes), indexing="ij"), dim=-1).reshape(-1, len(axes))
        pos = torch.sqrt(torch.sum((grid[:, None, :] - grid_ref[None, :, :]) ** 2, dim=-1))
        return pos.unsqueeze(0).repeat(batchsize, 1, 1).contiguous()

    def set_gumbel_noise(self, mode: str) -> Transolver:
        """Set the Gumbel noise mode of every Transolver++ attention (``"always"``, ``"train"``, ``"never"``)."""
        if mode not in GUMBEL_NOISE_MODES:
            raise ValueError(f"Transolver.set_gumbel_noise: mode must be one of {GUMBEL_NOISE_MODES}, got {mode!r}.")
        for block in self.blocks:
            block.Attn.gumbel_noise = mode
        return self

    def unified_embedding(self, n_points: int) -> torch.Tensor:
        """The unified-position embedding of this model's points ``(1, N, ref^d)``."""
        return self.embedding

    def forward(
        self, fx: torch.Tensor, embedding: torch.Tensor | None = None, time: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See the class docstring."""
        if fx.dim() < 2:
            raise ValueError(f"Transolver: fx needs at least 2 dims, got shape {tuple(fx.shape)}.")
        if not self.unified_pos and embedding is None:
            raise ValueError("Transolver: embedding is required when unified_pos=False.")
        if time is not None and not self.time_input:
            raise ValueError("Transolver: time was given but the model was built with time_input=False.")
        out_shape = None
        if self.structured_shape is not None:
            if fx.dim() != 3:
                out_shape = fx.shape[:-1]  # (B, H[_local], W[, D])
                fx = fx.reshape(fx.shape[0], -1, fx.shape[-1])
            if embedding is not None and embedding.dim() != 3:
                embedding = embedding.reshape(embedding.shape[0], -1, embedding.shape[-1])
        if self.unified_pos:
            embedding = self.unified_embedding(fx.shape[1]).expand(fx.shape[0], -1, -1).to(fx.dtype)
        fx = self.preprocess(torch.cat((embedding, fx), -1))
        if time is not None:
            fx = fx + self.time_fc(self.time_embed(time)).unsqueeze(1)
        for block in self.blocks:
            fx = block(fx)
        return fx if out_shape is None else fx.reshape(*out_shape, fx.shape[-1])


@register(Transolver)
class ShardedTransolver(Transolver):
    """``Transolver`` on points sharded over the domain ranks; see the module docstring.

    Built by ``snn.convert(model, mesh)`` (or ``from_module``), which converts the blocks'
    Physics-Attention layers and keeps every parameter (state-dict keys unchanged).
    """

    @classmethod
    def from_module(cls, module: Transolver, mesh: DeviceMesh, **options) -> ShardedTransolver:
        """A sharded copy of ``module`` that shares its parameters."""
        if options:
            raise TypeError(f"ShardedTransolver.from_module: unexpected options {sorted(options)}.")
        axes = domain_axes(mesh)
        if module.structured_shape is not None and len(axes) != 1:
            raise ShardingError(
                f"ShardedTransolver: a structured model shards its grid's first spatial dim, which needs a mesh "
                f"with one domain axis; got domain axes {axes}."
            )
        new = cls.__new__(cls)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new.mesh = mesh
        new.mesh_axes = axes
        # Only the attention layers mix points; the MLPs, LayerNorms and the time embedding are
        # pointwise or per-sample. strict: anything else that mixes points must not slip through.
        new._modules["blocks"] = convert(new.blocks, mesh, strict=True)
        return new

    def unified_embedding(self, n_points: int) -> torch.Tensor:
        """This rank's rows of the unified-position embedding (slabs in domain-rank order)."""
        counts = [r[0] for r in gather_ints([n_points], domain_peers(self.mesh))]
        if sum(counts) != self.embedding.shape[1]:
            raise ShardingError(
                f"ShardedTransolver: the ranks hold {counts} grid points, {sum(counts)} in all, but the grid "
                f"{self.structured_shape} has {self.embedding.shape[1]}. Shard the grid along its first spatial dim."
            )
        rank = domain_peers(self.mesh).index
        start = sum(counts[:rank])
        return self.embedding[:, start : start + n_points]

    def extra_repr(self) -> str:  # noqa: D102
        return f"mesh_axes={self.mesh_axes}, dims=(1,)"


@register_model("transolver")
def _create_transolver(name: str, *, mesh: DeviceMesh | None = None, pretrained_file: str | None = None, **kwargs):
    """``create_model("transolver", mesh=..., **Transolver_kwargs)``; ``pretrained_file``: a state dict.

    ``pretrained_file`` is a ``torch.save``'d state dict (or ``{"state_dict": ...}``) or a
    ``.safetensors`` file of a PhysicsNeMo ``use_te=False`` Transolver; it loads with ``strict=True``.
    """
    model = Transolver(**kwargs)
    if pretrained_file is not None:
        if str(pretrained_file).endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(str(pretrained_file))
        else:
            state = torch.load(pretrained_file, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state)
        model.load_state_dict(state, strict=True)
    return model if mesh is None else convert(model, mesh)
