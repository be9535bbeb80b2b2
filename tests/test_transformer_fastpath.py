"""torch's Transformer modules, converted, are exact in every mode (issue 15, item 1).

In eval, with no gradient needed, ``nn.TransformerEncoderLayer`` runs the fused
``torch._transformer_encoder_layer_fwd`` and ``nn.TransformerEncoder`` packs padded input into a
nested tensor; ``nn.MultiheadAttention`` has a fused path of its own. Each reads the attention
weights itself, so a converted model would attend to the local slab only. Every module is
compared, in training, eval (grad enabled), ``no_grad`` and ``inference_mode``, forward (and
backward where grad is enabled) with the single-device module in float64 on uneven slabs.

Reference values: the single-device module run in the same mode, on every position that is not
key padding (torch's nested path returns zeros at padded query positions), and the module with
gradients enabled (torch's reference path, the one the sharded modules always take) everywhere.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

TOL = {"atol": 1e-10, "rtol": 1e-10}
MODES = ("train", "eval", "no_grad", "inference_mode")
E, HEADS, FF = 8, 2, 16
L_SRC, L_TGT, B = 11, 9, 2  # 11 = 6+5 at P=2, 4+4+3 at P=3; 9 = 5+4, 3+3+3


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _padding(length: int, pad: int) -> torch.Tensor:
    """(B, L) bool key padding, True = padding: sample 0 ends with ``pad`` padded tokens."""
    mask = torch.zeros(B, length, dtype=torch.bool)
    mask[0, length - pad :] = True
    return mask


def _context(mode: str):
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


def _tokens(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """(B, L, E) -> the module's layout."""
    return (x if batch_first else x.transpose(0, 1)).detach().clone(memory_format=torch.contiguous_format)


def _build(kind: str, batch_first: bool, norm_first: bool) -> nn.Module:
    torch.manual_seed(0)
    kw = {"dim_feedforward": FF, "dropout": 0.0, "batch_first": batch_first, "norm_first": norm_first}
    if kind == "encoder_layer":
        return nn.TransformerEncoderLayer(E, HEADS, **kw)
    if kind == "encoder":
        return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, **kw), 2, norm=nn.LayerNorm(E))
    if kind == "decoder_layer":
        return nn.TransformerDecoderLayer(E, HEADS, **kw)
    if kind == "decoder":
        return nn.TransformerDecoder(nn.TransformerDecoderLayer(E, HEADS, **kw), 2, norm=nn.LayerNorm(E))
    if kind == "transformer":
        return nn.Transformer(E, HEADS, 2, 2, **kw)
    if kind == "mha":
        return nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
    raise AssertionError(kind)


def _call(kind: str, model: nn.Module, src, tgt, src_pad, tgt_pad, tgt_mask):
    """Run ``model`` on (already laid out) inputs, with key padding and a causal decoder mask."""
    if kind == "encoder_layer":
        return model(src, src_key_padding_mask=src_pad)
    if kind == "encoder":
        return model(src, src_key_padding_mask=src_pad)
    if kind in ("decoder_layer", "decoder"):
        causal = {"tgt_is_causal": True}
        return model(
            tgt, src, tgt_mask=tgt_mask, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, **causal
        )
    if kind == "transformer":
        return model(
            src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad, tgt_is_causal=True,
        )
    if kind == "mha":
        return model(src, src, src, key_padding_mask=src_pad, need_weights=False)[0]
    raise AssertionError(kind)


def _out_len(kind: str) -> int:
    return L_TGT if kind in ("decoder_layer", "decoder", "transformer") else L_SRC


def _case(domain: int, kind: str, batch_first: bool, norm_first: bool) -> None:
    m = mesh(domain)
    seq = 1 if batch_first else 0
    ref = _build(kind, batch_first, norm_first).double()
    sharded = snn.convert(copy.deepcopy(ref), m)
    src_full, tgt_full = _rand(B, L_SRC, E, seed=1), _rand(B, L_TGT, E, seed=2)
    src_pad, tgt_pad = _padding(L_SRC, 4), _padding(L_TGT, 2)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(L_TGT, dtype=torch.float64)
    w = _rand(B, _out_len(kind), E, seed=3)
    out_pad = (tgt_pad if _out_len(kind) == L_TGT else src_pad).unsqueeze(-1)  # (B, L, 1)

    def local(t, dim=1):
        return snn.shard(t, m, dims=(dim,))

    for mode in MODES:
        what = f"{kind} P={domain} batch_first={batch_first} norm_first={norm_first} {mode}"
        train = mode == "train"
        ref.train(train)
        sharded.train(train)
        grad = mode in ("train", "eval")

        # The reference path (grad enabled) gives every position, padded ones included.
        src_r = _tokens(src_full, batch_first).requires_grad_()
        tgt_r = _tokens(tgt_full, batch_first).requires_grad_()
        ref.zero_grad()
        y_slow = _call(kind, ref, src_r, tgt_r, src_pad, tgt_pad, tgt_mask)
        (y_slow * _tokens(w, batch_first)).sum().backward()
        with _context(mode):  # the single-device module in this very mode (torch's fast paths)
            y_mode = _call(kind, ref, _tokens(src_full, batch_first), _tokens(tgt_full, batch_first), src_pad, tgt_pad,
                           tgt_mask)

        sharded.zero_grad()
        src_l = local(_tokens(src_full, batch_first), seq).requires_grad_(grad)
        tgt_l = local(_tokens(tgt_full, batch_first), seq).requires_grad_(grad)
        with _context(mode):
            y_l = _call(kind, sharded, src_l, tgt_l, local(src_pad), local(tgt_pad), tgt_mask)
        y = snn.gather(y_l.detach().clone(), m, dims=(seq,))
        y_bf, y_slow_bf, y_mode_bf = (t if batch_first else t.transpose(0, 1) for t in (y, y_slow.detach(), y_mode))
        torch.testing.assert_close(y_bf, y_slow_bf, **TOL, msg=lambda s: f"{what}: {s}")
        keep = ~out_pad.expand_as(y_bf)
        torch.testing.assert_close(y_bf[keep], y_mode_bf[keep], **TOL, msg=lambda s: f"{what} (same mode): {s}")
        if not grad:
            continue
        # A slab-local loss is a partial sum: no share needed (DESIGN.md section 3).
        (y_l * local(_tokens(w, batch_first), seq)).sum().backward()
        for name, t_l, t_r in (("src", src_l, src_r), ("tgt", tgt_l, tgt_r)):
            if t_r.grad is None:
                assert t_l.grad is None, f"{what}: {name} has a gradient only when sharded"
                continue
            torch.testing.assert_close(
                snn.gather(t_l.grad, m, dims=(seq,)), t_r.grad, **TOL, msg=lambda s, n=name: f"{what} d{n}: {s}"
            )
        # Parameter gradients are partial sums over the domain ranks: one all-reduce of them all.
        names = [n for n, _ in sharded.named_parameters()]
        flat = torch.cat([p.grad.flatten() for p in sharded.parameters()])
        total = snn.losses.domain_sum(flat, m).split([p.numel() for p in ref.parameters()])
        for name, g, p_ref in zip(names, total, ref.parameters()):
            torch.testing.assert_close(g.view_as(p_ref), p_ref.grad, **TOL, msg=lambda s, n=name: f"{what} d{n}: {s}")


def _cases(domain: int, kinds: tuple[str, ...]) -> bool:
    for kind in kinds:
        for batch_first in (True, False):
            for norm_first in (False, True) if kind != "mha" else (False,):
                _case(domain, kind, batch_first, norm_first)
    return True


@pytest.mark.parametrize("domain", [2, 3])
def test_encoders_exact_in_every_mode(run, domain):
    assert all(run(domain, _cases, domain, ("encoder_layer", "encoder", "mha")))


@pytest.mark.parametrize("domain", [2, 3])
def test_decoders_and_transformer_exact_in_every_mode(run, domain):
    assert all(run(domain, _cases, domain, ("decoder_layer", "decoder", "transformer")))


def _containers_case() -> dict:
    """Constructor, plan options, state_dict keys, convert twice, nested input refused."""
    m = mesh(2)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, FF, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, 2).double().eval()
    built = snn.layers.ShardedTransformerEncoder(layer, 2, mesh=m, attention="ulysses").double().eval()
    built.load_state_dict(ref.state_dict())
    plan = {"0": {"attention": "ulysses", "layout": "contiguous"}}
    planned = snn.convert(nn.Sequential(copy.deepcopy(ref)), m, plan=plan)
    assert list(planned[0].state_dict()) == list(ref.state_dict())
    again = snn.convert(planned, m)
    x = _rand(B, L_SRC, E, seed=4)
    with torch.inference_mode():
        want = ref(x)
        outs = [snn.gather(mod(snn.shard(x, m, dims=(1,))), m, dims=(1,)) for mod in (built, planned, again)]
    for y in outs:
        torch.testing.assert_close(y, want, **TOL)
    nested = torch.nested.nested_tensor([x[0], x[1, :5]])
    try:
        built(nested)
    except snn.ShardingNotImplementedError as exc:
        error = str(exc)
    return {
        "types": [type(mod).__name__ for mod in (planned[0], planned[0].layers[1], planned[0].layers[1].self_attn)],
        "attention": [a.attention for a in (built.layers[0].self_attn, planned[0].layers[1].self_attn)],
        "again is same": again[0] is planned[0],
        "error": error,
    }


def test_containers_constructor_plan_and_state_dict(run):
    for r in run(2, _containers_case):
        want = ["ShardedTransformerEncoder", "ShardedTransformerEncoderLayer", "ShardedMultiheadAttention"]
        assert r["types"] == want
        assert r["attention"] == ["ulysses", "ulysses"] and r["again is same"]
        assert "nested tensors are not supported" in r["error"]


def _errors_case() -> list[tuple[str, str]]:
    """Bad masks on one rank or every rank: every rank raises the same error (in eval + no_grad too)."""
    m = mesh(2)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    enc = snn.convert(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, FF, batch_first=True), 2), m)
    enc = enc.double().eval()
    x = snn.shard(_rand(B, L_SRC, E, seed=5), m, dims=(1,))
    pad = snn.shard(_padding(L_SRC, 2), m, dims=(1,))
    out = []
    for bad in (
        lambda: enc(x, src_key_padding_mask=pad[:, :-1] if r == 1 else pad),  # wrong length on one rank
        lambda: enc(x, src_key_padding_mask=pad.double()),  # a float mask everywhere
        # A mask that is not causal runs since session 60 (tests/test_mha_weights.py); one that
        # does not cover the whole sequence is refused.
        lambda: enc(x, mask=torch.zeros(L_SRC - 1, L_SRC - 1, dtype=torch.float64)),
    ):
        try:
            with torch.no_grad():
                bad()
        except (snn.ShardingError, snn.ShardingNotImplementedError) as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(("no error", ""))
    return out


def test_container_errors_on_every_rank(run):
    results = run(2, _errors_case)
    assert results[0] == results[1], results
    kinds = [k for k, _ in results[0]]
    assert kinds == ["ShardingError", "ShardingError", "ShardingError"], results[0]
    assert "attn_mask must cover the whole sequences" in results[0][2][1]
    assert "key_padding_mask must be a bool (B, L_local)" in results[0][0][1]
