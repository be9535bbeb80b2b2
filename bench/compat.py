"""Compatibility table: popular models converted as a new user would, at P=2, float64, eval mode.

For each model: build it single-device (no pretrained weights), randomise every norm layer's
running statistics and affine parameters (so that no zero-initialised branch hides an error),
convert a copy with ``snn.convert(model, mesh)``, run it on slabs of H (aligned with
``snn.alignment``) and compare the gathered output with the single-device output. Outcomes:

- ``exact``: max abs error <= 1e-9 (relative to the output's scale); for the models listed in
  ``FLOAT32_INSIDE``, which cast to float32 inside their own forward whatever the input dtype,
  1e-5 (float32 rounding of sums taken in another order), with the reason in the detail column;
  for an ill-conditioned model, whose own output moves by more than 1e-10 (relative) when torch
  runs it on a channels-last copy of the input (only the summation order changes; random
  weights under randomised norms can amplify rounding a millionfold, as in
  ``efficientnetv2_rw_t``: 1.9e-7), 10 times that, with the measured spread in the detail column;
- ``refused``: a ``ShardingError`` / ``ShardingNotImplementedError`` on every rank, with its reason;
- ``WRONG``: the model ran and the output differs (a silently wrong answer: must never happen);
- ``error``: any other exception (a crash, not silent, but worth a look).

Usage: ``python -m bench.compat [--models a,b] [--out bench/compat.md]`` (a few minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import warnings

import torch
import torch.nn as nn


def _tv(name, **kw):
    def make():
        import torchvision.models as tvm
        import torchvision.models.segmentation as tvs

        fn = getattr(tvm, name, None) or getattr(tvs, name)
        return fn(weights=None, **kw)

    return make


def _timm(name, **kw):
    def make():
        import timm

        return timm.create_model(name, pretrained=False, **kw)

    return make


def _monai(name, **kw):
    def make():
        from monai.networks import nets

        return getattr(nets, name)(**kw)

    return make


#: name -> (builder, input shape (N, C, H, W[, D]), family)
MODELS = {
    "tv/resnet18": (_tv("resnet18"), (1, 3, 64, 32), "torchvision cls"),
    "tv/mobilenet_v3_small": (_tv("mobilenet_v3_small"), (1, 3, 64, 32), "torchvision cls"),
    "tv/efficientnet_b0": (_tv("efficientnet_b0"), (1, 3, 64, 32), "torchvision cls"),
    "tv/regnet_y_400mf": (_tv("regnet_y_400mf"), (1, 3, 64, 32), "torchvision cls"),
    "tv/densenet121": (_tv("densenet121"), (1, 3, 64, 32), "torchvision cls"),
    "tv/shufflenet_v2_x0_5": (_tv("shufflenet_v2_x0_5"), (1, 3, 64, 32), "torchvision cls"),
    "tv/squeezenet1_1": (_tv("squeezenet1_1"), (1, 3, 64, 32), "torchvision cls"),
    "tv/convnext_tiny": (_tv("convnext_tiny"), (1, 3, 192, 32), "torchvision cls"),
    "tv/swin_t": (_tv("swin_t"), (1, 3, 64, 64), "torchvision cls"),
    "tv/fcn_resnet50": (_tv("fcn_resnet50", aux_loss=False, weights_backbone=None), (1, 3, 64, 40), "torchvision seg"),
    "tv/deeplabv3_resnet50": (_tv("deeplabv3_resnet50", aux_loss=False, weights_backbone=None), (1, 3, 64, 40),
                              "torchvision seg"),
    "tv/lraspp_mobilenet_v3_large": (_tv("lraspp_mobilenet_v3_large", weights_backbone=None), (1, 3, 128, 32),
                                     "torchvision seg"),
    "timm/efficientnet_b0": (_timm("efficientnet_b0"), (1, 3, 64, 32), "timm CNN"),
    "timm/mobilenetv3_small_100": (_timm("mobilenetv3_small_100"), (1, 3, 64, 32), "timm CNN"),
    "timm/regnety_002": (_timm("regnety_002"), (1, 3, 64, 32), "timm CNN"),
    "timm/ecaresnet26t": (_timm("ecaresnet26t"), (1, 3, 64, 32), "timm CNN"),
    "timm/resnest14d": (_timm("resnest14d"), (1, 3, 64, 32), "timm CNN"),
    "timm/convnext_atto": (_timm("convnext_atto"), (1, 3, 192, 32), "timm CNN"),
    "timm/ghostnet_100": (_timm("ghostnet_100"), (1, 3, 64, 32), "timm CNN"),
    "timm/rexnet_100": (_timm("rexnet_100"), (1, 3, 64, 32), "timm CNN"),
    "timm/nf_resnet26": (_timm("nf_resnet26"), (1, 3, 64, 32), "timm CNN"),
    "timm/tf_efficientnet_b0": (_timm("tf_efficientnet_b0"), (1, 3, 64, 32), "timm CNN"),
    "timm/resnetblur18": (_timm("resnetblur18"), (1, 3, 64, 32), "timm CNN"),
    "timm/mobilevit_xxs": (_timm("mobilevit_xxs"), (1, 3, 64, 64), "timm hybrid"),
    "timm/convnextv2_atto": (_timm("convnextv2_atto"), (1, 3, 64, 32), "timm CNN"),
    "timm/pvt_v2_b0": (_timm("pvt_v2_b0"), (1, 3, 64, 32), "timm hybrid"),
    "timm/efficientvit_b0": (_timm("efficientvit_b0"), (1, 3, 64, 32), "timm hybrid"),
    "timm/poolformerv2_s12": (_timm("poolformerv2_s12"), (1, 3, 64, 32), "timm CNN"),
    "timm/edgenext_xx_small": (_timm("edgenext_xx_small"), (1, 3, 64, 32), "timm hybrid"),
    "timm/xcit_nano_12_p8_224": (_timm("xcit_nano_12_p8_224", depth=2), (1, 3, 64, 32), "timm ViT"),
    "timm/vit_tiny_r_s16_p8_224": (_timm("vit_tiny_r_s16_p8_224", img_size=(128, 64), depth=2), (1, 3, 128, 64),
                                   "timm ViT"),
    "timm/vit_small_patch16_224": (_timm("vit_small_patch16_224", img_size=(64, 32), depth=2), (1, 3, 64, 32),
                                   "timm ViT"),
    "timm/deit_tiny_distilled_patch16_224": (_timm("deit_tiny_distilled_patch16_224", img_size=(64, 32), depth=2),
                                             (1, 3, 64, 32), "timm ViT"),
    "timm/eva02_tiny_patch14_224": (_timm("eva02_tiny_patch14_224", img_size=(56, 28), depth=2), (1, 3, 56, 28),
                                    "timm ViT"),
    "timm/swin_tiny_patch4_window7_224": (_timm("swin_tiny_patch4_window7_224", img_size=(256, 64), window_size=4,
                                                depths=(2, 2, 2, 2)), (1, 3, 256, 64), "timm Swin"),
    "timm/swinv2_tiny_window8_256": (_timm("swinv2_tiny_window8_256", img_size=(256, 64), window_size=4,
                                           depths=(2, 2, 2, 2)), (1, 3, 256, 64), "timm Swin"),
    "timm/swinv2_cr_tiny_ns_224": (_timm("swinv2_cr_tiny_ns_224", img_size=(256, 64), window_size=4,
                                         depths=(2, 2, 2, 2)), (1, 3, 256, 64), "timm Swin"),
    "timm/cait_xxs24_224": (_timm("cait_xxs24_224", img_size=(64, 32), depth=2), (1, 3, 64, 32), "timm ViT"),
    "timm/beit_base_patch16_224": (_timm("beit_base_patch16_224", img_size=(64, 32), depth=2), (1, 3, 64, 32),
                                   "timm ViT"),
    "timm/vit_relpos_small_patch16_224": (_timm("vit_relpos_small_patch16_224", img_size=(64, 32), depth=2),
                                          (1, 3, 64, 32), "timm ViT"),
    "timm/coat_lite_tiny": (_timm("coat_lite_tiny", img_size=(64, 32)), (1, 3, 64, 32), "timm ViT"),
    # Window attention written with views in the model's own forward (snn.alignment finds the
    # windows: 4 tokens at 1/32, 128 rows); EfficientViT-M is built for one size (its own).
    "timm/davit_tiny": (_timm("davit_tiny", window_size=4, depths=(1, 1, 2, 1)), (1, 3, 64, 32), "timm window"),
    "timm/tiny_vit_5m_224": (_timm("tiny_vit_5m_224", window_sizes=(4, 4, 4, 4), depths=(1, 1, 2, 1)),
                             (1, 3, 64, 32), "timm window"),
    "timm/twins_svt_small": (_timm("twins_svt_small", wss=(4, 4, 4, 4), depths=(1, 1, 2, 1)), (1, 3, 64, 32),
                             "timm window"),
    "timm/efficientvit_m0": (_timm("efficientvit_m0", img_size=512, window_size=(4, 4, 4)), (1, 3, 512, 512),
                             "timm window"),
    "monai/UNETR-3d": (_monai("UNETR", in_channels=1, out_channels=2, img_size=(64, 32, 32), feature_size=4,
                              hidden_size=32, mlp_dim=64, num_heads=2), (1, 1, 64, 32, 32), "MONAI 3-D"),
    "monai/BasicUNet-2d": (_monai("BasicUNet", spatial_dims=2, in_channels=1, out_channels=2,
                                  features=(4, 4, 8, 8, 8, 4)), (1, 1, 64, 32), "MONAI 2-D"),
    "monai/AttentionUnet-2d": (_monai("AttentionUnet", spatial_dims=2, in_channels=1, out_channels=2,
                                      channels=(4, 8, 16), strides=(2, 2)), (1, 1, 32, 24), "MONAI 2-D"),
    "monai/SwinUNETR-2d": (_monai("SwinUNETR", in_channels=1, out_channels=2, feature_size=12, spatial_dims=2,
                                  depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1)), (1, 1, 64, 64), "MONAI 2-D"),
    "monai/UNet-3d": (_monai("UNet", spatial_dims=3, in_channels=1, out_channels=1, channels=(4, 8, 16),
                             strides=(2, 2), num_res_units=1, norm="batch"), (1, 1, 16, 12, 8), "MONAI 3-D"),
    "monai/SegResNet-3d": (_monai("SegResNet", spatial_dims=3, in_channels=1, out_channels=2, init_filters=8,
                                  blocks_down=(1, 1, 1), blocks_up=(1, 1)), (1, 1, 16, 12, 8), "MONAI 3-D"),
    "monai/DynUNet-3d": (_monai("DynUNet", spatial_dims=3, in_channels=1, out_channels=2, kernel_size=(3, 3, 3),
                                strides=(1, 2, 2), upsample_kernel_size=(2, 2), filters=(4, 8, 16)),
                         (1, 1, 16, 12, 8), "MONAI 3-D"),
}  # fmt: skip


def randomise_norms(model: nn.Module, seed: int = 0) -> None:
    """Random running statistics and affine parameters for every norm layer (no hidden branch)."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        for name in ("running_mean", "running_var"):
            buf = getattr(m, name, None)
            if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                with torch.no_grad():
                    r = torch.rand(buf.shape, generator=gen, dtype=buf.dtype)
                    buf.copy_(0.5 + r if name == "running_var" else (r - 0.5) * 0.2)
        if "Norm" in type(m).__name__ or "norm" in type(m).__name__:
            for name in ("weight", "bias"):
                p = getattr(m, name, None)
                if isinstance(p, nn.Parameter):
                    with torch.no_grad():
                        r = torch.rand(p.shape, generator=gen, dtype=p.dtype)
                        p.copy_(0.5 + r if name == "weight" else (r - 0.5) * 0.2)
        for name, p in m.named_parameters(recurse=False):  # zero-initialised scales (layer scale, gammas)
            if p.numel() and bool((p == 0).all()) and "bias" not in name:
                with torch.no_grad():
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))


#: Models whose own forward computes part of the model in float32 whatever the input dtype: the
#: float64 comparison then sees float32 rounding (checked: with that cast removed they agree to
#: 1e-15), so they are held to 1e-5 relative, with this reason shown.
FLOAT32_INSIDE = {
    # Every EfficientViT-MIT size (b0-b3, l1-l3): the same LiteMLA.
    "efficientvit_b": "LiteMLA computes its linear attention in float32 (`q.float()`); tolerance 1e-5",
    "efficientvit_l": "LiteMLA computes its linear attention in float32 (`q.float()`); tolerance 1e-5",
}


def _float32_inside(name: str) -> str | None:
    """The reason a model (by table or timm name) computes part of itself in float32, if it does."""
    base = name.split("/")[-1]
    return next((why for prefix, why in FLOAT32_INSIDE.items() if base.startswith(prefix)), None)


def _outputs(y):
    if isinstance(y, torch.Tensor):
        return [y]
    if isinstance(y, dict):
        return [v for v in y.values() if isinstance(v, torch.Tensor)]
    if isinstance(y, (list, tuple)):
        return [v for v in y if isinstance(v, torch.Tensor)]
    return []


#: Models built for one input size (position embeddings, window masks): checked at their table
#: shape exactly, with ``snn.alignment`` probed at that shape (not at the default 1024 probe).
FIXED_SIZE = {"timm/vit_small_patch16_224", "timm/deit_tiny_distilled_patch16_224", "timm/swin_tiny_patch4_window7_224",
              "timm/swinv2_tiny_window8_256", "timm/swinv2_cr_tiny_ns_224", "timm/cait_xxs24_224", "timm/beit_base_patch16_224",
              "timm/eva02_tiny_patch14_224", "timm/vit_relpos_small_patch16_224", "timm/coat_lite_tiny",
              "timm/vit_tiny_r_s16_p8_224", "timm/efficientvit_m0",
              "monai/UNETR-3d"}


def _own_spread(ref: nn.Module, x: torch.Tensor, y_ref: list) -> float:
    """How far torch's own output moves (relative to its scale) when only the summation order
    changes: the model run on a channels-last copy of the input (0 for other ranks of input)."""
    if x.dim() not in (4, 5):
        return 0.0
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    y_cl = _outputs(ref(x.contiguous(memory_format=fmt)))
    err = max(((a - b).abs().max().item() for a, b in zip(y_cl, y_ref) if a.shape == b.shape), default=0.0)
    scale = max((b.abs().max().item() for b in y_ref), default=0.0)
    return err / max(scale, 1e-30)


def _entry(name: str):
    """The table's entry for ``name``, or any other timm model name (3 input channels, 64x32)."""
    return MODELS.get(name) or MODELS.get(f"timm/{name}") or (_timm(name), (1, 3, 64, 32), "timm")


def _check_one(name: str, size_scale: int = 1, batch: int = 1, grid: bool = False) -> dict:
    import sharded_nn as snn

    make, shape, family = _entry(name)
    # ``grid``: a 2x2 domain mesh sharding H and W (both sized for it), instead of 2 ranks on H.
    mesh = snn.init_mesh(domain=(2, 2) if grid else 2, device_type="cpu")
    torch.manual_seed(0)
    ref = make().double().eval()
    randomise_norms(ref)
    dims = (2, 3) if grid else (2,)
    fixed = name in FIXED_SIZE or f"timm/{name}" in FIXED_SIZE
    try:
        aligns = snn.alignment(ref, dims=dims, input_shape=shape if fixed else None)
    except ValueError as e:  # alignment's shape-only forward failed: fall back to the model's stride
        aligns = (32,) * len(dims)
        note = f"snn.alignment failed ({str(e)[:80]}...); align 32 used"
    else:
        note = ""
    align = aligns[0] if not grid else tuple(aligns)
    if max(aligns) > 256:
        return {"model": name, "family": family, "shape": list(shape), "align": align, "status": "skipped",
                "reason": f"snn.alignment(model) = {align} rows: too large an input for this table"}
    if fixed and grid and any(shape[2 + i] // a < 2 for i, a in enumerate(aligns)):
        return {"model": name, "family": family, "shape": list(shape), "align": align, "status": "skipped",
                "reason": f"built for {tuple(shape[2:])} only: fewer than 2 blocks of {align} along a dim of the 2x2 mesh"}
    if not fixed:
        sizes = list(shape[2:])
        for i, a in enumerate(aligns):
            n = max(shape[2 + i], 4 * a)  # deep 5x5 stages need slabs of >= 2 rows at 1/32
            sizes[i] = -(-n // a) * a * (size_scale if i == 0 else 1)
        shape = (*shape[:2], *sizes)
    shape = (batch, *shape[1:])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    out = {"model": name, "family": family, "shape": list(shape), "align": align, "note": note}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = snn.convert(copy.deepcopy(ref), mesh)
        out["warnings"] = [str(w.message)[:300] for w in caught if "Sharding" in type(w.message).__name__]
        with torch.no_grad():
            y_ref = _outputs(ref(x))
            own = _own_spread(ref, x, y_ref)
            x_local = snn.shard(x, mesh, dims=dims, align=align)
            y_loc = _outputs(model(x_local))
            err, scale = 0.0, 0.0
            for a, b in zip(y_loc, y_ref):
                full = a if tuple(a.shape) == tuple(b.shape) and a.dim() < 3 else snn.gather(a, mesh, dims=dims)
                if tuple(full.shape) != tuple(b.shape):
                    raise RuntimeError(f"output shape {tuple(full.shape)} != reference {tuple(b.shape)}")
                err = max(err, (full - b).abs().max().item())
                scale = max(scale, b.abs().max().item())
        rel = err / max(scale, 1e-30)
        f32 = _float32_inside(name)
        tol = 1e-5 if f32 else 1e-9
        if 10 * own > tol:
            # An ill-conditioned model (random weights, norms randomised): torch's own output
            # moves this much when only its summation order does. Held to 10x that, said so.
            tol = 10 * own
            out["note"] = (f"torch's own output moves by {own:.1e} (relative) on a channels-last copy of the input "
                           f"(another summation order): tolerance {tol:.0e}")
        out.update(status="exact" if rel <= tol else "WRONG", max_abs_err=err, rel_err=rel)
        if f32:
            out["note"] = f32
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        out.update(status="refused", reason=f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        out.update(status="error", reason=f"{type(e).__name__}: {e}")
    return out


def run_model(name: str, timeout: float, batch: int = 1, grid: bool = False) -> dict:
    import sharded_nn as snn

    t0 = time.perf_counter()
    try:
        res = snn.launch(_check_one, 4 if grid else 2, name, 1, batch, grid, timeout=timeout, device_type="cpu",
                         threads=1)
    except Exception as e:  # noqa: BLE001 - a hang or a rank-asymmetric failure
        res = {"model": name, "family": _entry(name)[2], "status": "error", "reason": f"{type(e).__name__}: {e}"}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _short(reason: str, n: int = 160) -> str:
    first = reason.replace("\n", " ").replace("|", "/")
    return first if len(first) <= n else first[: n - 3] + "..."


def table(results: list[dict]) -> str:
    lines = ["| model | family | input | outcome | max abs error / reason |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        what = (
            f"{r['max_abs_err']:.1e}" if r["status"] in ("exact", "WRONG") else _short(r.get("reason", ""))
        )
        if r["status"] == "exact" and _float32_inside(r.get("model", "")):
            what += f" ({_float32_inside(r['model'])})"
        shape = "x".join(str(s) for s in r.get("shape", [])[2:])
        lines.append(f"| {r['model']} | {r['family']} | {shape} | {r['status']} | {what} |")
    counts = {s: sum(r["status"] == s for r in results) for s in ("exact", "refused", "WRONG", "error", "skipped")}
    lines.append("")
    lines.append(", ".join(f"{k}: {v}" for k, v in counts.items()) + f" (of {len(results)})")
    return "\n".join(lines)


def _overhead(name: str, size: tuple[int, int], reps: int, guard: bool) -> dict:
    """Median per-forward time of the converted model, with or without the forward guard.

    One model per launch: two differently converted models timed in one process do not measure
    alike even when they run the same code (allocator and cache state; the same model in both
    slots does), so ``main`` alternates separate launches.
    """
    import sharded_nn as snn

    # A name of the table, or any timm model name (e.g. mobilenetv3_large_100): 3 input channels.
    make, shape, _ = _entry(name)
    mesh = snn.init_mesh(domain=2, device_type="cpu")
    torch.manual_seed(0)
    ref = make().eval()
    model = snn.convert(copy.deepcopy(ref), mesh, guard=guard)
    x = snn.shard(torch.randn(1, shape[1], *size), mesh, align=snn.alignment(ref, dims=(2,))[0])
    times, cpu = [], []  # cpu: this thread's CPU time, robust to other jobs on a shared machine
    with torch.no_grad():
        for _ in range(3):
            model(x)  # warm-up
        for _ in range(reps):
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            model(x)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return {"ms": 1e3 * sorted(times)[len(times) // 2], "cpu_ms": 1e3 * sorted(cpu)[len(cpu) // 2]}


def overhead(name: str, size: tuple[int, int], reps: int, rounds: int) -> dict:
    """The guard's per-forward cost: guarded and unguarded launches alternated ``rounds`` times."""
    import sharded_nn as snn

    got: dict = {"guard": [], "no_guard": []}
    for _ in range(rounds):
        for key in got:
            r = snn.launch(_overhead, 2, name, size, reps, key == "guard", device_type="cpu", threads=1)
            got[key].append(r)
    med = {k: sorted(r["ms"] for r in v)[len(v) // 2] for k, v in got.items()}
    cmed = {k: sorted(r["cpu_ms"] for r in v)[len(v) // 2] for k, v in got.items()}
    return {"model": name, "size": "x".join(map(str, size)), "launches": rounds,
            **{f"{k}_ms": round(v, 2) for k, v in med.items()},
            "per_launch_ms": {k: [round(r["ms"], 2) for r in v] for k, v in got.items()},
            "overhead_ms": round(med["guard"] - med["no_guard"], 2), "ratio": round(med["guard"] / med["no_guard"], 3),
            **{f"{k}_cpu_ms": round(v, 2) for k, v in cmed.items()}, "cpu_ratio": round(cmed["guard"] / cmed["no_guard"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names of the table or any timm model (default: the table)")
    ap.add_argument("--out", default="bench/compat.md")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--batch", type=int, default=1, help="samples per input (the table: 1); the batch stays whole")
    ap.add_argument("--mesh", default="2", choices=["2", "2x2"],
                    help="domain mesh: 2 ranks sharding H (the table), or 2x2 sharding H and W (4 processes)")
    ap.add_argument("--overhead", default="", help="model name: time the guard's per-forward overhead instead")
    ap.add_argument("--size", default="224", help="input H x W for --overhead: 224 or 512x256")
    ap.add_argument("--reps", type=int, default=20, help="--overhead: forwards timed per launch")
    ap.add_argument("--rounds", type=int, default=3, help="--overhead: launches of each kind, alternated")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch: expected a positive number of samples, got {args.batch}")
    if args.overhead:
        try:
            hw = tuple(int(v) for v in args.size.lower().split("x"))
            size = hw * 2 if len(hw) == 1 else hw
            assert len(size) == 2 and min(size) > 0
        except (ValueError, AssertionError):
            ap.error(f"--size: expected H or HxW (e.g. 224 or 512x256), got {args.size!r}")
        from sharded_nn.errors import ShardingError

        try:
            print(json.dumps(overhead(args.overhead, size, args.reps, args.rounds)))
        except ShardingError as e:  # e.g. a model with squeeze-excite blocks, exact only under the guard
            ap.exit(2, f"--overhead {args.overhead}: cannot time it without the guard: {str(e).splitlines()[0]}\n")
        return 0
    names = [n for n in args.models.split(",") if n] or list(MODELS)
    results = []
    for name in names:
        r = run_model(name, args.timeout, args.batch, args.mesh == "2x2")
        print(json.dumps({k: v for k, v in r.items() if k != "warnings"})[:400], flush=True)
        results.append(r)
    md = table(results)
    print(md)
    with open(args.out, "w") as f:
        f.write(md + "\n")
    with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
        json.dump(results, f, indent=1)
    return 1 if any(r["status"] == "WRONG" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
del math
