"""Hypothesis fuzzing of ``snn.reshard``, ``snn.shard``/``local_slices`` and ``snn.gather`` together.

``tests/test_reshard.py`` and ``tests/test_sharding.py`` check chosen layouts; this file draws
them: tensors of 1-4 dims of lengths 0-9 (float64 or int64), any dims sharded (a leading one
included), slabs of random uneven lengths with empty ones, alignments 1-3 per dim, on 1-4 ranks
or a 2x2 mesh. ``reshard`` of each rank's slab must be the slab ``local_slices`` cuts from the
whole tensor (``shard``'s too), ``gather`` of either must give the whole tensor back, and the
gradient through ``reshard`` must reach each rank's own rows exactly. A ``ShardingError``
raised alike on every rank is a refusal (the balanced layout would leave a rank empty, or an
alignment cannot be met), counted apart; any mismatch fails.

- ``test_fuzz_reshard_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_reshard_campaign`` (``pytest -m slow``): ``SNN_FUZZ_RESHARD_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .fuzzing import fuzz_tests, outcome, slab_of
from .harness import mesh
from .test_fuzz_fft_modes import _split


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    dims = tuple(d for d, _ in splits)
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    gen = torch.Generator().manual_seed(cfg["seed"])
    if cfg["integer"]:
        x = torch.randint(-50, 50, cfg["shape"], generator=gen)
    else:
        x = torch.randn(cfg["shape"], generator=gen, dtype=torch.float64)
    x_l = slab_of(x, splits, coords).clone().requires_grad_(not cfg["integer"])
    align = cfg["align"]
    try:
        sl = snn.local_slices(tuple(x.shape), m, dims=dims, align=align)
        y = snn.reshard(x_l, m, dims=dims, align=align)
    except ShardingError as e:
        return ("refused", str(e)[:120])
    want = x[sl]
    assert y.dtype == x.dtype and torch.equal(y, want), f"reshard: {tuple(y.shape)} against {tuple(want.shape)}"
    assert torch.equal(snn.shard(x, m, dims=dims, align=align), want), "shard differs from local_slices"
    assert torch.equal(snn.gather(y.detach(), m, dims=dims), x), "gather of the resharded slabs"
    assert torch.equal(snn.gather(x_l.detach(), m, dims=dims), x), "gather of the drawn slabs"
    if not cfg["integer"]:
        g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        (y * g[sl]).sum().backward()
        assert torch.equal(x_l.grad, slab_of(g, splits, coords)), "the gradient reaches other rows than the slab's"
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    nd = draw(st.integers(len(axes), 4))
    shape = [draw(st.integers(0 if draw(st.integers(0, 9)) == 0 else 1, 9)) for _ in range(nd)]
    sharded = draw(st.permutations(range(nd)))[: len(axes)]
    align = [draw(st.integers(1, 3)) for _ in sharded]
    for d, a, parts in zip(sharded, align, axes):
        if draw(st.integers(0, 3)):  # mostly a balanced block per rank (else: refused, as documented)
            shape[d] = max(shape[d], a * parts + draw(st.integers(0, 3)))
    return dict(
        domain=domain, shape=shape, integer=draw(st.booleans()), align=align if len(align) > 1 else align[0],
        splits=[(d, _split(draw, shape[d], p)) for d, p in zip(sharded, axes)], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: three ranks with an empty middle slab resharded to an
# alignment of 2; a 2x2 mesh sharding a leading dim and the last one.
EXAMPLES = [
    dict(domain=3, shape=[2, 9, 3], integer=False, align=2, splits=[(1, [6, 0, 3])], seed=1),
    dict(domain=(2, 2), shape=[5, 3, 7], integer=False, align=[1, 3], splits=[(0, [0, 5]), (2, [4, 3])], seed=2),
]  # fmt: skip

test_fuzz_reshard_fast, test_fuzz_reshard_campaign = fuzz_tests(
    "reshard fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_RESHARD_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_RESHARD_EXAMPLES", 300), every=50,
)
