"""Per-rank CPU profile of a timm CNN step: plain timm at P=1 against the converted model at P=2.

Reports, per rank, process user/sys CPU seconds, minor page faults and the torch.profiler ops
with the most self CPU time, for the forward (eval, no_grad) or the train step (fwd+bwd).

    python bench/cnn_profile.py regnetx_002 512x256 step
    python bench/cnn_profile.py --taps     # halo tap rows: folded conv1d, thin conv2d, unfolded matmul
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sharded_nn as snn  # noqa: E402


def rank_main(name: str, h: int, w: int, what: str, sharded: bool, iters: int, top: int) -> str:
    import ctypes
    import os

    import timm

    if os.environ.get("CNN_PROFILE_MALLOC") == "big":
        # Serve buffers up to 32 MiB from the heap and keep freed memory (no trim): what glibc's
        # dynamic threshold ends up doing in a long-running process, from the first step.
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, drop_rate=0.0, drop_path_rate=0.0)
    x = torch.randn(1, 3, h, w, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(1, 10)
    mesh = None
    if sharded:
        mesh = snn.init_mesh(domain=dist.get_world_size())
        align = snn.alignment(model, 2)
        model = snn.convert(model, mesh)
        x = x[snn.local_slices(x.shape, mesh, dims=(2,), align=align)].clone()

    def step():
        if what == "fwd":
            with torch.no_grad():
                return model(x)
        model.zero_grad(set_to_none=True)
        loss = (model(x) * weights).sum()
        (snn.losses.share(loss, mesh) if mesh is not None else loss).backward()

    model.train(what != "fwd")
    step()
    step()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    wall = (time.perf_counter() - t0) / iters
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    lines = [
        f"rank {dist.get_rank() if dist.is_initialized() else 0}: wall {wall:.3f} s/it, user "
        f"{(r1.ru_utime - r0.ru_utime) / iters:.3f} sys {(r1.ru_stime - r0.ru_stime) / iters:.3f} s/it, "
        f"minflt {(r1.ru_minflt - r0.ru_minflt) / iters:.0f}/it, majflt {r1.ru_majflt - r0.ru_majflt}, "
        f"nvcsw {(r1.ru_nvcsw - r0.ru_nvcsw) / iters:.0f} nivcsw {(r1.ru_nivcsw - r0.ru_nivcsw) / iters:.0f}"
    ]
    if top:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ka = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
        lines.append(repr(ka))
    text = "\n".join(lines)
    if dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, text)
        return "\n".join(out)
    return text


def taps_bench() -> None:
    """Halo tap rows of 2-D convolutions: the folded grouped conv1d, the thin conv2d and the
    unfolded matrix product (``conv._grouped_rows``, grouped weights only).

    One output row from T received planes under T kernel rows (``conv._tap_conv``), one thread,
    ``time.thread_time`` per call (median); forward, and forward+backward (input and weight
    gradients) for the thin conv2d and the matrix product; geometries of efficientnet_b0
    (depthwise), regnetx_002 (grouped) and dense convolutions at 512x256, P=2.
    """
    import torch.nn.functional as F

    from sharded_nn.layers.conv import _grouped_rows

    torch.set_num_threads(1)

    def per_call(f, n=40):
        f()
        f()
        ts = []
        for _ in range(n):
            t0 = time.thread_time()
            f()
            ts.append(time.thread_time() - t0)
        return sorted(ts)[n // 2] * 1e6

    cases = [(3, 32, 1, 128, 1, 3, 2), (32, 32, 32, 128, 1, 3, 1), (144, 144, 144, 64, 2, 5, 2),
             (672, 672, 672, 16, 2, 5, 1), (1152, 1152, 1152, 8, 2, 5, 1), (24, 24, 3, 128, 1, 3, 1),
             (56, 56, 7, 64, 1, 3, 1), (152, 152, 19, 16, 1, 3, 1), (368, 368, 46, 8, 1, 3, 1),
             (64, 64, 1, 64, 1, 3, 1), (256, 256, 1, 16, 1, 3, 1)]
    for cin, cout, g, w, t, k, s in cases:
        planes = torch.randn(1, cin, t, w, requires_grad=True)
        weight = torch.randn(cout, cin // g, k, k, requires_grad=True)
        folded_in = planes.detach().reshape(1, cin * t, w)
        folded_w = weight.detach()[:, :, k - t :].reshape(cout, cin // g * t, k)
        fold = per_call(lambda: F.conv1d(folded_in, folded_w, None, s, k // 2, 1, g))

        def thin():
            return F.conv2d(planes, weight[:, :, k - t :], None, (1, s), (0, k // 2), 1, g)

        def mm():
            return _grouped_rows(planes, weight[:, :, k - t :], 2, (1, s), (0, k // 2), (1, 1), g)

        go = torch.randn_like(thin())
        line = (f"C_in={cin} C_out={cout} groups={g} W={w} taps={t} k={k} stride={s}: folded conv1d {fold:.0f} us, "
                f"thin conv2d {per_call(lambda: thin().detach()):.0f} us "
                f"(fwd+bwd {per_call(lambda: torch.autograd.grad(thin(), (planes, weight), go)):.0f})")
        if g > 1 and cin // g > 1:
            line += (f", unfolded matmul {per_call(lambda: mm().detach()):.0f} us "
                     f"(fwd+bwd {per_call(lambda: torch.autograd.grad(mm(), (planes, weight), go)):.0f})")
        print(line)


if __name__ == "__main__":
    if sys.argv[1:] == ["--taps"]:
        taps_bench()
        sys.exit(0)
    name, size, what = sys.argv[1], sys.argv[2], sys.argv[3]
    p = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    iters = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    top = int(sys.argv[6]) if len(sys.argv) > 6 else 25
    h, w = (int(v) for v in size.split("x"))
    tables = {}
    for world in ([1, 2] if p == 0 else [p]):
        text = snn.launch(rank_main, world, name, h, w, what, world > 1, iters, top, threads=1, timeout=1800)
        for line in text.splitlines():
            if line.startswith("{"):
                tables[f"P{world}r{len([k for k in tables if k.startswith(f'P{world}')])}"] = eval(line)
            else:
                print(f"P={world} {line}")
    cols = list(tables)
    names = sorted({n for t in tables.values() for n in t}, key=lambda n: -max(t.get(n, (0, 0))[0] for t in tables.values()))
    print("op".ljust(62) + "".join(f"{c:>18}" for c in cols))
    for n in names[:top]:
        print(n[:60].ljust(62) + "".join(f"{tables[c].get(n, (0, 0))[0]:>11.1f}ms/{tables[c].get(n, (0, 0))[1]:<5}" for c in cols))
