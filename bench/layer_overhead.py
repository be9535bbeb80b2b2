"""Per-call overhead of a sharded layer against the plain torch layer, at small sizes on CPU.

What is measured: the fixed cost that sharded_nn adds to every call of a layer, where the
computation itself is small enough for it to show.

* ``nn.Conv2d(16, 16, 3, padding=1)`` on a ``1 x 16 x 64 x 64`` sample (forward only, under
  ``torch.no_grad()``, and forward + backward of a sum loss), one thread per rank
  (``OMP_NUM_THREADS=1``).
* P=1: the plain torch layer, and the converted layer on a 1-rank mesh. With one rank along the
  sharded dim there is nothing to exchange or agree on, so the sharded layer calls the torch
  layer itself: what remains is one attribute test and one Python call frame (issue 16: within
  10% of the plain layer).
* P=2: the converted layer on a 2-rank mesh holding the same global sample (each rank 32 rows),
  against the plain layer on one rank's slab (the local compute the sharded layer must do);
  once on its own (it agrees on its input's layout: one small all-gather per call) and once
  inside a ``layout_scope`` that already knows its input's layout (what each layer of a model
  converted with ``enable_layout_scope`` pays after the first: no all-gather, only the halo
  exchange with the neighbour).
* P=2 transports: the sharded layer and the converted model run both through the same-host
  transport for small CPU messages (``comm/local_transport.py``, the default) and through gloo
  (``SHARDED_NN_TRANSPORT=gloo``, columns ``[gloo]``), interleaved in the same loop.
* ``gather_layouts`` alone: the layout agreement every sharded layer makes per call (one
  all-gather of a few integers on the domain group, or on its CPU side group on NCCL meshes),
  next to one all-reduce of a single integer on the same group (the latency floor of any
  agreement between ranks).

* Norms in training (``--norms``, a second table): ``nn.BatchNorm2d(16)`` and
  ``nn.GroupNorm(4, 16)`` forward + backward on the same sample, plain against converted (P=1:
  the torch layer itself; P=2: the statistics merged across ranks, one collective each way,
  against the plain layer on the slab).

* The forward guard's own cost (``--guard``, a third table), at P=2 on tiny tensors where the
  computation is negligible: per sharded layer (a chain of 100 ``BatchNorm2d(8)`` in eval mode,
  which exchange nothing) and per torch call a model makes between its layers (50 blocks of
  ``permute``, ``Linear``, ``gelu``, ``permute``, a scale and a residual add), each model
  converted with the guard and with ``guard=False``, in separate launches alternated
  ``--guard-rounds`` times (two differently converted models in one process do not time alike).

* Chains of deep-stage layers at P=2 (``--chains``, a fourth table): ten ``Conv2d`` + ``ReLU``
  pairs in eval mode under ``torch.no_grad()`` on the slab sizes of a timm CNN's last stage at
  1024x512 (each rank 16 x 16): RegNetX-200MF's grouped 3x3 (368 channels in groups of 8),
  MobileNetV3's depthwise 3x3 (240 channels) and a pointwise 1x1 (64 channels on 32 x 32), per
  layer. Four configurations, each in launches of its own, alternated ``--chain-rounds`` times:
  ``plain`` (each rank runs the plain chain on its half at once: the host's cap), ``minimal`` (the
  same algorithm as the sharded layer written out by hand: each rank's edge rows sent through
  ``AxisPeers.start_p2p``, the slab copied into an extended buffer while they travel, one
  convolution on it; its output is checked against the plain model's rows), ``converted``
  (``snn.convert``, the guard on: what a user runs) and ``guard=False``. Read as: ``minimal -
  plain`` is what the exchange and the halo rows cost at the least in Python on this transport,
  ``guard=False - minimal`` what the library's layers add above it (layout agreement, path
  choice, the halo module's general code), ``converted - guard=False`` the forward guard.

* Phases of a chain layer at P=2 (``--phases``, a fifth table): the depthwise and grouped chains
  above, the ``minimal`` forward and the converted model (guard on, and ``guard=False`` in a
  launch of its own) alternated forward by forward in one process, each call of the convolution
  kernel, of the transport's start of an exchange (``AxisPeers.start_p2p``) and of its waits
  timestamped: per layer, the kernel, the start, the wait and the rest (the Python and torch
  calls around them: halo buffers and copies, the layer's decisions, the guard, the ReLU). The
  same kernel call on the same inputs costs more inside the library's layer than in the
  hand-written chain: the code around it has evicted its lines (session 46, README Status).

Each figure is the median of ``--iters`` timed calls after ``--warmup`` untimed ones, per rank,
maximum over ranks; a barrier separates the configurations. Reported: the times in microseconds
and the ratio sharded / plain. All configurations of one world size run in one launch, side by
side.

Run it from the repository root::

    python bench/layer_overhead.py                # about half a minute
    python bench/layer_overhead.py --iters 50     # quicker, noisier
    python bench/layer_overhead.py --worlds --chains   # the P=2 chains only, about four minutes
    python bench/layer_overhead.py --worlds --phases   # a chain layer's phases, about a minute
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sharded_nn as snn  # noqa: E402
from sharded_nn.comm import gather_layouts  # noqa: E402
from sharded_nn.comm.sizes import layout_scope  # noqa: E402

from bench.comm_latency import via_gloo  # noqa: E402


def _time(fns: dict, iters: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, slowest rank; the calls are interleaved
    (A, B, A, B, ...) so that a load change on a shared machine hits every configuration alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times[k]) for k in fns], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    dist.barrier()
    return dict(zip(fns, med.tolist()))


def _measure(channels: int, size: int, iters: int, warmup: int) -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = snn.init_mesh(domain=dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    plain = nn.Conv2d(channels, channels, 3, padding=1)
    sharded = snn.ShardedConv2d(channels, channels, 3, padding=1, mesh=mesh, dims=(2,))
    sharded.load_state_dict(plain.state_dict())
    # A converted two-layer model: its first layer agrees (with the model's entry facts), the
    # second derives its layout (convert's layout scope); against the plain model on the slab.
    plain2 = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, channels, 3, padding=1))
    conv2 = snn.convert(copy.deepcopy(plain2), mesh)
    x = torch.randn(1, channels, size, size)
    x_loc = snn.shard(x, mesh, dims=(2,))
    out: dict[str, float] = {}

    def step(model, inp):
        inp = inp.detach().requires_grad_()
        model(inp).sum().backward()

    with torch.no_grad():
        got = _time({"plain": lambda: plain(x_loc), "sharded": lambda: sharded(x_loc),
                     "sharded gloo": via_gloo(lambda: sharded(x_loc))}, iters, warmup)
        got |= _time({"plain2": lambda: plain2(x_loc), "model2": lambda: conv2(x_loc),
                      "model2 gloo": via_gloo(lambda: conv2(x_loc))}, iters, warmup)
    out |= {f"{k} fwd": v for k, v in got.items()}
    got = _time({"plain": lambda: step(plain, x_loc), "sharded": lambda: step(sharded, x_loc),
                 "sharded gloo": via_gloo(lambda: step(sharded, x_loc))}, iters, warmup)
    got |= _time({"plain2": lambda: step(plain2, x_loc), "model2": lambda: step(conv2, x_loc),
                  "model2 gloo": via_gloo(lambda: step(conv2, x_loc))}, iters, warmup)
    out |= {f"{k} fwd+bwd": v for k, v in got.items()}
    with layout_scope():  # the first call agrees and remembers the layout; the timed ones derive it
        sharded(x_loc)
        with torch.no_grad():
            out["scoped fwd"] = _time({"s": lambda: sharded(x_loc)}, iters, warmup)["s"]
        out["scoped fwd+bwd"] = _time({"s": lambda: step(sharded, x_loc)}, iters, warmup)["s"]
    # The floor for any agreement: one all-reduce of a single integer on the same group.
    one = torch.zeros(1, dtype=torch.int64)
    group = snn.domain_group(mesh)
    gl = lambda: gather_layouts(x_loc.shape, mesh, (2,), what="bench")  # noqa: E731
    got = _time(
        {"g": gl, "gg": via_gloo(gl), "a": lambda: dist.all_reduce(one, group=group)},
        iters,
        warmup,
    )
    out["gather_layouts"], out["gather_layouts gloo"], out["all_reduce"] = got["g"], got["gg"], got["a"]
    return out


def _measure_norms(channels: int, size: int, iters: int, warmup: int) -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = snn.init_mesh(domain=dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    x_loc = snn.shard(torch.randn(1, channels, size, size), mesh, dims=(2,))
    out: dict[str, float] = {}
    for name, layer in (("BatchNorm2d", nn.BatchNorm2d(channels)), ("GroupNorm", nn.GroupNorm(4, channels))):
        # A converted model whose first layer is a pointwise conv, so that the norm runs as in a
        # network: its input's layout comes from the model's entry (one agreement per forward).
        plain = nn.Sequential(nn.Conv2d(channels, channels, 1), layer).train()
        sharded = snn.convert(copy.deepcopy(plain), mesh).train()

        def step(model):
            inp = x_loc.detach().requires_grad_()
            model(inp).sum().backward()

        got = _time({"plain": lambda: step(plain), "sharded": lambda: step(sharded)}, iters, warmup)
        out[f"{name} plain"], out[f"{name} sharded"] = got["plain"], got["sharded"]
    return out


class _LayerChain(nn.Sequential):
    def __init__(self, n: int = 100) -> None:
        super().__init__(*[nn.BatchNorm2d(8) for _ in range(n)])


class _CallChain(nn.Module):
    """A sharded convolution, then ``blocks`` blocks of six torch calls of the model's own."""

    def __init__(self, blocks: int = 50) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.lin = nn.ModuleList([nn.Linear(8, 8) for _ in range(blocks)])
        self.scale = nn.Parameter(torch.ones(8, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        for lin in self.lin:
            h = lin(x.permute(0, 2, 3, 1))
            x = torch.nn.functional.gelu(h).permute(0, 3, 1, 2) * self.scale + x
        return x


def _measure_guard(guard: bool, iters: int, warmup: int) -> dict[str, float]:
    """Seconds per sharded layer and per model call of the two probe models (one launch, one guard setting)."""
    torch.set_num_threads(1)
    mesh = snn.init_mesh(domain=dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    x = snn.shard(torch.randn(1, 8, 8 * dist.get_world_size(), 8), mesh, dims=(2,))
    out = {}
    for key, model, per in (("layer", _LayerChain(), 100), ("call", _CallChain(), 6 * 50)):
        model = snn.convert(model.eval(), mesh, guard=guard)
        with torch.no_grad():
            got = _time({key: lambda: model(x)}, iters, warmup)
        out[key] = got[key] / per
    return out


#: ``--chains``: (label, channels, groups, kernel, global rows, columns) of each chain's layers.
_CHAINS = {
    "grouped": ("grouped 3x3, 368 ch / 8", 368, 46, 3, 32, 16),
    "depthwise": ("depthwise 3x3, 240 ch", 240, 240, 3, 32, 16),
    "pointwise": ("pointwise 1x1, 64 ch", 64, 1, 1, 64, 32),
}
_CHAIN_CONFIGS = ("plain", "minimal", "converted", "guard=False")
_CHAIN_LAYERS = 10


def _chain(kind: str) -> nn.Sequential:
    _, c, groups, k, _, _ = _CHAINS[kind]
    layers: list[nn.Module] = []
    for _ in range(_CHAIN_LAYERS):
        layers += [nn.Conv2d(c, c, k, padding=k // 2, groups=groups), nn.ReLU()]
    return nn.Sequential(*layers).eval()


def _minimal_chain(model: nn.Sequential, ring):
    """The chain's forward written out by hand, as the sharded layer computes it on the
    synchronous path: edge rows to the neighbours, the slab copied into an extended buffer while
    they travel, the zero padding at the domain's ends, one convolution on the extended slab."""
    r, p = ring.index, ring.size
    convs = [m for m in model if isinstance(m, nn.Conv2d)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for conv in convs:
            h = conv.kernel_size[0] // 2
            if h == 0:
                x = torch.relu(conv(x))
                continue
            n = x.shape[2]
            tag = ring.next_tags(2)
            ops, left, right = [], None, None
            if r + 1 < p:  # my last rows to the right neighbour; its first rows to me
                ops.append((x.narrow(2, n - h, h).contiguous(), r + 1, True, tag))
                right = torch.empty(x.shape[0], x.shape[1], h, x.shape[3])
                ops.append((right, r + 1, False, tag + 1))
            if r > 0:
                ops.append((x.narrow(2, 0, h).contiguous(), r - 1, True, tag + 1))
                left = torch.empty(x.shape[0], x.shape[1], h, x.shape[3])
                ops.append((left, r - 1, False, tag))
            works = ring.start_p2p(ops)
            ext = torch.empty(x.shape[0], x.shape[1], n + 2 * h, x.shape[3])
            ext.narrow(2, h, n).copy_(x)
            if left is None:
                ext.narrow(2, 0, h).zero_()
            if right is None:
                ext.narrow(2, n + h, h).zero_()
            for w in works:
                w.wait()
            if left is not None:
                ext.narrow(2, 0, h).copy_(left)
            if right is not None:
                ext.narrow(2, n + h, h).copy_(right)
            x = torch.relu(nn.functional.conv2d(ext, conv.weight, conv.bias, 1, (0, conv.padding[1]), 1, conv.groups))
        return x

    return forward


def _measure_chain(kind: str, config: str, iters: int, warmup: int) -> float:
    """Seconds per layer (a convolution and its ReLU) of one chain in one configuration, P=2."""
    from sharded_nn.comm.peers import axis_peers

    torch.set_num_threads(1)
    mesh = snn.init_mesh(domain=dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    _, c, _, _, h, w = _CHAINS[kind]
    model = _chain(kind)
    x = torch.randn(1, c, h, w)
    x_loc = snn.shard(x, mesh, dims=(2,))
    if config == "plain":
        fn = lambda: model(x_loc)  # noqa: E731
    elif config == "minimal":
        ring = axis_peers(mesh, snn.domain_axes(mesh)[0])
        forward = _minimal_chain(model, ring)
        with torch.no_grad():  # the hand-written path must compute what the model does
            want = snn.shard(model(x), mesh, dims=(2,))
            torch.testing.assert_close(forward(x_loc), want, rtol=1e-4, atol=1e-5)
        fn = lambda: forward(x_loc)  # noqa: E731
    else:
        sharded = snn.convert(copy.deepcopy(model), mesh, guard=config == "converted")
        fn = lambda: sharded(x_loc)  # noqa: E731
    with torch.no_grad():
        return _time({"t": fn}, iters, warmup)["t"] / _CHAIN_LAYERS


_PHASE_KINDS = ("depthwise", "grouped")


def _measure_phases(kind: str, guard: bool, iters: int, warmup: int) -> dict[str, dict[str, float]]:
    """Per layer (seconds, median over forwards) of the minimal and the converted chain, alternated:
    total, kernel, exchange start, exchange wait."""
    import torch.nn.functional as F

    import sharded_nn.layers.conv as conv_mod
    from sharded_nn.comm import local_transport
    from sharded_nn.comm.peers import AxisPeers, axis_peers

    torch.set_num_threads(1)
    mesh = snn.init_mesh(domain=dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    _, c, _, _, h, w = _CHAINS[kind]
    model = _chain(kind)
    x_loc = snn.shard(torch.randn(1, c, h, w), mesh, dims=(2,))
    ring = axis_peers(mesh, snn.domain_axes(mesh)[0])
    minimal = _minimal_chain(model, ring)
    sharded = snn.convert(copy.deepcopy(model), mesh, guard=guard)
    spent = {"kernel": 0.0, "start": 0.0, "wait": 0.0}
    clock = time.perf_counter

    def timed(fn, phase):
        def call(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[phase] += clock() - t0

        return call

    # (A collective's wait waits on its parts: the transport's works, timed once each.)
    saved = (F.conv2d, conv_mod._CONV_FN[2], AxisPeers.start_p2p, local_transport._Work.wait)
    F.conv2d = conv_mod._CONV_FN[2] = timed(saved[0], "kernel")
    AxisPeers.start_p2p = timed(saved[2], "start")
    local_transport._Work.wait = timed(saved[3], "wait")
    rows: dict[str, dict[str, list[float]]] = {n: {k: [] for k in ("total", *spent)} for n in ("minimal", "library")}
    try:
        with torch.no_grad():
            for i in range(warmup + iters):
                for name, fn in (("minimal", lambda: minimal(x_loc)), ("library", lambda: sharded(x_loc))):
                    for k in spent:
                        spent[k] = 0.0
                    t0 = clock()
                    fn()
                    total = clock() - t0
                    if i >= warmup:
                        rows[name]["total"].append(total / _CHAIN_LAYERS)
                        for k, v in spent.items():
                            rows[name][k].append(v / _CHAIN_LAYERS)
    finally:
        F.conv2d, conv_mod._CONV_FN[2], AxisPeers.start_p2p, local_transport._Work.wait = saved
    return {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}


def _print_phases(args) -> None:
    print(f"\nPhases of a chain layer at P=2 ({_CHAIN_LAYERS} Conv2d + ReLU, eval, 16x16 slabs), rank 0, "
          f"median of {args.iters} forwards, us per layer; the hand-written chain and the converted one "
          "alternated in one process")
    print(f"{'':>24} {'':>22} {'total':>7} {'kernel':>7} {'start':>7} {'wait':>7} {'rest':>7}")
    for kind in _PHASE_KINDS:
        for guard in (False, True):
            r = snn.launch(_measure_phases, 2, kind, guard, args.iters, args.warmup, device_type="cpu",
                           threads=1)
            for name in ("minimal", "library"):
                m = {k: v * 1e6 for k, v in r[name].items()}
                rest = m["total"] - m["kernel"] - m["start"] - m["wait"]
                label = "minimal" if name == "minimal" else ("converted" if guard else "guard=False")
                print(f"{_CHAINS[kind][0]:>24} {label:>22} {m['total']:7.0f} {m['kernel']:7.0f} {m['start']:7.0f}"
                      f" {m['wait']:7.0f} {rest:7.0f}")


def _print_layer_table(args) -> None:
    print(f"Conv2d({args.channels}, {args.channels}, 3, padding=1) on 1x{args.channels}x{args.size}x{args.size}, "
          f"1 thread per rank, median of {args.iters} calls (us)")
    print(f"{'P':>2} {'':>8} {'plain':>9} {'sharded':>9} {'ratio':>6} {'scoped':>9} {'ratio':>6}"
          f" {'plain x2':>9} {'convert':>9} {'ratio':>6}   {'[gloo] sharded':>14} {'convert':>8}"
          f"   gather_layouts [gloo]  1-int gloo all_reduce")
    for p in args.worlds:
        r = snn.launch(_measure, p, args.channels, args.size, args.iters, args.warmup, device_type="cpu", threads=1)
        for kind in ("fwd", "fwd+bwd"):
            a, b, c = r[f"plain {kind}"], r[f"sharded {kind}"], r[f"scoped {kind}"]
            a2, b2 = r[f"plain2 {kind}"], r[f"model2 {kind}"]
            g1, g2 = r[f"sharded gloo {kind}"], r[f"model2 gloo {kind}"]
            extra = (f"   {r['gather_layouts'] * 1e6:14.0f} {r['gather_layouts gloo'] * 1e6:6.0f}"
                     f"  {r['all_reduce'] * 1e6:20.0f}" if kind == "fwd" else "")
            print(f"{p:>2} {kind:>8} {a * 1e6:9.0f} {b * 1e6:9.0f} {b / a:6.2f} {c * 1e6:9.0f} {c / a:6.2f}"
                  f" {a2 * 1e6:9.0f} {b2 * 1e6:9.0f} {b2 / a2:6.2f}   {g1 * 1e6:14.0f} {g2 * 1e6:8.0f}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--worlds", type=int, nargs="*", default=[1, 2],
                    help="world sizes of the first tables (default: 1 2; none: skip them)")
    ap.add_argument("--norms", action="store_true", help="also time BatchNorm2d and GroupNorm in training")
    ap.add_argument("--guard", action="store_true", help="also time the forward guard's cost per layer and per call")
    ap.add_argument("--guard-rounds", type=int, default=2, help="--guard: launches of each setting, alternated")
    ap.add_argument("--chains", action="store_true",
                    help="also time chains of deep-stage layers at P=2, with the overhead taken apart")
    ap.add_argument("--chain-rounds", type=int, default=2, help="--chains: launches of each configuration, alternated")
    ap.add_argument("--phases", action="store_true",
                    help="also take a chain layer apart at P=2: kernel, exchange start and wait, the rest")
    args = ap.parse_args()
    if args.worlds:
        _print_layer_table(args)
    if args.norms and args.worlds:
        print(f"\nConv2d({args.channels}, {args.channels}, 1) + norm in training, fwd+bwd on 1x{args.channels}x"
              f"{args.size}x{args.size} (P=2: each rank's slab), median of {args.iters} calls (us)")
        print(f"{'P':>2} {'norm':>12} {'plain':>9} {'converted':>10} {'ratio':>6}")
        for p in args.worlds:
            r = snn.launch(_measure_norms, p, args.channels, args.size, args.iters, args.warmup, device_type="cpu",
                           threads=1)
            for name in ("BatchNorm2d", "GroupNorm"):
                a, b = r[f"{name} plain"], r[f"{name} sharded"]
                print(f"{p:>2} {name:>12} {a * 1e6:9.0f} {b * 1e6:10.0f} {b / a:6.2f}")
    if args.guard:
        got: dict = {True: [], False: []}
        for _ in range(args.guard_rounds):
            for g in (True, False):
                got[g].append(snn.launch(_measure_guard, 2, g, args.iters, args.warmup, device_type="cpu", threads=1))
        med = {g: {k: statistics.median(r[k] for r in rs) for k in ("layer", "call")} for g, rs in got.items()}
        print(f"\nForward guard at P=2 (tiny tensors; separate launches, {args.guard_rounds} each, median), us")
        print(f"{'':>26} {'guard':>7} {'no guard':>9} {'cost':>6}")
        for k, label in (("layer", "per sharded layer"), ("call", "per call of the model's own")):
            a, b = med[True][k] * 1e6, med[False][k] * 1e6
            print(f"{label:>26} {a:7.1f} {b:9.1f} {a - b:6.1f}")
    if args.chains:
        got = {(k, c): [] for k in _CHAINS for c in _CHAIN_CONFIGS}
        for _ in range(args.chain_rounds):
            for kind in _CHAINS:
                for config in _CHAIN_CONFIGS:
                    got[kind, config].append(snn.launch(_measure_chain, 2, kind, config, args.iters, args.warmup,
                                                        device_type="cpu", threads=1))
        print(f"\nChains of {_CHAIN_LAYERS} Conv2d + ReLU at P=2, eval, each rank's slab 16x16 (pointwise 32x32), "
              f"us per layer (separate launches, {args.chain_rounds} each, median)")
        print(f"{'':>24} {'plain':>7} {'minimal':>8} {'guard=False':>12} {'converted':>10}   {'converted/plain':>15}"
              f" {'minimal-plain':>14} {'library':>8} {'guard':>6}")
        for kind, (label, *_) in _CHAINS.items():
            m = {c: statistics.median(got[kind, c]) * 1e6 for c in _CHAIN_CONFIGS}
            print(f"{label:>24} {m['plain']:7.0f} {m['minimal']:8.0f} {m['guard=False']:12.0f} {m['converted']:10.0f}"
                  f"   {m['converted'] / m['plain']:14.2f}x {m['minimal'] - m['plain']:14.0f}"
                  f" {m['guard=False'] - m['minimal']:8.0f} {m['converted'] - m['guard=False']:6.0f}")

    if args.phases:
        _print_phases(args)


if __name__ == "__main__":
    main()
