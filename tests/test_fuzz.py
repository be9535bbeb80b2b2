"""Hypothesis fuzzing of the grid layers: random configs, splits, meshes and world sizes.

Each example draws one layer config (convolution, transposed convolution, max/avg pool,
upsample or norm), a world size (1-4) with random uneven aligned slab sizes on a 1-D domain, or
a 2x2 mesh with balanced aligned slabs on two dims, training or eval mode (norms then on random
running statistics), and compares the converted layer against the torch layer on the full
tensor, forward and backward (input and parameter gradients after the domain sum), and the
forward under ``no_grad`` where it changes no state, in float64 (``tests/reference.py``).

The configs respect the layers' documented preconditions: every slab starts at a multiple of the
layer's stride (its alignment) and is at least one window plus one stride wide, so that no halo
is wider than a neighbour's slab and no rank is left without outputs. A ``ShardingError`` is
still accepted as an outcome when every rank raised it with the same message (a documented
refusal, never a hang or a wrong answer), and counted apart; any numerical mismatch fails.

- ``test_fuzz_fast``: the CI subset (a few dozen examples, well under a minute).
- ``test_fuzz_campaign`` (``pytest -m slow tests/test_fuzz.py``): the long run,
  ``SNN_FUZZ_EXAMPLES`` examples (default 1,200); it records every mismatch and refusal, prints
  the counts and fails if any example mismatched.
"""

from __future__ import annotations


import torch
import torch.nn as nn
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome, randomize_norm_state_
from .harness import mesh
from .reference import check_against_reference

KINDS = ("conv", "conv_transpose", "max_pool", "avg_pool", "upsample", "norm")


# --------------------------------------------------------------------------- worker side


def _layer(cfg: dict) -> nn.Module:
    nd, kind = cfg["nd"], cfg["kind"]
    if kind == "conv":
        return getattr(nn, f"Conv{nd}d")(
            cfg["cin"], cfg["cout"], cfg["kernel"], stride=cfg["stride"], padding=cfg["padding"],
            dilation=cfg["dilation"], groups=cfg["groups"], padding_mode=cfg["mode"], bias=cfg["bias"],
        )
    if kind == "conv_transpose":
        return getattr(nn, f"ConvTranspose{nd}d")(
            cfg["cin"], cfg["cout"], cfg["kernel"], stride=cfg["stride"], padding=cfg["padding"],
            output_padding=cfg["output_padding"], dilation=cfg["dilation"], groups=cfg["groups"], bias=cfg["bias"],
        )
    if kind == "max_pool":
        return getattr(nn, f"MaxPool{nd}d")(
            cfg["kernel"], cfg["stride"], cfg["padding"], dilation=cfg["dilation"], ceil_mode=cfg["ceil_mode"]
        )
    if kind == "avg_pool":
        # (tests/test_fuzz_grid_nd.py draws a divisor; AvgPool1d has none)
        extra = {"divisor_override": cfg["divisor"]} if cfg.get("divisor") is not None and nd > 1 else {}
        return getattr(nn, f"AvgPool{nd}d")(
            cfg["kernel"], cfg["stride"], cfg["padding"], ceil_mode=cfg["ceil_mode"],
            count_include_pad=cfg["count_include_pad"], **extra,
        )
    if kind == "upsample":
        if cfg.get("size") is not None:  # (tests/test_fuzz_grid_nd.py: size= instead of factors)
            return nn.Upsample(size=cfg["size"], mode=cfg["mode"], align_corners=cfg["align_corners"])
        return nn.Upsample(scale_factor=cfg["scale"], mode=cfg["mode"], align_corners=cfg["align_corners"])
    norm = cfg["norm"]
    c = cfg["cin"]
    if norm == "group":
        return nn.GroupNorm(cfg["groups"], c, affine=cfg["bias"])
    if norm == "instance":
        return getattr(nn, f"InstanceNorm{nd}d")(c, affine=cfg["bias"], track_running_stats=cfg.get("track", False))
    if norm == "batch":
        return getattr(nn, f"BatchNorm{nd}d")(c)
    return nn.LayerNorm([c, *cfg["spatial"]], elementwise_affine=cfg["bias"])


def _case(cfg: dict):
    """One fuzz example on this rank: ``"ok"``, or ``("refused", type, message)``; raises on a mismatch."""
    domain = cfg["domain"]
    m = mesh(domain)
    torch.manual_seed(cfg["seed"])
    # Non-trivial affine parameters; in inference, norms on non-trivial running statistics.
    ref = randomize_norm_state_(_layer(cfg).double(), statistics=bool(cfg.get("eval")))
    if cfg.get("eval"):
        ref.eval()
    x = torch.randn(cfg["batch"], cfg["cin"], *cfg["spatial"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(cfg["seed"] + 1))
    dims = (2,) if isinstance(domain, int) else (2, 3)
    try:
        check_against_reference(ref, x, m, dims=dims, align=cfg["align"], sizes=cfg["sizes"], atol=1e-9, rtol=1e-9)
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", type(e).__name__, str(e))
    return "ok"


# --------------------------------------------------------------------------- configs


@st.composite
def configs(draw, kinds=KINDS):
    kind = draw(st.sampled_from(kinds))
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    nd = 2 if isinstance(domain, tuple) else draw(st.sampled_from([1, 2]))
    cfg = dict(kind=kind, nd=nd, domain=domain, seed=draw(st.integers(0, 2**16)), batch=draw(st.integers(1, 2)),
               bias=draw(st.booleans()), cin=2, cout=3, groups=1, align=1, sizes=None, eval=draw(st.booleans()))
    span, stride, min_slab = 1, 1, 1  # window extent, alignment, smallest slab
    if kind in ("conv", "conv_transpose"):
        k, d = draw(st.integers(1, 4)), draw(st.integers(1, 2))
        stride = draw(st.integers(1, 3))
        span = d * (k - 1) + 1
        g = draw(st.sampled_from([1, 2]))
        cfg.update(kernel=k, dilation=d, stride=stride, groups=g, cin=2 * g, cout=3 * g if g > 1 else 3)
        if kind == "conv":
            mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
            cfg.update(mode=mode, padding=draw(st.integers(0, span - 1 if mode == "zeros" else min(span - 1, 2))))
            min_slab = span + stride
        else:
            cfg.update(padding=draw(st.integers(0, span - 1)),
                       output_padding=draw(st.integers(0, max(stride, d) - 1)))
            # transposed windows scatter span outputs from each input: the output strip sent to a
            # neighbour must fit in its (stride times wider) slab.
            min_slab = span + 2
            stride = 1  # input slabs need no alignment; the output slab starts at stride x start
    elif kind in ("max_pool", "avg_pool"):
        k = draw(st.integers(1, 4))
        stride = draw(st.integers(1, 3))
        d = draw(st.integers(1, 2)) if kind == "max_pool" else 1
        span = d * (k - 1) + 1
        cfg.update(kernel=k, stride=stride, dilation=d, padding=draw(st.integers(0, k // 2)),
                   ceil_mode=draw(st.booleans()), count_include_pad=draw(st.booleans()))
        min_slab = span + stride
    elif kind == "upsample":
        modes = ["nearest", "nearest-exact", "linear" if nd == 1 else "bilinear"] + (["bicubic"] if nd == 2 else [])
        mode = draw(st.sampled_from(modes))
        linear = mode in ("linear", "bilinear", "bicubic")
        cfg.update(scale=draw(st.integers(1, 3)), mode=mode,
                   align_corners=draw(st.booleans()) if linear else None)
        min_slab = 3 if mode == "bicubic" else 2
    else:
        norm = draw(st.sampled_from(["group", "instance", "batch", "layer"]))
        g = draw(st.sampled_from([1, 2, 4]))
        cfg.update(norm=norm, groups=g, cin=4)
        # torch needs more than one value per channel (batch norm) or per sample and channel
        # (instance norm) in training: two positions on every rank's slab keep that true.
        min_slab = 2
    cfg["align"] = stride
    other = max(span + 1, 3)
    parts = domain if isinstance(domain, int) else domain[0]
    blocks_min = -(-min_slab // stride)
    if isinstance(domain, int):
        # Random uneven slabs: multiples of the stride, the last one possibly shorter (but still
        # at least min_slab), as the balanced rule of the layout allows.
        sizes = [draw(st.integers(blocks_min, blocks_min + 3)) * stride for _ in range(parts)]
        sizes[-1] = max(min_slab, sizes[-1] - draw(st.integers(0, stride - 1)))
        cfg["sizes"] = tuple(sizes) if parts > 1 else None
        spatial = [sum(sizes)] + [other] * (nd - 1)
    else:
        # 2x2 mesh: balanced aligned slabs on both spatial dims.
        spatial = [parts * blocks_min * stride + draw(st.integers(0, 2 * stride)) for _ in range(2)]
    cfg["spatial"] = tuple(spatial)
    return cfg


# --------------------------------------------------------------------------- tests


def _run(pools, cfg, timeout: float = 120.0):
    return outcome(pools, _case, cfg, timeout)


# No shrinking: a failing example restarts the worker pool; the example is reported as found.
# The campaign runs at low priority on a shared machine: a starved case gets a long timeout
# (``SNN_FUZZ_TIMEOUT``), and a timeout is reported apart from the mismatches (a hang or
# starvation, not a wrong answer; either way it fails the campaign).
test_fuzz_fast, test_fuzz_campaign = fuzz_tests(
    "fuzz campaign", configs(), _run, [],
    fast=("SNN_FUZZ_FAST_EXAMPLES", 20), campaign=("SNN_FUZZ_EXAMPLES", 1200), every=50,
    count=lambda cfg: cfg["kind"], minimum=1000, fast_timeout=120.0,
)
