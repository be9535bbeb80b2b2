"""timm CNNs at moderate resolutions: plain timm at P=1 against the converted model at P=2.

Issue 16: per-layer latency, not bytes, decides the speedup of modern CNNs at one to four
megapixels. For each model and input size this measures, one thread per rank, in separate
``snn.launch`` runs (so each process's allocator and caches are its own):

* **forward**: ``model.eval()`` under ``torch.no_grad()``;
* **forward+backward**: ``model.train()`` (BatchNorm statistics over the whole sample: the
  sharded BatchNorm all-reduces them), drop rates 0 so the output is deterministic, loss = the
  sum of the logits weighted by fixed random numbers.

P=1 is plain timm (``timm.create_model(name, num_classes=10, drop_rate=0, drop_path_rate=0)``,
randomly initialised with a fixed seed; models timm builds for one input size, such as Swin,
with ``img_size=(H, W)``); P=2 is ``snn.convert`` of the same model, the ``(1, 3, H, W)`` input
sharded on H with the model's alignment (``snn.alignment`` at that input shape). Times are
the median of ``--iters`` steps after one warm-up (more for short steps: about
``--min-seconds`` of steps, at most 30), slowest rank; steps shorter than a quarter second run
back to back in at least five groups, one barrier before each group (as a training loop runs
them: no barrier between steps), and the median is over the groups' time per step. Checked: P=1 and P=2 logits
(eval mode) and the domain-summed gradient of the first convolution's weight (train step)
against plain timm in float64 at P=1 (relative error, max |diff| / max |reference|), so the
table shows the error of the sharded model next to plain timm's own float32 error. The gradient
of a ReLU network is discontinuous where a ReLU input is within rounding of zero: one such
position flipped by a different summation order moves ``mobilenetv3_large_100``'s first-layer
gradient by ~1e-3 at P=2 or at P=1 alike (``tests/test_cnn_precision.py``); in float64 P=2
matches plain timm to ~1e-13. ``--no-f64`` skips the float64 reference run.

Targets (issue 16): >= 1.6x at 1024x512 and >= 1.85x at 2048x1024 for every model, forward and
forward+backward; never slower than one process at 512x256.

Run from the repository root::

    python bench/cnn.py                                     # 5 models x 3 sizes (long)
    python bench/cnn.py --models regnetx_002 --sizes 512x256 --iters 2   # quick
    python bench/cnn.py --models efficientnet_b0 --sizes 512x256 --transport both   # transport A/B
    python bench/cnn.py --sizes 512x256 --cap   # also the host's cap (below)

``--cap`` adds a third launch per cell: two processes, each running *plain* timm on its own slab
(the slab the sharded model's rank holds) at the same time, with no message between them. P=1's
time over that is what this host allows a perfect domain-parallel P=2 (cache and memory
bandwidth shared, small kernels that do not halve); the sharded run's distance to it is the
library's cost.

``--transport gloo`` sets ``SHARDED_NN_TRANSPORT=gloo`` in the P=2 ranks (every message through
gloo); ``both`` runs P=2 once with each and prints a row per variant.

Two environments (``--env``):

* ``launch`` (the default): P=1 and P=2 both run under ``snn.launch``, so plain timm at P=1 gets
  sharded_nn's host allocator too (the host cache, ``sharded_nn.host_cache``) and the ratio is the
  domain split's alone.
* ``user``: the way a user measures (and the way issue 16 measured): P=1 is plain timm in a
  fresh ``python`` process in the user's default environment (one thread, no allocator
  variables, sharded_nn's process tuning off: a process that never imported it), P=2 is ours
  under ``python -m torch.distributed.run --standalone --nproc_per_node 2`` in that same
  environment, with what the library sets for itself (``init_mesh`` installs the host cache on
  CPU meshes) and nothing else. Errors are P=2 against that P=1 (no float64 run). ``--cap``'s
  two processes then run in P=1's environment (plain allocator), under torchrun.
  The ratio then includes what plain timm pays for its allocator (page faults on fresh buffers,
  the more the larger the activations) that our ranks do not.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sharded_nn as snn  # noqa: E402

MODELS = ("convnext_atto", "regnetx_002", "efficientnet_b0", "mobilenetv3_large_100", "resnet50")
SIZES = ("512x256", "1024x512", "2048x1024")
TARGETS = {"512x256": 1.0, "1024x512": 1.6, "2048x1024": 1.85}
SEED = 0


def _build(name: str, h: int, w: int):
    import timm

    torch.manual_seed(SEED)
    # Models built for one input size (Swin: its window masks; ViTs: position embeddings) are
    # built for this one, as a user fine-tuning at the resolution would.
    fixed = timm.models.get_pretrained_cfg(name) is not None and timm.models.get_pretrained_cfg(name).fixed_input_size
    kw = {"img_size": (h, w)} if fixed else {}
    return timm.create_model(name, num_classes=10, drop_rate=0.0, drop_path_rate=0.0, **kw)


def _median_time(fn, iters: int, sync, min_seconds: float = 0.0) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()  # warm-up (the only run when iters == 0: the float64 reference)
    if iters == 0:
        return float("nan"), out
    # Short steps are timed more often (up to _MAX_ITERS, about ``min_seconds`` in all): one
    # slow step of a noisy host moves a median of 3 a lot at 30-500 ms a step. The count is
    # agreed (the slowest rank's warm-up) so that every rank runs the same steps.
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    warm = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if distributed:
        dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    iters = max(iters, min(_MAX_ITERS, math.ceil(min_seconds / max(warm.item(), 1e-6))))
    # Steps run back to back, as in a user's loop, in groups that start together (one barrier
    # before each group, none inside): a barrier after every step would add a gloo round trip
    # (0.5-1 ms on a 2-vCPU host) to each P=2 step that no training loop pays, several percent
    # of a 20 ms step. Per group, the slowest rank's time per step; the median over groups.
    group = max(1, min(iters // _MIN_GROUPS, math.floor(_GROUP_SECONDS / max(warm.item(), 1e-6))))
    times = []
    for _ in range(math.ceil(iters / group)):
        sync()
        t0 = time.perf_counter()
        for _ in range(group):
            out = fn()
        times.append((time.perf_counter() - t0) / group)
    if distributed:
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
    return statistics.median(times), out


#: Steps shorter than this many seconds are timed in groups run back to back (``_median_time``).
_GROUP_SECONDS = 0.25
#: At least this many groups per measurement, the median taken over them.
_MIN_GROUPS = 5
#: Most timed steps per measurement (``--min-seconds``).
_MAX_ITERS = 30


def rank_main(
    name: str,
    h: int,
    w: int,
    iters: int,
    sharded: bool,
    dtype: torch.dtype = torch.float32,
    transport: str = "local",
    min_seconds: float = 0.0,
    cap: bool = False,
) -> dict:
    # Read by the communication layer at every call: "gloo" sends every message through gloo
    # (the A/B of the same-host transport, ``--transport``).
    os.environ["SHARDED_NN_TRANSPORT"] = transport
    model = _build(name, h, w).to(dtype)
    x_full = torch.randn(1, 3, h, w, generator=torch.Generator().manual_seed(SEED + 1)).to(dtype)
    weights = torch.randn(1, 10, generator=torch.Generator().manual_seed(SEED + 2)).to(dtype)
    mesh = None
    if sharded:
        mesh = snn.init_mesh(domain=dist.get_world_size())
        align = snn.alignment(model, 2, input_shape=(1, 3, h, w))
        x = x_full[snn.local_slices(x_full.shape, mesh, dims=(2,), align=align)].clone()
        if cap:
            # The host's cap: each rank runs the *plain* model on its own slab, with no message
            # between the ranks (only the timing's barriers), at the same time as the other. The
            # timing below takes the slowest rank's time as for the sharded run; the outputs are
            # not compared.
            mesh = None
        else:
            # convert installs the layout scope: layouts agreed once per forward, on the input.
            model = snn.convert(model, mesh)
    else:
        x = x_full
    del x_full
    sync = dist.barrier if dist.is_initialized() and dist.get_world_size() > 1 else (lambda: None)
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))

    def forward():
        with torch.no_grad():
            return model(x)

    def train_step():
        model.zero_grad(set_to_none=True)
        loss = (model(x) * weights).sum()
        (snn.losses.share(loss, mesh) if mesh is not None else loss).backward()
        return first_conv.weight.grad.clone()

    model.eval()
    t_fwd, logits = _median_time(forward, iters, sync, min_seconds)
    model.train()
    t_step, grad = _median_time(train_step, iters, sync, min_seconds)
    if mesh is not None:
        times = torch.tensor([t_fwd, t_step], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        t_fwd, t_step = times.tolist()
        dist.all_reduce(grad)  # parameter gradients are per-rank partial sums
    return {"fwd": t_fwd, "step": t_step, "logits": logits.double(), "grad": grad.double()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _measure_user(name: str, h: int, w: int, args) -> tuple[dict, dict, dict | None]:
    """``--env user``: (plain timm at P=1 in a fresh process, ours at P=2 under torchrun, and with
    ``--cap`` the host's cap: plain timm on each rank's slab at once, in P=1's environment)."""
    from bench.user_env import launch_as_user

    one = launch_as_user(rank_main, 1, name, h, w, args.iters, False, torch.float32, "local", args.min_seconds,
                         timeout=args.timeout)  # fmt: skip
    two = launch_as_user(rank_main, 2, name, h, w, args.iters, True, torch.float32, "local", args.min_seconds,
                         timeout=args.timeout)  # fmt: skip
    cap = None
    if args.cap:
        cap = launch_as_user(rank_main, 2, name, h, w, args.iters, True, torch.float32, "local", args.min_seconds,
                             True, timeout=args.timeout, plain=True)  # fmt: skip
    return one, two, cap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help="HxW, e.g. 1024x512")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per measurement, at least")
    parser.add_argument(
        "--min-seconds", type=float, default=2.0,
        help=f"time shorter steps more often, up to {_MAX_ITERS} (about this many seconds per measurement; 0: --iters)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--no-f64", action="store_true", help="skip the float64 reference (errors against P=1)")
    parser.add_argument(
        "--transport", choices=("local", "gloo", "both"), default="local",
        help="P=2 messages: the same-host transport (default), gloo only, or both (one P=2 run each, A/B)",
    )
    parser.add_argument(
        "--cap", action="store_true",
        help="also time the host's cap: two processes each running plain timm on its own slab at once, no messages",
    )
    parser.add_argument(
        "--env", choices=("launch", "user"), default="launch",
        help="launch: P=1 and P=2 under snn.launch (the split alone); user: plain timm in a fresh default process "
        "against ours under torchrun (see the module docstring)",
    )
    args = parser.parse_args(argv)
    if args.env == "user" and args.transport != "local":
        parser.error("--env user measures the default transport only")
    rows = []
    ref_tag = "P=1" if args.no_f64 or args.env == "user" else "float64"
    for size in args.sizes:
        h, w = (int(v) for v in size.split("x"))
        for name in args.models:
            if args.env == "user":
                ref, got, cap = _measure_user(name, h, w, args)
                err = f"P=2 {_rel(got['logits'], ref['logits']):.1e}/{_rel(got['grad'], ref['grad']):.1e}"
                rows.append((name, size, ref, got, err, cap))
                print(f"{name} {size}: fwd {ref['fwd']:.3f}/{got['fwd']:.3f} s, fwd+bwd {ref['step']:.3f}/{got['step']:.3f} s, "
                      f"rel. err vs P=1 (logits/grad) {err}", flush=True)  # fmt: skip
                continue
            ref = snn.launch(
                rank_main, 1, name, h, w, args.iters, False, torch.float32, "local", args.min_seconds, threads=1,
                timeout=args.timeout,
            )
            variants = ("local", "gloo") if args.transport == "both" else (args.transport,)
            runs = {
                t: snn.launch(
                    rank_main, 2, name, h, w, args.iters, True, torch.float32, t, args.min_seconds, threads=1,
                    timeout=args.timeout,
                )
                for t in variants
            }
            got = runs[variants[0]]
            cap = None
            if args.cap:
                cap = snn.launch(
                    rank_main, 2, name, h, w, args.iters, True, torch.float32, "local", args.min_seconds, True,
                    threads=1, timeout=args.timeout,
                )
            if args.no_f64:
                exact = ref
            else:
                exact = snn.launch(rank_main, 1, name, h, w, 0, False, torch.float64, threads=1, timeout=args.timeout)
            errs = {
                tag: (_rel(run["logits"], exact["logits"]), _rel(run["grad"], exact["grad"]))
                for tag, run in (("P=1", ref), ("P=2", got))
            }
            err = " ".join(f"{tag} {lo:.1e}/{gr:.1e}" for tag, (lo, gr) in errs.items() if tag != ref_tag)
            for t, run in runs.items():
                label = name if len(runs) == 1 else f"{name} ({t})"
                if run is not got:
                    lo, gr = _rel(run["logits"], exact["logits"]), _rel(run["grad"], exact["grad"])
                    err = f"P=2 {lo:.1e}/{gr:.1e}"
                    if not args.no_f64:
                        err = f"P=1 {errs['P=1'][0]:.1e}/{errs['P=1'][1]:.1e} {err}"
                rows.append((label, size, ref, run, err, cap))
                capped = "" if cap is None else f", host cap (plain halves at once) {cap['fwd']:.3f}/{cap['step']:.3f} s"
                print(f"{label} {size}: fwd {ref['fwd']:.3f}/{run['fwd']:.3f} s, "
                      f"fwd+bwd {ref['step']:.3f}/{run['step']:.3f} s, "
                      f"rel. err vs {ref_tag} (logits/grad) {err}{capped}", flush=True)  # fmt: skip
    cap_head = " host cap fwd / fwd+bwd |" if args.cap else ""
    if args.env == "user":
        print("\nP=1: plain timm in a fresh process, default environment; P=2: ours under torchrun, default environment")
    print(f"\n| model | size | fwd P=1 (s) | fwd P=2 (s) | speedup | fwd+bwd P=1 (s) | fwd+bwd P=2 (s) | speedup | "
          f"rel. error vs {ref_tag} (logits/grad) | target |{cap_head}")  # fmt: skip
    print("| --- " * (11 if args.cap else 10) + "|")
    for name, size, ref, got, err, cap in rows:
        s1, s2 = ref["fwd"] / got["fwd"], ref["step"] / got["step"]
        t = TARGETS.get(size)
        mark = "n/a" if t is None else ("PASS" if min(s1, s2) >= t else "MISS") + f" ({t}x)"
        cap_cell = "" if cap is None else f" {ref['fwd'] / cap['fwd']:.2f}x / {ref['step'] / cap['step']:.2f}x |"
        print(f"| {name} | {size} | {ref['fwd']:.3f} | {got['fwd']:.3f} | {s1:.2f}x | {ref['step']:.3f} | "
              f"{got['step']:.3f} | {s2:.2f}x | {err} | {mark} |{cap_cell}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
