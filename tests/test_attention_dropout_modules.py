"""Attention dropout in training in the drop-in modules (``ShardedTimmAttention``,
``ShardedMultiheadAttention``): the position-keyed mask law, against the single-device module run
with ``F.scaled_dot_product_attention`` replaced by attention under that same mask (float64,
uneven slabs, P = 2-4, ring and Ulysses)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.attention_kernels import dropout_keep

from .harness import mesh as make_mesh
from .test_attention import UNEVEN

P_DROP = 0.25
E, HEADS = 16, 4


@contextlib.contextmanager
def masked_sdpa(seed: int, p: float):
    """``F.scaled_dot_product_attention`` with dropout drawn from the position-keyed law."""
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        assert attn_mask is None and dropout_p == p, (attn_mask, dropout_p)
        b, h, n, d = q.shape
        s = torch.matmul(q, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
        if is_causal:
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        keep = dropout_keep(seed, p, torch.arange(b), torch.arange(h), torch.arange(n), torch.arange(k.shape[2]))
        return torch.matmul(s.softmax(-1) * keep / (1 - p), v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _gather(x_local, dim, sizes):
    shapes = [(*x_local.shape[:dim], n, *x_local.shape[dim + 1 :]) for n in sizes]
    return torch.cat(snn.comm.all_gather_uneven(x_local.contiguous(), dist.group.WORLD, shapes), dim)


def _check(world, kind, attention, causal, batch_first):
    m = make_mesh(world)
    sizes = UNEVEN[world]
    rank = dist.get_rank()
    torch.manual_seed(0)
    if kind == "timm":
        from timm.models.vision_transformer import Attention

        ref = Attention(E, num_heads=HEADS, qkv_bias=True, attn_drop=P_DROP).double()
        seq_dim = 1
    else:
        ref = nn.MultiheadAttention(E, HEADS, dropout=P_DROP, batch_first=batch_first).double()
        seq_dim = 1 if batch_first else 0
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"": {"attention": attention}})
    ref.train(), sharded.train()
    torch.manual_seed(1)
    n = sum(sizes)
    x = torch.randn(2, n, E, dtype=torch.float64) if seq_dim == 1 else torch.randn(n, 2, E, dtype=torch.float64)
    grad = torch.randn_like(x)
    x_loc = x.narrow(seq_dim, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
    torch.manual_seed(100 + rank)  # ranks' default generators differ: the seed must still agree

    def call(mod, t):
        if kind == "timm":
            return mod(t, is_causal=causal) if causal else mod(t)
        if causal:
            mask = nn.Transformer.generate_square_subsequent_mask(t.shape[seq_dim], dtype=t.dtype)
            return mod(t, t, t, need_weights=False, attn_mask=mask, is_causal=True)[0]
        return mod(t, t, t, need_weights=False)[0]

    out = call(sharded, x_loc)
    out.backward(grad.narrow(seq_dim, sum(sizes[:rank]), sizes[rank]))
    seed = sharded.dropout_seed
    seeds = [None] * world
    dist.all_gather_object(seeds, seed)
    assert seed is not None and len(set(seeds)) == 1
    xr = x.clone().requires_grad_()
    with masked_sdpa(seed, P_DROP):
        ref_out = call(ref, xr)
    ref_out.backward(grad)
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(_gather(out.detach(), seq_dim, sizes), ref_out.detach(), **tol)
    torch.testing.assert_close(_gather(x_loc.grad, seq_dim, sizes), xr.grad, **tol)
    for (name, p_s), p_r in zip(sharded.named_parameters(), ref.parameters()):
        g = p_s.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, p_r.grad, **tol, msg=lambda s, n=name: f"{n}: {s}")
    # Dropout is really on (the eval output differs) and a new forward draws a new mask seed.
    with torch.no_grad():
        again = call(sharded, x_loc)
        assert sharded.dropout_seed != seed and not torch.allclose(again, out)
        sharded.eval()
        call(sharded, x_loc)
        assert sharded.dropout_seed is None
    return True


@pytest.mark.parametrize(
    "world,kind,attention,causal,batch_first",
    [
        (2, "timm", "ring", False, True),
        (3, "timm", "ring", True, True),
        (4, "timm", "ulysses", False, True),
        (2, "mha", "ulysses", True, True),
        (3, "mha", "ring", False, False),
        (4, "mha", "ring", True, True),
    ],
)
def test_module_attention_dropout(run, world, kind, attention, causal, batch_first):
    assert run(world, _check, world, kind, attention, causal, batch_first) == [True] * world


def _disagree(world):
    m = make_mesh(world)
    torch.manual_seed(0)
    mod = snn.convert(nn.MultiheadAttention(E, HEADS, dropout=P_DROP, batch_first=True), m).train()
    if dist.get_rank() == 1:
        mod.eval()  # one rank in eval: the dropout facts differ
    try:
        mod(*(torch.randn(1, 3, E),) * 3, need_weights=False)
    except Exception as err:  # noqa: BLE001 - the type and message are what is compared
        return type(err).__name__, "attention dropout" in str(err)
    return None


def test_dropout_disagreement_raises_on_every_rank(run):
    assert run(2, _disagree, 2) == [("ShardingError", True)] * 2
