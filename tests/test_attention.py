"""Ring and Ulysses attention against F.scaled_dot_product_attention on the full sequence."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn import functional as snf
from sharded_nn.comm.ring_pass import domain_ring, gather_ints

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
    dtype: torch.dtype = torch.float64

    def tensors(self):
        g = torch.Generator().manual_seed(0)
        hk = self.kv_heads or self.heads
        q = torch.randn(self.batch, self.heads, self.length, self.dim, generator=g, dtype=self.dtype) * self.big
        k = torch.randn(self.batch, hk, self.length, self.dim, generator=g, dtype=self.dtype) * self.big
        v = torch.randn(self.batch, hk, self.length, self.dim_v or self.dim, generator=g, dtype=self.dtype)
        pad = None
        if self.mask:
            pad = torch.rand(self.batch, self.length, generator=g) < 0.4
            pad[:, 0] = False  # every query keeps at least one key (also under the causal mask)
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
    ring = domain_ring(m)
    sizes = cfg.sizes or snn.Layout.balanced(x.shape[dim], ring.size).sizes
    return x.narrow(dim, sum(sizes[: ring.index]), sizes[ring.index]).clone()


def _unshard(cfg: Cfg, m, x_local, dim):
    if cfg.layout == "zigzag":
        return snf.zigzag_unshard(x_local, m, dim)
    ring = domain_ring(m)
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
        out = fn(*local, m, cfg.causal, cfg.scale, key_padding_mask=pad_local, layout=cfg.layout)
        out.backward(_local(cfg, m, grad, 2))
        tol = dict(atol=1e-10, rtol=1e-10)
        if cfg.dtype != torch.float64:
            tol = dict(atol=2e-3, rtol=2e-3, check_dtype=False)
        torch.testing.assert_close(_unshard(cfg, m, out.detach(), 2), ref.detach(), **tol, msg=lambda s: f"{cfg}: {s}")
        for name, loc, leaf in zip("qkv", local, leaves):
            torch.testing.assert_close(
                _unshard(cfg, m, loc.grad, 2), leaf.grad, **tol, msg=lambda s, n=name: f"{cfg} d{n}: {s}"
            )
        assert out.dtype == cfg.dtype and all(torch.isfinite(t.grad).all() for t in local)
        errs.append((out.detach().double() - _local(cfg, m, ref.detach(), 2)).abs().max().item())
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
    Cfg(scale=0.37, heads=3),  # 3 heads: ring attention does not care whether P divides them
    Cfg(dim_v=5),  # value head size != query head size: blocked math path
    Cfg(dim_v=5, causal=True, mask=True),
    Cfg(big=30.0, dtype=torch.float32, causal=True),  # logits ~ 1e3: the lse merge must stay finite
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


ULYSSES_CASES = [
    Cfg(),
    Cfg(causal=True),
    Cfg(causal=True, layout="zigzag", length=19),
    Cfg(heads=8, kv_heads=4, mask=True),
    Cfg(mask=True, causal=True),
    Cfg(scale=0.5, dim_v=6),
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
    m = mesh(world)
    mha = snn.convert(nn.MultiheadAttention(8, 2).double(), m)
    x = torch.randn(3, 1, 8, dtype=torch.float64)
    with pytest.raises(snn.ShardingNotImplementedError, match="need_weights"):
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
