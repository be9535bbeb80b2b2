"""The demo job behind ``sharded-nn demo``: one sample split over P processes equals P=1.

Each case builds a zoo model twice from the same seed, runs one forward and backward step at
P=1 (the plain model, one process) and at P=``nproc`` (the converted model, each rank holding
only its slab of the sample), and compares the output, the input gradient and the parameter
gradients. Each run is a separate ``sharded_nn.launch`` so that each process's memory
high-water mark belongs to that run alone.

Peak memory per rank: on CPU, the peak resident memory of the step above the resident memory
just after the model and the input were built (:class:`PeakRSS`: the kernel's high-water mark,
reset at that point), so replicated weights and the import of torch are not counted; on CUDA,
``torch.cuda.max_memory_allocated`` above the allocation at the same point.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the demo runs inside the given world with its
backend (NCCL on GPUs): the sharded step runs on every rank, then rank 0 runs the P=1 reference in
its own process; on CPU its memory is then not measurable (the high-water mark is shared) and is
reported as ``None``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import host_cache

#: model name -> (default size, what --size means)
MODELS: dict[str, tuple[int, str]] = {
    "vit": (1024, "image side in pixels (a multiple of 16)"),
    "unet": (512, "image side in pixels (a multiple of 4)"),
    "transolver": (65536, "number of points"),
    "cnn": (64, "cube side (a multiple of 2)"),
    "fno": (512, "grid side in points (a multiple of 16)"),
    "meshgraphnet": (160, "side of the triangulated grid (nodes = side^2)"),
}
SEED = 1234


@dataclass
class DemoConfig:
    """What to run. ``depth`` shrinks the ViT, Transolver, FNO or MeshGraphNet (its steps; ``None``: the defaults)."""

    model: str = "vit"
    nproc: int = 2
    size: int | None = None
    depth: int | None = None
    dtype: str = "float32"
    out: str = "sharded_nn_demo"
    #: steps per run; the time reported is the fastest (>1: the first step's one-time costs drop out)
    repeat: int = 1

    def resolved_size(self) -> int:
        return MODELS[self.model][0] if self.size is None else self.size


@dataclass
class RunRecord:
    """One run at P ranks: per-rank peak memory (MiB), the step time (s, slowest rank)."""

    nproc: int
    mem_mib: list[float | None]
    seconds: float


@dataclass
class DemoRecord:
    """What the demo measured; written as JSON."""

    model: str
    description: str
    size: int
    input_shape: list[int]
    dtype: str
    backend: str
    runs: list[RunRecord] = field(default_factory=list)
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    #: The largest of ``tolerances`` (each difference is checked against its own).
    tolerance: float = 0.0
    #: Per compared quantity: the relative tolerance times that quantity's largest reference value.
    tolerances: dict[str, float] = field(default_factory=dict)
    ok: bool = False


def maxrss_mib() -> float:
    """This process's resident-memory high-water mark in MiB (Linux reports KiB)."""
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024  # macOS reports bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def _proc_status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError(f"/proc/self/status has no {key}")


class PeakRSS:
    """The peak resident memory of a step above the resident memory at its start, in MiB.

    On Linux the kernel's high-water mark (``VmHWM``) is reset to the current resident size by
    writing ``5`` to ``/proc/self/clear_refs``, so the peak belongs to the step alone. Where that
    is unavailable, the growth of ``ru_maxrss`` is the fallback, which undercounts: it starts at
    the highest mark reached so far, and a process started by spawn inherits its parent's mark
    (exec keeps the old image's high-water mark in ``ru_maxrss``), which hid 65 MiB of the
    sharded ViT's 333 MiB step at P=2 before this was used.
    """

    def __init__(self) -> None:
        # Blocks the host cache keeps from before (model building) go back to the OS first: the
        # step would reuse them, and their pages, already resident, would hide part of its peak.
        host_cache.empty_cache()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _proc_status_mib("VmRSS")
            self.exact = True
        except OSError:
            self._base = maxrss_mib()
            self.exact = False

    def mib(self) -> float:
        """Peak since construction, above the resident memory then."""
        return (_proc_status_mib("VmHWM") if self.exact else maxrss_mib()) - self._base


# --------------------------------------------------------------------------------------------
# The cases: each gives the plain model, the global input, the sharded dim and its alignment.


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64}[name]


def describe(cfg: DemoConfig) -> tuple[str, tuple[int, ...]]:
    """A one-line description of the case and the global input shape."""
    s = cfg.resolved_size()
    if cfg.model == "vit":
        depth = 12 if cfg.depth is None else cfg.depth
        return f"timm vit_tiny_patch16_224 (depth {depth}, width 192) at {s}x{s}", (1, 3, s, s)
    if cfg.model == "unet":
        return f"zoo UNet 2-D, channels (16, 32, 64), GroupNorm, at {s}x{s}", (1, 1, s, s)
    if cfg.model == "transolver":
        depth = 4 if cfg.depth is None else cfg.depth
        return f"Transolver ({depth} layers, 128 hidden, 32 slices) on {s} points", (1, s, 3)
    if cfg.model == "fno":
        depth = 4 if cfg.depth is None else cfg.depth
        return f"zoo FNO 2-D ({depth} blocks, width 32, 16 modes) at {s}x{s}", (1, 3, s, s)
    if cfg.model == "meshgraphnet":
        depth = 6 if cfg.depth is None else cfg.depth
        return f"zoo MeshGraphNet ({depth} steps, hidden 64) on a {s}x{s} triangulated grid", (s * s, 4)
    return f"3-D CNN (4 convs, circular/reflect padding, a stride) on 4x{s}^3", (1, 4, s, s, s)


def build_model(cfg: DemoConfig, mesh: Any) -> nn.Module:
    """The plain model (``mesh=None``) or the sharded one, with the same seeded weights."""
    from sharded_nn import zoo

    import sharded_nn as snn

    torch.manual_seed(SEED)
    s = cfg.resolved_size()
    if cfg.model == "vit":
        kw = {} if cfg.depth is None else {"depth": cfg.depth}
        model = zoo.create_model("vit_tiny_patch16_224", mesh=mesh, img_size=s, **kw)
    elif cfg.model == "unet":
        model = zoo.create_model("unet2d", mesh=mesh, in_channels=1, out_channels=1, channels=(16, 32, 64))
    elif cfg.model == "transolver":
        model = zoo.create_model(
            "transolver", mesh=None, functional_dim=3, out_dim=1, embedding_dim=3,
            n_layers=4 if cfg.depth is None else cfg.depth, n_hidden=128, n_head=8, slice_num=32,
        )  # fmt: skip
        if mesh is not None:
            model = snn.convert(model, mesh, strict=True)
    elif cfg.model == "fno":
        depth = 4 if cfg.depth is None else cfg.depth
        model = zoo.create_model("fno2d", mesh=mesh, in_channels=3, out_channels=1, width=32, modes=16, depth=depth)
    elif cfg.model == "meshgraphnet":
        steps = 6 if cfg.depth is None else cfg.depth
        model = zoo.create_model("meshgraphnet", mesh=mesh, node_in=4, edge_in=3, out=2, hidden=64, steps=steps)
    else:
        model = nn.Sequential(
            nn.Conv3d(4, 16, 3, padding=1),
            nn.GELU(),
            nn.Conv3d(16, 16, 3, stride=2, padding=1, padding_mode="circular"),
            nn.GELU(),
            nn.Conv3d(16, 16, 5, padding="same", padding_mode="reflect"),
            nn.GELU(),
            nn.Conv3d(16, 1, 1),
        )
        if mesh is not None:
            model = snn.convert(model, mesh)
    return model.to(_torch_dtype(cfg.dtype)).eval()


def _shard_dim(cfg: DemoConfig) -> int:
    return {"transolver": 1, "meshgraphnet": 0}.get(cfg.model, 2)


def mesh_graph(side: int, node_in: int = 4, seed: int = SEED):
    """A triangulated ``side x side`` grid: positions ``(N, 2)`` (jittered), node features
    ``(N, node_in)``, edge features ``(E, 3)`` (dx, dy, length) and ``edge_index`` (each vertex
    joined both ways to its right, lower and lower-right neighbours)."""
    g = torch.Generator().manual_seed(seed)
    ij = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    pos = ij.double() + 0.3 * (torch.rand(side * side, 2, generator=g, dtype=torch.float64) - 0.5)
    node = ij[:, 0] * side + ij[:, 1]
    pairs = []
    for di, dj in ((0, 1), (1, 0), (1, 1)):
        a = node[(ij[:, 0] + di < side) & (ij[:, 1] + dj < side)]
        b = a + di * side + dj
        pairs += [torch.stack([a, b]), torch.stack([b, a])]
    edge_index = torch.cat(pairs, 1)
    d = pos[edge_index[1]] - pos[edge_index[0]]
    edge_attr = torch.cat([d, d.norm(dim=1, keepdim=True)], 1)
    x = torch.randn(side * side, node_in, generator=g, dtype=torch.float64)
    return pos, x, edge_attr, edge_index


def _align(cfg: DemoConfig, model: nn.Module) -> int:
    if cfg.model == "vit":
        return 16
    if cfg.model in ("transolver", "fno", "meshgraphnet"):
        return 1
    from .alignment import alignment

    return alignment(model, 2) if cfg.model == "unet" else 2


def global_input(cfg: DemoConfig) -> torch.Tensor:
    _, shape = describe(cfg)
    gen = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(shape, generator=gen, dtype=_torch_dtype(cfg.dtype))


def validate(cfg: DemoConfig) -> None:
    """Raise ``ValueError`` (one line) for options the demo cannot run."""
    if cfg.model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {cfg.model!r}.")
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {cfg.nproc}.")
    s = cfg.resolved_size()
    multiple = {"vit": 16, "unet": 4, "transolver": 1, "cnn": 2, "fno": 16, "meshgraphnet": 1}[cfg.model]
    if s < multiple * 2 or s % multiple:
        raise ValueError(
            f"--size for --model {cfg.model} is the {MODELS[cfg.model][1]}: expected a multiple of "
            f"{multiple} of at least {multiple * 2}, got {s}."
        )
    slab = s // multiple
    if cfg.nproc > slab:
        raise ValueError(
            f"--size {s} gives only {slab} aligned slab(s) for --nproc {cfg.nproc}: raise --size or lower --nproc."
        )
    if cfg.depth is not None and cfg.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {cfg.depth}.")
    if cfg.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {cfg.repeat}.")
    if cfg.dtype not in ("float32", "float64"):
        raise ValueError(f"--dtype must be float32 or float64, got {cfg.dtype!r}.")


# --------------------------------------------------------------------------------------------
# One step, on every rank of a run.


def _loss(cfg: DemoConfig, out: torch.Tensor, mesh: Any) -> torch.Tensor:
    """A loss that touches every output element (the same at P=1 and P>1)."""
    import sharded_nn as snn

    if cfg.model == "vit":  # logits are replicated: each rank back-propagates its 1/P share
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED + 2)).to(out)
        loss = (out * w).sum()
        return loss if mesh is None else snn.losses.share(loss, mesh)
    target = torch.full_like(out, 0.5)
    return nn.functional.mse_loss(out, target) if mesh is None else snn.losses.mse_loss(out, target, mesh)


def rank_step(cfg: DemoConfig, sharded: bool) -> dict[str, Any]:
    """Build, run one forward and backward step, measure; run on every rank of a launch."""
    import sharded_nn as snn

    device_type = "cuda" if torch.cuda.is_available() and os.environ.get("SNN_DEMO_DEVICE") != "cpu" else "cpu"
    mesh = snn.init_mesh(device_type=device_type) if sharded else None
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    model = build_model(cfg, mesh).to(device)
    dim = _shard_dim(cfg)
    graph, part = None, None
    if cfg.model == "meshgraphnet":  # nodes split by position; each rank's in-edges and halo
        pos, x_full, e_full, edge_index = mesh_graph(cfg.resolved_size())
        x_full, e_full = x_full.to(_torch_dtype(cfg.dtype)), e_full.to(_torch_dtype(cfg.dtype))
        if mesh is not None:
            from .points import PointCloudPartition

            part = PointCloudPartition(mesh)
            _, x_full = part(pos, x_full)
            g = part.graph(edge_index.to(device))
            graph = (e_full[g.edge_ids].to(device), g)
        else:
            graph = (e_full.to(device), edge_index.to(device))
        x = x_full.detach().clone()
    else:
        x_full = global_input(cfg)
        if mesh is not None:
            sl = snn.local_slices(tuple(x_full.shape), mesh, dims=(dim,), align=_align(cfg, model))
            x = x_full[sl].clone()
        else:
            x = x_full.clone()
    del x_full
    x = x.to(device).requires_grad_()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    peak_rss = PeakRSS()
    times = []
    for _ in range(cfg.repeat):
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = None
        t0 = time.perf_counter()
        if cfg.model == "transolver":
            out = model(x, embedding=x.detach())
        elif graph is not None:
            out = model(x, *graph)
        else:
            out = model(x)
        _loss(cfg, out, mesh).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    if device.type == "cuda":
        mem = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        mem = peak_rss.mib()

    out, dx = out.detach(), x.grad
    params = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
    if mesh is not None:
        # Per-rank numbers travel as a P-vector sharded along dim 0 (a collective, so also a barrier).
        stats = snn.gather(torch.tensor([[mem, seconds]], dtype=torch.float64, device=device), mesh, dims=0)
        mems, seconds = stats[:, 0].tolist(), stats[:, 1].max().item()
        dx = part.restore(dx) if part is not None else snn.gather(dx, mesh, dims=dim)
        # Parameter gradients are per-rank partial sums (DESIGN.md section 3); training sums them
        # with DDP/FSDP (``parallelize``); here one gather of the flattened gradients does it.
        flat = torch.cat([g.flatten() for g in params]).to(device)[None]
        total = snn.gather(flat, mesh, dims=0).sum(0).cpu()
        params = list(torch.split(total, [g.numel() for g in params]))
        params = [t.view(g.shape) for t, g in zip(params, [p.grad for p in model.parameters() if p.grad is not None])]
        if part is not None:  # nodes: back in their original order
            out = part.restore(out)
        elif cfg.model != "vit":  # ViT logits are replicated already
            out = snn.gather(out, mesh, dims=dim)
    else:
        mems = [mem]
    return {"mem": mems, "seconds": seconds, "out": out.cpu(), "dx": dx.cpu(), "params": params,
            "backend": torch.distributed.get_backend() if mesh is not None else "none"}  # fmt: skip


def _single(cfg: DemoConfig) -> dict[str, Any]:
    return rank_step(cfg, sharded=False)


def _sharded(cfg: DemoConfig) -> dict[str, Any]:
    return rank_step(cfg, sharded=True)


# --------------------------------------------------------------------------------------------
# The job: runs, comparison, table, plot, JSON.


def _max_diff(a: list[torch.Tensor] | torch.Tensor, b: list[torch.Tensor] | torch.Tensor) -> float:
    if isinstance(a, torch.Tensor):
        a, b = [a], [b]
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True)), default=0.0)


def compare(cfg: DemoConfig, ref: dict[str, Any], got: dict[str, Any]) -> tuple[dict[str, float], dict[str, float], bool]:
    """Max absolute differences, their tolerances and pass/fail.

    Each quantity is checked against its own scale (the reference's largest magnitude): one scale
    for all three would let an output off by a tenth pass wherever the parameter gradients of a
    summed loss are in the hundreds.
    """
    diffs = {
        "output": _max_diff(got["out"], ref["out"]),
        "input grad": _max_diff(got["dx"], ref["dx"]),
        "param grads": _max_diff(got["params"], ref["params"]),
    }
    scales = {
        "output": ref["out"].abs().max().item(),
        "input grad": ref["dx"].abs().max().item(),
        "param grads": max((p.abs().max().item() for p in ref["params"]), default=0.0),
    }
    rel = 1e-10 if cfg.dtype == "float64" else 1e-3
    tols = {k: rel * max(scales[k], 1e-30) for k in diffs}
    return diffs, tols, all(diffs[k] <= tols[k] for k in diffs)


def format_table(rec: DemoRecord) -> str:
    lines = ["| P | peak memory per rank (MiB) | fwd+bwd time (s) |", "| --- | --- | --- |"]
    for r in rec.runs:
        mems = ", ".join("n/a" if m is None else f"{m:.0f}" for m in r.mem_mib)
        lines.append(f"| {r.nproc} | {mems} | {r.seconds:.2f} |")
    tols = rec.tolerances or dict.fromkeys(rec.max_abs_diff, rec.tolerance)
    diffs = ", ".join(f"{k} {v:.2e} (tolerance {tols[k]:.1e})" for k, v in rec.max_abs_diff.items())
    verdict = "OK: sharded == single process" if rec.ok else "MISMATCH"
    p = rec.runs[-1].nproc
    lines.append(f"max |difference| P={p} vs P=1: {diffs} -> {verdict}")
    return "\n".join(lines)


def plot(rec: DemoRecord, path: Path) -> None:
    """Peak memory per rank and step time against P (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(8, 3.2))
    ps = [r.nproc for r in rec.runs]
    for r in rec.runs:
        mems = [m for m in r.mem_mib if m is not None]
        ax_m.scatter([r.nproc] * len(mems), mems, color="C0")
    ax_m.plot(ps, [max((m for m in r.mem_mib if m is not None), default=float("nan")) for r in rec.runs], "C0-")
    ax_m.set(xlabel="processes P", ylabel="peak memory per rank (MiB)", xticks=ps, title="memory")
    ax_m.set_ylim(bottom=0)
    ax_t.plot(ps, [r.seconds for r in rec.runs], "C1o-")
    ax_t.set(xlabel="processes P", ylabel="fwd+bwd time (s)", xticks=ps, title="time")
    ax_t.set_ylim(bottom=0)
    fig.suptitle(rec.description, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _record(cfg: DemoConfig, ref: dict[str, Any], got: dict[str, Any], nproc: int, ref_mem_ok: bool) -> DemoRecord:
    desc, shape = describe(cfg)
    diffs, tols, ok = compare(cfg, ref, got)
    return DemoRecord(
        model=cfg.model, description=desc, size=cfg.resolved_size(), input_shape=list(shape), dtype=cfg.dtype,
        backend=got["backend"],
        runs=[RunRecord(1, ref["mem"] if ref_mem_ok else [None], ref["seconds"]),
              RunRecord(nproc, got["mem"], got["seconds"])],
        max_abs_diff=diffs, tolerance=max(tols.values()), tolerances=tols, ok=ok,
    )  # fmt: skip


def _write(rec: DemoRecord, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, png = out / f"demo_{rec.model}.json", out / f"demo_{rec.model}.png"
    js.write_text(json.dumps(asdict(rec), indent=2) + "\n")
    plot(rec, png)
    return js, png


def run_local(cfg: DemoConfig, *, progress: bool = True) -> DemoRecord:
    """P=1 and P=``cfg.nproc`` as separate local launches (``sharded_nn.launch``, one thread each)."""
    from tqdm import tqdm

    from .launch import launch

    desc, shape = describe(cfg)
    device_type = "cuda" if torch.cuda.device_count() >= cfg.nproc else "cpu"
    if device_type == "cpu":
        os.environ["SNN_DEMO_DEVICE"] = "cpu"  # inherited by the ranks
    results = {}
    steps = [(1, _single), (cfg.nproc, _sharded)]
    with tqdm(steps, desc="runs", unit="run", disable=not progress, file=sys.stdout) as bar:
        for p, fn in bar:
            bar.set_postfix_str(f"P={p}: start {p} process(es), build, forward+backward")
            results[p] = launch(fn, p, cfg, threads=1, device_type=device_type, timeout=3600)
    return _record(cfg, results[1], results[cfg.nproc], cfg.nproc, True)


def run_torchrun(cfg: DemoConfig) -> DemoRecord | None:
    """Inside a torchrun world: sharded over every rank, then the P=1 reference on rank 0."""
    import torch.distributed as dist

    from .mesh import ensure_process_group

    ensure_process_group()
    got = _sharded(cfg)
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank != 0:
        dist.barrier()
        return None
    # On CPU the high-water mark now includes the sharded step: P=1 memory is not measurable here.
    ref = _single(cfg)
    dist.barrier()
    return _record(cfg, ref, got, world, torch.cuda.is_available())


def main(cfg: DemoConfig, *, progress: bool = True) -> int:
    """Run the demo, print the table, write JSON and PNG; return the exit code (0: outputs match)."""
    validate(cfg)
    desc, shape = describe(cfg)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        rec = run_torchrun(cfg)
        if rec is None:
            return 0
    else:
        print(f"sharded_nn demo: {desc}, forward + backward, P=1 against P={cfg.nproc} local processes")
        held = (
            "a part of the nodes (PointCloudPartition) with its in-edges and halo nodes"
            if cfg.model == "meshgraphnet"
            else f"a slab of dim {_shard_dim(cfg)}"
        )
        print(f"  global input {tuple(shape)} {cfg.dtype}; each rank holds {held}")
        rec = run_local(cfg, progress=progress)
    js, png = _write(rec, Path(cfg.out))
    print(format_table(rec))
    print(f"wrote {js} and {png}")
    return 0 if rec.ok else 1


__all__ = ["DemoConfig", "DemoRecord", "MODELS", "PeakRSS", "main", "maxrss_mib", "run_local", "validate"]
