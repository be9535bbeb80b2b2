"""Hypothesis fuzzing of ``snn.interpolate``: ``F.interpolate`` of random slabs, any output size.

``tests/test_upsample.py`` checks chosen cases and ``tests/test_fuzz.py`` draws ``nn.Upsample``
with integer factors; this file draws the rest: every mode (nearest, nearest-exact, linear,
bilinear, bicubic, trilinear, area), an output ``size`` of any length (down- and upsampling,
fewer outputs than ranks) or a fractional ``scale_factor`` per dim with
``recompute_scale_factor`` on or off, ``align_corners`` for the linear and cubic modes, 1-3
spatial dims of lengths 1-9, any spatial dims sharded, slabs of random uneven lengths with empty
ones, on 1-4 ranks or a 2x2 mesh (float64). Each rank's output must be its slab in the
documented layout (a rank whose input slab is ``[a, b)`` of ``L`` holds the outputs
``[round(a O / L), round(b O / L))``; for ``area``, the adaptive pool's own, one output along a
sharded dim replicated) holding torch's values on the whole tensor, and the input's gradient the
single device's slab. Torch's own refusals on the whole tensor count as invalid; any other
outcome fails.

- ``test_fuzz_interpolate_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_interpolate_campaign`` (``pytest -m slow``): ``SNN_FUZZ_INTERPOLATE_EXAMPLES``
  examples (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .fuzzing import adaptive_or_replicated, fuzz_tests, outcome, output_blocks, slab_of
from .harness import mesh
from .test_fuzz_fft_modes import _split

#: mode -> the spatial dims it takes (None: any of 1-3)
MODES = {"nearest": None, "nearest-exact": None, "area": None, "linear": 1, "bilinear": 2, "bicubic": 2,
         "trilinear": 3}  # fmt: skip


def _rounded(n: int, o: int, a: int, b: int) -> tuple[int, int]:
    """The resampling layout: a slab ``[a, b)`` of ``n`` holds outputs ``[round(a o / n), round(b o / n))``."""
    return (2 * a * o + n) // (2 * n), (2 * b * o + n) // (2 * n)


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    dims = [d for d, _ in splits]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    gen = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(cfg["shape"], generator=gen, dtype=torch.float64).requires_grad_()
    kw = dict(mode=cfg["mode"], align_corners=cfg["align_corners"])
    if cfg["size"] is not None:
        kw["size"] = tuple(cfg["size"])
    else:
        kw.update(scale_factor=tuple(cfg["scale"]), recompute_scale_factor=cfg["recompute"])
    try:
        y_ref = F.interpolate(x, **kw)
    except (RuntimeError, ValueError) as e:  # torch's own rules on the whole tensor
        return ("invalid", str(e)[:100])
    if not y_ref.numel():  # torch makes an empty output (area), whose backward it then refuses
        return ("invalid", "empty output")

    def block(t):
        return slab_of(t, splits, coords)

    x_l = block(x.detach()).clone().requires_grad_()
    try:
        y = snn.interpolate(x_l, m, **kw, dims=dims)
    except ShardingError as e:
        return ("refused", str(e)[:120])
    # The documented layout: this rank's outputs along each sharded dim. ``area`` is adaptive
    # average pooling: bin i, [floor(i L / O), ceil((i + 1) L / O)), belongs to the rank whose
    # slab holds its start, and one output (the global mean) is replicated along that axis.
    g = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    rule = adaptive_or_replicated if cfg["mode"] == "area" else _rounded
    out_block, g_block, rep = output_blocks(y_ref.detach(), g, splits, coords, rule)
    torch.testing.assert_close(y, out_block, atol=1e-12, rtol=1e-12, msg=lambda s: f"output: {s}")
    if cfg["mode"] == "bicubic" and y_ref.shape == x.shape and cfg["scale"] and not cfg["recompute"]:
        # torch's bicubic backward copies the gradient where every size is kept, while its
        # forward used the scale factors (gradcheck fails on torch itself there); ours is the
        # forward's true gradient, so only the forward is compared.
        return ("invalid", "torch's bicubic backward at kept sizes")
    (y_ref * g).sum().backward()
    # A value replicated over r ranks carries 1 / r of the loss on each (the library's convention).
    ((y * g_block).sum() / rep).backward()
    torch.testing.assert_close(x_l.grad, block(x.grad), atol=1e-12, rtol=1e-12, msg=lambda s: f"grad: {s}")
    return "ok"


@st.composite
def configs(draw):
    mode = draw(st.sampled_from(sorted(MODES)))
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    nsp = MODES[mode] or draw(st.integers(len(axes), 3))
    if nsp < len(axes):
        domain, axes = 2, [2]
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 2))] + [draw(st.integers(1, 9)) for _ in range(nsp)]
    size = scale = recompute = None
    if draw(st.booleans()):
        size = [draw(st.integers(1, 12)) for _ in range(nsp)]
    else:
        scale = [draw(st.sampled_from([0.3, 0.5, 0.75, 1.0, 1.3, 1.5, 2.0, 2.5, 3.0])) for _ in range(nsp)]
        recompute = draw(st.sampled_from([None, True, False]))
    corners = draw(st.booleans()) if mode in ("linear", "bilinear", "bicubic", "trilinear") else None
    sharded = draw(st.permutations(range(2, 2 + nsp)))[: len(axes)]
    return dict(
        domain=domain, mode=mode, shape=shape, size=size, scale=scale, recompute=recompute, align_corners=corners,
        splits=[(d, _split(draw, shape[d], p)) for d, p in zip(sharded, axes)], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: bicubic downsampling to fewer rows than ranks with an empty
# slab (its multi-hop path raised a NameError before session 59); trilinear with a fractional
# factor on a 2x2 mesh; bilinear whose factor 1.3 keeps the 3 sharded rows (torch copies them:
# computed with the factor before session 59).
EXAMPLES = [
    dict(domain=3, mode="bicubic", shape=[1, 2, 7, 4], size=[2, 5], scale=None, recompute=None, align_corners=False,
         splits=[(2, [3, 0, 4])], seed=1),
    dict(domain=(2, 2), mode="trilinear", shape=[1, 1, 5, 6, 3], size=None, scale=[1.5, 0.75, 2.0], recompute=False,
         align_corners=True, splits=[(3, [2, 4]), (2, [1, 4])], seed=2),
    dict(domain=2, mode="bilinear", shape=[1, 2, 3, 4], size=None, scale=[1.3, 2.5], recompute=False,
         align_corners=False, splits=[(2, [2, 1])], seed=3),
]  # fmt: skip

test_fuzz_interpolate_fast, test_fuzz_interpolate_campaign = fuzz_tests(
    "interpolate fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_INTERPOLATE_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_INTERPOLATE_EXAMPLES", 300), every=50,
)
