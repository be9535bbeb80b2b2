"""Ring attention's backward schedule: no hop waited for with nothing left to compute, no copies
of the token-major output or its gradient (exactness is tested in test_attention*.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from sharded_nn import functional as snf

from .harness import mesh


class _Clones(TorchDispatchMode):
    """Counts ``aten.clone`` (what ``.contiguous()`` of a strided tensor runs) outside ring_pass
    (which sends contiguous copies of strided tensors, e.g. the kernels' dK/dV)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.in_hop = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default and not self.in_hop:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_log(pieces: int, replicated: bool) -> dict:
    """Events of one ring-attention backward on this rank: hops (with their tag) and kernel calls."""
    p, rank = dist.get_world_size(), dist.get_rank()
    m = mesh(p)
    g = torch.Generator().manual_seed(10 + rank)
    local = (5, 7, 6, 4)[rank]  # uneven slabs
    q, k, v = (torch.randn(1, 6, local, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    rq = torch.randn(1, 6, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) if replicated else None
    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf.ring_pass, snf.block_backward
    log: list = []

    clones = _Clones()

    def ring_pass(ring, send, shapes, *, tag=None, out=None):
        log.append(("hop", tag))
        clones.in_hop = True
        try:
            return old[2](ring, send, shapes, tag=tag, out=out)
        finally:
            clones.in_hop = False

    def block_backward(*args, **kwargs):
        log.append(("kernel", None))
        return old[3](*args, **kwargs)

    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = pieces, 1
    try:
        res = snf.ring_attention(q, k, v, m, replicated_q=rq, concat_replicated=replicated)
        snf.ring_pass, snf.block_backward = ring_pass, block_backward
        with clones:
            res.backward(torch.randn(res.shape, dtype=res.dtype, generator=g))
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf.ring_pass, snf.block_backward = old
    return {"log": log, "clones": clones.count}


@pytest.mark.parametrize("world,pieces,replicated", [(2, 1, False), (2, 3, True), (3, 2, False), (4, 6, True)])
def test_ring_backward_hides_its_last_hop_and_copies_nothing(run, world, pieces, replicated):
    for rank, res in enumerate(run(world, _backward_log, pieces, replicated)):
        log = res["log"]
        dkv_tag = max(tag for kind, tag in log if kind == "hop")  # dK/dV hops have the highest tag offset
        last = max(i for i, (kind, tag) in enumerate(log) if kind == "hop" and tag == dkv_tag)
        # The last dK/dV hop (bringing this rank's gradient shares home) travels while this rank
        # computes its own block of the last piece; before, it was waited for right after it left.
        assert ("kernel", None) in log[last + 1 :], (rank, log)
        # Every block pair is computed once (and once more for the replicated queries).
        assert sum(kind == "kernel" for kind, _ in log) == world * pieces * (2 if replicated else 1), (rank, log)
        # The token-major output and its gradient go to the kernels as views (contiguous q, k, v
        # of one batch item: the travelling pieces need no copy either).
        assert res["clones"] == 0, (rank, res["clones"])
