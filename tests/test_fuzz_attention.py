"""Hypothesis fuzzing of ring and Ulysses attention: every option at once, against float64 math.

``tests/test_attention*.py`` and ``tests/test_ring_*.py`` check hand-picked cases; this file draws
the options together, where their interactions live: world size (1-4 or a 2x2 mesh), uneven slabs
(query and key slabs of their own lengths when not causal; sometimes empty ones), contiguous or
zigzag layout, batch,
heads and grouped KV heads, query and value head sizes, causal, key padding (up to rows with no
visible key), a score scale, large logits, attention dropout, replicated queries (riding the ring,
separate, concatenated or stored right before the local ones as a ViT's split projection gives
them), ``return_lse``, ``seq_lens``, the ring's K/V pieces, and each of q, k, v and the output
gradient stored contiguous, with a strided last dim, or token-major.

The reference is a hand-written float64 attention on the full tensors (a query with no visible key
gives zeros, as the contract says, where ``F.scaled_dot_product_attention`` gives NaN), with the
dropout mask law of ``attention_kernels.dropout_keep`` on global positions. Each rank compares its
own slabs (outputs, ``lse``, the q/k/v gradients) with the reference's, the replicated queries'
output bit for bit across ranks and their gradient after the domain sum. A ``ShardingError`` (or
``ShardingNotImplementedError``, ``ValueError``) raised alike on every rank is a refusal, counted
apart; any mismatch fails.

- ``test_fuzz_attention_fast``: the CI subset (derandomized, a few dozen examples).
- ``test_fuzz_attention_campaign`` (``pytest -m slow``): ``SNN_FUZZ_EXAMPLES`` examples (default
  1,200), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn import functional as snf
from sharded_nn.attention_kernels import dropout_keep
from sharded_nn.comm.ring_pass import domain_peers

from .fuzzing import fast_settings, outcome, run_campaign
from .harness import mesh, world_of

STORAGES = ("contiguous", "strided", "token_major")


# --------------------------------------------------------------------------- reference


def _reference(cfg: dict, q, k, v, rq, pad):
    """Attention of ``[rq; q]`` over all keys in float64; returns (output, lse), rows of rq first.

    Causal masks the local queries only (replicated queries attend over every key, as the
    contract says); a row with no visible key has output 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    lr = 0 if rq is None else rq.shape[2]
    qa = q if rq is None else torch.cat([rq, q], 2)
    b, h, n, d = qa.shape
    lk = k.shape[2]
    scale = cfg["scale"] if cfg["scale"] is not None else d**-0.5
    s = torch.matmul(qa, k.transpose(-1, -2)) * scale
    visible = torch.ones(b, 1, n, lk, dtype=torch.bool)
    if pad is not None:
        visible = visible & ~pad[:, None, None, :]
    if cfg["causal"]:
        visible[:, :, lr:] &= torch.ones(n - lr, lk, dtype=torch.bool).tril()
    s = s.masked_fill(~visible, float("-inf"))
    # (No key at all: zeros, the contract's answer for a query with no visible key.)
    top = s.detach().amax(-1, keepdim=True) if lk else s.new_zeros((b, h, n, 1))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    den = e.sum(-1, keepdim=True)
    probs = e / torch.where(den > 0, den, torch.ones_like(den))
    lse = (torch.log(den.detach()) + top).squeeze(-1)
    if cfg["p_drop"]:
        qpos, kpos = torch.arange(n), lr + torch.arange(lk)
        keep = dropout_keep(cfg["drop_seed"], cfg["p_drop"], torch.arange(b), torch.arange(h), qpos, kpos)
        probs = probs * keep / (1 - cfg["p_drop"])
    return torch.matmul(probs, v), lse


# --------------------------------------------------------------------------- worker side


def _runs(cfg: dict, which: str, p: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every rank's (start, length) runs of the query (``which="q"``) or key sequence: one run per
    rank (contiguous: the drawn slab sizes) or two (zigzag: chunks r and 2P-1-r of a balanced 2P
    split of the drawn total)."""
    sizes = cfg[f"{which}_sizes"]
    if cfg["layout"] == "zigzag":
        chunks = snn.Layout.balanced(sizes[0], 2 * p).sizes
        starts = [sum(chunks[:i]) for i in range(2 * p)]
        return tuple(((starts[r], chunks[r]), (starts[2 * p - 1 - r], chunks[2 * p - 1 - r])) for r in range(p))
    return tuple(((sum(sizes[:r]), sizes[r]),) for r in range(p))


def _slab(runs, x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([x.narrow(dim, s, n) for s, n in runs], dim)


def _stored(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values of a (B, H, L, D) tensor in another memory layout."""
    if how == "strided":  # last dim strided: the tokens of a channels-first map
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    if how == "token_major":  # a per-token projection's (B, L, H, D), transposed
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


def _case(cfg: dict):
    """One example on this rank: ``"ok"`` or ``("refused", type, message)``; raises on a mismatch."""
    m = mesh(cfg["domain"])
    ring = domain_peers(m)
    p, r = ring.size, ring.index
    f64 = cfg["dtype"] == "float64"
    dt = torch.float64 if f64 else torch.float32
    g = torch.Generator().manual_seed(cfg["seed"])
    b, h, hk, d, dv, lr = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["dim"], cfg["dim_v"], cfg["rep"]
    lq, lk = sum(cfg["q_sizes"]), sum(cfg["k_sizes"])

    def randn(*shape, big=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * big).to(dt)

    q, k, v = randn(b, h, lq, d, big=cfg["big"]), randn(b, hk, lk, d, big=cfg["big"]), randn(b, hk, lk, dv)
    rq = randn(b, h, lr, d, big=cfg["big"]) if lr else None
    pad = None
    if cfg["mask"]:
        pad = torch.rand(b, lk, generator=g) < cfg["density"]
    gout, gr = randn(b, h, lq, dv), randn(b, h, lr, dv)

    # Copies: ``.double()`` of a float64 tensor is the tensor itself.
    leaves = [t.double().clone().requires_grad_() for t in (q, k, v)]
    rq_leaf = rq.double().clone().requires_grad_() if lr else None
    ref, ref_lse = _reference(cfg, *leaves, rq_leaf, pad)
    ref.backward(torch.cat([gr.double(), gout.double()], 2) if lr else gout.double())

    q_runs, k_runs = _runs(cfg, "q", p), _runs(cfg, "k", p)
    mine_q, mine_k = q_runs[r], k_runs[r]
    st_q, st_k, st_v, st_g = cfg["storage"]
    local = [
        _stored(_slab(mine_q, q, 2), st_q).requires_grad_(),
        _stored(_slab(mine_k, k, 2), st_k).requires_grad_(),
        _stored(_slab(mine_k, v, 2), st_v).requires_grad_(),
    ]
    dout = _stored(_slab(mine_q, gout, 2), st_g)
    opts: dict = dict(key_padding_mask=None if pad is None else _slab(mine_k, pad, 1), layout=cfg["layout"])
    if cfg["p_drop"]:
        # Global positions: replicated queries first, then the sequence (queries and keys alike).
        qpos, kpos = lr + torch.arange(lq), lr + torch.arange(lk)
        opts.update(dropout_p=cfg["p_drop"], dropout_seed=cfg["drop_seed"], q_positions=_slab(mine_q, qpos, 0),
                    k_positions=_slab(mine_k, kpos, 0))
    if cfg["seq_lens"]:
        opts["seq_lens"] = (tuple(sum(n for _, n in x) for x in q_runs), tuple(sum(n for _, n in x) for x in k_runs))
    both = None
    args = list(local)
    ring_opts = dict(return_lse=cfg["lse"])
    if lr:
        if cfg["joint"]:
            both = torch.cat([rq, local[0].detach()], 2).transpose(1, 2).contiguous().transpose(1, 2)
            both.requires_grad_()
            rq_in, args[0] = both.split([lr, local[0].shape[2]], 2)
        else:
            rq_in = rq.clone().requires_grad_()
        ring_opts.update(replicated_q=rq_in, concat_replicated=cfg["concat"])
        if cfg["p_drop"]:
            ring_opts["replicated_positions"] = torch.arange(lr)

    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL
    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = cfg["pieces"], 1
    try:
        if cfg["kind"] == "ring":
            res = snf.ring_attention(*args, m, cfg["causal"], cfg["scale"], **opts, **ring_opts)
        else:
            res = snf.ulysses_attention(*args, m, cfg["causal"], cfg["scale"], **opts)
        res = list(res) if isinstance(res, tuple) else [res]
        out_r = lse = None
        if lr and cfg["concat"]:
            out = res.pop(0)
            out_r, out = out[:, :, :lr], out[:, :, lr:]
        else:
            out = res.pop(0)
        if cfg["kind"] == "ring" and cfg["lse"]:
            lse = res.pop(0)
        if lr and not cfg["concat"]:
            out_r = res.pop(0)
        assert not res, f"unexpected extra outputs: {len(res)}"
        # The replicated output's gradient is shared out over the ranks (uneven shares).
        share = (r + 1) / (p * (p + 1) / 2)
        outs, grads = [out], [dout]
        if lr:
            outs.append(out_r)
            grads.append(gr * share)
        torch.autograd.backward(outs, grads)
    except (snn.ShardingError, snn.ShardingNotImplementedError, ValueError) as e:
        return ("refused", type(e).__name__, str(e))
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = old

    if both is not None:
        rq_grad, local[0].grad = both.grad.split([lr, local[0].shape[2]], 2)
    elif lr:
        rq_grad = rq_in.grad
    where = f"rank {r} of {p}"

    def close(got, want, what):
        # float32: errors scale with the tensor's largest magnitude (logits up to ~300 here);
        # torch's own float32 SDPA on the full sequence reaches 1e-4 of it on such cases.
        atol = 1e-9 if f64 else 1e-3 * max(want.abs().max().item() if want.numel() else 0.0, 1.0)
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-9 if f64 else 3e-3, check_dtype=False,
                                   msg=lambda s: f"{where} {what}: {s}")

    assert out.dtype == dt and out.shape == (b, h, sum(n for _, n in mine_q), dv), (out.dtype, out.shape)
    close(out.detach(), _slab(mine_q, ref[:, :, lr:].detach(), 2), "output")
    if lse is not None:
        close(lse.detach(), _slab(mine_q, ref_lse[:, :, lr:], 2), "lse")
    for name, loc, leaf, runs in zip("qkv", local, leaves, (mine_q, mine_k, mine_k)):
        assert loc.grad is not None and loc.grad.shape == loc.shape, name
        close(loc.grad, _slab(runs, leaf.grad, 2), f"d{name}")
    if lr:
        close(out_r.detach(), ref[:, :, :lr].detach(), "replicated output")
        every = [torch.empty_like(out_r) for _ in range(dist.get_world_size(ring.group))]
        dist.all_gather(every, out_r.detach().contiguous(), group=ring.group)
        assert all(torch.equal(e, every[0]) for e in every), "replicated output differs across ranks"
        total = rq_grad.detach().clone()
        dist.all_reduce(total, group=ring.group)
        close(total, rq_leaf.grad, "d(replicated q)")
    return "ok"


# --------------------------------------------------------------------------- configs


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["ring", "ring", "ulysses"]))
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    p = world_of(domain)
    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    kv_heads = draw(st.sampled_from([x for x in (1, 2, 3, 6) if heads % x == 0]))
    if kind == "ulysses" and draw(st.integers(0, 9)):
        # Ulysses splits whole heads over the ranks (it refuses other counts): mostly divisible.
        kv_heads = p * draw(st.integers(1, 2))
        heads = kv_heads * draw(st.integers(1, 2))
    dim = draw(st.integers(1, 12))
    causal = draw(st.booleans())
    layout = draw(st.sampled_from(["contiguous", "contiguous", "zigzag"]))
    if layout == "zigzag":
        # Balanced 2P chunks of at least one token each.
        # (total,): ``_runs`` cuts it.
        q_sizes = k_sizes = (draw(st.integers(2 * p, 2 * p + 7)),)
        if not causal and draw(st.booleans()):
            k_sizes = (draw(st.integers(2 * p, 2 * p + 7)),)
    else:
        # Sometimes empty slabs (ring attention takes them since session 67; no key at all is
        # refused alike).
        low = 0 if not draw(st.integers(0, 4)) else 1
        q_sizes = tuple(draw(st.integers(low, 6)) for _ in range(p))
        k_sizes = q_sizes
        if not causal and draw(st.booleans()):
            k_sizes = tuple(draw(st.integers(low, 6)) for _ in range(p))
    rep = draw(st.sampled_from([0, 0, 1, 3])) if kind == "ring" else 0
    if causal and draw(st.integers(0, 9)):
        rep = 0  # replicated queries with causal attention are refused (no causal position): rarely
    cfg = dict(
        kind=kind, domain=domain, seed=draw(st.integers(0, 2**16)), batch=draw(st.integers(1, 2)), heads=heads,
        kv_heads=kv_heads, dim=dim, dim_v=draw(st.sampled_from([dim, dim, draw(st.integers(1, 9))])),
        causal=causal, layout=layout, q_sizes=q_sizes, k_sizes=k_sizes,
        mask=draw(st.booleans()), density=draw(st.sampled_from([0.2, 0.5, 0.9])),
        scale=draw(st.sampled_from([None, None, 0.37, 2.5])), big=draw(st.sampled_from([1.0, 1.0, 6.0])),
        dtype=draw(st.sampled_from(["float64", "float64", "float64", "float32"])),
        p_drop=draw(st.sampled_from([0.0, 0.0, 0.0, 0.3])), drop_seed=draw(st.integers(0, 2**31)),
        rep=rep, joint=rep > 0 and draw(st.booleans()), concat=rep > 0 and draw(st.booleans()),
        lse=kind == "ring" and draw(st.booleans()), seq_lens=draw(st.booleans()),
        pieces=draw(st.sampled_from([1, 2, 3, 8])) if kind == "ring" else 8,
        storage=tuple(draw(st.sampled_from(STORAGES)) for _ in range(4)),
    )  # fmt: skip
    return cfg


def _outcome(pools, cfg, timeout: float = 120.0):
    return outcome(pools, _case, cfg, timeout)


# --------------------------------------------------------------------------- tests


FAST = fast_settings("SNN_FUZZ_FAST_EXAMPLES", 30)


@FAST
@given(cfg=configs())
def test_fuzz_attention_fast(pools, cfg):
    _outcome(pools, cfg)


@pytest.mark.slow
def test_fuzz_attention_campaign(pools):
    timeout = float(os.environ.get("SNN_FUZZ_TIMEOUT", 900))
    run_campaign(
        "attention fuzz", configs(), lambda cfg: _outcome(pools, cfg, timeout), int(os.environ.get("SNN_FUZZ_EXAMPLES", 1200)),
        minimum=1000, count=lambda cfg: cfg["kind"], every=100,
    )
