"""Determinism of the zoo models: bitwise-repeatable at fixed P, and P-independent to float32 rounding.

Under ``torch.use_deterministic_algorithms(True)`` every zoo model (ViT, UNet, Transolver; small
sizes, float32) runs forward and backward twice at the same P, from the same weights and input:
the outputs, input gradients and (domain-summed) parameter gradients must be identical bit for
bit (at P = 2). Across P = 1 (the plain model), 2 and 3 they must agree to float32 tolerance: the sharded
models sum the same terms in another order (per-rank partials, ring-attention blocks), which
changes roundings but nothing else. Where a value is a sum that cancels (its float32 value is
all rounding), P=2 must be no farther from the float64 result than P=1 is.
"""

from __future__ import annotations


import torch

import sharded_nn as snn

from .harness import mesh
from .reference import reduce_param_grads
from .test_mixed_precision import MODELS, _call, _model


def _step(name: str, model, m, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Output, input gradient and summed parameter gradients of one forward and backward."""
    _, shape, dim, align, replicated = MODELS[name]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen).to(dtype)
    emb = torch.randn(*shape[:2], 3, generator=gen).to(dtype) if name == "transolver" else None
    if m is None:
        xl, el = x.requires_grad_(), emb
    else:
        xl = snn.shard(x, m, dims=(dim,), align=align).requires_grad_()
        el = snn.shard(emb, m, dims=(dim,)) if emb is not None else None
    y = _call(name, model, xl, el)
    if m is None or replicated:
        full = y
    else:
        full = snn.gather(y, m, dims=(dim,))
    g = torch.randn(full.shape, generator=gen).to(dtype)
    loss = (full * g).sum()
    (snn.losses.share(loss, m) if m is not None else loss).backward()
    out = {"out": full.detach(), "grad_in": xl.grad if m is None else snn.gather(xl.grad, m, dims=(dim,))}
    if m is None:
        out.update({f"grad:{n}": p.grad for n, p in model.named_parameters()})
    else:
        out.update({f"grad:{n}": v for n, v in reduce_param_grads(model, m).items()})
    return out


def _results(world: int, repeats: int, dtype: torch.dtype = torch.float32) -> dict[str, list[dict[str, torch.Tensor]]]:
    m = mesh(world) if world > 1 else None
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = {}
        for name in MODELS:
            runs = []
            for _ in range(repeats):
                model = _model(name).to(dtype)
                model = snn.convert(model, m) if m is not None else model
                runs.append(_step(name, model, m, dtype))
            out[name] = runs
        return out
    finally:
        torch.use_deterministic_algorithms(previous)


def test_bitwise_repeatable_and_agrees_across_world_sizes(run):
    ref = run(1, _results, 1, 1)[0]
    ref64 = run(1, _results, 1, 1, torch.float64)[0]
    per_rank = run(2, _results, 2, 2)
    for name, (a, b) in per_rank[0].items():
        for what in a:
            # Repeated at P=2: bit for bit.
            assert torch.equal(a[what], b[what]), (name, what, (a[what] - b[what]).abs().max().item())
            # Every rank holds the same gathered results (nothing rank-dependent leaked in).
            for other in per_rank[1:]:
                assert torch.equal(other[name][0][what], a[what]), (name, what)
            # Against P=1 (the plain model): float32 rounding of sums taken in another order, a few
            # ulps of the largest entry.
            want = ref[name][0][what]
            scale = want.abs().max().item()
            close = torch.isclose(a[what], want, rtol=1e-4, atol=1e-5 * max(scale, 1.0))
            if not close.all():
                # A sum that cancels (a conv bias before a norm: its true gradient is 0) keeps the
                # rounding of its terms, at P=1 as at P=2: there P=2 must be no farther from the
                # float64 truth than P=1 is (with a margin of one such error).
                truth = ref64[name][0][what].to(a[what].dtype)
                err2, err1 = (a[what] - truth).abs(), (want - truth).abs()
                bad = ~close & (err2 > 2 * err1)
                assert not bad.any(), (name, what, err2[bad].max().item(), err1[bad].max().item())


def _p3_matches(ref: dict) -> bool:
    got = _results(3, 1)
    for name, runs in got.items():
        for what, v in runs[0].items():
            want = ref[name][0][what]
            torch.testing.assert_close(v, want, rtol=1e-4, atol=1e-5 * max(want.abs().max().item(), 1.0),
                                       msg=lambda s, n=name, w=what: f"{n} {w} at P=3 vs P=1: {s}")
    return True


def test_three_ranks_agree_with_one(run):
    ref = run(1, _results, 1, 1)[0]
    assert all(run(3, _p3_matches, ref))
