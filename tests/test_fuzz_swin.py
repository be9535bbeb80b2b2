"""Hypothesis fuzzing of converted timm Swin Transformers (V1, V2, V2-CR) over their options.

``tests/test_swin.py`` checks five named configurations; this file draws the constructor's
options together: the version, patch size, window size (per stage for V2), stages and their
depths and heads (or V1's head size), image widths that are not multiples of a window (timm pads
the last window), ``always_partition``, ``strict_img_size`` / ``dynamic_img_size``, MLP ratio,
qkv bias, V2's pretrained window sizes and activation, V2-CR's layer scale and extra norms and
sequential attention, every global pool, classifier or not, and the mesh: 1-4 ranks sharding
the image height, or a 2 x 2 mesh sharding height and width, with random uneven slabs of whole
alignment blocks (``snn.alignment``), the last one possibly cut short (timm pads the image's end
to whole windows). Each example converts
a float64 model (parameters randomised so that every one matters, relative position tables
included) with ``snn.convert`` and compares, in eval mode, the logits (pooled, or per position
gathered from their slabs), the pooled features,
the input gradient and every parameter gradient (summed over the ranks) with timm's on the whole
image, to 1e-9. A refusal (``ShardingError``) alike on every rank is counted apart, as is a
configuration timm itself rejects; any mismatch fails.

- ``test_fuzz_swin_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_swin_campaign`` (``pytest -m slow``): ``SNN_FUZZ_SWIN_EXAMPLES`` examples (default
  200), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome, randomize_
from .harness import mesh
from .reference import assert_param_grads


def _build(cfg: dict):
    """The float64 timm model of ``cfg`` with randomised parameters, or the reason timm refused it."""
    import timm.models.swin_transformer as v1
    import timm.models.swin_transformer_v2 as v2
    import timm.models.swin_transformer_v2_cr as cr

    cls = {"v1": v1.SwinTransformer, "v2": v2.SwinTransformerV2, "v2_cr": cr.SwinTransformerV2Cr}[cfg["arch"]]
    torch.manual_seed(cfg["seed"])
    try:
        model = cls(**cfg["kwargs"])
    except (AssertionError, ValueError, TypeError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"[:200]
    return randomize_(model.double().eval(), cfg["seed"] + 1, 0.2), None


def _two(cfg: dict) -> bool:
    """Whether the example's mesh is 2 x 2 (H and W sharded)."""
    return not isinstance(cfg["domain"], int)


def _cut(blocks, align, cut, patch) -> list[int]:
    """Slab lengths of whole alignment blocks, the last one shorter by ``cut`` whole patches."""
    sizes = [b * align for b in blocks]
    sizes[-1] -= min(cut, sizes[-1] // patch - 1) * patch  # whole patches (timm asserts)
    return sizes


def _case(cfg: dict):
    """One example on this rank: ``"ok"``, ``("refused", ...)`` or ``("invalid", ...)``; raises on a mismatch."""
    two = _two(cfg)
    m = mesh(tuple(cfg["domain"]) if two else cfg["domain"])
    ref, why = _build(cfg)
    if ref is None:
        return ("invalid", why)
    align = cfg.get("align")
    if align is None:
        return ("invalid", "timm refused the probe model")
    splits = [_cut(cfg["blocks"], align[0], cfg["cut"], cfg["patch"])]
    if two:
        splits.append(_cut(cfg["wblocks"], align[1], cfg["wcut"], cfg["patch"]))
    w = sum(splits[1]) if two else cfg["width"]
    x = torch.randn(2, 3, sum(splits[0]), w, generator=torch.Generator().manual_seed(cfg["seed"] + 2),
                    dtype=torch.float64)
    xr = x.clone().requires_grad_()
    try:
        y_ref = ref(xr)
    except (AssertionError, ValueError, RuntimeError) as e:  # timm refuses the run size
        return ("invalid", f"{type(e).__name__}: {e}"[:200])
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(cfg["seed"] + 3), dtype=y_ref.dtype)
    (y_ref * g).sum().backward()
    dims = (2, 3) if two else (2,)
    try:
        model = snn.convert(copy.deepcopy(ref), m)
        x_local = x
        for d, sizes, axis in zip(dims, splits, m.mesh_dim_names):
            r = m.get_local_rank(axis)
            x_local = x_local.narrow(d, sum(sizes[:r]), sizes[r])
        x_local = x_local.clone().requires_grad_()
        y = model(x_local)
        pooled = cfg["kwargs"]["global_pool"] != ""
        if pooled:  # replicated logits
            snn.losses.share((y * g).sum(), m).backward()
        else:  # per-position logits: a slab of the rows (and columns; NHWC, V2-CR keeps NCHW)
            rows = tuple(d - (cfg["arch"] != "v2_cr") for d in dims)
            (y * g[snn.local_slices(y, m, dims=rows)]).sum().backward()
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", type(e).__name__, str(e)[:200])
    tol = dict(atol=1e-9, rtol=1e-9)
    y_all = y if pooled else snn.gather(y, m, dims=rows)
    torch.testing.assert_close(y_all, y_ref.detach(), **tol, msg=lambda s: f"logits: {s}")
    torch.testing.assert_close(snn.gather(x_local.grad, m, dims=dims), xr.grad, **tol, msg=lambda s: f"input grad: {s}")
    assert_param_grads(ref, model, m, atol=1e-9, rtol=1e-8)
    return "ok"


@st.composite
def configs(draw):
    arch = draw(st.sampled_from(["v1", "v1", "v2", "v2_cr"]))
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    stages = draw(st.integers(1, 2))
    heads = tuple(draw(st.sampled_from([1, 2])) * (2**i) for i in range(stages))
    patch = draw(st.sampled_from([2, 4]))
    window = draw(st.integers(2, 4))
    kwargs = dict(
        patch_size=patch, embed_dim=heads[0] * draw(st.sampled_from([4, 8])), depths=tuple(draw(st.integers(1, 2))
        for _ in range(stages)), num_heads=heads, mlp_ratio=draw(st.sampled_from([1.0, 2.0])),
        num_classes=draw(st.sampled_from([0, 3])), global_pool=draw(st.sampled_from(["avg", "avg", ""])),
        always_partition=draw(st.booleans()), drop_path_rate=0.0,
    )  # fmt: skip
    if kwargs["num_classes"] == 0 and kwargs["global_pool"] == "":
        kwargs["global_pool"] = "avg"  # un-pooled NHWC features: compared as the logits are
    if arch == "v2_cr":
        kwargs.update(window_size=window, init_values=draw(st.sampled_from([None, 0.5])),
                      extra_norm_period=draw(st.sampled_from([0, 1])), extra_norm_stage=draw(st.booleans()),
                      sequential_attn=draw(st.booleans()))  # fmt: skip
    else:
        kwargs.update(window_size=window, qkv_bias=draw(st.booleans()))
        if arch == "v2":
            kwargs.update(pretrained_window_sizes=tuple(draw(st.sampled_from([0, 0, 3])) for _ in range(stages)),
                          act_layer=draw(st.sampled_from(["gelu", "silu"])))  # fmt: skip
        elif draw(st.booleans()):
            kwargs["head_dim"] = draw(st.sampled_from([4, 8]))
    mode = draw(st.sampled_from(["strict", "loose", "dynamic"]))
    width = patch * draw(st.integers(2, 3 * window))
    blocks = [draw(st.integers(1, 2)) for _ in range(2 if domain == (2, 2) else domain)]
    cut = draw(st.integers(0, 5))  # patches off the last slab (the image's end padded to whole windows)
    # On a 2 x 2 mesh the width is cut into alignment blocks too (``width`` then unused).
    wide = {}
    if domain == (2, 2):
        wide = dict(wblocks=[draw(st.integers(1, 2)) for _ in range(2)], wcut=draw(st.integers(0, 5)))
    # The image size the model is built for: the run size when strict (the alignment decides H
    # at run time: built below from a probe), else any size.
    kwargs["strict_img_size"] = mode == "strict"
    if mode == "dynamic" and arch != "v2_cr":
        kwargs["dynamic_img_size"] = True
    return dict(arch=arch, domain=domain, patch=patch, width=width, blocks=blocks, cut=cut, mode=mode, kwargs=kwargs,
                seed=draw(st.integers(0, 2**16)), **wide)  # fmt: skip


def _sized(cfg: dict) -> dict:
    """``cfg`` with ``align`` (``snn.alignment`` of a probe model built for a tall image, and a
    wide one on a 2 x 2 mesh) and ``img_size``: the run size for strict models (whole blocks per
    rank, the last one shorter by ``cut`` patches), the probe's size otherwise."""
    cfg = copy.deepcopy(cfg)
    kw = cfg["kwargs"]
    if "img_size" in kw:
        return cfg
    two = _two(cfg)
    probe_size = (64 * cfg["patch"], 64 * cfg["patch"] if two else cfg["width"])
    probe, why = _build({**cfg, "kwargs": {**kw, "img_size": probe_size}})
    if probe is None:
        kw["img_size"] = probe_size
        return cfg
    try:
        align = snn.alignment(probe, dims=(2, 3) if two else (2,), input_shape=(1, 3, *probe_size))
    except ValueError:
        kw["img_size"] = probe_size
        return cfg
    cfg["align"] = list(align)
    h = sum(_cut(cfg["blocks"], align[0], cfg["cut"], cfg["patch"]))
    w = sum(_cut(cfg["wblocks"], align[1], cfg["wcut"], cfg["patch"])) if two else cfg["width"]
    kw["img_size"] = (h, w) if cfg["mode"] == "strict" else probe_size
    return cfg


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, _sized(cfg), timeout)



_BASE = dict(patch_size=4, embed_dim=8, depths=(2,), num_heads=(2,), mlp_ratio=1.0, num_classes=3, global_pool="avg",
             always_partition=False, drop_path_rate=0.0, window_size=3)  # fmt: skip
# Cases the fast run always includes: V1 on uneven slabs with the image's end padded to whole
# windows, V2 with pretrained window sizes on two stages, V2-CR with extra norms, V1 on a 2 x 2 mesh.
EXAMPLES = [
    dict(arch="v1", domain=3, patch=4, width=20, blocks=[2, 1, 2], cut=5, mode="loose",
         kwargs={**_BASE, "qkv_bias": True, "strict_img_size": False}, seed=1),
    dict(arch="v2", domain=2, patch=2, width=16, blocks=[1, 2], cut=0, mode="strict",
         kwargs={**_BASE, "patch_size": 2, "depths": (1, 1), "num_heads": (1, 2), "window_size": 2, "qkv_bias": False,
                 "pretrained_window_sizes": (0, 3), "act_layer": "gelu", "strict_img_size": True}, seed=2),
    dict(arch="v2_cr", domain=4, patch=4, width=24, blocks=[1, 2, 1, 1], cut=3, mode="loose",
         kwargs={**_BASE, "init_values": 0.5, "extra_norm_period": 1, "extra_norm_stage": True,
                 "sequential_attn": False, "strict_img_size": False}, seed=3),
    # A 2 x 2 mesh: H and W sharded, both ends padded to whole windows, shifted blocks.
    dict(arch="v1", domain=(2, 2), patch=4, width=0, blocks=[2, 1], cut=3, wblocks=[1, 2], wcut=2, mode="strict",
         kwargs={**_BASE, "qkv_bias": True, "strict_img_size": True}, seed=4),
]  # fmt: skip


test_fuzz_swin_fast, test_fuzz_swin_campaign = fuzz_tests(
    "swin fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_SWIN_FAST_EXAMPLES", 5), campaign=("SNN_FUZZ_SWIN_EXAMPLES", 200), every=25,
    count=lambda cfg: f"{cfg['arch']} {'2x2' if _two(cfg) else '1-D'}",
)
