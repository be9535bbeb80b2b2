"""One prepared check for a machine with one NVIDIA GPU (issue 12 item 5).

Three parts, each printed as a Markdown table and written to ``--out`` (JSON):

1. **NCCL at world size 1**: ``sharded_nn.init_mesh(device_type="cuda")`` in a one-process
   group must pick NCCL; each zoo model (small sizes) runs forward and backward through the
   sharded path on it and is checked against the plain model on the same GPU.
2. **CUDA attention kernels inside ring attention**: ``snn.functional.ring_attention`` with the
   fused block kernel (``sharded_nn.attention_kernels``; the CUDA memory-efficient kernel behind
   its one-time self-check) against the blocked math path, for float32 / bfloat16 / float16,
   with and without key padding, causal and not: output and q/k/v gradients, and whether the
   fused kernel was really used.
3. **CUDA peak memory against the planner**: each zoo model at a moderate size, forward and
   backward of the plain model at P=1, ``torch.cuda.max_memory_allocated`` growth above the
   model and input, against ``snn.plan_memory``'s P=1 activation prediction (its peak less
   parameters and input, as ``bench/run.py`` compares on CPU).
4. **What the sharded path costs on a GPU at world size 1** (issue 16's per-call overhead, where
   kernels take microseconds and Python does not shrink with them): a 16x64x64 ``Conv2d`` plain
   against ``ShardedConv2d`` and a converted two-layer model, per forward call; each zoo model's
   training step plain against sharded; and two timm CNNs converted with ``snn.convert`` (the
   forward guard on every call), forward at 1024x512. Times are medians of synchronised runs.
5. **Stream synchronisations in a training step** (``torch.cuda.set_sync_debug_mode``): each zoo
   model's forward, loss and backward, plain against sharded at world size 1; the sharded step
   must not synchronise more often than the plain one (a synchronisation stalls the host until
   the GPU drains, and the next kernels wait for the host). Where it does, the first frames in
   ``sharded_nn``/``zoo`` are printed.
6. **The sharded layers' multi-rank code on the device**: at world size 1 the layers run torch's
   own (a one-rank mesh has nothing to exchange), so parts 1-5 never reach the halo convolutions
   and the sharded norms' kernels on CUDA. Here every layer is forced onto its multi-rank path
   (halo exchange with no neighbours, norms' statistics through their all-reduce) and the zoo
   CNN, UNet and Transolver and two converted timm CNNs in training mode (depthwise convolutions, batch
   norms on batch statistics, squeeze-excite, channels-last LayerNorm2d) are checked in float64
   against the plain models: output, input gradient and parameter gradients.
7. **The same under ``torch.autocast`` to bfloat16**: ours and the plain model under the same
   autocast are each compared with the plain model in float64; ours may be at most twice as far
   off (the low precision, not the sharding, sets the error).

Run it from the repository root on the GPU machine::

    python bench/gpu_check.py --out gpu_check.json

Without a GPU it runs the same code on the CPU with gloo (``--allow-cpu``, a dry run of the
script itself: part 2 then compares the CPU flash kernel with the math path, part 3 measures the
resident-set growth), so the script is known to work before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sharded_nn as snn  # noqa: E402
from sharded_nn import attention_kernels, demo  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process_group() -> None:
    """A world of one, as torchrun would set it up, so that ``init_mesh`` chooses the backend."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")  # fmt: skip


def check_backend(device_type: str) -> list[dict]:
    """Part 1: every zoo model through the sharded path at world size 1 against the plain model."""
    rows = []
    cases = [("cnn", 32, None), ("vit", 256, 2), ("unet", 128, None), ("transolver", 4096, 2)]
    for model, size, depth in cases:
        cfg = demo.DemoConfig(model=model, size=size, depth=depth, nproc=1)
        ref = demo.rank_step(cfg, sharded=False)
        got = demo.rank_step(cfg, sharded=True)
        diffs, tols, ok = demo.compare(cfg, ref, got)
        rows.append({"model": model, "size": size, "backend": got["backend"], "max_diff": max(diffs.values()),
                     # each quantity against its own tolerance (demo.compare): the worst fraction of it
                     "diff/tolerance": max(diffs[k] / tols[k] for k in diffs), "ok": ok and got["backend"] == ("nccl" if device_type == "cuda" else "gloo")})
    return rows


def _attention_case(device, dtype, masked, causal, mesh):
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 4, 300, 64

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    pad = None
    if masked:
        pad = torch.rand(b, n, generator=g) < 0.2
        pad[:, 0] = False
        pad = pad.to(device)
    dout = torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype)
    # ``return_lse`` keeps the ring's block path at world size 1 (without it, a one-rank ring
    # calls torch's own attention and the block kernels under test would not run).
    out, _lse = snn.functional.ring_attention(q, k, v, mesh, causal, key_padding_mask=pad, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [out.detach(), *grads]


def check_attention(device_type: str, mesh) -> list[dict]:
    """Part 2: the fused block kernel against the blocked math path inside ring attention."""
    device = torch.device(device_type)
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device_type == "cuda" else (torch.float32,)
    rows = []
    for dtype in dtypes:
        for masked in (False, True):
            for causal in (False, True):
                attention_kernels._CHECKED.clear()
                fused = _attention_case(device, dtype, masked, causal, mesh)
                used = any(ok for key, ok in attention_kernels._CHECKED.items() if key[1] == dtype)
                used = used or (device_type == "cpu" and attention_kernels._use_cpu_flash(fused[0], fused[0]))
                saved = dict(attention_kernels._CHECKED_KERNELS)
                attention_kernels._CHECKED_KERNELS.clear()  # no fused kernel: the math path
                orig_cpu = attention_kernels._use_cpu_flash
                attention_kernels._use_cpu_flash = lambda q, v: False
                try:
                    math = _attention_case(device, dtype, masked, causal, mesh)
                finally:
                    attention_kernels._CHECKED_KERNELS.update(saved)
                    attention_kernels._use_cpu_flash = orig_cpu
                err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                          for a, b in zip(fused, math))
                tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
                rows.append({"dtype": str(dtype).replace("torch.", ""), "key_padding": masked, "causal": causal,
                             "fused_used": used, "max_rel_err": err, "ok": used and err <= tol})
    return rows


def check_memory(device_type: str) -> list[dict]:
    """Part 3: measured P=1 activation peak of each zoo model against the planner's prediction."""
    os.environ["SNN_DEMO_DEVICE"] = device_type
    big = device_type == "cuda"
    cases = [("vit", 1024 if big else 256, None if big else 2), ("unet", 1024 if big else 256, None),
             ("transolver", 262144 if big else 8192, None if big else 2), ("cnn", 128 if big else 32, None)]
    rows = []
    for model, size, depth in cases:
        cfg = demo.DemoConfig(model=model, size=size, depth=depth, nproc=1)
        measured = demo.rank_step(cfg, sharded=False)["mem"][0]
        plain = demo.build_model(cfg, None)
        _, shape = demo.describe(cfg)
        if model == "transolver":
            plan = snn.plan_memory(plain, shape, max_ranks=1, dims=1, input_kwargs={"embedding": shape})
        else:
            plan = snn.plan_memory(plain, shape, max_ranks=1, dims=2)
        planned = (plan.peak(1) - plan.param_bytes - plan.input_bytes[0]) / 2**20
        rows.append({"model": model, "size": size, "measured_mib": measured, "planned_mib": planned,
                     "ratio": planned / measured if measured else float("nan")})
    return rows


def _median_ms(fn, device_type: str, calls: int = 20, runs: int = 15) -> float:
    """Median over ``runs`` of the time per call of ``calls`` back-to-back calls, synchronised."""
    import statistics

    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e3


def check_latency(device_type: str, mesh) -> list[dict]:
    """Part 4: plain against sharded at world size 1 on the same device (ratio > 1: ours slower)."""
    import copy

    from torch import nn

    device = torch.device(device_type)
    rows = []

    def row(case, plain_ms, ours_ms):
        rows.append({"case": case, "plain_ms": plain_ms, "sharded_ms": ours_ms, "ratio": ours_ms / plain_ms})

    torch.manual_seed(0)
    plain = nn.Conv2d(16, 16, 3, padding=1).to(device)
    sharded = snn.ShardedConv2d(16, 16, 3, padding=1, mesh=mesh, dims=(2,)).to(device)
    sharded.load_state_dict(plain.state_dict())
    two = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)).to(device)
    two_sharded = snn.convert(copy.deepcopy(two), mesh)
    x = torch.randn(1, 16, 64, 64, device=device)
    with torch.no_grad():
        row("Conv2d 16x64x64 fwd", _median_ms(lambda: plain(x), device_type),
            _median_ms(lambda: sharded(x), device_type))
        row("2 x Conv2d converted fwd", _median_ms(lambda: two(x), device_type),
            _median_ms(lambda: two_sharded(x), device_type))
    for model, size in (("vit", 1024 if device_type == "cuda" else 256), ("unet", 512 if device_type == "cuda" else 128),
                        ("transolver", 262144 if device_type == "cuda" else 8192)):
        cfg = demo.DemoConfig(model=model, size=size, nproc=1, repeat=5,
                              depth=None if device_type == "cuda" else 2)
        plain_s = demo.rank_step(cfg, sharded=False)["seconds"]
        ours_s = demo.rank_step(cfg, sharded=True)["seconds"]
        row(f"{model} {size} fwd+bwd step", plain_s * 1e3, ours_s * 1e3)
    try:
        import timm
    except ImportError:
        return rows
    h, w = (1024, 512) if device_type == "cuda" else (256, 128)
    x = torch.randn(1, 3, h, w, device=device)
    for name in ("resnet50", "efficientnet_b0"):
        torch.manual_seed(0)
        ref = timm.create_model(name, pretrained=False).to(device).eval()
        ours = snn.convert(copy.deepcopy(ref), mesh).eval()
        with torch.no_grad():
            err = (ours(x) - ref(x)).abs().max().item()
            row(f"timm {name} {h}x{w} fwd (max diff {err:.1e})", _median_ms(lambda: ref(x), device_type, 5, 9),
                _median_ms(lambda: ours(x), device_type, 5, 9))
    return rows


def _count_syncs(step, device_type: str) -> tuple[int, list[str]]:
    """Synchronising CUDA calls made by one ``step()``, and where in sharded_nn / zoo they were."""
    import traceback
    import warnings

    if device_type != "cuda":
        step()
        return 0, []
    places: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")

        def note(*_args, **_kwargs):
            ours = [f for f in traceback.extract_stack()[:-1] if "sharded_nn" in f.filename or "/zoo/" in f.filename]
            places.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in ours[::-1][:3]) or "(torch/timm)")

        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return len(places), sorted(set(places))


def check_syncs(device_type: str, mesh) -> list[dict]:
    """Part 5: stream synchronisations of one training step, plain against sharded."""
    rows = []
    sizes = {"vit": 256, "unet": 128, "transolver": 4096, "cnn": 32}
    for model, size in sizes.items():
        counts = {}
        for sharded in (False, True):
            cfg = demo.DemoConfig(model=model, size=size, depth=2 if model in ("vit", "transolver") else None, nproc=1)
            m = mesh if sharded else None
            net = demo.build_model(cfg, m).to(device_type)
            x = demo.global_input(cfg).to(device_type).requires_grad_()

            def step(net=net, x=x, m=m):
                out = net(x, embedding=x.detach()) if model == "transolver" else net(x)
                loss = out.float().square().mean()  # plain and replicated alike; no host numbers
                (loss if m is None else snn.losses.share(loss, m)).backward()

            step()
            step()
            counts[sharded] = _count_syncs(step, device_type)
        rows.append({"model": model, "plain_syncs": counts[False][0], "sharded_syncs": counts[True][0],
                     "where": "; ".join(counts[True][1]) or "-", "ok": counts[True][0] <= counts[False][0]})
    return rows


def check_forced(device_type: str, mesh, autocast: torch.dtype | None = None) -> list[dict]:
    """Part 6: every sharded layer on its multi-rank path at world size 1, float64, against torch.

    Part 7 (``autocast``): the same in float32 under ``torch.autocast`` to ``autocast``, where the
    plain model under the same autocast is itself off from float64 by the low precision: each is
    compared with the plain model in float64, and ours must be no more than twice as far off.
    """
    from sharded_nn.layers.base import ShardedMixin

    import copy

    def zoo_case(model, size):
        cfg = demo.DemoConfig(model=model, size=size, nproc=1, dtype="float64", depth=2 if model == "transolver" else None)
        return (demo.build_model(cfg, None), demo.build_model(cfg, mesh), demo.global_input(cfg))

    def timm_case(name, channels_last=False):
        import timm

        torch.manual_seed(0)
        # BatchNorm on batch statistics; no dropout (its draws would differ between the two models).
        plain = timm.create_model(name, pretrained=False, drop_rate=0.0).train()
        x = torch.randn(2, 3, 64, 48, dtype=torch.float64)
        if channels_last:  # the norms' per-channel statistics then read strided slabs in place
            plain, x = plain.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        return plain, snn.convert(copy.deepcopy(plain), mesh), x

    cases = [("cnn 32^3", lambda: zoo_case("cnn", 32)), ("unet 128^2", lambda: zoo_case("unet", 128)),
             ("transolver 4096 points", lambda: zoo_case("transolver", 4096)),
             ("timm efficientnet_b0 train 2x3x64x48", lambda: timm_case("efficientnet_b0")),
             ("timm efficientnet_b0 train, channels-last", lambda: timm_case("efficientnet_b0", True)),
             ("timm convnext_atto train 2x3x64x48", lambda: timm_case("convnext_atto"))]
    rows = []
    for model, make in cases:
        ref, ours, x = make()
        exact = copy.deepcopy(ref).to(device_type, torch.float64)
        dtype = torch.float64 if autocast is None else torch.float32
        ref, ours = ref.to(device_type, dtype), ours.to(device_type, dtype)
        forced = 0
        for m in ours.modules():
            if isinstance(m, ShardedMixin) and getattr(m, "_local_only", False):
                m._local_only, forced = False, forced + 1
                if hasattr(m, "_stats_local"):
                    m._stats_local = False
        x = x.to(device_type)

        def run(net, inp):
            inp = inp.to(torch.float64 if net is exact else dtype).clone().requires_grad_()
            kw = {"embedding": inp.detach()} if model.startswith("transolver") else {}
            with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None and net is not exact):
                y = net(inp, **kw)
            y.double().square().sum().backward()
            # Parameter gradients as one vector: a bias before a training-mode batch norm has a
            # zero gradient mathematically, so per-tensor relative errors would compare noise.
            grads = torch.cat([p.grad.double().flatten() for p in net.parameters() if p.grad is not None])
            return [y.detach().double(), inp.grad.double(), grads]

        def rel(a, b):
            return max(((u - v).abs().max() / v.abs().max().clamp_min(1e-300)).item() for u, v in zip(a, b))

        want, got = run(exact, x), run(ours, x)
        if autocast is None:
            err = rel(got, want)
            rows.append({"model": model, "layers_forced": forced, "max_rel_err": err, "ok": forced > 0 and err < 1e-9})
        else:
            err, base = rel(got, want), rel(run(ref, x), want)
            rows.append({"model": model, "layers_forced": forced, "ours_vs_float64": err, "plain_vs_float64": base,
                         "ok": forced > 0 and err <= 2 * base + 1e-3})
    return rows


def _table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--allow-cpu", action="store_true", help="dry run on the CPU (gloo) without a GPU")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: no CUDA device; run on a GPU machine, or pass --allow-cpu for a dry run.")
        return 2
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ["SNN_DEMO_DEVICE"] = device_type
    _one_process_group()
    t0 = time.perf_counter()
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device_type == "cuda" else "cpu",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device_type == "cuda" else None}
    print("environment:", info)
    backend = check_backend(device_type)
    print("\n## 1. backend at world size 1 (sharded path against the plain model)\n\n" + _table(backend))
    mesh = snn.init_mesh(device_type=device_type)
    attention = check_attention(device_type, mesh)
    print("\n## 2. ring attention: fused block kernel against the math path\n\n" + _table(attention))
    memory = check_memory(device_type)
    print("\n## 3. peak activation memory at P=1: measured against plan_memory\n\n" + _table(memory))
    try:
        latency = check_latency(device_type, mesh)
    except Exception as exc:  # noqa: BLE001 - a timing part must not hide the checks above
        import traceback

        traceback.print_exc()
        latency = [{"case": "error", "error": repr(exc)}]
    print("\n## 4. plain against sharded at world size 1 (ratio > 1: the sharded path is slower)\n\n"
          + _table(latency))
    syncs = check_syncs(device_type, mesh)
    print("\n## 5. stream synchronisations in one training step at world size 1\n\n" + _table(syncs))
    forced = check_forced(device_type, mesh)
    print("\n## 6. the sharded layers' multi-rank path at world size 1 (float64, against torch)\n\n" + _table(forced))
    mixed = check_forced(device_type, mesh, autocast=torch.bfloat16)
    print("\n## 7. the same under autocast to bfloat16 (each against the plain model in float64)\n\n" + _table(mixed))
    ok = all(r["ok"] for r in backend + attention + syncs + forced + mixed)
    print(f"\nall checks {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
    Path(args.out).write_text(json.dumps({"info": info, "backend": backend, "attention": attention,
                                          "memory": memory, "latency": latency, "syncs": syncs, "forced": forced, "autocast": mixed, "ok": ok}, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
