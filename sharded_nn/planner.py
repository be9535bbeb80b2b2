"""``plan_memory``: predict the peak memory per rank for P = 1..max_ranks without running the model.

Method: one traced forward and backward of the plain (single-device) model at the *full* size on
fake tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and devices, no data and no
memory), under a ``TorchDispatchMode`` that follows every storage an operator creates and frees
(a weak reference on each storage), so the trace gives the exact timeline of live bytes that
eager PyTorch would hold, op by op, through forward and backward. Each byte is classified:

* the parameter gradients (identified by storage after the backward) are replicated over the
  domain ranks: they do not shrink with P (nor do the parameters, counted apart);
* every other tensor (activations, saved tensors, activation gradients) lives on the sharded
  sample, so its size scales with the local slab: ``ceil(S / P) / S`` of the full size, where ``S``
  is the extent of the sharded dim ``dims[0]``.

``peak(P) = params + max over the timeline of (activations(t) * ceil(S/P)/S + replicated(t))``.

Why this method: fake tensors cost no memory and little time even at 2048^2 or 10^7 points, the
timeline is exact for eager autograd (what is saved for backward, when it is freed), and the
tracker is deterministic, unlike allocator or RSS statistics. A traced small run scaled up
would miss terms that do not scale linearly (attention, global pooling); the sharded model cannot
be traced without its process group.

An operator's output that shares an input's storage (a view such as ``weight.t()`` in every
``Linear``, ``detach``, an in-place op) allocates nothing and is not counted; counting it charged
each parameter once more, as an activation that shrinks with P (21 MiB of vit_tiny's 614 MiB at
1024^2, and the P=2 plan of a small ViT 18% off the sharded model).

Kernels' own scratch: a CPU convolution allocates buffers inside its kernel that no operator
returns (torch's native kernels unfold the input into a column matrix, 27 times the input of a
3x3x3 convolution; oneDNN reorders its operands), invisible to the dispatch trace; the tracker
adds them while such a call runs, from the call's shapes and the backend ATen picks for them
(``conv_workspace``): P=1 with torch's kernels, P >= 2 with the sharded layers' (which send
torch's native 3-D kernel's calls to oneDNN). With them the plan equals the CPU allocator's own
peak (the profiler's allocation events) on the demo's CNN, UNet and ViT at P=1; without them it
was 54% of the 3-D CNN's (69 of 128 MiB at 64^3).

What it does not model: halo rows and ring-attention buffers of the sharded layers (a few rows or
one peer's key/value block per layer: at 1024^2 the sharded vit_tiny keeps about 7% more per rank
than the scaled plain timeline; ``tests/test_planner.py`` compares the plan at P=2 with the
tracked sharded ViT, UNet, Transolver and CNN), allocator fragmentation and caching, the CPU
process's baseline (torch, libraries) and communication buffers. On CPU the step's peak resident
memory above its start (``sharded_nn.demo.PeakRSS``) is the quantity to compare with
(``bench/run.py`` prints both).
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .conv_workspace import scratch_bytes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(budget: int | float | str) -> int:
    """``24 * 2**30``, ``"24GiB"``, ``"24 GB"``, ``"512MiB"`` -> bytes.

    Raises:
        ValueError: for anything else, naming the accepted forms.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget: expected bytes (int) or a string like '24GiB', got {budget!r}.")
    if isinstance(budget, (int, float)):
        if budget <= 0 or not math.isfinite(budget):
            raise ValueError(f"budget: expected a positive number of bytes or a string like '24GiB', got {budget!r}.")
        return int(budget)
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if m and m.group(2).lower() in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"budget: expected bytes (int) or a string like '24GiB', '512MiB', '32GB', got {budget!r} "
        f"(units: {', '.join(u for u in _UNITS if u)}; case-insensitive)."
    )


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


class LiveBytes(TorchDispatchMode):
    """Follows the storages created by operators: a timeline of live bytes, op by op.

    Works on real and on fake tensors. Every allocation gets a sequence number; after the run,
    :meth:`mark_replicated` names the tensors (the parameter gradients) whose bytes do not shrink
    with P, and :attr:`timeline` gives ``(activation, replicated)`` bytes after every event.
    Classifying by identity, not by shape, matters: a ViT's position embedding has the shape of
    every token activation.
    """

    def __init__(self, workspaces: bool = True):
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # id(storage) -> (seq, bytes)
        self._refs: dict[int, weakref.ref] = {}
        # (seq, +bytes on allocation / -bytes on free, the same under the sharded layers' kernels)
        self.events: list[tuple[int, int, int]] = []
        self.replicated: set[int] = set()
        self._seq = 0
        # Kernels' own scratch (``conv_workspace``); False: follow returned tensors only.
        self.workspaces = workspaces

    def _free(self, key: int) -> None:
        seq, nbytes = self._live.pop(key, (None, 0))
        self._refs.pop(key, None)
        if seq is not None:
            self.events.append((seq, -nbytes, -nbytes))

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        self._seq += 1
        self._live[key] = (self._seq, st.nbytes())
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
        self.events.append((self._seq, st.nbytes(), st.nbytes()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A kernel's own scratch (a CPU convolution's column matrix), live while it runs:
        # allocated before its outputs, freed after them (``conv_workspace``), under torch's
        # kernels and under the sharded layers' choice of kernel.
        plain, sharded = scratch_bytes(func, args) if self.workspaces else (0, 0)
        if plain or sharded:
            self._seq += 1
            seq = self._seq
            self.events.append((seq, plain, sharded))
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view such as ``weight.t()``, ``detach``,
        # an in-place op) allocates nothing: counting it would charge a parameter (or the input)
        # again, as an activation that shrinks with P.
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and id(t.untyped_storage()) not in inputs:
                self._track(t)
        if plain or sharded:
            self.events.append((seq, -plain, -sharded))
        return out

    def mark_replicated(self, tensors) -> None:
        """Count these (still alive) tensors' storages as replicated over the domain ranks."""
        for t in tensors:
            if t is not None:
                entry = self._live.get(id(t.untyped_storage()))
                if entry is not None:
                    self.replicated.add(entry[0])

    @property
    def act(self) -> int:
        return sum(b for s, b in self._live.values() if s not in self.replicated)

    @property
    def rep(self) -> int:
        return sum(b for s, b in self._live.values() if s in self.replicated)

    @property
    def timeline(self) -> list[tuple[int, int]]:
        """``(activation, replicated)`` bytes after every event, under torch's own kernels."""
        return self.timeline_of(sharded=False)

    def timeline_of(self, sharded: bool) -> list[tuple[int, int]]:
        """The timeline under torch's kernels (the plain model) or the sharded layers' (P >= 2)."""
        act = rep = 0
        out = [(0, 0)]
        for seq, plain, shard in self.events:
            delta = shard if sharded else plain
            if seq in self.replicated:
                rep += delta
            else:
                act += delta
            out.append((act, rep))
        return out

    def peak(self, scale: float = 1.0, sharded: bool = False) -> int:
        """Peak of ``activation * scale + replicated`` over the timeline (``sharded``: under the
        sharded layers' kernels)."""
        return int(max(a * scale + r for a, r in self.timeline_of(sharded)))


@dataclass
class MemoryPlan:
    """Predicted peak memory per rank (bytes) for P = 1..max_ranks.

    Attributes:
        ranks: P values.
        peak_bytes: predicted peak per rank: parameters + the input slab + the traced peak.
        activation_bytes: the activation part of the traced peak at each P (scales with the slab).
        param_bytes: replicated parameter bytes (on every rank).
        budget: the budget in bytes (``None``: not given).
        fits: smallest P whose peak fits ``budget`` (``None``: none up to ``max_ranks`` or no budget).
        method: how the numbers were obtained.
    """

    ranks: list[int]
    peak_bytes: list[int]
    activation_bytes: list[int]
    param_bytes: int
    input_bytes: list[int]
    budget: int | None = None
    fits: int | None = None
    method: str = ""
    notes: list[str] = field(default_factory=list)

    def peak(self, p: int) -> int:
        return self.peak_bytes[self.ranks.index(p)]

    def table(self) -> str:
        lines = ["| P | peak per rank | activations | parameters | fits budget |", "| --- | --- | --- | --- | --- |"]
        for p, pk, a in zip(self.ranks, self.peak_bytes, self.activation_bytes, strict=True):
            fit = "-" if self.budget is None else ("yes" if pk <= self.budget else "no")
            lines.append(f"| {p} | {_fmt(pk)} | {_fmt(a)} | {_fmt(self.param_bytes)} | {fit} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = f"plan_memory ({self.method})"
        if self.budget is not None:
            verdict = f"smallest P that fits: {self.fits}" if self.fits else f"no P <= {self.ranks[-1]} fits"
            head += f"\nbudget {_fmt(self.budget)}: {verdict}"
        return head + "\n" + self.table()


def _normalize_dims(dims: int | Sequence[int] | None, ndim: int) -> int:
    if dims is None:
        dims = 2 if ndim >= 3 else 1
    d = dims if isinstance(dims, int) else (list(dims) or [None])[0]
    if not isinstance(d, int) or not -ndim <= d < ndim:
        raise ValueError(f"plan_memory: dims must name a dim of the {ndim}-d input, got {dims!r}.")
    return d % ndim


def trace_peak(
    model: nn.Module, x: torch.Tensor, *, backward: bool = True, tracker: LiveBytes | None = None, params=None
) -> LiveBytes:
    """Run ``model(x)`` and a backward of ones under a :class:`LiveBytes` tracker.

    The gradients of ``params`` (default: ``model.parameters()``) are marked replicated.
    """
    tracker = tracker or LiveBytes()
    with tracker:
        out = model(x)
        if backward:
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        del out
    tracker.mark_replicated(p.grad for p in (params if params is not None else model.parameters()))
    return tracker


def plan_memory(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    max_ranks: int = 8,
    budget: int | float | str | None = None,
    dims: int | Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    backward: bool = True,
    input_kwargs: dict[str, Sequence[int]] | None = None,
) -> MemoryPlan:
    """Predict the peak memory per rank of ``model`` on one sample of ``input_shape``, P = 1..max_ranks.

    See the module docstring for the method (a fake-tensor trace at the full size; activations
    scale with the slab, parameters and their gradients are replicated).

    Args:
        model: the plain single-device model (not converted); it is not modified and runs on
            fake tensors only.
        input_shape: the global input shape, e.g. ``(1, 3, 1024, 1024)``.
        max_ranks: largest P to report.
        budget: bytes per rank, as an int or a string like ``"24GiB"``; the plan reports the
            smallest P whose peak fits.
        dims: the sharded input dim (the first, if several); default 2 (the first spatial dim of
            ``(N, C, ...)``), or 1 for 2-d inputs (``(N, points)``).
        dtype: the parameter and input dtype (default: the model's parameter dtype, else float32).
        backward: include the backward (a gradient of ones on the output); ``False``: inference.
        input_kwargs: shapes of further keyword inputs of ``model.forward`` (e.g. Transolver's
            ``{"embedding": (1, n, 3)}``), sharded like the input (counted with the input).

    Returns:
        A :class:`MemoryPlan`; ``print(plan)`` shows the table.

    Raises:
        ValueError: a bad ``budget``, ``dims`` or ``max_ranks``; a converted model.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape = tuple(int(s) for s in input_shape)
    from .layers.base import ShardedMixin

    converted = next((name for name, m in model.named_modules() if isinstance(m, ShardedMixin)), None)
    if converted is not None:
        # Its layers would make collectives on fake tensors (a crash in the transport, not an error).
        raise ValueError(
            f"plan_memory: expected the plain single-device model, got a converted one (module "
            f"{converted or '<root>'!r} is {type(model.get_submodule(converted)).__name__}); plan the model before "
            "sharded_nn.convert (convert swaps layers in place: keep a copy, or build the model again)."
        )
    if max_ranks < 1:
        raise ValueError(f"plan_memory: max_ranks must be >= 1, got {max_ranks}.")
    budget_bytes = None if budget is None else parse_bytes(budget)
    dim = _normalize_dims(dims, len(shape))
    params = list(model.parameters())
    if dtype is None:
        dtype = params[0].dtype if params and params[0].is_floating_point() else torch.float32
    device = params[0].device if params else torch.device("cpu")

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode:
        # Fake copies of the parameters and buffers (no memory), swapped in by functional_call.
        state = {}
        for name, p in model.named_parameters():
            state[name] = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
            state[name].requires_grad_(p.requires_grad and backward)
        for name, b in model.named_buffers():
            state[name] = torch.empty(b.shape, dtype=dtype if b.is_floating_point() else b.dtype, device=device)
        x = torch.empty(shape, dtype=dtype, device=device).requires_grad_(backward)
        extra = {k: torch.empty(tuple(v), dtype=dtype, device=device) for k, v in (input_kwargs or {}).items()}
        tracker = LiveBytes()

        class _Bound(nn.Module):
            def forward(self, inp):
                return torch.func.functional_call(model, state, (inp,), extra)

        fake_params = [state[name] for name, _ in model.named_parameters()]
        trace_peak(_Bound(), x, backward=backward, tracker=tracker, params=fake_params)

    itemsize = torch.empty((), dtype=dtype).element_size()
    param_bytes = sum(p.numel() * (itemsize if p.is_floating_point() else p.element_size()) for p in params)
    input_full = (math.prod(shape) + sum(math.prod(v) for v in (input_kwargs or {}).values())) * itemsize
    ranks, peaks, acts, inputs = [], [], [], []
    for p in range(1, max_ranks + 1):
        frac = -(-shape[dim] // p) / shape[dim]  # the largest slab
        pk = tracker.peak(frac, sharded=p > 1)
        act = int(max(a for a, _ in tracker.timeline_of(p > 1)) * frac)
        ranks.append(p)
        inputs.append(int(input_full * frac))
        acts.append(act)
        peaks.append(param_bytes + inputs[-1] + pk)
    fits = None
    if budget_bytes is not None:
        fits = next((p for p, pk in zip(ranks, peaks) if pk <= budget_bytes), None)
    return MemoryPlan(
        ranks=ranks, peak_bytes=peaks, activation_bytes=acts, param_bytes=param_bytes, input_bytes=inputs,
        budget=budget_bytes, fits=fits,
        method=f"fake-tensor trace at {shape}, dim {dim} sharded, {'forward+backward' if backward else 'forward'}, {dtype}",
        notes=["halo rows and ring-attention buffers are not modelled", "process baseline (torch, libraries) not included"],
    )  # fmt: skip


__all__ = ["LiveBytes", "MemoryPlan", "parse_bytes", "plan_memory", "trace_peak"]
