"""Hypothesis fuzzing of ``sharded_nn.reductions``: global reductions of random slabs.

``tests/test_reductions.py`` checks chosen cases; this file draws them: every function (``sum``,
``mean``, ``max``, ``argmax`` and ``argmin`` (one dim, or since session 60 the flat index), ``max_dim``
(torch.max/min along a dim: values and indices, since session 60), ``norm`` with p in 1, 2, 3, 0.5,
0, -1, inf, -inf and "fro", ``var``,
``std``, ``var_mean``, ``std_mean`` with corrections 0, 0.5, 1, 2, ``logsumexp``, ``softmax``,
``log_softmax``, ``cumsum``), tensors of 1-4 dims of lengths 1-6, float64 (random, or whole
numbers with many ties, or with lines of ``-inf`` for ``max`` and the log-partitions) or int64 where
torch takes it, the reduced dims (all, one, several, negative or not) and ``keepdim``, any dims
sharded (reduced or not), slabs of random uneven lengths (empty ones sometimes: taken by
``sum`` and ``mean`` since session 61, by every function since session 67), on 1-4 ranks or a 2x2 mesh. The result must be this rank's part of torch's on the
whole tensor (replicated along the reduced sharded dims, still sharded along the others), and
the input's gradient the single device's slab, under the library's convention (a value
replicated over ``r`` ranks carries ``1 / r`` of the loss on each; float64, 1e-10). A ``ShardingError`` raised alike on every rank is
a refusal, counted apart; any mismatch fails.

- ``test_fuzz_reductions_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_reductions_campaign`` (``pytest -m slow``): ``SNN_FUZZ_REDUCTIONS_EXAMPLES``
  examples (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .test_fuzz_fft_modes import _split

#: name -> (argument form, takes integers)
FUNCTIONS = {
    "sum": ("dims", True), "mean": ("dims", False), "max": ("dims", True), "argmax": ("dim_or_none", True),
    "argmin": ("dim_or_none", True), "max_dim": ("dim", True), "min_dim": ("dim", True),
    "norm": ("dims", False), "var": ("dims", False), "std": ("dims", False), "var_mean": ("dims", False),
    "std_mean": ("dims", False), "logsumexp": ("dim_or_dims", False), "softmax": ("dim", False),
    "log_softmax": ("dim", False), "cumsum": ("dim", True),
}  # fmt: skip
REDUCING = {"sum", "mean", "max", "argmax", "argmin", "max_dim", "min_dim", "norm", "var", "std", "var_mean",
            "std_mean", "logsumexp"}


def _torch(cfg, x):
    """torch's own call on the whole tensor (a tuple of outputs)."""
    name, dims, keep = cfg["name"], cfg["dims"], cfg["keepdim"]
    nd = x.dim()
    every = tuple(range(nd)) if dims is None else dims
    if name == "sum":
        return (torch.sum(x, every, keepdim=keep),)
    if name == "mean":
        return (torch.mean(x, every, keepdim=keep),)
    if name == "max":
        return (torch.amax(x, every, keepdim=keep),)
    if name in ("argmax", "argmin"):
        return (getattr(torch, name)(x, dims, keepdim=keep),)
    if name in ("max_dim", "min_dim"):
        return tuple((torch.max if name == "max_dim" else torch.min)(x, dims, keepdim=keep))
    if name == "norm":
        p = 2 if cfg["p"] == "fro" else cfg["p"]
        return (torch.linalg.vector_norm(x, p, every, keepdim=keep),)
    if name in ("var", "std", "var_mean", "std_mean"):
        out = getattr(torch, name)(x, every, correction=cfg["correction"], keepdim=keep)
        return out if isinstance(out, tuple) else (out,)
    if name == "logsumexp":
        return (torch.logsumexp(x, dims, keepdim=keep),)
    if name in ("softmax", "log_softmax"):
        return (getattr(torch, name)(x, dims),)
    return (torch.cumsum(x, dims, dtype=cfg["dtype"]),)


def _ours(cfg, x, m, sharded):
    name, dims, keep = cfg["name"], cfg["dims"], cfg["keepdim"]
    f = getattr(snn.reductions, name, None)
    kw = dict(sharded_dims=sharded)
    if name in ("softmax", "log_softmax"):
        out = f(x, m, dims, **kw)
    elif name == "cumsum":
        out = f(x, m, dims, dtype=cfg["dtype"], **kw)
    elif name == "norm":
        out = f(x, m, dims, cfg["p"], keepdim=keep, **kw)
    elif name in ("max_dim", "min_dim"):
        out = snn.reductions.max_dim(x, m, dims, keepdim=keep, largest=name == "max_dim", **kw)
    elif name in ("var", "std", "var_mean", "std_mean"):
        out = f(x, m, dims, correction=cfg["correction"], keepdim=keep, **kw)
    else:
        out = f(x, m, dims, keepdim=keep, **kw)
    return out if isinstance(out, tuple) else (out,)


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    axes = list(m.mesh_dim_names)
    splits = cfg["splits"]
    sharded = [d for d, _ in splits]
    coords = [m.get_local_rank(a) for a in axes]
    nd = len(cfg["shape"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    if cfg["values"] == "int":
        x = torch.randint(-3, 4, cfg["shape"], generator=gen)
    elif cfg["values"] == "ties":
        x = torch.randint(-2, 3, cfg["shape"], generator=gen).double()
    else:
        x = torch.randn(cfg["shape"], generator=gen, dtype=torch.float64)
        if cfg["values"] == "-inf" and x.numel():
            x.view(-1)[:: 3] = -math.inf  # whole rows of -inf where a reduced line falls on them
    no_grad = cfg["name"] in ("argmax", "argmin") or (cfg["name"] == "norm" and cfg["p"] == 0)
    grads = x.is_floating_point() and not no_grad
    xr = x.clone().requires_grad_(grads)
    try:
        refs = _torch(cfg, xr)
    except RuntimeError as e:  # torch's own rules (e.g. argmax over an empty dim)
        return ("invalid", str(e)[:100])
    named = (cfg["dims"],) if isinstance(cfg["dims"], int) else cfg["dims"]
    reduced = set() if cfg["name"] not in REDUCING else set(range(nd)) if named is None else {d % nd for d in named}

    def block(t, inp=False):
        """This rank's part of a whole result: narrowed along the sharded dims it still has."""
        for (d, split), c in zip(splits, coords):
            if d is None or (not inp and d in reduced):
                continue  # (an axis that shards nothing: the tensor is replicated over it)
            od = d if (inp or cfg["keepdim"]) else d - sum(1 for r in reduced if r < d)
            t = t.narrow(od, sum(split[:c]), split[c])
        return t

    x_l = block(x, inp=True).clone().requires_grad_(grads)
    try:
        outs = _ours(cfg, x_l, m, sharded)
    except ShardingError as e:
        return ("refused", str(e)[:160])
    assert len(outs) == len(refs)
    for i, (y, ref) in enumerate(zip(outs, refs)):
        assert y.dtype == ref.dtype, f"output {i}: dtype {y.dtype}, torch's {ref.dtype}"
        torch.testing.assert_close(y, block(ref.detach()), atol=1e-10, rtol=1e-10, equal_nan=True,
                                   msg=lambda s, i=i: f"output {i}: {s}")  # fmt: skip
    if not grads:
        return "ok"
    # The library's gradient convention: a value replicated over r ranks carries 1/r of the loss.
    rep = math.prod(m.size(i) for i, (d, _) in enumerate(splits) if d in reduced)
    # (Integer outputs, max_dim's indices, carry no gradient.)
    outs, refs = zip(*[(y, r) for y, r in zip(outs, refs) if r.is_floating_point()])
    gs = [torch.randn(ref.shape, generator=gen, dtype=ref.dtype) for ref in refs]
    finite = [torch.where(torch.isfinite(r.detach()), g, torch.zeros_like(g)) for r, g in zip(refs, gs)]
    sum(torch.where(f != 0, r, torch.zeros_like(r)).mul(f).sum() for r, f in zip(refs, finite)).backward()
    loss = sum(torch.where(block(f) != 0, y, torch.zeros_like(y)).mul(block(f)).sum() for y, f in zip(outs, finite))
    (loss / rep).backward()
    torch.testing.assert_close(x_l.grad, block(xr.grad, inp=True), atol=1e-10, rtol=1e-10, equal_nan=True,
                               msg=lambda s: f"input grad: {s}")  # fmt: skip
    return "ok"


def _split_rows(draw, n: int, parts: int) -> list[int]:
    """Random uneven slabs, each of at least one row where there are enough, else some empty."""
    if n < parts or not draw(st.integers(0, 4)):
        return _split(draw, n, parts)
    cuts = sorted(draw(st.permutations(range(1, n)))[: parts - 1])
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def configs(draw):
    name = draw(st.sampled_from(sorted(FUNCTIONS)))
    form, integers = FUNCTIONS[name]
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    naxes = 2 if domain == (2, 2) else 1
    nd = draw(st.integers(naxes, 4))
    shape = [draw(st.integers(1, 6)) for _ in range(nd)]
    sign = lambda d: d - nd if draw(st.booleans()) else d  # noqa: E731 - a draw per dim
    if form == "dim":
        dims = sign(draw(st.integers(0, nd - 1)))
    elif form == "dim_or_dims" and draw(st.booleans()):
        dims = sign(draw(st.integers(0, nd - 1)))
    elif form == "dim_or_none":
        dims = None if not draw(st.integers(0, 2)) else sign(draw(st.integers(0, nd - 1)))
    else:
        k = draw(st.integers(0 if form == "dims" else 1, nd))
        dims = None if k == 0 else tuple(sign(d) for d in draw(st.permutations(range(nd)))[:k])
    with_inf = name in ("logsumexp", "softmax", "log_softmax", "max", "max_dim", "min_dim")
    values = draw(st.sampled_from(["random", "ties"] + (["int"] if integers else []) + (["-inf"] if with_inf else [])))
    sharded = draw(st.permutations(range(nd)))[:naxes]
    axes = [2, 2] if domain == (2, 2) else [domain]
    if draw(st.integers(0, 4)):  # mostly a row per rank at least (empty slabs: since session 67 taken)
        for d, parts in zip(sharded, axes):
            shape[d] = max(shape[d], parts)
    splits = [(d, _split_rows(draw, shape[d], p)) for d, p in zip(sharded, axes)]
    if domain == (2, 2) and not draw(st.integers(0, 3)):
        # A tensor that only the second axis shards (replicated over the first): what a reduction
        # over the rows leaves of a 2x2-sharded image (refused before session 60).
        splits[0] = (None, None)
    return dict(
        domain=domain, name=name, shape=shape, dims=dims, keepdim=draw(st.booleans()), values=values,
        p=draw(st.sampled_from([1, 2, 3, 0.5, 0, -1, math.inf, -math.inf, "fro"])),
        correction=draw(st.sampled_from([0, 0.5, 1, 2])),
        dtype=draw(st.sampled_from([None, torch.float64 if values != "int" else torch.int64])),
        splits=splits, seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a variance over both sharded dims of a 2x2 mesh (its
# second dim's slabs uneven); ties at the maximum split across 3 ranks, the reduced dim sharded.
EXAMPLES = [
    dict(domain=(2, 2), name="std_mean", shape=[2, 3, 4], dims=(1, -1), keepdim=False, values="random", p=2,
         correction=1, dtype=None, splits=[(1, [2, 1]), (2, [1, 3])], seed=1),
    dict(domain=3, name="max", shape=[3, 5], dims=(1,), keepdim=True, values="ties", p=2, correction=1, dtype=None,
         splits=[(1, [2, 1, 2])], seed=2),
]  # fmt: skip

test_fuzz_reductions_fast, test_fuzz_reductions_campaign = fuzz_tests(
    "reductions fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_REDUCTIONS_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_REDUCTIONS_EXAMPLES", 300), every=50,
)
