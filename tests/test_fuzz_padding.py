"""Hypothesis fuzzing of sharded padding: ``sharded_nn.layers.padding.pad`` and the converted
``nn.*Pad1d/2d/3d`` modules.

``tests/test_padding.py`` checks chosen cases; this file draws them: every mode (constant with a
fill value, reflect, replicate, circular), 1-3 spatial dims of lengths 1-7 after a batch and a
channel dim, padding amounts per dim from -2 to 7 (left and right apart, wider than a slab and up
to torch's own limits of the whole dim, negative ones cropping), the functional form (pairs for
some trailing dims only) or the module (``ZeroPad``, ``ConstantPad``, ``ReflectionPad``,
``ReplicationPad``, ``CircularPad`` converted with ``snn.convert``), any spatial dims sharded,
slabs of random uneven lengths with empty ones, on 1-4 ranks or a 2x2 mesh. The output must be
this rank's part of ``F.pad`` on the whole tensor in the documented layout (each rank holds the
padded positions where its input slab was, the last rank also the right padding), and the
input's gradient the single device's slab (float64, exact). Torch's own refusals on the whole
tensor count as invalid; the one documented refusal (circular padding cropping a sharded dim;
before session 60 any crop of a sharded dim) must come alike on every rank exactly where
predicted; any other outcome fails. A crop keeps the input's slab boundaries cut at the output's
end (the last ranks hold fewer rows, or none).

- ``test_fuzz_padding_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_padding_campaign`` (``pytest -m slow``): ``SNN_FUZZ_PADDING_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError, ShardingNotImplementedError
from sharded_nn.layers.padding import pad as sharded_pad

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .test_fuzz_fft_modes import _split

MODULES = {"constant": "ConstantPad", "zeros": "ZeroPad", "reflect": "ReflectionPad", "replicate": "ReplicationPad",
           "circular": "CircularPad"}  # fmt: skip


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    parts = [len(s) for _, s in splits]
    gen = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(cfg["shape"], generator=gen, dtype=torch.float64).requires_grad_()
    mode, amounts = cfg["mode"], cfg["pad"]
    torch_mode = "constant" if mode == "zeros" else mode
    value = cfg["value"] if mode == "constant" else None
    try:
        y_ref = F.pad(x, amounts, torch_mode, value) if torch_mode == "constant" else F.pad(x, amounts, torch_mode)
    except (RuntimeError, NotImplementedError, ValueError) as e:  # torch's own limits on the whole tensor
        return ("invalid", str(e)[:100])
    nd = x.dim()
    per_dim = {nd - 1 - i: (amounts[2 * i], amounts[2 * i + 1]) for i in range(len(amounts) // 2)}
    wraps_past = any(max(a, b) > x.shape[d] + min(a, 0) + min(b, 0) for d, (a, b) in per_dim.items())
    if torch_mode == "circular" and wraps_past:
        # torch checks the wrap against the dim before its crop and then reads past the cropped
        # dim: uninitialized values, different from call to call (seen in session 60).
        return ("invalid", "torch wraps past the cropped dim (uninitialized values)")
    sharded = [d for d, _ in splits]
    # The documented refusal: circular padding cropping a sharded dim (torch crops, then wraps).
    crops = torch_mode == "circular" and any(d in per_dim and min(per_dim[d]) < 0 for d in sharded)

    def block(t, padded: bool):
        for (d, split), c, p in zip(splits, coords, parts):
            a, b = sum(split[:c]), sum(split[: c + 1])
            if padded:  # the input's boundaries, cut at the output's end; the last rank to the end
                end = sum(split) + sum(per_dim.get(d, (0, 0)))
                a, b = min(a, end), (end if c == p - 1 else min(b, end))
            t = t.narrow(d, a, b - a)
        return t

    x_l = block(x.detach(), False).clone().requires_grad_()
    try:
        if cfg["api"] == "module":
            k = len(amounts) // 2
            cls = getattr(nn, f"{MODULES[mode]}{k}d")
            layer = cls(tuple(amounts), value) if mode == "constant" else cls(tuple(amounts))
            model = snn.convert(copy.deepcopy(nn.Sequential(layer)), m, dims=tuple(sharded), strict=True)
            y = model(x_l)
        else:
            y = sharded_pad(x_l, amounts, m, torch_mode, value, dims=sharded)
    except (ShardingError, ShardingNotImplementedError) as e:
        assert crops, f"refused where the documented rules do not: {e}"
        return ("refused", str(e)[:120])
    assert not crops, "cropped a sharded dim where the documented rules refuse"
    torch.testing.assert_close(y, block(y_ref.detach(), True), atol=0, rtol=0, msg=lambda s: f"output: {s}")
    g = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    (y_ref * g).sum().backward()
    (y * block(g, True)).sum().backward()
    torch.testing.assert_close(x_l.grad, block(x.grad, False), atol=1e-12, rtol=1e-12, msg=lambda s: f"grad: {s}")
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    nsp = draw(st.integers(len(axes), 3))
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 2))] + [draw(st.integers(1, 7)) for _ in range(nsp)]
    mode = draw(st.sampled_from(["constant", "zeros", "reflect", "replicate", "circular"]))
    api = draw(st.sampled_from(["functional", "module"]))
    k = nsp if api == "module" else draw(st.integers(1, nsp))  # padded trailing dims
    amounts = []
    for i in range(k):
        n = shape[-1 - i]
        top = {"reflect": n - 1, "circular": n}.get(mode, 7)  # torch's limits (sometimes passed)
        for _ in range(2):
            wild = not draw(st.integers(0, 3))  # a quarter of the amounts: any, cropping included
            amounts.append(draw(st.integers(-2, 7)) if wild else draw(st.integers(0, max(top, 0))))
    sharded = draw(st.permutations(range(2, 2 + nsp)))[: len(axes)]
    return dict(
        domain=domain, shape=shape, mode=mode, api=api, pad=amounts, value=draw(st.sampled_from([0.0, 1.5, -2.0])),
        splits=[(d, _split(draw, shape[d], p)) for d, p in zip(sharded, axes)], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: reflect padding wider than the thin first slabs at 3 ranks
# (multi-hop), an empty last slab; circular padding of both sharded dims of a 2x2 mesh.
EXAMPLES = [
    dict(domain=3, shape=[1, 2, 7, 3], mode="reflect", api="functional", pad=[1, 0, 5, 2], value=0.0,
         splits=[(2, [1, 6, 0])], seed=1),
    dict(domain=(2, 2), shape=[2, 1, 3, 5, 2], mode="circular", api="module", pad=[1, 2, 4, 0, 3, 3], value=0.0,
         splits=[(3, [1, 4]), (2, [2, 1])], seed=2),
]  # fmt: skip

test_fuzz_padding_fast, test_fuzz_padding_campaign = fuzz_tests(
    "padding fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_PADDING_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_PADDING_EXAMPLES", 300), every=50,
)
