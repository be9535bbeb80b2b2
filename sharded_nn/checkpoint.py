"""Checkpoints that load into sharded and unsharded models alike, and never unpickle.

Parameters are replicated over the domain ranks and ``convert`` never changes ``state_dict`` keys,
so a converted model's ``state_dict`` *is* the single-device one: a checkpoint needs no
resharding of weights, only a safe file format and ranks that agree.

- ``save(model, path)`` / ``load(model, path, mesh=mesh)``: the model's tensors in one
  safetensors file (no pickle: loading cannot execute code), written by one rank. ``load``
  checks on every rank that all ranks of the mesh loaded the same values, so a rank that read
  another (stale, partial, other-run) file raises the same ``ShardingError`` on every rank
  instead of training a silently diverged replica.
- ``save_training_state`` / ``load_training_state``: model *and* optimizer through
  ``torch.distributed.checkpoint`` (DCP) with its safetensors storage (tensors, each written
  once by one rank) plus a JSON file for the non-tensor values (step counts, learning rates,
  betas). Neither file is unpickled on load (DCP's default ``.metadata`` file is a pickle,
  which is why the default storage is not used). The state is saved as full (unsharded)
  tensors, so it resumes at any number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .comm import AxisPeers, gather_ints
from .errors import ShardingError
from .mesh import group_over, mesh_cached

#: File of the non-tensor values of a training state (inside the DCP directory).
EXTRA_FILE = "sharded_nn_extra.json"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _mesh_peers(mesh: DeviceMesh) -> AxisPeers:
    """Every rank of ``mesh`` (data replicas included) as one ``AxisPeers``, for ``gather_ints``."""

    def make() -> AxisPeers:
        group = group_over(mesh, mesh.mesh_dim_names)
        ranks = tuple(dist.get_global_rank(group, i) for i in range(dist.get_world_size(group)))
        return AxisPeers(group, dist.get_rank(group), ranks)

    return mesh_cached(mesh, ("checkpoint_peers",), make)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def state_digest(state: Mapping[str, torch.Tensor]) -> int:
    """A 63-bit digest of keys, shapes, dtypes and bytes of ``state`` (equal states, equal digests)."""
    h = hashlib.blake2b(digest_size=8)
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1  # fits an int64


def _text_digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _agree(mesh: DeviceMesh | None, error: str | None, digest: int, what: str) -> None:
    """Raise the same error on every rank of ``mesh`` when any rank failed or the digests differ.

    Messages hold only facts every rank shares: a rank's own cause (e.g. its path) is appended
    after " This rank:" unless every rank failed with the very same message.
    """
    if mesh is None:
        if error is not None:
            raise ShardingError(error)
        return
    rows = gather_ints([int(error is not None), _text_digest(error or ""), digest], _mesh_peers(mesh))
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        if len(failed) == len(rows) and len({row[1] for row in rows}) == 1:
            raise ShardingError(error)  # the same message on every rank
        mine = f" This rank: {error}" if error is not None else ""
        raise ShardingError(
            f"{what} failed on mesh rank(s) {failed} (every rank raises; see those ranks' messages for the "
            f"cause, and pass a path that every rank can read).{mine}"
        )
    digests = [row[2] for row in rows]
    if len(set(digests)) != 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise ShardingError(
            f"{what}: the ranks of the mesh loaded different values (ranks grouped by identical state: "
            f"{sorted(groups.values())}). Parameters are replicated, so every rank must load the same "
            "checkpoint: pass the same path on every rank (a shared file system) or save again."
        )


def save(model: nn.Module | Mapping[str, torch.Tensor], path: str | os.PathLike, *,
         mesh: DeviceMesh | None = None, src: int = 0, metadata: Mapping[str, str] | None = None) -> None:
    """Write the model's ``state_dict`` to a safetensors file from global rank ``src`` only.

    Args:
        model: a (converted or plain, possibly DDP-wrapped) model, or a ``state_dict``.
        path: the file to write.
        mesh: when given, every rank of the mesh waits for the write and raises the same error if
            it failed, so that a following ``load`` finds the file.
        src: the global rank that writes.
        metadata: string pairs stored in the file header.
    """
    from safetensors.torch import save_file

    state = unwrap(model).state_dict() if isinstance(model, nn.Module) else dict(model)
    error = None
    if _rank() == src:
        try:
            # safetensors refuses shared storage; clones also make the tensors contiguous.
            save_file({k: v.detach().cpu().clone().contiguous() for k, v in state.items()}, str(path),
                      metadata=dict(metadata or {}))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"save: writing {path} failed: {type(e).__name__}: {e}"
    _agree(mesh, error, 0, "save")


def load(model: nn.Module, path: str | os.PathLike, *, mesh: DeviceMesh | None = None,
         strict: bool = True) -> nn.Module:
    """Load a safetensors ``state_dict`` into a converted or plain model (keys are the same).

    Never unpickles. With ``mesh``, every rank of the mesh checks that all ranks loaded without
    error and hold identical values afterwards, and otherwise raises the same ``ShardingError``.

    Args:
        model: the (possibly DDP-wrapped) model to load into.
        path: a file written by ``save`` (or any safetensors file with matching keys).
        mesh: the mesh whose ranks must agree; None loads locally without checks.
        strict: as ``nn.Module.load_state_dict``.

    Returns:
        ``model``.

    Raises:
        ShardingError: on every rank, when a rank could not load the file (missing, keys or
            shapes differ) or the ranks loaded different values.
    """
    from safetensors.torch import load_file

    target = unwrap(model)
    error = None
    try:
        target.load_state_dict(load_file(str(path)), strict=strict)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        error = (
            f"load: {str(path)!r} does not fit the model ({type(e).__name__}: {e}). Load a safetensors file "
            "written by sharded_nn.checkpoint.save for a model with the same keys and shapes (torch.save "
            "pickles are refused: they can execute code)."
        )
    digest = state_digest(target.state_dict()) if mesh is not None and error is None else 0
    _agree(mesh, error, digest, "load")
    return model


# --------------------------------------------------------------------------- training state


def _split(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON values of a flat state dict."""
    tensors, extra = {}, {}
    for k, v in state.items():
        if torch.is_tensor(v):
            tensors[k] = v
        else:
            extra[k] = list(v) if isinstance(v, tuple) else v
    return tensors, extra


def _flat_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {f"model.{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {**{f"model.{k}": v for k, v in msd.items()}, **{f"optim.{k}": v for k, v in osd.items()}}


def save_training_state(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                        *, extra: Mapping[str, Any] | None = None) -> None:
    """Save model and optimizer state through DCP (safetensors) into the directory ``path``.

    Every rank calls it (DCP coordinates; each replicated tensor is written once). Non-tensor
    optimizer values and ``extra`` (JSON values, e.g. ``{"step": 10}``) go to a JSON file written by
    rank 0.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors, values = _split(_flat_state(model, optimizer))
    Path(path).mkdir(parents=True, exist_ok=True)
    # The JSON is written before the collective save, which every rank leaves only after rank 0
    # entered it: when save_training_state returns on any rank, both files are complete.
    if _rank() == 0:
        with open(Path(path) / EXTRA_FILE, "w") as f:
            json.dump({"values": values, "extra": dict(extra or {})}, f)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True))


def load_training_state(path: str | os.PathLike, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a state saved by ``save_training_state`` into ``model`` (and ``optimizer``); any world size.

    Every rank calls it. Reads safetensors and JSON only (no pickle). Returns the ``extra`` dict.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    with open(Path(path) / EXTRA_FILE) as f:
        saved = json.load(f)
    tensors, _ = _split(_flat_state(model, optimizer))
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path)))
    state: dict[str, Any] = dict(tensors)
    for k, v in saved["values"].items():
        state[k] = tuple(v) if isinstance(v, list) else v
    msd = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    osd = {k.removeprefix("optim."): v for k, v in state.items() if k.startswith("optim.")}
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, msd, options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=opts)
    return saved["extra"]
