"""Hypothesis fuzzing of the grid layers in 1-3 dims, sharded along any spatial dim, per-dim options.

``tests/test_fuzz.py`` draws 1-d and 2-d layers with one kernel, stride and padding for every dim,
sharded along the first spatial dim (both on a 2x2 mesh). Volumes (the library's first use:
``Conv3d`` on a 512^3 sample) and anisotropic layers (a (3, 1) kernel, a (2, 1) stride, a
weather grid sharded along longitude) live elsewhere. Each example here draws: the number of
spatial dims (1-3); which spatial dim a 1-d domain of 1-4 ranks shards (random uneven aligned
slabs), or which two dims, in which order, a 2x2 mesh shards (``convert(..., dims=...)``); a
kernel, stride, dilation and padding per dim (``padding="same"``/``"valid"`` for stride-1
convolutions; ``divisor_override`` for average pools; per-dim ``scale_factor`` tuples, fractional
for nearest modes, and ``size=`` for upsampling); channels-last inputs; training or eval. The
converted layer must equal the torch layer on the whole tensor, forward, input and parameter
gradients and the ``no_grad`` forward, in float64 (``tests/reference.py``).

Slabs respect the documented preconditions along the sharded dims (aligned to the layer's stride
there, at least one window plus one stride wide); a ``ShardingError`` raised alike on every rank
counts as a refusal, apart; any mismatch fails.

- ``test_fuzz_grid_nd_fast``: the CI subset (fixed examples first, then drawn ones).
- ``test_fuzz_grid_nd_campaign`` (``pytest -m slow``): ``SNN_FUZZ_GRID_ND_EXAMPLES`` examples
  (default 1,000), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome, randomize_norm_state_
from .test_fuzz import _layer  # the same layers, with the per-dim options this file draws
from .harness import mesh
from .reference import check_against_reference

KINDS = ("conv", "conv_transpose", "max_pool", "avg_pool", "upsample", "norm")


# --------------------------------------------------------------------------- worker side


def _case(cfg: dict):
    """One fuzz example on this rank: ``"ok"``, or ``("refused", type, message)``; raises on a mismatch."""
    m = mesh(cfg["domain"])
    torch.manual_seed(cfg["seed"])
    ref = randomize_norm_state_(_layer(cfg).double(), statistics=cfg["eval"])
    if cfg["eval"]:
        ref.eval()
    x = torch.randn(cfg["batch"], cfg["cin"], *cfg["spatial"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(cfg["seed"] + 1))
    if cfg["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last if cfg["nd"] == 2 else torch.channels_last_3d)
    dims = cfg["dims"]
    try:
        sharded = snn.convert(copy.deepcopy(ref), m, dims=dims)
        align = cfg["align"] if len(dims) > 1 else cfg["align"][0]
        check_against_reference(ref, x, m, dims=dims, align=align, sizes=cfg["sizes"], sharded=sharded,
                                atol=1e-9, rtol=1e-9)
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", type(e).__name__, str(e))
    return "ok"


# --------------------------------------------------------------------------- configs


def _per_dim(draw, nd: int, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(draw(st.integers(lo, hi)) for _ in range(nd))


@st.composite
def configs(draw, kinds=KINDS):
    kind = draw(st.sampled_from(kinds))
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    nd = draw(st.sampled_from([2, 3])) if isinstance(domain, tuple) else draw(st.sampled_from([1, 2, 3]))
    if isinstance(domain, tuple):
        dims = tuple(draw(st.permutations(range(2, 2 + nd)))[:2])  # two dims, either order
    else:
        dims = (draw(st.integers(2, 1 + nd)),)
    cfg = dict(kind=kind, nd=nd, domain=domain, dims=dims, seed=draw(st.integers(0, 2**16)),
               batch=draw(st.integers(1, 2)), bias=draw(st.booleans()), cin=2, cout=3, groups=1, sizes=None,
               eval=draw(st.booleans()), channels_last=nd > 1 and draw(st.booleans()))  # fmt: skip
    ones = (1,) * nd
    span, stride, min_slab = ones, ones, ones  # per dim: window extent, alignment, smallest slab
    if kind in ("conv", "conv_transpose"):
        k, d, s = _per_dim(draw, nd, 1, 4), _per_dim(draw, nd, 1, 2), _per_dim(draw, nd, 1, 3)
        span = tuple(di * (ki - 1) + 1 for ki, di in zip(k, d))
        g = draw(st.sampled_from([1, 2]))
        cfg.update(kernel=k, dilation=d, stride=s, groups=g, cin=2 * g, cout=3 * g if g > 1 else 3)
        if kind == "conv":
            mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
            if s == ones and mode == "zeros" and draw(st.booleans()):
                padding = draw(st.sampled_from(["same", "valid"]))
            else:
                padding = tuple(draw(st.integers(0, sp - 1 if mode == "zeros" else min(sp - 1, 2))) for sp in span)
            cfg.update(mode=mode, padding=padding)
            stride = s
            min_slab = tuple(sp + si for sp, si in zip(span, s))
        else:
            cfg.update(padding=tuple(draw(st.integers(0, sp - 1)) for sp in span),
                       output_padding=tuple(draw(st.integers(0, max(si, di) - 1)) for si, di in zip(s, d)))
            # the output strip a transposed window sends must fit in the neighbour's slab.
            min_slab = tuple(sp + 2 for sp in span)
    elif kind in ("max_pool", "avg_pool"):
        k, s = _per_dim(draw, nd, 1, 4), _per_dim(draw, nd, 1, 3)
        d = _per_dim(draw, nd, 1, 2) if kind == "max_pool" else ones
        span = tuple(di * (ki - 1) + 1 for ki, di in zip(k, d))
        cfg.update(kernel=k, stride=s, dilation=d, padding=tuple(draw(st.integers(0, ki // 2)) for ki in k),
                   ceil_mode=draw(st.booleans()), count_include_pad=draw(st.booleans()),
                   divisor=draw(st.sampled_from([None, 1, 3])))  # fmt: skip
        stride = s
        min_slab = tuple(sp + si for sp, si in zip(span, s))
    elif kind == "upsample":
        linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[nd]
        modes = ["nearest", "nearest-exact", linear] + (["bicubic"] if nd == 2 else [])
        mode = draw(st.sampled_from(modes))
        smooth = mode in (linear, "bicubic")
        scale = tuple(draw(st.sampled_from([1.0, 2.0, 3.0, 0.5, 1.5, 2.5])) for _ in range(nd))
        cfg.update(scale=scale, size=None, mode=mode, align_corners=draw(st.booleans()) if smooth else None)
        min_slab = (3 if mode == "bicubic" else 2,) * nd
    else:
        norm = draw(st.sampled_from(["group", "instance", "batch", "layer"]))
        cfg.update(norm=norm, groups=draw(st.sampled_from([1, 2, 4])), cin=4, track=draw(st.booleans()))
        min_slab = (2,) * nd  # torch needs two values per channel (batch/instance norm, training)
    cfg["align"] = tuple(stride[d - 2] for d in dims)
    other = [max(sp + 1, 3) for sp in span]
    spatial = list(other)
    if isinstance(domain, int):
        d = dims[0] - 2
        a = stride[d]
        blocks_min = -(-min_slab[d] // a)
        sizes = [draw(st.integers(blocks_min, blocks_min + 3)) * a for _ in range(domain)]
        sizes[-1] = max(min_slab[d], sizes[-1] - draw(st.integers(0, a - 1)))
        cfg["sizes"] = tuple(sizes) if domain > 1 else None
        spatial[d] = sum(sizes)
    else:
        for dd in dims:
            d = dd - 2
            a = stride[d]
            spatial[d] = 2 * -(-min_slab[d] // a) * a + draw(st.integers(0, 2 * a))
    cfg["spatial"] = tuple(spatial)
    if kind == "upsample" and draw(st.integers(0, 3)) == 0:
        # size= instead of factors: integer multiples along the sharded dims (as the layer needs),
        # anything along the others.
        size = [draw(st.integers(1, 2 * n)) for n in spatial]
        for dd in dims:
            size[dd - 2] = spatial[dd - 2] * draw(st.integers(1, 2))
        cfg.update(size=tuple(size), scale=None)
    return cfg


# --------------------------------------------------------------------------- tests


def _run(pools, cfg, timeout: float = 120.0):
    return outcome(pools, _case, cfg, timeout)


test_fuzz_grid_nd_fast, test_fuzz_grid_nd_campaign = fuzz_tests(
    "grid nd campaign", configs(), _run, [],
    fast=("SNN_FUZZ_GRID_ND_FAST_EXAMPLES", 16), campaign=("SNN_FUZZ_GRID_ND_EXAMPLES", 1000), every=50,
    count=lambda cfg: f"{cfg['kind']} {cfg['nd']}d", minimum=500, fast_timeout=120.0,
)
