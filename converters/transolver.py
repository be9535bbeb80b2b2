"""Checkpoints of the original thuml/Transolver models -> ``sharded_nn.zoo.Transolver``.

thuml/Transolver (https://github.com/thuml/Transolver) ships three model files in
``PDE-Solving-StandardBenchmark/model`` (``Transolver_Irregular_Mesh``,
``Transolver_Structured_Mesh_2D``, ``Transolver_Structured_Mesh_3D``; the ShapeNet-Car and
AirfRANS models use the irregular-mesh layers and keys). Their layers compute what PhysicsNeMo's
Transolver computes, with other names and three numerical differences that the model takes as
keyword options (``thuml_transolver_kwargs`` fills them in):

* the slice-softmax temperature is not clamped (irregular mesh) or clamped to ``[0.1, 5]``
  (structured), where PhysicsNeMo clamps to ``[0.5, 5]``: ``temperature_clamp``;
* the slice normalisation adds ``1e-5``, PhysicsNeMo ``1e-2``: ``slice_norm_eps``;
* a learned ``placeholder`` vector is added after the input MLP (always for the irregular mesh,
  only when called with ``fx=None`` for the structured grids): folded into that MLP's last bias.

Calling convention: thuml's ``model(x, fx, T)`` is ``Transolver.forward(fx, embedding=x,
time=T[:, 0])``; with ``fx=None`` pass an empty ``fx`` of shape ``(B, N, 0)``
(``functional_dim=0``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["thuml_transolver_kwargs", "transolver_from_thuml"]

_KINDS = ("irregular", "structured2d", "structured3d")


def _kind(state_dict: Mapping[str, torch.Tensor]) -> str:
    key = "blocks.0.Attn.in_project_x.weight"
    if key not in state_dict:
        raise ValueError(
            f"transolver_from_thuml: {key!r} not found; this does not look like a thuml Transolver "
            f"state dict (first keys: {list(state_dict)[:6]})."
        )
    return {2: "irregular", 4: "structured2d", 5: "structured3d"}[state_dict[key].dim()]


def transolver_from_thuml(
    state_dict: Mapping[str, torch.Tensor], *, functional_input: bool | None = None
) -> dict[str, torch.Tensor]:
    """Map a thuml/Transolver ``Model`` state dict onto ``Transolver``'s keys (full tensors).

    Args:
        state_dict: the thuml model's ``state_dict()`` (a ``"module."`` prefix from DDP is
            stripped).
        functional_input: structured models only: whether the thuml model was called with a
            functional input ``fx`` (``model(x, fx)``, e.g. Darcy, Navier-Stokes) or with
            ``fx=None`` (e.g. Airfoil, Pipe, Elasticity). thuml adds its ``placeholder`` only in
            the second case. Irregular-mesh models always add it; leave this ``None`` for them.

    Returns:
        A state dict that loads with ``strict=True`` into
        ``Transolver(**thuml_transolver_kwargs(kind, **thuml_args))``.

    Raises:
        ValueError: for keys this converter does not know (named in the message), or a structured
            checkpoint without ``functional_input``.
    """
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()}
    kind = _kind(sd)
    if kind == "irregular":
        if functional_input is not None:
            raise ValueError(
                "transolver_from_thuml: functional_input applies to structured checkpoints only; the "
                "irregular-mesh model adds its placeholder in every call. Leave it None."
            )
        fold = True
    else:
        if functional_input is None:
            raise ValueError(
                f"transolver_from_thuml: a {kind} checkpoint needs functional_input=True (the thuml model was "
                "called as model(x, fx)) or False (model(x, None)): thuml adds its placeholder vector only "
                "in the second case."
            )
        fold = not functional_input

    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    simple = [
        (r"preprocess\.linear_pre\.0\.(weight|bias)", r"preprocess.layers.0.\1"),
        (r"preprocess\.linear_post\.(weight|bias)", r"preprocess.layers.2.\1"),
        (r"time_fc\.(0|2)\.(weight|bias)", r"time_fc.\1.\2"),
        (r"blocks\.(\d+)\.ln_1\.(weight|bias)", r"blocks.\1.ln_1.\2"),
        (r"blocks\.(\d+)\.Attn\.(in_project_x|in_project_fx|in_project_slice)\.(weight|bias)", r"blocks.\1.Attn.\2.\3"),
        (r"blocks\.(\d+)\.Attn\.to_out\.0\.(weight|bias)", r"blocks.\1.Attn.out_linear.\2"),
        (r"blocks\.(\d+)\.ln_2\.(weight|bias)", r"blocks.\1.ln_mlp1.0.\2"),
        (r"blocks\.(\d+)\.mlp\.linear_pre\.0\.(weight|bias)", r"blocks.\1.ln_mlp1.1.layers.0.\2"),
        (r"blocks\.(\d+)\.mlp\.linear_post\.(weight|bias)", r"blocks.\1.ln_mlp1.1.layers.2.\2"),
        (r"blocks\.(\d+)\.ln_3\.(weight|bias)", r"blocks.\1.ln_mlp2.0.\2"),
        (r"blocks\.(\d+)\.mlp2\.(weight|bias)", r"blocks.\1.ln_mlp2.1.\2"),
    ]
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    placeholder = None
    for key, value in sd.items():
        if key == "placeholder":
            placeholder = value
            continue
        m = re.fullmatch(r"blocks\.(\d+)\.Attn\.temperature", key)
        if m:
            # thuml keeps heads on dim 1 of (B, H, N, S) tensors, PhysicsNeMo on dim 2 of (B, N, H, S).
            out[f"blocks.{m[1]}.Attn.temperature"] = value.reshape(1, 1, -1, 1).clone()
            continue
        m = re.fullmatch(r"blocks\.(\d+)\.Attn\.to_(q|k|v)\.weight", key)
        if m:
            qkv.setdefault(m[1], {})[m[2]] = value
            continue
        for pattern, repl in simple:
            if re.fullmatch(pattern, key):
                out[re.sub(pattern, repl, key)] = value.clone()
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"transolver_from_thuml: keys this converter does not know: {unknown}.")
    for i, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(
                f"transolver_from_thuml: block {i} has attention weights {sorted(parts)}, expected q, k, v."
            )
        # PhysicsNeMo splits qkv_project's output as (t d) with t = q, k, v outermost.
        out[f"blocks.{i}.Attn.qkv_project.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if fold:
        if placeholder is None:
            raise ValueError("transolver_from_thuml: the checkpoint has no 'placeholder' to fold.")
        out["preprocess.layers.2.bias"] = out["preprocess.layers.2.bias"] + placeholder.to(
            out["preprocess.layers.2.bias"].dtype
        )
    if "time_fc.0.weight" in out:
        n_hidden = out["time_fc.0.weight"].shape[0]
        half = n_hidden // 2
        # In the checkpoint's dtype: a float64 checkpoint gets float64 frequencies.
        dtype = out["time_fc.0.weight"].dtype
        out["time_embed.freqs"] = (1 / 10000) ** (torch.arange(half, dtype=torch.float64) / half)
        out["time_embed.freqs"] = out["time_embed.freqs"].to(dtype)
    return out


def thuml_transolver_kwargs(kind: str, **thuml_args) -> dict:
    """``Transolver`` constructor arguments equivalent to thuml's ``Model(**thuml_args)``.

    Args:
        kind: ``"irregular"``, ``"structured2d"`` or ``"structured3d"`` (the thuml model file).
        **thuml_args: the thuml constructor arguments (``space_dim``, ``fun_dim``, ``n_layers``,
            ``n_hidden``, ``n_head``, ``mlp_ratio``, ``out_dim``, ``slice_num``, ``Time_Input``,
            ``act``, ``dropout``, ``ref``, ``unified_pos``, ``H``, ``W``, ``D``); thuml's defaults
            apply to the ones left out.
    """
    if kind not in _KINDS:
        raise ValueError(f"thuml_transolver_kwargs: kind must be one of {_KINDS}, got {kind!r}.")
    args = dict(space_dim=1, n_layers=5, n_hidden=256, dropout=0.0, n_head=8, Time_Input=False, act="gelu",
                mlp_ratio=1, fun_dim=1, out_dim=1, slice_num=32, ref=8, unified_pos=False)  # fmt: skip
    args.update({"structured2d": dict(H=85, W=85), "structured3d": dict(H=32, W=32, D=32)}.get(kind, {}))
    unknown = set(thuml_args) - set(args)
    if unknown:
        raise ValueError(f"thuml_transolver_kwargs: unknown thuml arguments {sorted(unknown)} for kind {kind!r}.")
    args.update(thuml_args)
    kwargs = dict(
        functional_dim=args["fun_dim"],
        out_dim=args["out_dim"],
        n_layers=args["n_layers"],
        n_hidden=args["n_hidden"],
        dropout=args["dropout"],
        n_head=args["n_head"],
        act=args["act"],
        mlp_ratio=args["mlp_ratio"],
        slice_num=args["slice_num"],
        time_input=args["Time_Input"],
        slice_norm_eps=1e-5,
    )
    if kind == "irregular":
        if args["unified_pos"]:
            raise ValueError(
                "thuml_transolver_kwargs: thuml's irregular-mesh unified_pos computes distances from the point "
                "positions to a reference grid inside forward; compute that tensor yourself and pass it as "
                "the embedding of a unified_pos=False model (embedding_dim = its channel count)."
            )
        kwargs.update(embedding_dim=args["space_dim"], temperature_clamp=None)
    else:
        shape = (args["H"], args["W"]) if kind == "structured2d" else (args["H"], args["W"], args["D"])
        kwargs.update(structured_shape=shape, temperature_clamp=(0.1, 5.0))
        if args["unified_pos"]:
            kwargs.update(unified_pos=True, ref=args["ref"])
        else:
            kwargs.update(embedding_dim=args["space_dim"])
    return kwargs
