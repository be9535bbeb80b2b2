"""Ring attention's schedule: no hop waited for with nothing left to compute, a hop's sends
completed after the computation on what it brought, no copies of the token-major output or its
gradient, travelling buffers reused (exactness is tested in test_attention*.py)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from sharded_nn import comm, functional as snf

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


def _chunk_allocations(pieces: int, lens: tuple[int, ...], projected: bool = False) -> dict:
    """Fresh travelling-chunk buffers against chunk buffers used, in one ring-attention forward
    and backward on this rank, and the results against plain attention on the whole sequence."""
    p, rank = dist.get_world_size(), dist.get_rank()
    m = mesh(p)
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(1, 6, sum(lens), 8, dtype=torch.float64, generator=g) for _ in range(3)]
    start = sum(lens[:rank])
    q, k, v = (t[:, :, start : start + lens[rank]].clone().requires_grad_() for t in full)
    qkv = None
    if projected:
        # Views of one (B, L, 3, H, D) projection, as a ViT's attention makes them: a piece of
        # k or v is not contiguous in the token-major wire form, and is copied to travel.
        qkv = torch.stack([q, k, v]).detach().permute(1, 3, 0, 2, 4).contiguous().requires_grad_()
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    counts = {"taken": 0, "fresh": 0}

    class Counting(snf._ChunkBuffers):
        def take(self, shape, dtype, device):
            counts["taken"] += 1
            held = sum(len(f) for f in self._free.values())
            t = super().take(shape, dtype, device)
            counts["fresh"] += held == sum(len(f) for f in self._free.values())
            return t

    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf._ChunkBuffers
    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf._ChunkBuffers = pieces, 1, Counting
    try:
        out = snf.ring_attention(q, k, v, m)
        out.backward(torch.ones_like(out))
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf._ChunkBuffers = old
    ref = [t.clone().requires_grad_() for t in full]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref)
    ref_out.backward(torch.ones_like(ref_out))
    sl = slice(start, start + lens[rank])
    errs = [(out - ref_out[:, :, sl]).abs().max().item()]
    grads = (q.grad, k.grad, v.grad) if qkv is None else qkv.grad.permute(2, 0, 3, 1, 4).unbind(0)
    errs += [(a - b.grad[:, :, sl]).abs().max().item() for a, b in zip(grads, ref)]
    return {**counts, "err": max(errs)}


@pytest.mark.parametrize("world,lens", [(2, (7, 5)), (3, (4, 4, 4)), (3, (5, 7, 6))])
@pytest.mark.parametrize("projected", [False, True])
def test_ring_chunks_reuse_their_buffers(run, world, lens, projected):
    pieces = 6  # one head per piece: six chunks, each travelling round the whole ring
    for rank, res in enumerate(run(world, _chunk_allocations, pieces, lens, projected)):
        assert res["err"] < 1e-12, (rank, res)
        # Every chunk takes a receive buffer per hop, in forward and again in backward, and a
        # copy of its own block where that is not contiguous in wire form (views of one
        # projection); before the pool each of them was a fresh allocation. (k and v: 2 (P - 1)
        # receive buffers per chunk and pass, and 2 copies.) One head of a (B, H, L, D) tensor
        # travels as it is.
        assert res["taken"] == 2 * pieces * 2 * (world - 1 + projected), (rank, res)
        if len(set(lens)) == 1 or world == 2:
            # All chunks of a pass have the same shapes: only the first chunk of each pass
            # allocates (k and v: a copy and a first receive buffer), plus, in backward, one hop
            # of the last chunk, whose own block is kept for last (``keep_first``).
            assert res["fresh"] <= 2 * 2 * 2 + (2 if world > 2 else 0), (rank, res)
        else:
            # Uneven slabs at P > 2: a hop's shape differs from the buffers given back before it
            # at some steps; reuse is partial (32 of 72 fresh on rank 0 for these sizes).
            assert res["fresh"] < res["taken"] // 2, (rank, res)


def _gradient_layouts(pieces: int) -> list[bool]:
    """Whether the gradients ring attention returns for q, k, v (per-token projections: token-major
    views) are token-major too, with the K/V cut into ``pieces``."""
    m = mesh(2)
    g = torch.Generator().manual_seed(6)
    rank = dist.get_rank()
    leaves = [torch.randn(1, 5 + 2 * rank, 6, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    seen = []
    for t in (q, k, v):
        t.register_hook(lambda grad: seen.append(grad.transpose(1, 2).is_contiguous()))
    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL
    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = pieces, 1
    try:
        out = snf.ring_attention(q, k, v, m)
        out.backward(torch.ones_like(out))
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = old
    return seen


@pytest.mark.parametrize("pieces", [1, 3])
def test_ring_gradients_come_back_token_major(run, pieces):
    # Token-major like the kernels' own gradients, so that a per-token projection's backward
    # reads them without a copy (with several pieces the gradients are assembled in buffers of
    # their own, which were head-major until session 48).
    for seen in run(2, _gradient_layouts, pieces):
        assert seen == [True, True, True], seen


def _forward_log(pieces: int) -> list:
    """Events of one ring-attention forward on this rank: hop starts, the completion of a hop's
    receives and of its sends (by hop number), and kernel calls."""
    p, rank = dist.get_world_size(), dist.get_rank()
    m = mesh(p)
    g = torch.Generator().manual_seed(20 + rank)
    local = (6, 4, 5)[rank]  # uneven slabs
    q, k, v = (torch.randn(1, 6, local, 8, dtype=torch.float64, generator=g) for _ in range(3))
    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf.ring_pass, snf.block_forward
    log: list = []

    class Spy:
        def __init__(self, handle, n):
            self.handle, self.n = handle, n

        def wait_received(self):
            log.append(("received", self.n))
            return self.handle.wait_received()

        def wait(self):
            log.append(("sent", self.n))
            return self.handle.wait()

    def ring_pass(ring, send, shapes, *, tag=None, out=None):
        n = sum(kind == "hop" for kind, _ in log)
        log.append(("hop", n))
        return Spy(old[2](ring, send, shapes, tag=tag, out=out), n)

    def block_forward(*args, **kwargs):
        log.append(("kernel", None))
        return old[3](*args, **kwargs)

    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf.ring_pass, snf.block_forward = pieces, 1, ring_pass, block_forward
    try:
        with torch.no_grad():
            snf.ring_attention(q, k, v, m)
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf.ring_pass, snf.block_forward = old
    return log


@pytest.mark.parametrize("world,pieces", [(2, 1), (2, 3), (3, 2)])
def test_ring_forward_computes_before_its_sends_complete(run, world, pieces):
    # A send completes when the right neighbour has read it, which it does when it is ready to.
    # Waiting for that before computing on what arrived made a rank idle for as long as its
    # neighbour was behind (vit_tiny 1024^2 at P=2: 6-8 ms of a 0.73 s forward).
    for rank, log in enumerate(run(world, _forward_log, pieces)):
        hops = [n for kind, n in log if kind == "hop"]
        assert len(hops) == pieces * (world - 1), (rank, log)
        for n in hops:
            got, sent = log.index(("received", n)), log.index(("sent", n))
            assert got < sent, (rank, n, log)
            if n % (world - 1) == world - 2:
                # A piece's last hop: the chunk it brought is computed on before its sends are
                # waited for (earlier hops complete before the next one reuses their tags).
                assert ("kernel", None) in log[got + 1 : sent], (rank, n, log)
        # Every hop completes within the call; every block pair is computed once.
        assert sum(kind == "sent" for kind, _ in log) == len(hops), (rank, log)
        assert sum(kind == "kernel" for kind, _ in log) == world * pieces, (rank, log)


def _handle_round(world_lens: tuple[int, ...], transport: str, between: bool) -> bool:
    """``ring_pass``'s ``wait_received`` gives the left neighbour's tensors while this rank's
    sends may still be in flight; ``wait`` completes the hop and gives the same tensors.
    ``between``: a collective runs between the two waits (a rank computes and talks meanwhile)."""
    with mock.patch.dict(os.environ, {"SHARDED_NN_TRANSPORT": transport}):
        p, rank = dist.get_world_size(), dist.get_rank()
        peers = comm.axis_peers(mesh(p), "domain")
        mine = [torch.full((world_lens[rank], 3), float(rank + 1), dtype=torch.float64), torch.arange(5.0) + rank]
        left = (rank - 1) % p
        shapes = [(world_lens[left], 3), (5,)]
        ok = True
        for _ in range(3):
            h = comm.ring_pass(peers, mine, shapes)
            got = h.wait_received()
            ok &= torch.equal(got[0], torch.full(shapes[0], float(left + 1), dtype=torch.float64))
            ok &= torch.equal(got[1], torch.arange(5.0) + left)
            if between:
                ok &= comm.all_reduce_sum(torch.ones(1), peers.group).item() == p
            again = h.wait()
            ok &= all(a is b for a, b in zip(again, got))
        return ok


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport", ["local", "gloo"])
def test_ring_pass_receives_complete_before_sends(run, world, transport):
    # Small messages (the socket path) and ones of a few MiB (read from the sender's memory or
    # through the arena with the same-host transport), uneven between ranks.
    for rows in ((3, 5, 4), (70000, 90000, 80000)):
        lens = rows[:world]
        assert run(world, _handle_round, lens, transport, False) == [True] * world
        assert run(world, _handle_round, lens, transport, True) == [True] * world
