"""Hypothesis fuzzing of the sharded adaptive pools (``nn.AdaptiveAvgPool1d/2d/3d``,
``nn.AdaptiveMaxPool1d/2d/3d`` converted by ``snn.convert``).

``tests/test_pool.py`` checks chosen cases; this file draws them: average or max, 1-3 spatial
dims of lengths 1-9, any output size per dim (1: a global pool, replicated; fewer bins than
ranks; more bins than positions, whose windows overlap; ``None`` keeps a dim), any spatial dims
sharded, slabs of random uneven lengths (thin ones, whose bins reach over several ranks; empty
ones and ranks without a bin start, taken since session 67), on
1-4 ranks or a 2x2 mesh, in float64 with values that tie (whole numbers) or not. Each rank's
output must hold the documented bins (bin ``i`` of ``O``, ``[floor(i L / O), ceil((i + 1) L /
O))``, belongs to the rank whose slab holds its start; one output along a sharded dim is
replicated) with torch's values, and the input's gradient must be the single device's slab (a
value replicated over ``r`` ranks carrying ``1 / r`` of the loss). Max pooling of tied values
may route a bin's gradient to another of its equal maxima than torch (documented): with ties,
only the output and the gradient's total per bin are compared. A ``ShardingError`` raised alike
on every rank is a refusal, counted apart; any mismatch fails.

- ``test_fuzz_adaptive_pool_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_adaptive_pool_campaign`` (``pytest -m slow``): ``SNN_FUZZ_ADAPTIVE_POOL_EXAMPLES``
  examples (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError, ShardingNotImplementedError

from .fuzzing import adaptive_or_replicated, fuzz_tests, outcome, output_blocks, slab_of
from .harness import mesh
from .test_fuzz_fft_modes import _split


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    dims = [d for d, _ in splits]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    nsp = len(cfg["shape"]) - 2
    gen = torch.Generator().manual_seed(cfg["seed"])
    if cfg["ties"]:
        x = torch.randint(-2, 3, cfg["shape"], generator=gen).double().requires_grad_()
    else:
        x = torch.randn(cfg["shape"], generator=gen, dtype=torch.float64).requires_grad_()
    kind = "Max" if cfg["max"] else "Avg"
    ref = getattr(nn, f"Adaptive{kind}Pool{nsp}d")(tuple(cfg["out"]) if nsp > 1 else cfg["out"][0])
    try:
        y_ref = ref(x)
    except (RuntimeError, ValueError) as e:
        return ("invalid", str(e)[:100])

    def block(t):
        return slab_of(t, splits, coords)

    x_l = block(x.detach()).clone().requires_grad_()
    try:
        model = snn.convert(copy.deepcopy(nn.Sequential(ref)), m, dims=tuple(dims), strict=True)
        y = model(x_l)
    except (ShardingError, ShardingNotImplementedError) as e:
        return ("refused", str(e)[:120])
    g = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    out_block, g_block, rep = output_blocks(y_ref.detach(), g, splits, coords, adaptive_or_replicated)
    torch.testing.assert_close(y, out_block, atol=1e-12, rtol=1e-12, msg=lambda s: f"output: {s}")
    (y_ref * g).sum().backward()
    ((y * g_block).sum() / rep).backward()
    if cfg["max"] and cfg["ties"]:
        # Equal maxima may take the gradient in another order: compare each bin's total, by
        # pooling the gradient the same way (a bin's elements summed) on both sides.
        whole = torch.zeros_like(x)
        block(whole).copy_(x_l.grad)
        for group in (m.get_group(a) for a in m.mesh_dim_names):
            torch.distributed.all_reduce(whole, group=group)
        torch.testing.assert_close(whole.sum(), x.grad.sum(), atol=1e-10, rtol=1e-10, msg=lambda s: f"grad total: {s}")
        return "ok"
    torch.testing.assert_close(x_l.grad, block(x.grad), atol=1e-12, rtol=1e-12, msg=lambda s: f"grad: {s}")
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    nsp = draw(st.integers(len(axes), 3))
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 2))] + [draw(st.integers(1, 9)) for _ in range(nsp)]
    sharded = draw(st.permutations(range(2, 2 + nsp)))[: len(axes)]
    for d, parts in zip(sharded, axes):
        if draw(st.integers(0, 3)):  # mostly a row per rank at least (empty slabs: taken since session 67)
            shape[d] = max(shape[d], parts)
    out = [draw(st.integers(1, 11)) for _ in range(nsp)]
    splits = []
    for d, parts in zip(sharded, axes):
        n = shape[d]
        if n >= parts and draw(st.integers(0, 3)):
            cuts = sorted(draw(st.permutations(range(1, n)))[: parts - 1])
            edges = [0, *cuts, n]
            splits.append((d, [b - a for a, b in zip(edges, edges[1:])]))
        else:
            splits.append((d, _split(draw, n, parts)))
    return dict(domain=domain, shape=shape, out=out, max=draw(st.booleans()), ties=draw(st.booleans()),
                splits=splits, seed=draw(st.integers(0, 2**16)))  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a max pool to more bins than positions over thin slabs at 3
# ranks; an average pool on a 2x2 mesh, global along one sharded dim.
EXAMPLES = [
    dict(domain=3, shape=[1, 2, 5, 3], out=[7, 2], max=True, ties=False, splits=[(2, [1, 3, 1])], seed=1),
    dict(domain=(2, 2), shape=[2, 1, 4, 6, 3], out=[1, 4, 2], max=False, ties=False,
         splits=[(2, [3, 1]), (3, [2, 4])], seed=2),
    # Session 67: ranks without a bin (an empty slab, fewer bins than ranks), a bin reaching past
    # an empty neighbour; a global max beside them on the 2x2 mesh.
    dict(domain=4, shape=[1, 2, 7, 3], out=[2, 3], max=False, ties=False, splits=[(2, [1, 0, 4, 2])], seed=3),
    dict(domain=(2, 2), shape=[1, 2, 5, 4], out=[2, 1], max=True, ties=False, splits=[(2, [0, 5]), (3, [3, 1])],
         seed=4),
]  # fmt: skip

test_fuzz_adaptive_pool_fast, test_fuzz_adaptive_pool_campaign = fuzz_tests(
    "adaptive pool fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_ADAPTIVE_POOL_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_ADAPTIVE_POOL_EXAMPLES", 300), every=50,
)
