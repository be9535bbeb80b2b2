"""Bytes this rank sends, by kind of communication: a measuring tool for the benchmark suite.

``with count_traffic() as t: step()`` wraps ``torch.distributed``'s send and collective entry
points for the duration of the block (every call in sharded_nn looks them up on the module at
call time), so nothing is paid outside a measurement. Each call is attributed to the comm
module that made it:

* ``halo``: neighbour exchanges of halos and halo gradients (``comm/halo.py``, ``halo_add.py``);
* ``ring``: K/V blocks and their gradients passed around a ring (``comm/ring_pass.py``);
* ``all_to_all``: sequence <-> head re-sharding (Ulysses attention);
* ``reduction``: all-reduces and all-gathers of values (norm statistics, losses, gathers);
* ``metadata``: the small integer all-gathers by which ranks agree on layouts;
* ``other``: calls from outside ``sharded_nn.comm`` (DDP, user code).

Convention: point-to-point sends count the bytes sent; a collective counts its input tensor's
bytes once per call (the payload this rank contributes; the bytes on the wire depend on the
backend's algorithm, e.g. about twice the payload for a ring all-reduce).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Traffic", "count_traffic"]

_KIND_OF_MODULE = {
    "sharded_nn.comm.halo": "halo",
    "sharded_nn.comm.halo_add": "halo",
    "sharded_nn.comm.ring_pass": "ring",
    "sharded_nn.comm.ring": "ring",
    "sharded_nn.comm.all_to_all": "all_to_all",
    "sharded_nn.comm.collectives": "reduction",
    "sharded_nn.comm.pending": "reduction",
    "sharded_nn.comm.sizes": "metadata",
}
#: Functions whose traffic is metadata whatever module they live in.
_METADATA_FUNCTIONS = {"gather_ints", "gather_layouts", "all_gather_stacked_ints"}


@dataclass
class Traffic:
    """What one rank sent inside a ``count_traffic`` block.

    Attributes:
        sent: bytes by kind (see the module docstring).
        calls: number of send operations or collective calls by kind.
    """

    sent: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """All bytes sent, metadata included."""
        return sum(self.sent.values())

    def add(self, kind: str, nbytes: int) -> None:  # noqa: D102
        self.sent[kind] += int(nbytes)
        self.calls[kind] += 1


def _kind() -> str:
    """The kind of the comm-layer frame that called into torch.distributed."""
    frame = sys._getframe(2)
    kind = "other"
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name in _METADATA_FUNCTIONS:
            return "metadata"
        if name in _KIND_OF_MODULE:
            kind = _KIND_OF_MODULE[name]
            # Keep walking: a collective called from a metadata function is metadata.
        elif name.startswith("sharded_nn.") and kind != "other":
            return kind
        frame = frame.f_back
    return kind


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: The ``Traffic`` of the ``count_traffic`` block in progress (at most one).
_ACTIVE: list[Traffic] = []


def record_sends(tensors: list[torch.Tensor]) -> None:
    """Count point-to-point operations started without torch.distributed's entry points
    (``AxisPeers.start_p2p`` on gloo) as one ``batch_isend_irecv`` call sending ``tensors``."""
    if _ACTIVE:
        _ACTIVE[-1].add(_kind(), sum(_nbytes(t) for t in tensors))


def record_call(nbytes: int) -> None:
    """Count one collective made without torch.distributed's entry points (the same-host
    transport, ``comm/local_transport.py``) that contributes ``nbytes``: as the wrapped call would."""
    if _ACTIVE:
        _ACTIVE[-1].add(_kind(), nbytes)


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the bytes this rank sends inside the block; see the module docstring.

    Not re-entrant, and not for use while another thread makes collectives.

    Yields:
        A :class:`Traffic` filled in as the block runs.
    """
    traffic = Traffic()
    saved: dict[str, object] = {}

    def wrap(name: str, payload) -> None:
        fn = getattr(dist, name, None)
        if fn is None:
            return
        saved[name] = fn

        def counted(*args, **kwargs):
            nbytes = payload(*args, **kwargs)
            if nbytes is not None:
                traffic.add(_kind(), nbytes)
            return fn(*args, **kwargs)

        setattr(dist, name, counted)

    def p2p_list(ops, *a, **k):
        # dist.isend itself stays unwrapped: P2POp accepts only the original function.
        return sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)

    first = lambda t, *a, **k: _nbytes(t)  # noqa: E731
    second = lambda out, t, *a, **k: _nbytes(t)  # noqa: E731 - (output, input) signatures
    try:
        wrap("batch_isend_irecv", p2p_list)
        wrap("all_reduce", first)
        wrap("broadcast", first)
        wrap("all_gather_into_tensor", second)
        wrap("all_gather_single", second)
        wrap("reduce_scatter_tensor", second)
        wrap("all_to_all_single", second)
        wrap("all_gather", lambda out, t, *a, **k: _nbytes(t))
        _ACTIVE.append(traffic)
        yield traffic
    finally:
        if traffic in _ACTIVE:
            _ACTIVE.remove(traffic)
        for name, fn in saved.items():
            setattr(dist, name, fn)
