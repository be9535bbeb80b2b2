"""``convert(model, mesh)``: swap every registered layer of a module tree for its sharded class.

Plain local tensors flow between layers; only layers that mix values across a sharded dim need
replacing. Every other layer is checked against the sharded dims, from what it is known to act
on:

- pointwise layers (torch's and timm's activations, Dropout, Identity, Embedding) act on no dim;
- layers on trailing dims (``Linear``, ``Bilinear``, ``RMSNorm``, timm's channels-last
  ``LayerNorm``/``RmsNorm``) act on the last dim(s); ``GLU``/``Softmax``/``LogSoftmax``/
  ``Softmin`` on their ``dim``; channel layers (timm's ``LayerNorm2d``/``RmsNorm2d``,
  ``ChannelShuffle``, ``LocalResponseNorm``) on dim 1;
- layers that take statistics over positions without a sharded class (timm ``BatchNormAct2d``
  in training, timm ``GroupNorm``) and unknown leaf layers mix positions.

A layer is a *hazard* when a dim it acts on can be a sharded dim. Convert cannot see the rank of
the tensors a layer receives, so it uses this documented policy:

- the sharded dims are ``dims`` (the ``convert`` keyword; default ``default_dims(mesh)``, one
  per domain axis) together with the dims of every layer it swapped (plan options included);
- the tensor rank is ``2 + k`` for every k-d grid layer in the model (``Conv2d`` -> 4, ...): a
  trailing-dim layer is checked as if it saw those grid tensors. So ``Linear`` is a hazard in a
  1-d CNN (``(N, C, L)``: the last dim is L) and on a 2-D mesh of a 2-d CNN (W is sharded), not
  on a 1-D mesh of a 2-d CNN (it acts on the unsharded W, or on channels after a permute);
- a model without grid layers (tokens ``(B, L, C)``, points ``(B, N, C)``) is taken to carry at
  least one trailing channel dim after the sharded dims.

Hazards are named in a ``ShardingWarning`` (a ``ShardingNotImplementedError`` with
``strict=True``); ``plan={"<name>": None}`` marks a layer reviewed. In timm modules, the children
registered after a global pool (the classifier head: norm, flatten, fc) act on the pooled,
replicated features and are not reported.

Functional calls inside a model's own ``forward`` (``F.interpolate``, ``x.mean((2, 3))``,
``torch.roll``, a ``view`` into windows) cannot be seen from the module tree: ``convert`` installs
the *forward guard* (``sharded_nn.forward_guard``) on the converted root, which computes such
calls exactly when they run or raises a ``ShardingError`` naming the call, the module and the
source line. ``guard=False`` turns it off (the model then runs unchecked).
"""

from __future__ import annotations

import fnmatch
import inspect
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils import parametrize

from .errors import CONTEXT_ATTR, ModuleContext, ShardingError, ShardingNotImplementedError, ShardingWarning
from .mesh import axis_size, domain_axes
from .registry import registered, sharded_classes
from .sharding import default_dims

# --------------------------------------------------------------------------------------------
# What a layer acts on: a tuple of tensor dims (negative counts from the end; () = pointwise),
# MIXES (takes statistics over positions: a hazard whatever is sharded) or UNKNOWN (not in the
# tables: a hazard for leaf layers; a composite's children are checked one by one instead).

MIXES = "mixes positions"
UNKNOWN = "unknown"

_TORCH_POINTWISE: tuple[type, ...] = (
    nn.Identity,
    nn.Dropout,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,  # one weight per channel, applied elementwise
    nn.RReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardshrink,
    nn.Softshrink,
    nn.Tanhshrink,
    nn.Softplus,
    nn.Softsign,
    nn.Sigmoid,
    nn.LogSigmoid,
    nn.Tanh,
    nn.Threshold,
    nn.Embedding,  # a lookup per index: adds a trailing dim, mixes nothing
)
_TORCH_TRAILING: tuple[type, ...] = (nn.Linear, nn.Bilinear, nn.LazyLinear)  # the last dim
_TORCH_DIM_ATTR: tuple[type, ...] = (nn.GLU, nn.Softmax, nn.LogSoftmax, nn.Softmin)  # their .dim
# Channel dropout draws one mask per (sample, channel) for all positions; on slabs every rank
# would draw its own without the forward guard (``_GUARDED``).
_CHANNEL_DROPOUT = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)

# Grid layers give the rank of the tensors flowing through the model: 2 + k for a k-d layer.
# (BatchNorm1d/InstanceNorm1d also take (N, C) features, so they say nothing about the rank.)
_GRID_BASES = (
    "Conv", "ConvTranspose", "LazyConv", "LazyConvTranspose", "MaxPool", "AvgPool", "LPPool",
    "AdaptiveAvgPool", "AdaptiveMaxPool", "FractionalMaxPool", "MaxUnpool", "ReflectionPad",
    "ReplicationPad", "ZeroPad", "ConstantPad", "CircularPad",
)  # fmt: skip
_GRID_RANK: dict[type, int] = {
    getattr(nn, f"{base}{k}d"): k for base in _GRID_BASES for k in (1, 2, 3) if hasattr(nn, f"{base}{k}d")
} | {getattr(nn, f"{base}{k}d"): k for base in ("BatchNorm", "InstanceNorm") for k in (2, 3)}


def _timm_tables() -> dict[type, object]:
    """timm (and torchvision, MONAI) layer class -> what it acts on (see ``_acts_on``), for the modules loaded.

    A model can only hold timm layers once timm is imported, so nothing is imported here.
    """
    table: dict[type, object] = {}
    for mod_name in ("timm.layers.activations", "timm.layers.activations_me"):
        mod = sys.modules.get(mod_name)
        for obj in vars(mod).values() if mod else ():
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == mod_name:
                table[obj] = ()  # every timm activation is elementwise
    groups = {
        "timm.layers.norm": {
            "trailing": ("LayerNorm", "LayerNormFp32", "RmsNorm", "RmsNormFp32", "SimpleNorm", "SimpleNormFp32"),
            "channels": (
                "LayerNorm2d", "LayerNorm2dFp32", "LayerNormExp2d", "RmsNorm2d", "RmsNorm2dFp32", "SimpleNorm2d",
                "SimpleNorm2dFp32",
            ),
            "mixes": ("GroupNorm", "GroupNorm1"),
        },
        "timm.layers.norm_act": {
            "trailing": ("LayerNormAct", "LayerNormActFp32", "RmsNormAct", "RmsNormActFp32"),
            "channels": ("LayerNormAct2d", "LayerNormAct2dFp32", "RmsNormAct2d", "RmsNormAct2dFp32"),
            "pointwise": ("FrozenBatchNormAct2d",),
            "batchnorm": ("BatchNormAct2d", "SyncBatchNormAct"),
            "mixes": ("GroupNormAct", "GroupNorm1Act"),
        },
        # A per-channel scale of tokens (last dim) or of NCHW maps (dim 1).
        "timm.layers.layer_scale": {"pointwise": ("LayerScale", "LayerScale2d")},
        # MetaFormer's layer and residual scales, and its norms without bias (ConvFormer, CAFormer:
        # LayerNorm2d's over the channels, LayerNorm's over the last dim). Its blocks run on
        # channels-last maps in the attention stages (CAFormer: the norms, the attention's
        # Linear layers and the MLP over the channels of (B, H, W, C)), all followed by the guard.
        "timm.models.metaformer": {"pointwise": ("Scale",), "channels": ("LayerNorm2dNoBias",),
                                   "trailing": ("LayerNormNoBias",), "guarded": ("MetaFormerBlock",)},
        # Its statistics over positions are torch calls (a vector norm over H and W) that the
        # forward guard routes to ``reductions.norm``: exact under the guard, mixing without it.
        "timm.layers.grn": {"guarded": ("GlobalResponseNorm",)},
        # One keep/drop decision per sample: the guard draws it alike on every rank (its draws
        # on replicated tensors share one stream), so every slab of a sample is dropped or kept.
        "timm.layers.drop": {"guarded": ("DropPath",)},
        # Global pools of NHWC or NCHW maps written as ``x.mean(dim)`` / ``x.amax(dim)`` (timm's
        # ``SelectAdaptivePool2d`` picks them for flattened or NHWC heads, e.g. Swin's): the guard
        # routes the reductions over sharded dims.
        "timm.layers.adaptive_avgmax_pool": {
            "guarded": ("FastAdaptiveAvgPool", "FastAdaptiveMaxPool", "FastAdaptiveAvgMaxPool",
                        "FastAdaptiveCatAvgMaxPool"),
        },
        "torchvision.ops.stochastic_depth": {"guarded": ("StochasticDepth",)},
        # Swin's patch merging: a reshape of the channels-last token grid into 2 x 2 groups, a
        # norm and a Linear over the channels, all followed by the guard (the grid's H and W are
        # sharded dims 1 and 2 there, not the NCHW dims the static check assumes on a 2x2 mesh).
        "timm.models.swin_transformer": {"guarded": ("PatchMerging",)},
        "timm.models.swin_transformer_v2": {"guarded": ("PatchMerging",)},
        "timm.models.swin_transformer_v2_cr": {"guarded": ("PatchMerging",)},
        # (torchvision's Swin blocks too: a LayerNorm and an MLP of Linear layers over the
        # channels-last tokens around the sharded window attention.)
        "torchvision.models.swin_transformer": {"guarded": ("PatchMerging", "PatchMergingV2", "SwinTransformerBlock",
                                                            "SwinTransformerBlockV2")},
        "monai.networks.nets.swin_unetr": {"guarded": ("PatchMerging", "PatchMergingV2")},
        # torchvision's ConvNeXt: its LayerNorm2d permutes to channels last, normalises the
        # channels and permutes back; its block runs a Permute, a LayerNorm and two Linear layers
        # over channels-last maps, all followed by the guard (the static check would take them
        # for layers over W, the last dim, on a 2x2 mesh: 33 false alarms on convnext_tiny).
        "torchvision.models.convnext": {"channels": ("LayerNorm2d",), "guarded": ("CNBlock",)},
        # A permutation of dims (torchvision's ConvNeXt and Swin: channels last and back), which
        # the guard follows; ResNeSt's softmax over the radix groups of pooled features, whose
        # view and softmax the guard follows (or refuses) like any call of the model's own.
        "torchvision.ops.misc": {"guarded": ("Permute",)},
        "timm.layers.split_attn": {"guarded": ("RadixSoftmax",)},
        # HaloNet's relative position logits inside each block (a table over the block's own
        # offsets, not the image's: views, pads and a matmul the guard follows; exact since
        # session 67, when views whose constants split a dim beside a -1 became followed).
        "timm.layers.halo_attn": {"guarded": ("PosEmbedRel",)},
        # einops' layers are torch calls (reshape, permute, reductions, einsum) that the guard
        # follows or routes (MONAI's attention blocks hold ``Rearrange`` layers).
        "einops.layers.torch": {"guarded": ("Rearrange", "Reduce", "EinMix")},
        "monai.networks.layers.drop_path": {"guarded": ("DropPath",)},
        # MONAI's elementwise activations (its "SWISH", "MEMSWISH" and "MISH" act names); GEGLU
        # splits and gates the last dim.
        "monai.networks.blocks.activation": {"pointwise": ("Swish", "MemoryEfficientSwish", "Mish"),
                                             "trailing_dim": ("GEGLU",)},
    }  # fmt: skip
    for mod_name, kinds in groups.items():
        mod = sys.modules.get(mod_name)
        for kind, names in kinds.items() if mod else ():
            for name in names:
                if isinstance(getattr(mod, name, None), type):
                    table[getattr(mod, name)] = kind
    return table


#: Unregistered subclasses whose position-mixing calls the forward guard computes exactly (or
#: refuses): see ``forward_guard._GuardMode._h_conv``, ``_h_spatial_norm`` (the ``F.group_norm``
#: of timm's ``GroupNorm1`` subclasses, e.g. MetaFormer's ``GroupNorm1NoBias``) and the pool
#: handler (timm's TF-"same" ``MaxPool2dSame``/``AvgPool2dSame``: ``F.pad`` then ``F.*_pool2d``).
_GUARD_ROUTED = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
    nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._LPPoolNd,
)
#: ``_acts_on`` of a layer whose position-mixing calls the forward guard routes (timm's
#: ``GlobalResponseNorm``): nothing to report with the guard on, ``MIXES`` with it off.
_GUARDED = "guarded"


def _acts_on(m: nn.Module, timm_table: Mapping[type, object]) -> tuple[int, ...] | str:
    """The tensor dims ``m`` combines values along, ``MIXES``, or ``UNKNOWN``."""
    kind = timm_table.get(type(m), UNKNOWN)
    if kind is UNKNOWN and getattr(type(m), "_sharded_nn_guarded", None) is type(m):
        kind = "guarded"  # ``forward_guard.mark_guarded``
    if kind == "trailing" or (kind is UNKNOWN and isinstance(m, nn.RMSNorm)):
        return tuple(range(-len(m.normalized_shape), 0))
    if kind == "channels":
        return (1,)
    if kind == "trailing_dim":
        return (-1,)
    if kind == "pointwise" or kind == ():
        return ()
    if kind == "mixes":
        return MIXES
    if kind == "guarded":
        return _GUARDED
    if kind == "batchnorm":
        # Batch statistics (over N and every position) in training, or without running stats.
        uses_batch_stats = m.training or m.running_mean is None
        return MIXES if uses_batch_stats else ()
    if isinstance(m, _TORCH_POINTWISE):
        return ()
    if isinstance(m, _TORCH_TRAILING):
        return (-1,)
    if isinstance(m, _TORCH_DIM_ATTR):
        # Softmax(dim=None) picks a dim from the input's rank: nothing to check against.
        return MIXES if m.dim is None else (m.dim,)
    if isinstance(m, nn.Softmax2d):
        return (-3,)  # channels of (N, C, H, W) or (C, H, W)
    if isinstance(m, (nn.ChannelShuffle, nn.LocalResponseNorm)):
        return (1,)
    if isinstance(m, _CHANNEL_DROPOUT):
        # In training the guard draws the per-channel mask alike on every rank.
        return () if not m.training or m.p == 0 else _GUARDED
    if isinstance(m, nn.LayerNorm):  # a subclass (the exact class is registered)
        return tuple(range(-len(m.normalized_shape), 0))
    return UNKNOWN


def _replicated_children(m: nn.Module) -> tuple[str, ...]:
    """Children of a timm module (or an ``nn.Sequential``) that run on globally pooled (replicated) features.

    timm registers a model's head in forward order (``forward_head``: global_pool -> norm ->
    flatten -> drop -> fc, in ResNet, EfficientNet, ConvNeXt's ``NormMlpClassifierHead``, ...;
    ``SelectAdaptivePool2d``: pool -> flatten), so the children of a timm module registered
    after a global pool see the pooled tensor, which a sharded global pool replicates over the
    domain ranks. A pool that is not sharded is itself reported.
    """
    # (An nn.Sequential's registration order is its forward order by definition: MetaFormer's
    # head is one, global pool first. torchvision's models register theirs in forward order
    # too: its Swin's norm, permute, avgpool, flatten, head.)
    if not (type(m).__module__.startswith(("timm.", "torchvision.")) or type(m) is nn.Sequential):
        return ()
    names = list(m._modules)
    if type(m).__name__ == "SelectAdaptivePool2d":
        return tuple(names[names.index("pool") + 1 :]) if "pool" in names and _is_global_pool(m) else ()
    pools = [i for i, c in enumerate(m._modules.values()) if _is_global_pool(c)]
    return tuple(names[pools[0] + 1 :]) if pools else ()


def _is_global_pool(m: nn.Module | None) -> bool:
    """A timm ``SelectAdaptivePool2d`` or a torch adaptive pool, pooling to one value per channel."""
    if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                      nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
        size = m.output_size
        return all(s == 1 for s in (size if isinstance(size, tuple) else (size,)))
    if type(m).__name__ != "SelectAdaptivePool2d" or m.is_identity():
        return False
    return getattr(m.pool, "output_size", 1) in (1, (1, 1))  # timm's fast pools always give 1


def _hazard_dims(
    acts: tuple[int, ...], sharded: Sequence[int], ranks: Sequence[int]
) -> tuple[int, tuple[int, ...]] | None:
    """(rank, acted dims that are sharded) for the first tensor rank where they meet, else None."""
    for n in ranks:
        if any(not -n <= d < n for d in sharded):
            continue  # a tensor of this rank cannot carry these sharded dims
        s = {d % n for d in sharded}
        hit = tuple(sorted({d % n for d in acts if -n <= d < n} & s))
        if hit:
            return n, hit
    return None


def _candidate_ranks(model: nn.Module, sharded: Sequence[int]) -> list[int]:
    """Ranks of the tensors trailing-dim layers are checked against (see the module docstring)."""
    ranks = sorted({2 + k for m in model.modules() for cls, k in _GRID_RANK.items() if isinstance(m, cls)})
    if ranks:
        return ranks
    # No grid layer: tokens / points, with a trailing channel dim after the sharded dims.
    return [max([d + 2 for d in sharded if d >= 0] + [-d for d in sharded if d < 0] + [2])]


def _accepts_dims(cls: type) -> bool:
    """Whether ``cls.from_module`` takes a ``dims`` option (directly or via ``_init_sharding``)."""
    for fn in (getattr(cls, "from_module", None), getattr(cls, "_init_sharding", None)):
        if fn is None:
            return False
        params = inspect.signature(fn).parameters
        if "dims" in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
    return False


def _plan_entry(name: str, plan: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    """(matching glob, options) for module ``name``; first matching glob wins, ``None`` means skip."""
    if plan:
        for pattern, options in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                return pattern, (None if options is None else dict(options))
    return None, {}


#: How deep inside ``convert`` calls we are: sharded classes call ``convert`` on their children
#: from ``from_module``; only the outermost call installs the forward guard.
_DEPTH = [0]


def _load_model_families() -> None:
    """Import the zoo, whose model families register sharded classes (timm's ViT, Eva, ...).

    Without them a timm ``VisionTransformer`` would not be swapped as a whole: ``convert`` would
    descend into it and leave its position-embedding and pooling code running on slabs, a
    silently wrong answer. ``import sharded_nn`` keeps the zoo lazy; the first ``convert`` loads it.
    """
    import importlib

    from . import layers

    layers.load_timm_layers()
    importlib.import_module("sharded_nn.zoo")
    from .layers import squeeze_excite, swin

    squeeze_excite.register_loaded()
    swin.register_loaded()


def convert(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, Mapping[str, Any] | None] | None = None,
    dims: int | Sequence[int] | None = None,
    strict: bool = False,
    guard: bool = True,
    layout_scope: bool = True,
    input_dims: Mapping[str | int, int | Sequence[int] | None] | None = None,
) -> nn.Module:
    """Swap every registered layer of ``model`` (in place) for its sharded class; return the model.

    Args:
        model: any module tree. The root itself is swapped too (use the return value).
        mesh: mesh with a domain axis (see ``init_mesh``).
        plan: maps module-name globs (``fnmatch``, matched against ``named_modules`` names, root
            ``""``) to keyword options for the sharded class's ``from_module`` (e.g.
            ``{"stem.*": {"dims": (2,)}}``) or to ``None`` to leave the module as it is. The
            first matching glob wins. A ``None`` entry also marks the module reviewed: it is not
            reported as a hazard. A glob that matches no module, or whose options reach only
            modules that are not swapped, is reported in a ``ShardingWarning``.
        dims: the tensor dims the domain axes shard (one per axis), given to every swapped
            layer that takes a ``dims`` option unless its plan entry sets its own; also the dims
            the hazard check compares with. Default: each layer's own default, which is
            ``default_dims(mesh)`` (the first spatial dims) for grid layers.
        strict: raise instead of warning when some layer would compute a wrong answer on slabs,
            and (with the guard) when every rank backs up a replicated output of the model
            seeded with ones (``loss.backward()`` without ``snn.losses.share``: P times the
            gradient; one small all-reduce per backward).
        guard: install the forward guard on the returned model (see the module docstring and
            ``sharded_nn.forward_guard``): position-mixing calls in the model's own ``forward``
            are computed exactly or refused with a ``ShardingError``. The tensor inputs of the
            root are taken as slabs along ``dims`` (default: the dims the swapped layers share,
            else ``default_dims(mesh)``). Modules marked reviewed with ``plan={name: None}`` run
            unchecked. ``False``: no guard (the model's own calls run unchecked on slabs).
        layout_scope: run every forward of the returned model in a layout scope
            (``comm.sizes.enable_layout_scope``): the first sharded layer agrees on the model's
            input together with the model's entry facts (grad mode, autocast, input dtypes,
            parameters, train/eval modes), and later layers derive their layouts instead of
            agreeing per call (issue 16: one small all-gather per forward instead of one per
            layer). Not installed on a single swapped layer (it agrees per call, as before) or
            on a mesh with one domain rank (nothing is agreed). ``False``: every layer agrees
            on its input per call.
        input_dims: root inputs sharded along dims of their own: forward parameter name (or
            position after ``self``) -> their sharded dims (one per domain axis, as ``dims``), or
            ``None`` for a whole (replicated) tensor. E.g. ``{"target": (1,)}`` for class indices
            ``(N, H, W)`` next to scores ``(N, C, H, W)`` sharded along dim 2 (a model that
            returns ``F.cross_entropy(self.net(x), target)``). Other inputs: ``dims`` as above.
            A later ``convert`` (or ``parallelize``) of the same model without ``input_dims``
            keeps these.

    Returns:
        The converted model. State-dict keys are unchanged; converting twice changes nothing.

    Raises:
        ShardingNotImplementedError: with ``strict=True``, listing the layers that act on a
            sharded dim and have no sharded class.
    """
    _DEPTH[0] += 1
    try:
        return _convert(model, mesh, plan=plan, dims=dims, strict=strict, guard=guard, layout_scope=layout_scope,
                        input_dims=input_dims)
    finally:
        _DEPTH[0] -= 1


def convert_as_model(module: nn.Module, mesh: DeviceMesh, **options) -> nn.Module:
    """``convert(module, mesh, **options)`` as an outermost call, from inside a sharded class's
    ``from_module``: for a part that runs as a model of its own inside a model whose class is
    sharded as a whole (a hybrid ViT's CNN stem), which gets its own forward guard and layout
    scope. (Nested ``convert`` calls install neither: the outer model's guard covers them.)"""
    depth = _DEPTH[0]
    _DEPTH[0] = 0
    try:
        return convert(module, mesh, **options)
    finally:
        _DEPTH[0] = depth


def _convert(model, mesh, *, plan, dims, strict, guard, layout_scope, input_dims=None):
    domain_axes(mesh)  # a clear error now for a mesh without a domain axis
    _load_model_families()
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected an nn.Module, got {type(model).__name__}.")
    uninitialized = nn.parameter.UninitializedTensorMixin
    lazy = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if any(isinstance(t, uninitialized) for t in (*m._parameters.values(), *m._buffers.values()))
    ]
    if lazy:
        # A lazy module draws its weights at its first forward, on each rank its own (this torch
        # seeds every process differently), after the first forward's weights check: refused.
        raise ShardingError(
            f"convert: {len(lazy)} module(s) have uninitialized (lazy) parameters: {', '.join(lazy[:6])}"
            f"{', ...' if len(lazy) > 6 else ''}. Run the single-device model once on a small input (any "
            "spatial size) before convert, so that torch materializes them; then seed alike on every rank or "
            "call sharded_nn.sync_weights(model, mesh)."
        )
    if dims is not None:
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
    timm_table = _timm_tables()
    done = sharded_classes()
    replaced: dict[str, nn.Module] = {}
    reviewed: list[str] = []  # prefixes of subtrees not to check (plan None, pooled features)
    plan_none: list[str] = []  # modules the user marked reviewed: the guard leaves them unchecked
    checked: list[tuple[str, nn.Module, tuple[int, ...] | str]] = []
    glob_hits: dict[str, list[str]] = {g: [] for g in plan or {}}
    glob_used: set[str] = set()
    for name, module in model.named_modules():
        glob, options = _plan_entry(name, plan)
        if glob is not None:
            glob_hits[glob].append(name)
            if options is None:
                glob_used.add(glob)  # marking a module reviewed is never wasted
        if any(name.startswith(r + ".") or (r == "" and name) for r in replaced):
            continue  # inside a module that was just replaced: its own class handles its children
        if options is None:
            reviewed.append(name)
            plan_none.append(name)
            continue
        if isinstance(module, parametrize.ParametrizationList):
            # torch's parametrizations (weight_norm, spectral_norm, orthogonal, a user's own)
            # compute a parameter from others: they never see an activation.
            reviewed.append(name)
            continue
        sharded_cls = registered(type(module))
        if sharded_cls is not None:
            if dims is not None and "dims" not in options and _accepts_dims(sharded_cls):
                options["dims"] = dims
            if glob is not None:
                glob_used.add(glob)
            replaced[name] = sharded_cls.from_module(module, mesh, **options)
            continue
        if any(name == r or name.startswith(r + ".") or (r == "" and name) for r in reviewed):
            continue
        reviewed += [f"{name}.{c}" if name else c for c in _replicated_children(module)]
        acts = _acts_on(module, timm_table)
        if acts == _GUARDED:
            if guard:
                # Its forward, its children's calls included, is torch code the guard follows
                # (each call computed on slabs or refused at run time on every rank): nothing in
                # the subtree to report; registered children are still swapped above.
                reviewed.append(name)
                continue
            acts = MIXES
        if type(module) in done or acts == ():
            continue
        if acts is UNKNOWN and module._modules:
            continue  # a composite: its children are checked one by one
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)):
            continue  # (empty) containers have no forward of their own
        if type(module) is nn.Sequential and not module._modules:
            continue  # an empty Sequential is the identity (ShuffleNet's and GhostNet's shortcuts)
        if acts is UNKNOWN and guard and isinstance(module, _GUARD_ROUTED):
            # A convolution, norm or pool subclass with its own forward (timm's StdConv2d,
            # ScaledStdConv2d, GroupNorm1NoBias, MaxPool2dSame): not swapped, but its F.conv*d /
            # F.group_norm / F.pad and pool calls run under the forward guard, which computes them
            # with their sharded forms and the weights passed (or refuses them on every rank).
            continue
        checked.append((name, module, acts))

    for name, new in replaced.items():
        if name == "":
            model = new
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)

    # The sharded dims: the convert-level default and what every sharded layer shards (those
    # swapped now and any swapped by an earlier convert).
    sharded = set(dims if dims is not None else default_dims(mesh))
    for m in model.modules():
        if type(m) in done or any(m is new for new in replaced.values()):
            layer_dims = getattr(m, "dims", ())
            sharded |= {layer_dims} if isinstance(layer_dims, int) else set(layer_dims)
    sharded_t = tuple(sorted(sharded))
    ranks = _candidate_ranks(model, sharded_t)
    hazards: list[str] = []
    for name, module, acts in checked:
        label = f"{name or '<root>'} ({type(module).__name__})"
        if isinstance(acts, str):
            hazards.append(label)
            continue
        hit = _hazard_dims(acts, sharded_t, ranks)
        if hit is not None:
            n, on = hit
            hazards.append(f"{label} acts on dim(s) {on} of rank-{n} tensors, which are sharded")

    for glob, names in glob_hits.items():
        if not names:
            warnings.warn(
                f"convert: plan glob {glob!r} matches no module of the model; check the name against "
                "model.named_modules() (the root is '').",
                ShardingWarning,
                stacklevel=3,
            )
        elif glob not in glob_used:
            warnings.warn(
                f"convert: plan glob {glob!r} gives options {dict(plan[glob])} only to modules that are "
                f"not swapped ({', '.join(n or '<root>' for n in names[:8])}{', ...' if len(names) > 8 else ''}): "
                "the options are ignored. Point it at registered layers, or use None to mark modules reviewed.",
                ShardingWarning,
                stacklevel=3,
            )
    if hazards:
        msg = (
            f"convert: {len(hazards)} layer(s) have no sharded version and may mix positions across "
            f"the sharded dims {sharded_t}, which gives a silently wrong answer on slabs: "
            f"{', '.join(hazards)}. Register a sharded class for them (sharded_nn.register), or, if "
            "they only act on channels or on a replicated tensor (e.g. after a global pool), mark them "
            "reviewed with plan={'<name>': None}."
        )
        if strict:
            raise ShardingNotImplementedError(msg)
        warnings.warn(msg, ShardingWarning, stacklevel=3)
    if _DEPTH[0] == 1:
        _record_context(model, mesh, dims, done)
    if _DEPTH[0] == 1:
        from .comm.sizes import ScopeHooks, disable_layout_scope, enable_layout_scope

        root_dims = _root_dims(model, mesh, dims, done)
        if input_dims:
            from .entry_inputs import InputDims

            entry = model.__dict__["_snn_input_dims"] = InputDims(model, root_dims, input_dims)
        else:
            # Converting again (``parallelize`` converts what it is given) keeps the input dims an
            # earlier ``convert`` was given: "converting twice changes nothing".
            entry = model.__dict__.get("_snn_input_dims")
        # The domain size is a fact of the mesh, the same on every rank: P=1 agrees on nothing.
        multi = any(axis_size(mesh, a) > 1 for a in domain_axes(mesh))
        scope = layout_scope and multi and type(model) not in done
        if scope:
            # The first forward's entry facts check that every rank holds the same weights
            # (again after each load_state_dict on the model): ``sharded_nn.weights``.
            from .weights import arm

            arm(model)
        disable_layout_scope(model)  # hooks of an earlier enable_layout_scope: replaced below
        if guard and type(model) not in done and "" not in plan_none:
            from .forward_guard import install

            # One pair of root hooks runs both the scope and the guard (scope first).
            install(model, mesh, root_dims, set(done), plan_none,
                    scope=ScopeHooks(root_dims, mesh, entry) if scope else None, input_dims=entry, strict=strict)
        else:
            if not guard:
                from .forward_guard import uninstall

                uninstall(model)
            if scope:
                enable_layout_scope(model, root_dims, mesh=mesh, input_dims=entry)
    return model


def _root_dims(model: nn.Module, mesh: DeviceMesh, dims: tuple[int, ...] | None, done) -> tuple[int, ...]:
    """The dims along which the root's tensor inputs are sharded (for the guard and the scope)."""
    if dims is not None:
        return tuple(dims)
    layer_dims = {
        tuple(d) if not isinstance(d, int) else (d,)
        for m in model.modules()
        if type(m) in done and (d := getattr(m, "dims", None)) is not None and not getattr(m, "_guard_inside", False)
    }
    # Layers that shard no dim (a LayerNorm over channels) say nothing about the layout.
    layer_dims = {d for d in layer_dims if d}
    # Grid layers say how the root's grid input is sharded; token layers (attention, dims (1,))
    # act on tensors the model makes from it.
    layer_dims = {d for d in layer_dims if all(k >= 2 for k in d)} or layer_dims
    if len(layer_dims) == 1:
        return next(iter(layer_dims))
    return tuple(default_dims(mesh))


def _record_context(model: nn.Module, mesh: DeviceMesh, dims: tuple[int, ...] | None, done) -> None:
    """Record on every sharded layer its qualified name and the model input's alignment.

    ``ShardingError`` reads the record when a layer raises (``sharded_nn.errors``), so that the
    message names the module and the model-level fix. The alignment is computed once here (a
    shape-only forward on the meta device); it is optional information: any failure leaves it
    unknown. Every fact is the same on every rank.
    """
    from .alignment import alignment

    if dims is None:
        layer_dims = {
            (d,) if isinstance(d, int) else tuple(d)
            for m in model.modules()
            if type(m) in done and (d := getattr(m, "dims", None)) is not None
        }
        layer_dims = {d for d in layer_dims if d and all(k >= 2 for k in d)} or layer_dims
        dims = next(iter(layer_dims)) if len(layer_dims) == 1 else tuple(default_dims(mesh))
    align = None
    # A model converted before carries the forward guard, whose hooks must not see the probe
    # forward: keep the alignment recorded then.
    earlier = [c for m in model.modules() if isinstance(c := m.__dict__.get(CONTEXT_ATTR), ModuleContext)]
    if model.__dict__.get("_snn_guard_handles"):
        align = next((c.align for c in earlier if c.dims == tuple(dims)), None)
    elif dims and all(d >= 2 for d in dims):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = alignment(model, dims)
            align = tuple(int(a) for a in got)
        except Exception:  # noqa: BLE001 - optional information: the error message says it is unknown
            align = None
    root = type(model).__name__
    for name, m in model.named_modules():
        if type(m) in done:
            m.__dict__[CONTEXT_ATTR] = ModuleContext(name, type(m).__name__, root, tuple(dims), align)
