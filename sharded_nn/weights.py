"""Every domain rank must hold the same weights: a check at the first forward, and ``sync_weights``.

Domain parallelism replicates parameters and buffers (DESIGN.md section 3): each rank computes
its slab with its own copy, so copies that differ give a silently wrong answer, each slab computed
with other weights. It is easy to get there: this torch seeds every process differently, so a
model built under torchrun (or ``launch``) without ``torch.manual_seed`` holds other random
weights on every rank, and a checkpoint loaded on rank 0 only leaves the others as they were.

The check costs no collective of its own. A value digest of the parameters and buffers
(``value_digest``: exact, every bit and position counts) rides in the agreement that the first
sharded layer makes anyway: the model's entry facts inside a layout scope (``convert``'s
default), or a standalone layer's own agreement. It is computed once after the model or layer
is made (``arm``) and again after each ``load_state_dict`` on it or on one of its submodules (a
post-hook re-arms it); a call that is not armed sends 0, so a rank that loaded weights the
others did not makes the agreement fail too, and a failed check is armed again (``rearm_checked``) so that it fails at
every call until the weights agree. ``sync_weights`` copies the first rank's weights to every
rank of a mesh.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

#: The name of the agreed fact (messages match on it).
VALUES_FACT = "parameter and buffer values"

VALUES_HINT = (
    "Every rank must hold the same weights: this torch seeds each process differently, so a model built "
    "without torch.manual_seed(s) (the same s on every rank) before it, or weights loaded on some ranks only, "
    "differ by rank, and each slab would be computed with other weights (a silently wrong answer). Seed alike "
    "before building the model, load the same weights on every rank, or call sharded_nn.sync_weights(model, "
    "mesh) once (it copies the first rank's parameters and buffers to every rank). Checked at the first "
    "forward after convert (or after a sharded layer is made) and after each load_state_dict."
)

_ARMED = "_snn_values_unchecked"
_P61 = (1 << 61) - 1  # the digest's modulus (a Mersenne prime: the digest fits an int64 fact)
_P31 = (1 << 31) - 1
_CHUNK = 1 << 16  # elements summed exactly in int64 before a reduction mod _P31
_SLICE = 1 << 22  # elements turned into int64 at a time (32 MiB): bounds the digest's memory
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
#: The module whose digest the latest agreement carries (``take_digest``, ``rearm_checked``).
_CHECKED: list[weakref.ref | None] = [None]


def _weights(device: torch.device) -> torch.Tensor:
    """Fixed position weights in [1, 2^15): a value moved to another position changes the digest."""
    w = _WEIGHTS.get(device)
    if w is None:
        i = torch.arange(_CHUNK, dtype=torch.int64, device=device)
        w = _WEIGHTS[device] = (i * 40503 + 12345) % 32749 + 1
    return w


def _as_ints(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a 1-d integer tensor (same order), or None where they cannot be read."""
    if t.is_meta or t.is_sparse or t.is_quantized or isinstance(t, nn.parameter.UninitializedTensorMixin):
        return None
    if type(t).__name__ == "DTensor":  # FSDP2's sharded parameters: each rank holds its own shard
        return None
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    t = t.reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[size])


def _tensor_digest(t: torch.Tensor) -> int:
    if isinstance(t, nn.parameter.UninitializedTensorMixin):
        return 1  # (a lazy module's parameter: no shape or values yet)
    # Ints only: Python salts str hashes per process, a tuple of ints hashes alike everywhere.
    digest = hash((t.element_size(), int(t.is_floating_point()), int(t.is_complex()), *t.shape)) % _P61
    bits = _as_ints(t)
    if bits is None:
        return digest
    w = _weights(bits.device)
    for start in range(0, bits.numel(), _SLICE):
        part = bits[start : start + _SLICE].to(torch.int64)
        pad = -part.numel() % _CHUNK
        if pad:
            part = torch.cat([part, part.new_zeros(pad)])
        # |value| < 2^31 times a weight < 2^15, 2^16 of them: every chunk sum is exact in int64.
        sums = (part.view(-1, _CHUNK) * w).sum(1).remainder(_P31)
        mixed = int((sums * w[: sums.numel()]).sum())  # < 2^31 * 2^15 * 64: exact
        digest = (digest * 1_000_003 + mixed + start) % _P61
    return digest


def model_states(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (each tensor once), in ``named_modules`` order.

    Non-persistent buffers too: a forward reads them like the others (random Fourier features
    are often registered ``persistent=False``), and ``load_state_dict`` does not restore them.
    """
    seen: set[int] = set()
    for prefix, m in model.named_modules(remove_duplicate=True):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{prefix}.{name}" if prefix else name), t


def value_digest(tensors: Iterable[torch.Tensor]) -> int:
    """An exact digest of the tensors' values in [1, 2^61): equal tensors give equal digests on
    every rank; any other bit pattern or order almost surely another (a collision would only let
    a misuse through). Costs one pass over the values (0.03 s per 10^7 float32 values on a core);
    a GPU tensor synchronises once per slice of 2^22 elements."""
    digest = 1
    for t in tensors:
        digest = (digest * 1_000_003 + _tensor_digest(t)) % _P61
    return digest or 1


class _Rearm:
    """A ``load_state_dict`` post-hook on ``root`` and on each of its submodules: loading any of
    them (``model.head.load_state_dict(...)`` on rank 0 only, fine-tuning a new head) checks the
    root's values again. Holds the root weakly; a deep copy of the root re-points its copies' hooks
    at the copy (``memo``: the root was copied before its submodules)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = weakref.ref(root)

    def __call__(self, module: nn.Module, incompatible_keys) -> None:
        root = self.root()
        if root is not None:
            root.__dict__[_ARMED] = True

    def __deepcopy__(self, memo):
        root = self.root()
        return _Rearm(memo.get(id(root), root)) if root is not None else self


def arm(module: nn.Module) -> None:
    """Check ``module``'s values at its next agreement and again after each ``load_state_dict``
    on it or on any of its submodules."""
    module.__dict__[_ARMED] = True
    for m in module.modules():
        hooks = getattr(m, "_load_state_dict_post_hooks", {})
        held = (getattr(h, "hook", h) for h in hooks.values())
        if not any(isinstance(h, _Rearm) and h.root() is module for h in held):
            m.register_load_state_dict_post_hook(_Rearm(module))


def take_digest(module: nn.Module) -> int:
    """The value digest of ``module`` if it is armed (then disarmed), else 0 (nothing to check).

    The module is remembered until the next call: where the agreement then finds the ranks'
    values different, ``rearm_checked`` arms it again, so that every later call raises too
    until the weights agree (a caller that catches the error does not go on silently wrong).
    """
    _CHECKED[0] = weakref.ref(module)
    if not module.__dict__.pop(_ARMED, False):
        return 0
    return value_digest(t for _, t in model_states(module))


def rearm_checked() -> None:
    """The last agreement found different values (on every rank alike): check them again next time."""
    module = _CHECKED[0]() if _CHECKED[0] is not None else None
    if module is not None:
        module.__dict__[_ARMED] = True


def values_shown(by_rank) -> str:
    """The ranks grouped by the value digests they sent, for a message (``by_rank``: one fact row each)."""
    groups: dict = {}
    for r, v in enumerate(by_rank):
        groups.setdefault(tuple(v) if isinstance(v, (tuple, list)) else (v,), []).append(r)
    parts = []
    for v, ranks in groups.items():
        if v == (0,):
            parts.append(f"ranks {ranks} had nothing to re-check (load_state_dict ran on the other ranks only)")
        else:
            parts.append(f"ranks {ranks} hold {'one set of values' if not parts else 'another'}")
    return "; ".join(parts)


def sync_weights(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Copy the first rank's parameters and buffers to every rank of ``mesh`` (in place); return ``model``.

    For a model whose ranks hold different weights: built without a common ``torch.manual_seed``,
    or loaded from a checkpoint on some ranks only. Call it on every rank of the mesh (a
    collective over all its ranks, data replicas included), before or after ``convert``. FSDP2's
    sharded parameters (``DTensor``) are left alone.
    """
    from .comm.collectives import broadcast_from_first
    from .mesh import group_over

    tensors = [t for _, t in model_states(model) if _as_ints(t) is not None]
    broadcast_from_first([t.detach() for t in tensors], group_over(mesh, mesh.mesh_dim_names))
    return model


__all__ = [
    "VALUES_FACT", "VALUES_HINT", "arm", "model_states", "rearm_checked", "sync_weights", "take_digest", "value_digest",
    "values_shown",
]
