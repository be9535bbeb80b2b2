"""Ring and Ulysses attention against F.scaled_dot_product_attention on the full sequence."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn import functional as snf
from sharded_nn.comm.ring_pass import domain_peers, gather_ints

from .harness import mesh
from .reference import check_against_reference


@dataclass(frozen=True)
class Cfg:
    length: int = 13
    heads: int = 4
    kv_heads: int | None = None
    dim: int = 8
    dim_v: int | None = None
    batch: int = 2
    causal: bool = False
    layout: str = "contiguous"
    mask: bool = False
    sizes: tuple | None = None  # explicit per-rank lengths (contiguous layout)
    scale: float | None = None
    big: float = 1.0  # multiplies q and k: large logits
    dead: bool = False  # every key of batch item 1 is padding: its outputs and gradients are 0
    dtype: torch.dtype = torch.float64
    # q, k, v and the output gradient as views whose last dim is strided (tokens of a
    # channels-first map: ``x.flatten(2).transpose(1, 2)``); the CPU flash kernel once read them wrong.
    strided: bool = False

    def tensors(self):
        q, k, v, pad, grad = self._tensors()
        if self.strided:
            q, k, v, grad = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q, k, v, grad))
            assert q.stride(-1) != 1
        return q, k, v, pad, grad

    def _tensors(self):
        g = torch.Generator().manual_seed(0)
        hk = self.kv_heads or self.heads
        q = torch.randn(self.batch, self.heads, self.length, self.dim, generator=g, dtype=self.dtype) * self.big
        k = torch.randn(self.batch, hk, self.length, self.dim, generator=g, dtype=self.dtype) * self.big
        v = torch.randn(self.batch, hk, self.length, self.dim_v or self.dim, generator=g, dtype=self.dtype)
        pad = None
        if self.mask:
            pad = torch.rand(self.batch, self.length, generator=g) < 0.4
            pad[:, 0] = False  # every query keeps at least one key (also under the causal mask)
            pad[1] |= self.dead
        grad = torch.randn(self.batch, self.heads, self.length, self.dim_v or self.dim, generator=g, dtype=self.dtype)
        return q, k, v, pad, grad

    def reference(self, q, k, v, pad):
        mask = None
        if self.pad_mask(pad) is not None:
            mask = self.pad_mask(pad)
        if self.causal:
            tril = torch.ones(self.length, self.length, dtype=torch.bool).tril()
            mask = tril if mask is None else mask & tril
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=(self.kv_heads or self.heads) != self.heads
        )

    @staticmethod
    def pad_mask(pad):
        return None if pad is None else ~pad[:, None, None, :]


def _local(cfg: Cfg, m, x, dim):
    """This rank's slab of a full tensor along ``dim`` in the configured layout.

    Slabs follow the flattened domain ring (row-major over a 2x2 mesh), as ring attention does.
    """
    if cfg.layout == "zigzag":
        return snf.zigzag_shard(x, m, dim)
    ring = domain_peers(m)
    sizes = cfg.sizes or snn.Layout.balanced(x.shape[dim], ring.size).sizes
    return x.narrow(dim, sum(sizes[: ring.index]), sizes[ring.index]).clone()


def _unshard(cfg: Cfg, m, x_local, dim):
    if cfg.layout == "zigzag":
        return snf.zigzag_unshard(x_local, m, dim)
    ring = domain_peers(m)
    if ring.size == 1:
        return x_local
    shapes = [tuple(s) for s in gather_ints(x_local.shape, ring)]
    return torch.cat(snn.comm.all_gather_uneven(x_local, ring.group, shapes), dim)


def _check_cases(domain, cases, kind):
    m = mesh(domain)
    fn = snf.ring_attention if kind == "ring" else snf.ulysses_attention
    errs = []
    for cfg in cases:
        q, k, v, pad, grad = cfg.tensors()
        # The reference runs in float64 even for float32 inputs: with logits ~1e3, float32 SDPA
        # itself is off by ~1e-3 in dV.
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = cfg.reference(*leaves, pad)
        ref.backward(grad.double())
        local = [_local(cfg, m, t.detach(), 2).requires_grad_() for t in (q, k, v)]
        pad_local = _local(cfg, m, pad, 1) if pad is not None else None
        ins, dout = local, _local(cfg, m, grad, 2)
        if cfg.strided:  # the slabs too (a narrowed clone is contiguous)
            ins = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in local]
            dout = dout.transpose(2, 3).contiguous().transpose(2, 3)
        out = fn(*ins, m, cfg.causal, cfg.scale, key_padding_mask=pad_local, layout=cfg.layout)
        out.backward(dout)
        tol = dict(atol=1e-10, rtol=1e-10)
        if cfg.dtype != torch.float64:
            tol = dict(atol=2e-3, rtol=2e-3, check_dtype=False)
        torch.testing.assert_close(_unshard(cfg, m, out.detach(), 2), ref.detach(), **tol, msg=lambda s: f"{cfg}: {s}")
        for name, loc, leaf in zip("qkv", local, leaves):
            torch.testing.assert_close(
                _unshard(cfg, m, loc.grad, 2), leaf.grad, **tol, msg=lambda s, n=name: f"{cfg} d{n}: {s}"
            )
        assert out.dtype == cfg.dtype and all(torch.isfinite(t.grad).all() for t in local)
        diff = (out.detach().double() - _local(cfg, m, ref.detach(), 2)).abs()
        errs.append(diff.max().item() if diff.numel() else 0.0)  # (an empty slab: nothing to differ)
    return errs


RING_CASES = [
    Cfg(),
    Cfg(causal=True),
    Cfg(causal=True, layout="zigzag"),
    Cfg(causal=True, layout="zigzag", length=17),
    Cfg(kv_heads=2),
    Cfg(kv_heads=1, causal=True),
    Cfg(mask=True),
    Cfg(mask=True, causal=True, layout="zigzag", kv_heads=2),
    Cfg(mask=True, dead=True),
    Cfg(scale=0.37, heads=3),  # 3 heads: ring attention does not care whether P divides them
    Cfg(dim_v=5),  # value head size != query head size: blocked math path
    Cfg(dim_v=5, causal=True, mask=True),
    Cfg(big=30.0, dtype=torch.float32, causal=True),  # logits ~ 1e3: the lse merge must stay finite
    Cfg(strided=True),
    Cfg(strided=True, causal=True, mask=True, kv_heads=2),
]


@pytest.mark.parametrize("domain", [1, 2, 3, 4, (2, 2)])
def test_ring_attention(run, domain):
    world = domain if isinstance(domain, int) else 4
    errs = run(world, _check_cases, domain, RING_CASES, "ring")
    assert all(e < 1e-4 for r in errs for e in r)


UNEVEN = {2: (9, 4), 3: (2, 7, 4), 4: (1, 5, 3, 4)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_uneven(run, world):
    s = UNEVEN[world]
    cases = [Cfg(sizes=s), Cfg(sizes=s, causal=True, mask=True), Cfg(sizes=s, kv_heads=2, dim_v=3)]
    run(world, _check_cases, world, cases, "ring")


# Empty slabs (a deep stage, or a short sequence, on many ranks): first, in the middle, last.
EMPTY = {2: (13, 0), 3: (5, 0, 8), 4: (0, 6, 0, 7)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_empty_slabs(run, world):
    # Refused before session 67 (every rank needed queries and keys); in a converted model the
    # guard fuzzer's token attention after a deep stage. A rank without tokens computes nothing
    # and its block travels as no message.
    s = EMPTY[world]
    cases = [Cfg(sizes=s), Cfg(sizes=s, causal=True, mask=True), Cfg(sizes=s, kv_heads=2, dim_v=3)]
    run(world, _check_cases, world, cases, "ring")
    run(world, _check_chunked, world, [Cfg(sizes=s, kv_heads=2, mask=True)], 3)  # travelling pieces


def _check_chunked(domain, cases, pieces):
    """Run ``cases`` with the travelling blocks cut into ``pieces`` (tiny tensors are not cut)."""
    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL
    snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = pieces, 1
    try:
        return _check_cases(domain, cases, "ring")
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = old


CHUNKED_CASES = [
    Cfg(),
    Cfg(causal=True, layout="zigzag", mask=True),
    Cfg(kv_heads=2, causal=True),
    Cfg(kv_heads=1, dim_v=5, mask=True, dead=True),
]


@pytest.mark.parametrize("domain,pieces", [(2, 8), (3, 3), (3, 2), ((2, 2), 8)])
def test_ring_attention_chunked(run, domain, pieces):
    # pieces=8: one head per piece; 3: uneven head runs; 2 (= batch): whole batch items.
    world = domain if isinstance(domain, int) else 4
    cases = CHUNKED_CASES + ([Cfg(sizes=UNEVEN[world], causal=True, mask=True)] if world in UNEVEN else [])
    run(world, _check_chunked, domain, cases, pieces)


ULYSSES_CASES = [
    Cfg(),
    Cfg(causal=True),
    Cfg(causal=True, layout="zigzag", length=19),
    Cfg(heads=8, kv_heads=4, mask=True),
    Cfg(mask=True, causal=True),
    Cfg(scale=0.5, dim_v=6),
    Cfg(strided=True, causal=True),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ulysses_attention(run, world):
    cases = ULYSSES_CASES + ([Cfg(sizes=UNEVEN[world], causal=True)] if world > 1 else [])
    run(world, _check_cases, world, cases, "ulysses")


def _ulysses_bad_heads(world):
    m = mesh(world)
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    with pytest.raises(snn.ShardingError, match="4 query heads .* divisible by the 3 domain ranks"):
        snf.ulysses_attention(q, q, q, m)
    with pytest.raises(snn.ShardingError, match="divisible"):
        snn.UlyssesAttention(m)(q, q, q)
    return True


def test_ulysses_heads_not_divisible(run):
    assert run(3, _ulysses_bad_heads, 3) == [True] * 3


def _bad_layouts(world):
    m = mesh(world)
    r = m.get_local_rank("domain")
    q = torch.randn(1, 2, 3 + 2 * r, 4, dtype=torch.float64)
    # Zigzag needs chunk lengths r and 2P-1-r of a balanced 2P split: (3, 5) is not one.
    with pytest.raises(snn.ShardingError, match="zigzag"):
        snf.ring_attention(q, q, q, m, True, layout="zigzag")
    # A mask of the wrong length on one rank only: every rank raises.
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    pad = torch.zeros(1, 4 + r, dtype=torch.bool)
    with pytest.raises(snn.ShardingError, match=r"ranks \[1\] pass"):
        snf.ring_attention(x, x, x, m, key_padding_mask=pad)
    # Ranks disagree on the number of heads.
    k = torch.randn(1, 2 + r, 3, 4, dtype=torch.float64)
    with pytest.raises(snn.ShardingError, match="disagree"):
        snf.ring_attention(k, k, k, m)
    return True


def test_errors_on_every_rank(run):
    assert run(2, _bad_layouts, 2) == [True, True]


# ------------------------------------------------------------------------- modules and convert


def _module_forms(world):
    m = mesh(world)
    cfg = Cfg(causal=True, layout="zigzag")
    q, k, v, _, _ = cfg.tensors()
    ref = cfg.reference(q, k, v, None)
    for cls in (snn.RingAttention, snn.UlyssesAttention):
        attn = cls(m, is_causal=True, layout="zigzag")
        out = attn(*(snf.zigzag_shard(t, m, 2) for t in (q, k, v)))
        torch.testing.assert_close(snf.zigzag_unshard(out, m, 2), ref, atol=1e-10, rtol=1e-10)
    return True


def test_module_forms(run):
    assert run(2, _module_forms, 2) == [True, True]


class _MHAModel(nn.Module):
    def __init__(self, batch_first: bool, kdim=None):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.batch_first = batch_first

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def _mha_check(world, batch_first, attention, sizes):
    torch.manual_seed(0)
    ref = _MHAModel(batch_first).double()
    m = mesh(world)
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"mha": {"attention": attention}})
    assert isinstance(sharded.mha, snn.ShardedMultiheadAttention)
    assert sharded.state_dict().keys() == ref.state_dict().keys()
    torch.manual_seed(1)
    x = torch.randn(2, 11, 16, dtype=torch.float64) if batch_first else torch.randn(11, 2, 16, dtype=torch.float64)
    dim = 1 if batch_first else 0
    check_against_reference(ref, x, m, dims=(dim,), sharded=sharded, sizes=sizes)
    return True


@pytest.mark.parametrize(
    "world,attention,sizes", [(1, "ring", None), (2, "ring", (8, 3)), (2, "ulysses", None), (3, "ring", None)]
)
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention(run, world, attention, sizes, batch_first):
    assert run(world, _mha_check, world, batch_first, attention, sizes) == [True] * world


def _mha_errors(world):
    # need_weights=True (torch's default) runs since session 60 (tests/test_mha_weights.py), but
    # not with attention dropout in training: the weights would carry torch's own draws.
    m = mesh(world)
    torch.manual_seed(0)
    mha = snn.convert(nn.MultiheadAttention(8, 2, dropout=0.1).double(), m)
    x = torch.randn(3, 1, 8, dtype=torch.float64)
    with pytest.raises(snn.ShardingNotImplementedError, match="need_weights=True with attention dropout"):
        mha(x, x, x)
    return True


def test_multihead_attention_need_weights(run):
    assert run(2, _mha_errors, 2) == [True, True]


def _timm_check(world, attention, qk_norm):
    from timm.models.vision_transformer import Attention

    torch.manual_seed(0)
    ref = Attention(16, num_heads=4, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.LayerNorm).double()
    m = mesh(world)
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"": {"attention": attention}})
    assert isinstance(sharded, snn.ShardedTimmAttention)
    assert sharded.state_dict().keys() == ref.state_dict().keys()
    torch.manual_seed(1)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    check_against_reference(ref, x, m, dims=(1,), sharded=sharded)
    return True


@pytest.mark.parametrize(
    "world,attention,qk_norm", [(2, "ring", False), (2, "ulysses", True), (3, "ring", True), (4, "ulysses", False)]
)
def test_timm_attention(run, world, attention, qk_norm):
    assert run(world, _timm_check, world, attention, qk_norm) == [True] * world


# ------------------------------------------------------------------------- fused kernel self-check


def _math_kernels():
    """A correct stand-in for a fused kernel pair (the math path), counting its calls."""
    from sharded_nn import attention_kernels as ak

    calls = []

    def fwd(q, k, v, pad, scale, diag):
        calls.append("fwd")
        return ak._math_forward(q, k, v, ak._additive(pad, q.dtype), scale, diag)

    def bwd(dout, q, k, v, out, lse, pad, scale, diag):
        calls.append("bwd")
        return ak._math_backward(dout, q, k, v, out, lse, ak._additive(pad, q.dtype), scale, diag)

    return fwd, bwd, calls


def _block_problem(mask: bool, diag: bool):
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 query heads per key/value head
    pad = None
    if mask:
        pad = (torch.rand(2, 9, generator=g) < 0.4).to(torch.uint8)
        pad[:, 0] = 0
    return q, k, v, dout, pad


def _block_reference(q, k, v, dout, pad, diag):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = None if pad is None else ~pad.bool()[:, None, None, :]
    if diag:
        tril = torch.ones(9, 9, dtype=torch.bool).tril()
        mask = tril if mask is None else mask & tril
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=0.3, enable_gqa=True)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _run_block(q, k, v, dout, pad, diag):
    from sharded_nn import attention_kernels as ak

    out, lse = ak.block_forward(q, k, v, pad, 0.3, diag)
    grads = ak.block_backward(dout, q, k, v, out, lse, pad, 0.3, diag)
    return out, grads


@pytest.fixture
def fake_cpu_kernel(monkeypatch):
    """Route CPU blocks through the checked-kernel machinery with the given kernel pair."""
    from sharded_nn import attention_kernels as ak

    monkeypatch.setattr(ak, "_CHECKED", {})

    def install(fwd, bwd):
        monkeypatch.setitem(ak._CHECKED_KERNELS, "cpu", (fwd, bwd, (torch.float64,), 1))

    return install


@pytest.mark.parametrize("mask,diag", [(False, False), (True, True)])
def test_fused_kernel_used_after_check(fake_cpu_kernel, mask, diag):
    from sharded_nn import attention_kernels as ak

    fwd, bwd, calls = _math_kernels()
    fake_cpu_kernel(fwd, bwd)
    q, k, v, dout, pad = _block_problem(mask, diag)
    ref_out, ref_grads = _block_reference(q, k, v, dout, pad, diag)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            out, grads = _run_block(q, k, v, dout, pad, diag)
            torch.testing.assert_close(out, ref_out)
            for got, want in zip(grads, ref_grads):
                torch.testing.assert_close(got, want)
    # One self-check (fwd + bwd) for the key, then the kernel serves both blocks.
    assert calls == ["fwd", "bwd"] * 3
    assert list(ak._CHECKED.values()) == [True]


def test_fused_kernel_skips_runs_of_few_queries(monkeypatch):
    """A checked kernel serves query runs of at least its fewest rows; shorter runs (replicated
    class tokens) take the math path, with the same result."""
    from sharded_nn import attention_kernels as ak

    fwd, bwd, calls = _math_kernels()
    monkeypatch.setattr(ak, "_CHECKED", {})
    monkeypatch.setitem(ak._CHECKED_KERNELS, "cpu", (fwd, bwd, (torch.float64,), 4))
    q, k, v, dout, pad = _block_problem(True, False)
    for rows in (3, 4):
        calls.clear()
        ref_out, ref_grads = _block_reference(q[:, :, :rows], k, v, dout[:, :, :rows], pad, False)
        out, grads = _run_block(q[:, :, :rows], k, v, dout[:, :, :rows], pad, False)
        torch.testing.assert_close(out, ref_out)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want)
        # 3 rows: no kernel call at all (not even its self-check); 4 rows: self-check + block.
        assert calls == ([] if rows < 4 else ["fwd", "bwd"] * 2)


def _raising(*args, **kwargs):
    raise RuntimeError("bad signature")


def _wrong_forward(q, k, v, pad, scale, diag):
    fwd, _, _ = _math_kernels()
    out, lse = fwd(q, k, v, pad, scale, diag)
    return out * 1.01, lse


@pytest.mark.parametrize("broken", ["raises", "wrong forward", "wrong backward"])
def test_fused_kernel_falls_back(fake_cpu_kernel, broken):
    from sharded_nn import attention_kernels as ak

    fwd, bwd, calls = _math_kernels()
    if broken == "raises":
        fake_cpu_kernel(_raising, bwd)
    elif broken == "wrong forward":
        fake_cpu_kernel(_wrong_forward, bwd)
    else:
        fake_cpu_kernel(fwd, lambda *a: tuple(t * 2 for t in bwd(*a)))
    q, k, v, dout, pad = _block_problem(True, False)
    ref_out, ref_grads = _block_reference(q, k, v, dout, pad, False)
    with pytest.warns(snn.ShardingWarning, match="failed its self-check.*math path"):
        out, grads = _run_block(q, k, v, dout, pad, False)
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    n = len(calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per key, not per block
        _run_block(q, k, v, dout, pad, False)
    assert len(calls) == n and list(ak._CHECKED.values()) == [False]


def test_efficient_kernel_wrappers(fake_cpu_kernel, monkeypatch):
    """The CUDA wrappers' plumbing (lse padded to 32, aligned broadcast bias, argument order),
    run against CPU stand-ins that follow the aten schemas. The real CUDA kernels are not
    exercised here (no GPU); on CUDA the self-check guards them."""
    from types import SimpleNamespace

    from sharded_nn import attention_kernels as ak

    def efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        assert compute_lse and dropout_p == 0.0
        assert all(t.stride(-1) == 1 for t in (q, k, v))
        assert bias is None or (bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(2) == 0)
        out, lse = ak._math_forward(q, k, v, bias, scale, is_causal)
        n = q.shape[2]
        padded = torch.full((*lse.shape[:2], -(-n // 32) * 32), 123.0, dtype=lse.dtype)  # float32 on CUDA
        padded[:, :, :n] = lse
        return out.to(q.dtype), padded, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)

    def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False, *, scale):
        assert lse.shape[2] % 32 == 0 and list(mask) == [True, True, True, False]
        # The CUDA kernel's half-precision delta reads ``out`` as the forward stores it,
        # (B, M, H, K)-contiguous (its row stride is derived, not passed), and every operand
        # with unit-stride head rows.
        assert out.transpose(1, 2).is_contiguous()
        assert all(t.stride(-1) == 1 for t in (dout, q, k, v, out))
        grads = ak._math_backward(dout, q, k, v, out, lse[:, :, : q.shape[2]], bias, scale, is_causal)
        return (*grads, None)

    monkeypatch.setattr(ak, "_aten", SimpleNamespace(
        _scaled_dot_product_efficient_attention=efficient,
        _scaled_dot_product_efficient_attention_backward=efficient_backward,
    ))
    fake_cpu_kernel(ak._efficient_forward, ak._efficient_backward)
    for mask, diag in [(False, False), (True, False), (True, True)]:
        q, k, v, dout, pad = _block_problem(mask, diag)
        ref_out, ref_grads = _block_reference(q, k, v, dout, pad, diag)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, grads = _run_block(q, k, v, dout, pad, diag)
        torch.testing.assert_close(out, ref_out)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want)
    assert set(ak._CHECKED.values()) == {True}


def test_cpu_path_has_no_checked_kernel():
    from sharded_nn import attention_kernels as ak

    # The CPU flash kernel is used directly (covered by every test above); only CUDA is checked.
    assert set(ak._CHECKED_KERNELS) == {"cuda"}


def _ring_with_broken_kernel(world):
    """End to end: a kernel that fails its check leaves ring attention exact, with a warning."""
    from sharded_nn import attention_kernels as ak

    saved = dict(ak._CHECKED_KERNELS), dict(ak._CHECKED)
    ak._CHECKED.clear()
    ak._CHECKED_KERNELS["cpu"] = (_wrong_forward, _math_kernels()[1], (torch.float64,), 1)
    try:
        with pytest.warns(snn.ShardingWarning, match="self-check"):
            _check_cases(world, [Cfg(mask=True), Cfg(causal=True, layout="zigzag")], "ring")
    finally:
        ak._CHECKED_KERNELS.clear()
        ak._CHECKED_KERNELS.update(saved[0])
        ak._CHECKED.clear()
        ak._CHECKED.update(saved[1])
    return True


def test_ring_attention_broken_kernel(run):
    assert run(2, _ring_with_broken_kernel, 2) == [True, True]


def _seq_lens_given(world):
    """Lengths gathered by the caller: the same result without the per-call gather, and lengths
    that do not fit the tensors raise (here on every rank: the list has the wrong size)."""
    m = mesh(world)
    cfg = Cfg(sizes=UNEVEN[world], mask=True, kv_heads=2)
    q, k, v, pad, _ = cfg.tensors()
    local = [_local(cfg, m, t, 2) for t in (q, k, v)]
    pad_local = _local(cfg, m, pad, 1)
    lens = (UNEVEN[world], UNEVEN[world])
    same = []
    for fn in (snf.ring_attention, snf.ulysses_attention):
        if fn is snf.ulysses_attention and cfg.heads % world:
            continue
        a = fn(*local, m, key_padding_mask=pad_local)
        b = fn(*local, m, key_padding_mask=pad_local, seq_lens=lens)
        same.append(torch.equal(a, b))
    try:
        snf.ring_attention(*local, m, seq_lens=(lens[0][:-1], lens[1][:-1]))
        err = None
    except snn.ShardingError as e:
        err = str(e)
    return same, err


@pytest.mark.parametrize("world", [2, 3])
def test_seq_lens_skip_the_gather(run, world):
    for same, err in run(world, _seq_lens_given, world):
        assert same and all(same)
        assert err is not None and "do not match" in err
