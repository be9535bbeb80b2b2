"""Host allocator policies against the per-rank memory and CPU cost of the zoo models, P=1 vs P=2.

What is measured, per policy and case (each rank a fresh process from ``sharded_nn.launch`` with
one thread, ``mmap_threshold=None`` so that only the policy touches glibc):

* ``mem``: peak resident size (``VmHWM``, ``sharded_nn.demo.PeakRSS``) over ``--warmup`` + 1
  steps above the value after the model and the input were built, maximum over ranks, MiB;
* ``alloc``: the peak of the bytes malloc holds (``mallinfo2``, sampled after every aten op) in the
  first step above its start: the tensors alone, whatever the allocator keeps besides;
* ``cpu``: user and system CPU seconds of the last step (``getrusage``, all threads of the
  process), and its minor page faults, maximum over ranks.

A policy is a name: ``glibc`` (nothing set), ``t<N>`` (``M_MMAP_THRESHOLD`` fixed at N MiB, ``k``
for KiB: ``t256k``), ``+top<N>`` (``M_TOP_PAD``), ``+trim<N>`` (``M_TRIM_THRESHOLD``), ``+nommap``
(``M_MMAP_MAX=0``), ``+hugetlb`` (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc madvises its own
heap and mapped blocks for transparent huge pages), ``+nothp`` (``THP_MEM_ALLOC_ENABLE=0``),
``+arena1`` (``M_ARENA_MAX=1``), ``+lib`` (``sharded_nn.host_memory.tune_host_allocator()`` with no
argument: the library's policy), ``+cache`` (``sharded_nn.host_cache``, the caching CPU allocator
``launch`` installs by default; every other policy runs with torch's own allocator). Example::

    python bench/host_alloc.py --cases vit_small:1024:4 unet3d:96 --policies glibc t16 lib
    python bench/host_alloc.py --cases timm:convnext_atto:1024x512 --policies cache lib+cache
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import ctypes  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharded_nn as snn  # noqa: E402
from bench.vit import _MallinfoPeak  # noqa: E402  (malloc + host cache bytes, sampled per aten op)
from sharded_nn.demo import PeakRSS  # noqa: E402

_M = {"trim": -1, "top": -2, "mmap": -3, "mmapmax": -4, "arena": -8}


def _size(text: str) -> int:
    return int(text[:-1]) << 10 if text.endswith("k") else int(text) << 20


def parse_policy(name: str) -> tuple[list[tuple[int, int]], dict[str, str], bool]:
    """(mallopt calls, environment for the ranks, call tune_host_allocator()) of a policy name
    (``+cache`` is read by ``_uses_cache``)."""
    opts: list[tuple[int, int]] = []
    env: dict[str, str] = {}
    lib = False
    for part in name.split("+"):
        if part in ("glibc", "", "cache"):
            continue
        if part == "lib":
            lib = True
        elif part.startswith("t") and not part.startswith("top") and not part.startswith("trim"):
            opts.append((_M["mmap"], _size(part[1:])))
        elif part.startswith("top"):
            opts.append((_M["top"], _size(part[3:])))
        elif part.startswith("trim"):
            opts.append((_M["trim"], _size(part[4:])))
        elif part == "nommap":
            opts.append((_M["mmapmax"], 0))
        elif part == "arena1":
            opts.append((_M["arena"], 1))
        elif part == "hugetlb":
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        elif part == "nothp":
            env["THP_MEM_ALLOC_ENABLE"] = "0"
        else:
            raise SystemExit(f"host_alloc: unknown policy part {part!r} in {name!r}; see --help.")
    return opts, env, lib


def _uses_cache(policy: str) -> bool:
    return "cache" in policy.split("+")


def _build(case: str, mesh):
    """(model, local input) of a case ``vit_small:1024[:depth]``, ``unet3d:96``, ``unet2d:512x896``,
    ``timm:<name>:<H>x<W>`` (a timm CNN, ``snn.convert``-ed where there is a mesh)."""
    from sharded_nn.alignment import alignment
    from sharded_nn.zoo import create_model

    kind, *rest = case.split(":")
    torch.manual_seed(0)
    if kind == "timm":
        import timm

        model = timm.create_model(rest[0], num_classes=10, drop_rate=0.0, drop_path_rate=0.0)
        h, w = (int(v) for v in rest[1].split("x"))
        shape, align = (1, 3, h, w), alignment(model, 2, input_shape=(1, 3, h, w))
        if mesh is not None:
            model = snn.convert(model, mesh)
    elif kind.startswith("vit"):
        size = int(rest[0])
        kwargs = {"depth": int(rest[1])} if len(rest) > 1 else {}
        model = create_model(f"{kind}_patch16_224", mesh=mesh, img_size=size, **kwargs).eval()
        shape, align = (1, 3, size, size), 16
    else:
        dims = tuple(int(v) for v in rest[0].split("x"))
        spatial = dims * 3 if kind == "unet3d" and len(dims) == 1 else dims
        model = create_model(kind, mesh=mesh, in_channels=1, out_channels=1, channels=(16, 32, 64))
        shape, align = (1, 1, *spatial), alignment(model, 2)
    if mesh is not None:
        sl = snn.local_slices(shape, mesh, dims=(2,), align=align)[2]
        shape = shape[:2] + (sl.stop - sl.start,) + shape[3:]
    return model, torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _worker(case: str, mode: str, policy: str, warmup: int) -> dict:
    opts, _, lib = parse_policy(policy)
    libc = ctypes.CDLL("libc.so.6")
    for param, value in opts:
        assert libc.mallopt(param, value) == 1, (param, value)
    if lib:
        from sharded_nn.host_memory import tune_host_allocator

        tune_host_allocator()
    p = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = snn.init_mesh(device_type="cpu") if p > 1 else None
    model, x = _build(case, mesh)

    def step():
        if mode == "fwd":
            with torch.no_grad():
                model(x)
            return
        model.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out = model(xi)
        out.float().square().mean().backward()

    peak = PeakRSS()
    with _MallinfoPeak() as track:
        step()
    alloc = track.mib()
    for _ in range(warmup - 1):
        step()
    if mesh is not None:
        dist.barrier()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    step()
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    mem = peak.mib()
    row = torch.tensor(
        [mem, alloc, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt, wall],
        dtype=torch.float64,
    )
    if mesh is not None:
        dist.all_reduce(row, op=dist.ReduceOp.MAX)
    return dict(zip(("mem", "alloc", "user", "sys", "minflt", "wall"), row.tolist()))


def run(case: str, mode: str, policy: str, p: int, warmup: int) -> dict:
    _, env, _ = parse_policy(policy)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return snn.launch(
            _worker, p, case, mode, policy, warmup, threads=1, device_type="cpu", timeout=3600, mmap_threshold=None,
            host_cache=_uses_cache(policy),
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["vit_small:1024:4", "unet3d:96", "unet2d:512x896"])
    parser.add_argument("--modes", nargs="+", default=["fwdbwd"], choices=("fwd", "fwdbwd"))
    parser.add_argument("--policies", nargs="+", default=["glibc", "t16", "lib"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print("| case | mode | policy | P | mem MiB | alloc MiB | user s | sys s | minflt | wall s | mem ratio | alloc ratio | cpu ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for case in args.cases:
        for mode in args.modes:
            for policy in args.policies:
                base = None
                for p in args.ranks:
                    r = run(case, mode, policy, p, args.warmup)
                    ratios = ""
                    if base is None:
                        base = r
                        ratios = " | | |"
                    else:
                        ratios = (
                            f" {r['mem'] / base['mem']:.2f}x | {r['alloc'] / base['alloc']:.2f}x |"
                            f" {(r['user'] + r['sys']) / (base['user'] + base['sys']):.2f}x |"
                        )
                    print(
                        f"| {case} | {mode} | {policy} | {p} | {r['mem']:.0f} | {r['alloc']:.0f} | {r['user']:.2f} |"
                        f" {r['sys']:.2f} | {r['minflt']:.0f} | {r['wall']:.2f} |{ratios}",
                        flush=True,
                    )


if __name__ == "__main__":
    sys.exit(main())
