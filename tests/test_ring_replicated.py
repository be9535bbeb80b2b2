"""``ring_attention(replicated_q=...)``: replicated queries (a ViT's class / register tokens) riding
along the ring, against a single-process reference that attends ``[replicated; all queries]``
over all keys (float64, uneven slabs, chunked K/V, GQA, key padding, attention dropout)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import sharded_nn as snn
from sharded_nn import functional as snf
from sharded_nn.attention_kernels import dropout_keep
from sharded_nn.comm.ring_pass import domain_peers

from .harness import mesh
from .test_attention import UNEVEN, Cfg, _local, _unshard

N_REP = 2
P_DROP = 0.3
SEED = 777


def _reference(q, k, v, pad, p_drop):
    """Attention of all queries over all keys, float64 math, with the dropout mask law on the
    positions ``[0, n)`` of ``q`` (the replicated queries first)."""
    b, h, n, d = q.shape
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5
    if pad is not None:
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = s.softmax(-1)
    if p_drop:
        # Replicated queries at positions 0..N_REP-1, the keys (and sharded queries) after them.
        keep = dropout_keep(SEED, p_drop, torch.arange(b), torch.arange(h), torch.arange(n), torch.arange(N_REP, n))
        probs = probs * keep / (1 - p_drop)
    return torch.matmul(probs, v)


def _token_major(t: torch.Tensor, misaligned: bool) -> torch.Tensor:
    """``t`` (B, H, L, D) stored token-major, as a projection per token gives it; ``misaligned``:
    starting one element into its allocation (not on a 64-byte boundary)."""
    b, h, n, d = t.shape
    flat = torch.empty(b * n * h * d + int(misaligned), dtype=t.dtype)
    out = flat[int(misaligned) :].view(b, n, h, d)
    out.copy_(t.transpose(1, 2))
    return out.transpose(1, 2)


def _check(world, cfg: Cfg, pieces, p_drop, joint=False, token_major=False):
    """``joint``: the replicated and local queries are the two parts of one token-major tensor
    (a ViT's ``q.split``), which backward computes in joint kernel calls. ``token_major``: k and
    v stored token-major (they travel uncopied where aligned), misaligned on odd ranks (copied):
    the replicated output must still be bit-identical."""
    m = mesh(world)
    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf._ChunkBuffers.copy_of
    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = pieces, 1
    copies = []
    snf._ChunkBuffers.copy_of = lambda self, t: copies.append(t.shape) or old[2](self, t)
    try:
        q, k, v, pad, grad = cfg.tensors()
        g = torch.Generator().manual_seed(3)
        rq = torch.randn(cfg.batch, cfg.heads, N_REP, cfg.dim, generator=g, dtype=cfg.dtype)
        grad_r = torch.randn(cfg.batch, cfg.heads, N_REP, cfg.dim_v or cfg.dim, generator=g, dtype=cfg.dtype)
        leaves = [t.clone().requires_grad_() for t in (rq, q, k, v)]
        ref = _reference(torch.cat(leaves[:2], 2), leaves[2], leaves[3], pad, p_drop)
        ref.backward(torch.cat([grad_r, grad], 2))
        local = [_local(cfg, m, t, 2) for t in (q, k, v)]
        if token_major:
            local[1:] = [_token_major(t, dist.get_rank() % 2 == 1) for t in local[1:]]
        local = [t.requires_grad_() for t in local]
        rq_local = rq.clone().requires_grad_()
        args, seen = list(local), []
        if joint:
            both = torch.cat([rq, local[0].detach()], 2).transpose(1, 2).contiguous().transpose(1, 2)
            both.requires_grad_()
            rq_split, args[0] = both.split([N_REP, local[0].shape[2]], 2)
            real = snf._rows_before
            spy = lambda a, b: seen.append(real(a, b)) or seen[-1]  # noqa: E731
        else:
            rq_split = rq_local
        pad_local = _local(cfg, m, pad, 1) if pad is not None else None
        opts = {}
        if p_drop:
            ring = domain_peers(m)
            sizes = cfg.sizes or snn.Layout.balanced(cfg.length, ring.size).sizes
            start = N_REP + sum(sizes[: ring.index])
            pos = torch.arange(start, start + sizes[ring.index])
            opts = dict(dropout_p=p_drop, dropout_seed=SEED, q_positions=pos, k_positions=pos,
                        replicated_positions=torch.arange(N_REP))
        out, out_r = snf.ring_attention(*args, m, key_padding_mask=pad_local, replicated_q=rq_split, **opts)
        # The replicated output's gradient is shared out over the ranks (uneven shares).
        rank, p = dist.get_rank(), dist.get_world_size()
        share = (rank + 1) / (p * (p + 1) / 2)
        if joint:
            snf._rows_before = spy
        try:
            torch.autograd.backward([out, out_r], [_local(cfg, m, grad, 2), grad_r * share])
        finally:
            if joint:
                snf._rows_before = real
        if joint:
            # Joint calls are taken wherever they can be (a single-rank domain has no ring).
            assert p == 1 or (seen == [] if p_drop else len(seen) == 1 and seen[0] is not None), seen
            rq_local.grad, local[0].grad = both.grad.split([N_REP, local[0].shape[2]], 2)
        tol = dict(atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(_unshard(cfg, m, out.detach(), 2), ref[:, :, N_REP:].detach(), **tol)
        torch.testing.assert_close(out_r.detach(), ref[:, :, :N_REP].detach(), **tol)
        for name, loc, leaf in zip("qkv", local, leaves[1:]):
            torch.testing.assert_close(_unshard(cfg, m, loc.grad, 2), leaf.grad, **tol, msg=lambda s, n=name: f"d{n}: {s}")
        drq = rq_local.grad.clone()
        dist.all_reduce(drq)
        torch.testing.assert_close(drq, leaves[0].grad, **tol)
        # Bit-identical replicated output on every rank.
        every = [torch.empty_like(out_r) for _ in range(p)]
        dist.all_gather(every, out_r.detach().contiguous())
        assert all(torch.equal(e, every[0]) for e in every)
        if token_major and pieces == 1 and dist.get_world_size() > 1:
            # Whole blocks of token-major k, v: copied to travel only where misaligned (odd ranks).
            assert bool(copies) == (dist.get_rank() % 2 == 1), copies
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL, snf._ChunkBuffers.copy_of = old
    return True


CASES = [
    (Cfg(), 1, 0.0),
    (Cfg(kv_heads=2, mask=True), 3, 0.0),
    (Cfg(dim_v=5), 2, 0.0),  # blocked math path
    (Cfg(kv_heads=2), 2, P_DROP),
]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_replicated_queries_exact(run, world, case):
    cfg, pieces, p_drop = CASES[case]
    cfg = Cfg(**{**cfg.__dict__, "sizes": UNEVEN[world], "length": sum(UNEVEN[world])})
    assert run(world, _check, world, cfg, pieces, p_drop) == [True] * world


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", [0, 1])
def test_replicated_queries_with_token_major_keys(run, world, case):
    """Keys and values stored token-major travel uncopied (where aligned; odd ranks' are not and
    are copied): exact results, and the replicated output bit-identical on every rank."""
    cfg, pieces, p_drop = CASES[case]
    cfg = Cfg(**{**cfg.__dict__, "sizes": UNEVEN[world], "length": sum(UNEVEN[world])})
    assert run(world, _check, world, cfg, pieces, p_drop, True, True) == [True] * world


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_replicated_queries_stored_before_local_ones(run, world, case):
    """Replicated and local queries split from one tensor: backward runs them in joint kernel
    calls (not with dropout); the same exact results on uneven slabs."""
    cfg, pieces, p_drop = CASES[case]
    cfg = Cfg(**{**cfg.__dict__, "sizes": UNEVEN[world], "length": sum(UNEVEN[world])})
    assert run(world, _check, world, cfg, pieces, p_drop, True) == [True] * world


EMPTY = {2: (0, 7), 3: (4, 0, 0), 4: (3, 0, 2, 0)}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("joint", [False, True])
def test_replicated_queries_with_empty_slabs(run, world, joint):
    """Ranks without tokens (session 67): the class token still attends over every key (an
    empty block is merged as one that saw nothing), and its output is bit-identical everywhere;
    with the first block empty too (world 2 and 4), so the merge starts from nothing."""
    for cfg, pieces, p_drop in CASES[:2] + CASES[3:] if not joint else CASES[:2]:
        cfg = Cfg(**{**cfg.__dict__, "sizes": EMPTY[world], "length": sum(EMPTY[world])})
        assert run(world, _check, world, cfg, pieces, p_drop, joint) == [True] * world


@pytest.mark.parametrize("case", range(len(CASES)))
def test_replicated_queries_one_rank(run, case):
    """A one-rank domain: torch's fused attention on ``[replicated; queries]`` (no dropout, no
    padding) or the ring's own path (dropout, padding), exact either way, split or concatenated."""
    cfg, pieces, p_drop = CASES[case]
    assert run(1, _check, 1, cfg, pieces, p_drop) == [True]
    assert run(1, _check_concat, cfg) == [True]


def _check_concat(cfg: Cfg):
    m = mesh(1)
    q, k, v, pad, _ = cfg.tensors()
    rq = torch.randn(cfg.batch, cfg.heads, N_REP, cfg.dim, generator=torch.Generator().manual_seed(3), dtype=cfg.dtype)
    both = snf.ring_attention(q, k, v, m, key_padding_mask=pad, replicated_q=rq, concat_replicated=True)
    ref = _reference(torch.cat([rq, q], 2), k, v, pad, 0.0)
    torch.testing.assert_close(both, ref, atol=1e-10, rtol=1e-10)
    return True


def _errors(world):
    m = mesh(world)
    q = torch.randn(1, 2, 3, 4)
    out = []
    bad_len = torch.randn(1, 2, 1 + (dist.get_rank() == 1), 4)  # one rank holds another length
    for kwargs in (dict(replicated_q=bad_len), dict(replicated_q=q[:, :1], is_causal=True),
                   dict(replicated_q=torch.randn(1, 3, 1, 4))):
        causal = kwargs.pop("is_causal", False)
        try:
            snf.ring_attention(q, q, q, m, causal, **kwargs)
            out.append(None)
        except Exception as err:  # noqa: BLE001 - the type and message are what is compared
            out.append((type(err).__name__, str(err).split(";")[0]))
    return out


def test_replicated_query_errors_on_every_rank(run):
    res = run(2, _errors, 2)
    assert res[0] == res[1] and all(r is not None and r[0] == "ShardingError" for r in res[0])
