"""Hypothesis fuzzing of the converted Transolver (and Transolver++) over its constructor options.

``tests/test_transolver.py`` checks six named configurations; this file draws the options
together: unstructured points (any partition: a random permutation of the points cut into uneven
parts, empty parts included), 2-D and 3-D structured grids (slabs of whole rows of the first
spatial dim, given spatially shaped or flattened), unified positions with reference grids of 2-4
points per dim, a time input, Transolver++ (per-point temperature, Gumbel softmax without noise,
or with noise only in training and the model in eval mode), heads and head sizes, slices, MLP
ratio, activation, layers, the temperature clamp and the slice-normalisation epsilon, batches of
1-2, at 1-4 ranks. Each example converts a float64 model (``convert(strict=True)``) and compares
this rank's output, the input and embedding gradients and every parameter gradient (summed over
the ranks) with the model on all points (1e-10). A refusal (``ShardingError``) alike on every
rank is counted apart; any mismatch fails.

- ``test_fuzz_transolver_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_transolver_campaign`` (``pytest -m slow``): ``SNN_FUZZ_TRANSOLVER_EXAMPLES``
  examples (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.zoo.transolver import Transolver

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .reference import assert_param_grads

ACTS = ("gelu", "relu", "silu", "tanh", "leaky_relu", "softplus")


def _reference(cfg: dict):
    torch.manual_seed(cfg["seed"])
    try:
        model = Transolver(**cfg["kwargs"]).double()
    except ValueError as e:
        return None, f"ValueError: {e}"
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    with torch.no_grad():  # non-trivial values everywhere (the init leaves biases 0, LN 1)
        for name, p in model.named_parameters():
            if name.endswith("temperature"):
                p.uniform_(0.3, 1.5, generator=gen)
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.train(cfg["train"]), None


def _case(cfg: dict):
    """One example on this rank: ``"ok"``, ``("refused", ...)`` or ``("invalid", ...)``; raises on a mismatch."""
    domain, kw = cfg["domain"], cfg["kwargs"]
    m = mesh(domain)
    rank = snn.domain_group(m).rank()
    ref, why = _reference(cfg)
    if ref is None:
        return ("invalid", why)
    gen = torch.Generator().manual_seed(cfg["seed"] + 2)
    b = cfg["batch"]
    shape = kw.get("structured_shape")
    spatial = shape if shape is not None else (sum(cfg["sizes"]),)
    fx = torch.randn(b, *spatial, kw["functional_dim"], generator=gen, dtype=torch.float64)
    emb = None if kw.get("unified_pos") else torch.randn(b, *spatial, kw["embedding_dim"], generator=gen,
                                                         dtype=torch.float64)  # fmt: skip
    time = torch.rand(b, generator=gen, dtype=torch.float64) if kw.get("time_input") else None
    layout = cfg["sizes"]
    start = sum(layout[:rank])
    if shape is None:  # any partition of the points: a random permutation cut into the parts
        perm = torch.randperm(spatial[0], generator=torch.Generator().manual_seed(cfg["seed"] + 3))
        idx = perm[start : start + layout[rank]]
    else:  # whole rows of the first spatial dim
        idx = torch.arange(start, start + layout[rank])

    def local(t):
        if t is None:
            return None
        t = t.index_select(1, idx)
        return t.reshape(b, -1, t.shape[-1]) if cfg["flat"] else t

    fx_ref = fx.clone().requires_grad_()
    emb_ref = emb.clone().requires_grad_() if emb is not None else None
    try:
        y = ref(fx_ref, embedding=emb_ref, time=time)
    except RuntimeError as e:  # the model itself fails (a time embedding of an odd width)
        return ("invalid", f"RuntimeError: {e}"[:200])
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (y * g).sum().backward()
    try:
        model = snn.convert(copy.deepcopy(ref), m, strict=True)
        fx_l = local(fx).requires_grad_()
        emb_l = local(emb).requires_grad_() if emb is not None else None
        y_l = model(fx_l, embedding=emb_l, time=time)
        (y_l * local(g)).sum().backward()  # per-rank losses sum to the global loss
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", type(e).__name__, str(e)[:200])
    tol = dict(atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(y_l, local(y.detach()), **tol, msg=lambda s: f"output: {s}")
    torch.testing.assert_close(fx_l.grad, local(fx_ref.grad), **tol, msg=lambda s: f"grad fx: {s}")
    if emb is not None:
        torch.testing.assert_close(emb_l.grad, local(emb_ref.grad), **tol, msg=lambda s: f"grad embedding: {s}")
    assert_param_grads(ref, model, m, **tol)
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["points", "points", "grid2d", "grid3d"]))
    kw = dict(
        functional_dim=draw(st.integers(1, 3)), out_dim=draw(st.integers(1, 3)), n_layers=draw(st.integers(1, 2)),
        n_hidden=heads * draw(st.integers(1, 4)), n_head=heads, act=draw(st.sampled_from(ACTS)),
        mlp_ratio=draw(st.integers(1, 2)), slice_num=draw(st.integers(1, 6)), time_input=draw(st.booleans()),
        plus=draw(st.booleans()), gumbel_noise=draw(st.sampled_from(["never", "train"])),
        temperature_clamp=draw(st.sampled_from([(0.5, 5.0), None])), slice_norm_eps=draw(st.sampled_from([1e-2, 1e-5])),
    )  # fmt: skip
    if kind == "points":
        sizes = [draw(st.integers(0, 9)) for _ in range(domain)]
        if sum(sizes) == 0:
            sizes[-1] = 1
        kw["embedding_dim"] = draw(st.integers(1, 3))
    else:
        rows = [draw(st.integers(1, 3)) for _ in range(domain)]
        sizes = rows
        rest = [draw(st.integers(1, 4)) for _ in range(1 if kind == "grid2d" else 2)]
        kw["structured_shape"] = (sum(rows), *rest)
        if draw(st.booleans()):
            kw.update(unified_pos=True, ref=draw(st.integers(2, 4)))
        else:
            kw["embedding_dim"] = draw(st.integers(1, 3))
    train = draw(st.booleans())
    if train:
        kw["gumbel_noise"] = "never"  # "train" draws noise in training: a sample, not a value to compare
    return dict(
        domain=domain, kwargs=kw, sizes=sizes, flat=kind != "points" and draw(st.booleans()),
        batch=draw(st.integers(1, 2)), train=train, seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)



_BASE = dict(functional_dim=2, out_dim=2, n_layers=2, n_hidden=8, n_head=2, act="gelu", mlp_ratio=2, slice_num=3,
             time_input=False, plus=False, gumbel_noise="never", temperature_clamp=(0.5, 5.0), slice_norm_eps=1e-2)
# Cases the fast run always includes: an unstructured partition with an empty part, Transolver++
# with time on a flattened 3-D grid, unified positions on a 2-D grid.
EXAMPLES = [
    dict(domain=3, kwargs={**_BASE, "embedding_dim": 3}, sizes=[4, 0, 7], flat=False, batch=2, train=True, seed=3),
    dict(domain=2, kwargs={**_BASE, "embedding_dim": 2, "plus": True, "time_input": True, "structured_shape": (5, 2, 3),
                           "act": "silu"}, sizes=[3, 2], flat=True, batch=1, train=False, seed=4),
    dict(domain=4, kwargs={**_BASE, "unified_pos": True, "ref": 3, "structured_shape": (7, 3)}, sizes=[1, 3, 1, 2],
         flat=False, batch=2, train=True, seed=5),
]  # fmt: skip


test_fuzz_transolver_fast, test_fuzz_transolver_campaign = fuzz_tests(
    "transolver fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_TRANSOLVER_FAST_EXAMPLES", 6), campaign=("SNN_FUZZ_TRANSOLVER_EXAMPLES", 300), every=25,
    count=lambda cfg: "grid" if cfg["kwargs"].get("structured_shape") else "points",
)
