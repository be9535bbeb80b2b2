"""``nn.MultiheadAttention`` with attention weights or an explicit mask, converted (session 60).

torch's module returns the attention weights by default (``need_weights=True``) and takes any
``attn_mask``; before session 60 the sharded module refused both (the ring computes no weights).
They now take an explicit path as torch's module does: each rank gathers the keys and values and
computes its queries' rows of the weights and the output from them. Compared with torch's module
on the whole sequences in float64: the output, the weights (this rank's query rows), the input
and parameter gradients, through both, on uneven slabs at 2 and 3 ranks, batch-first or not,
averaged or per-head weights, bool and float masks of ``(L, S)`` or ``(B * heads, L, S)``, self-
and cross-attention, unbatched input; inside a converted model whose own code uses the weights
(the forward guard follows their layout: sharded along the query rows); and a Transformer
encoder layer with a mask that is not causal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh
from .reference import assert_param_grads

B, E, H, L, S = 2, 8, 2, 11, 9
SIZES = {2: ((6, 5), (5, 4)), 3: ((4, 4, 3), (3, 3, 3))}
TOL = {"atol": 1e-10, "rtol": 1e-10}


def _slab(t: torch.Tensor, sizes, r: int, dim: int) -> torch.Tensor:
    return t.narrow(dim, sum(sizes[:r]), sizes[r])


def _mask(kind: str, s_len: int, gen):
    if kind == "bool":
        m = torch.rand(L, s_len, generator=gen) > 0.7
        m[:, 0] = False  # every query keeps a key (a row of all -inf is NaN, on one device too)
        return m
    if kind == "float_heads":
        return torch.randn(B * H, L, s_len, dtype=torch.float64, generator=gen)
    if kind == "causal":
        return nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    return None


def _case(world: int, batch_first: bool, average: bool, mask_kind: str, self_attn: bool, unbatched: bool):
    m = mesh(world)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first).double()
    model = snn.convert(copy.deepcopy(ref), m)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, L, E, dtype=torch.float64, generator=gen)
    kv = q if self_attn else torch.randn(B, S, E, dtype=torch.float64, generator=gen)
    s_len = kv.shape[1]
    attn_mask = _mask(mask_kind, s_len, gen)
    pad = torch.zeros(B, s_len, dtype=torch.bool)
    pad[0, -2:] = True
    sq = SIZES[world][0]
    sk = sq if self_attn else SIZES[world][1]
    if unbatched:  # (L, E): one sample, no key padding (torch takes a (S,) mask then)
        q, kv, pad = q[:1], kv[:1], None
        attn_mask = attn_mask[:H] if mask_kind == "float_heads" else attn_mask

    def lay(t):  # (B, L, E) -> the module's layout
        t = t if batch_first else t.transpose(0, 1)
        return t.squeeze(0 if batch_first else 1) if unbatched else t

    seq = 0 if (unbatched or not batch_first) else 1
    qr = q.clone().requires_grad_()
    kvr = qr if self_attn else kv.clone().requires_grad_()
    kw = dict(attn_mask=attn_mask, is_causal=mask_kind == "causal", average_attn_weights=average)
    y, w = ref(lay(qr), lay(kvr), lay(kvr), key_padding_mask=pad, **kw)
    gy = torch.randn(y.shape, dtype=y.dtype, generator=gen)
    gw = torch.randn(w.shape, dtype=w.dtype, generator=gen)
    ((y * gy).sum() + (w * gw).sum()).backward()

    ql = _slab(q, sq, r, 1).clone().requires_grad_()
    kvl = ql if self_attn else _slab(kv, sk, r, 1).clone().requires_grad_()
    pad_l = None if pad is None else _slab(pad, sk, r, 1)
    yl, wl = model(lay(ql), lay(kvl), lay(kvl), key_padding_mask=pad_l, **kw)
    wq = w.dim() - 2  # the weights' query dim: (B, L, S), (B, H, L, S), (L, S) or (H, L, S)
    torch.testing.assert_close(yl, _slab(y.detach(), sq, r, seq), **TOL, msg=lambda s: f"output: {s}")
    torch.testing.assert_close(wl, _slab(w.detach(), sq, r, wq), **TOL, msg=lambda s: f"weights: {s}")
    ((yl * _slab(gy, sq, r, seq)).sum() + (wl * _slab(gw, sq, r, wq)).sum()).backward()
    torch.testing.assert_close(ql.grad, _slab(qr.grad, sq, r, 1), **TOL, msg=lambda s: f"d query: {s}")
    if not self_attn:
        torch.testing.assert_close(kvl.grad, _slab(kvr.grad, sk, r, 1), **TOL, msg=lambda s: f"d key/value: {s}")
    assert_param_grads(ref, model, m, **TOL)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "batch_first,average,mask_kind,self_attn,unbatched",
    [
        (True, True, "none", True, False),
        (False, False, "bool", False, False),
        (True, False, "float_heads", True, False),
        (False, True, "float_heads", False, False),
        (True, True, "causal", True, False),
        (True, False, "bool", True, True),
    ],
)
def test_weights_and_masks_are_exact(run, world, batch_first, average, mask_kind, self_attn, unbatched):
    assert all(run(world, _case, world, batch_first, average, mask_kind, self_attn, unbatched))


class _UsesWeights(nn.Module):
    """A model whose own code uses the attention weights (torch's default call, weights returned)."""

    def __init__(self, batch_first: bool, average: bool) -> None:
        super().__init__()
        self.batch_first, self.average = batch_first, average
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first)
        self.proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, L, E) or (L, B, E)
        out, w = self.attn(x, x, x, average_attn_weights=self.average)
        if not self.average:
            w = w.mean(1)  # (B, L, S)
        focus = w.amax(-1, keepdim=True) + w[..., :3].sum(-1, keepdim=True)  # over the (whole) keys
        focus = focus if self.batch_first else focus.transpose(0, 1)
        return self.proj(out * focus)


def _model_case(world: int, batch_first: bool, average: bool):
    m = mesh(world)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = _UsesWeights(batch_first, average).double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(B, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    seq = 1 if batch_first else 0
    x = x if batch_first else x.transpose(0, 1).contiguous()
    xr = x.clone().requires_grad_()
    y = ref(xr)
    g = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3))
    (y * g).sum().backward()
    sizes = SIZES[world][0]
    xl = _slab(x, sizes, r, seq).clone().requires_grad_()
    yl = model(xl)
    torch.testing.assert_close(yl, _slab(y.detach(), sizes, r, seq), **TOL)
    (yl * _slab(g, sizes, r, seq)).sum().backward()
    torch.testing.assert_close(xl.grad, _slab(xr.grad, sizes, r, seq), **TOL)
    assert_param_grads(ref, model, m, **TOL)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch_first,average", [(True, True), (False, True), (False, False)])
def test_weights_used_by_the_models_own_code(run, world, batch_first, average):
    assert all(run(world, _model_case, world, batch_first, average))


def _encoder_case(world: int):
    m = mesh(world)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True).double()
    model = snn.convert(copy.deepcopy(ref), m)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, L, E, dtype=torch.float64, generator=gen)
    band = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).abs() > 3  # a banded (local) mask
    xr = x.clone().requires_grad_()
    y = ref(xr, src_mask=band)
    g = torch.randn(y.shape, dtype=y.dtype, generator=gen)
    (y * g).sum().backward()
    sizes = SIZES[world][0]
    xl = _slab(x, sizes, r, 1).clone().requires_grad_()
    yl = model(xl, src_mask=band)
    torch.testing.assert_close(yl, _slab(y.detach(), sizes, r, 1), **TOL)
    (yl * _slab(g, sizes, r, 1)).sum().backward()
    torch.testing.assert_close(xl.grad, _slab(xr.grad, sizes, r, 1), **TOL)
    assert_param_grads(ref, model, m, **TOL)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_encoder_layer_with_a_mask_that_is_not_causal(run, world):
    assert all(run(world, _encoder_case, world))


def _errors():
    m = mesh(2)
    torch.manual_seed(0)
    x = torch.randn(B, 5, E, dtype=torch.float64)
    out = []
    drop = snn.convert(nn.MultiheadAttention(E, H, dropout=0.2, batch_first=True).double(), m)
    zig = snn.convert(nn.MultiheadAttention(E, H, batch_first=True).double(), m, plan={"": {"layout": "zigzag"}})
    plain = snn.convert(nn.MultiheadAttention(E, H, batch_first=True).double(), m)
    for bad in (
        lambda: drop(x, x, x),  # weights with attention dropout in training
        lambda: zig(x, x, x),  # the zigzag layout
        lambda: plain(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.bool)),  # a mask of the local size
    ):
        try:
            bad()
        except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
            out.append((type(e).__name__, str(e)))
        else:
            out.append(("no error", ""))
    return out


def test_errors_raise_alike_on_every_rank(run):
    res = run(2, _errors)
    assert res[0] == res[1], res
    kinds = [k for k, _ in res[0]]
    assert kinds == ["ShardingNotImplementedError", "ShardingNotImplementedError", "ShardingError"], res[0]
    assert "need_weights=True with attention dropout in training" in res[0][0][1]
    assert "needs layout='contiguous'" in res[0][1][1]
    assert "attn_mask must cover the whole sequences, (L, S) = (10, 10)" in res[0][2][1]
