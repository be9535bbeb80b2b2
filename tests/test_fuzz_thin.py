"""Hypothesis fuzzing of the grid layers on thin and empty slabs (multi-hop halos).

``tests/test_fuzz.py`` draws layer configurations on slabs at least one window plus one stride
wide, where every halo comes from the next rank. Deep stages on many ranks, and uneven inputs,
leave slabs thinner than a halo, of one aligned block, or empty: then a halo's rows come from
several ranks (``comm.halo_gather``), edge clipping reaches past a neighbour, and a rank may
have no outputs. This file draws the same layers (convolutions with every padding mode, strides
and dilations; transposed convolutions; max and average pools with ceil mode and padding;
integer upsampling; group, instance, batch and layer norms) with 2-4 ranks holding slabs of 0-2
aligned blocks each (the last one possibly cut short), or a 2x2 mesh with such slabs along both
sharded dims, and compares with the torch layer on the
whole tensor, forward and backward, in float64 (``tests/reference.py``), training or eval. A
``ShardingError`` raised alike on every rank counts as a refusal, a configuration torch itself
rejects on the whole tensor as invalid; any mismatch fails.

- ``test_fuzz_thin_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_thin_campaign`` (``pytest -m slow``): ``SNN_FUZZ_THIN_EXAMPLES`` examples (default
  300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from .fuzzing import fuzz_tests, outcome
from .test_fuzz import _case as _layer_case
from .test_fuzz import _layer, configs


def _case(cfg: dict):
    """torch's layer on the whole tensor first (its own refusals are ``invalid``), then the
    sharded comparison of ``tests/test_fuzz.py``."""
    torch.manual_seed(cfg["seed"])
    ref = _layer(cfg).double()
    if cfg.get("eval"):
        ref.eval()
    x = torch.randn(cfg["batch"], cfg["cin"], *cfg["spatial"], dtype=torch.float64)
    try:
        y = ref(x)
    except (RuntimeError, ValueError) as e:
        return ("invalid", str(e)[:100])
    if torch.isinf(y).any():
        # A max pool window that holds padding only (dilated, on a tiny input): torch gives -inf
        # and routes its gradient to an arbitrary element (0 on one channel, 1 on another).
        return ("invalid", "torch: a pooling window of padding only")
    return _layer_case(cfg)


@st.composite
def thin_configs(draw):
    cfg = dict(draw(configs()))
    a = cfg["align"]

    def thin(parts):
        sizes = [draw(st.integers(0, 2)) * a for _ in range(parts)]
        sizes[-1] = max(0, sizes[-1] - draw(st.integers(0, a - 1)))  # the balanced rule's short last slab
        if not sum(sizes):
            sizes[draw(st.integers(0, parts - 1))] = a
        return tuple(sizes)

    if isinstance(cfg["domain"], tuple):  # 2x2: thin slabs along both sharded dims
        sizes = (thin(2), thin(2))
        cfg.update(sizes=sizes, spatial=(sum(sizes[0]), sum(sizes[1]), *cfg["spatial"][2:]))
        return cfg
    sizes = thin(draw(st.integers(2, 4)))
    cfg.update(domain=len(sizes), sizes=sizes, spatial=(sum(sizes), *cfg["spatial"][1:]))
    return cfg


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a dilated reflect-padded convolution whose halo crosses an
# empty and a one-block slab; a ceil-mode max pool with padding on slabs of one and zero blocks;
# a transposed convolution whose padding crops the outputs of the last ranks away (their strips
# were added at wrong positions before session 59); the two cases below it.
EXAMPLES = [
    dict(kind="conv", nd=1, domain=3, seed=1, batch=1, bias=True, cin=2, cout=3, groups=1, align=1,
         sizes=(1, 0, 4), eval=False, kernel=3, dilation=2, stride=1, mode="reflect", padding=2, spatial=(5,)),
    dict(kind="max_pool", nd=2, domain=4, seed=2, batch=2, bias=False, cin=2, cout=3, groups=1, align=2,
         sizes=(2, 0, 2, 1), eval=True, kernel=3, stride=2, dilation=1, padding=1, ceil_mode=True,
         count_include_pad=False, spatial=(5, 4)),
    dict(kind="conv_transpose", nd=1, domain=4, seed=3, batch=1, bias=True, cin=2, cout=3, groups=1, align=1,
         sizes=(1, 1, 0, 0), eval=False, kernel=4, dilation=1, stride=3, padding=3, output_padding=1, spatial=(2,)),
    # Session 59: an empty last slab whose one output reads only its neighbour's rows (its rank
    # raised alone in the overlapped path); LayerNorm([C, H, W]) on a 2x2 mesh (refused before).
    dict(kind="conv", nd=1, domain=2, seed=4, batch=2, bias=True, cin=2, cout=3, groups=1, align=3, sizes=(3, 0),
         eval=False, kernel=3, dilation=1, stride=3, mode="zeros", padding=2, spatial=(3,)),
    dict(kind="norm", nd=2, domain=(2, 2), seed=5, batch=2, bias=True, cin=4, cout=3, groups=1, align=1,
         sizes=((1, 2), (2, 1)), eval=False, norm="layer", spatial=(3, 3)),
]  # fmt: skip

test_fuzz_thin_fast, test_fuzz_thin_campaign = fuzz_tests(
    "thin fuzz", thin_configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_THIN_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_THIN_EXAMPLES", 300), every=50,
    count=lambda cfg: cfg["kind"],
)
