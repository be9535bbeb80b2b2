"""Per-layer CPU paths of sharded CNN layers (issue 16): fast kernels, same results.

The halo corrections of 2-D convolutions (``window.apply_linear``'s tap rows) run as thin
``conv2d`` calls over the received planes. They used to fold the taps into the channels of a
grouped ``conv1d``, which for depthwise and grouped weights falls to slow 1-d kernels (0.5-0.7 ms
per correction row at efficientnet_b0's deep stages against 0.15 ms for the thin conv2d).
Grouped weights with several channels per group (RegNet, ResNeXt) correct their rows with one
unfolded matrix product instead (``_grouped_rows``), depthwise one-plane rows with multiply-adds
(``_depthwise_row``).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference, compare_on_slabs


@contextlib.contextmanager
def _conv_rules(**values):
    """Set path-rule constants of ``layers/conv.py`` (``_SYNC_WEIGHT_RATIO=...``) in this rank's
    process, and count the calls of the overlapped copy-free path (``apply_linear``); yields the
    list of calls."""
    from sharded_nn.layers import conv as conv_mod

    saved = {k: getattr(conv_mod, k) for k in (*values, "apply_linear")}
    calls: list = []

    def counting(*args, **kwargs):
        calls.append(1)
        return saved["apply_linear"](*args, **kwargs)

    conv_mod.apply_linear = counting
    for k, v in values.items():
        setattr(conv_mod, k, v)
    try:
        yield calls
    finally:
        for k, v in saved.items():
            setattr(conv_mod, k, v)


def _overlapped_rules_off():
    """The overlapped (copy-free) convolution path for every slab, in this rank's process.

    Small slabs run synchronously on the extended slab where that is cheaper (``layers/conv.py:
    _sync_cheaper``); the tests of the halo-row corrections turn those rules off so that the
    corrections they check still run."""
    return _conv_rules(_GROUPED_SYNC_MAX_BYTES=-1, _FORWARD_SYNC_MAX_ROWS=-1)


# (channels, groups, kernel, stride, padding, dilation, input H x W)
DEPTHWISE_CASES = [
    (6, 6, 3, 1, 1, 1, (23, 9)),
    (6, 6, 5, 2, 2, 1, (24, 9)),
    (6, 6, 5, 1, 2, 1, (23, 9)),
    (8, 4, 3, 2, 1, 1, (24, 10)),  # grouped, two channels per group
    # Grouped with several channels per group: one unfolded matrix product (``_grouped_rows``),
    # with a stride and dilation along the unsharded dim, and two taps of a 5x5 kernel.
    (12, 3, 3, 1, 1, 1, (23, 9)),
    (12, 4, (3, 5), (1, 2), (1, 2), (1, 2), (23, 13)),
    (8, 2, 5, 2, 2, 1, (24, 9)),
    (6, 3, (5, 3), 1, (4, 1), (2, 1), (23, 9)),  # dilation along the sharded dim
    (6, 6, 3, 1, 1, (1, 2), (23, 9)),  # dilation along the unsharded dim
    (6, 6, 7, 1, 3, 1, (23, 9)),  # ConvNeXt's 7x7: three rows read each halo (one band call)
    (6, 6, 7, 2, 3, 1, (26, 9)),
    (4, 2, 7, 1, (5, 3), 1, (23, 9)),  # padding wider than the halo rows the kernel reads
    # One row per halo with depthwise weights: shifted multiply-adds (``_depthwise_row``), with a
    # stride and a wider kernel row along the unsharded dim.
    (6, 6, 3, 2, 1, 1, (24, 9)),
    (6, 6, (3, 5), 1, (1, 2), 1, (23, 9)),
    (6, 6, (3, 5), (1, 2), (1, 2), (1, 1), (23, 11)),
]


def _check_grouped(c, g, k, s, p, d, size, dim, domain):
    with _overlapped_rules_off():
        torch.manual_seed(0)
        ref = nn.Conv2d(c, c, k, stride=s, padding=p, dilation=d, groups=g).double()
        torch.manual_seed(1)
        hw = size if dim == 2 else size[::-1]
        x = torch.randn(2, c, *hw, dtype=torch.float64)
        m = mesh(domain)
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": (dim,)}})
        stride = (s, s) if isinstance(s, int) else s
        return check_against_reference(ref, x, m, dims=(dim,), align=stride[dim - 2], sharded=sharded)


@pytest.mark.parametrize("domain", [2, 3, 4])
@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("case", DEPTHWISE_CASES, ids=str)
def test_grouped_conv2d_halo_rows_are_exact(run, case, dim, domain):
    errs = run(domain, _check_grouped, *case, dim, domain)
    assert all(e["out"] <= 1e-10 for e in errs)


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("taps, k, s, p, d", [(1, 3, 1, 1, 1), (1, 3, 2, 1, 1), (2, 5, 1, 2, 1), (1, 5, 3, 0, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_grouped_rows_equal_conv2d(dim, taps, k, s, p, d, channels_last):
    # The grouped halo correction as an unfolded matrix product equals torch's grouped conv2d on
    # the thin planes: values, input and weight gradients (float64), rows along H or W.
    from sharded_nn.layers.conv import _grouped_rows, _grouped_rows_ok

    g = torch.Generator().manual_seed(taps * 100 + k * 10 + s)
    c, groups, n_other = 12, 3, 11
    shape = (2, c, taps, n_other) if dim == 2 else (2, c, n_other, taps)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(24, c // groups, k, k, generator=g, dtype=torch.float64)
    assert _grouped_rows_ok(x, weight, groups) and not _grouped_rows_ok(x, weight[:c, :1], c)
    assert not _grouped_rows_ok(x, torch.randn(6, c, k, k, dtype=torch.float64), 1)
    stride, padding, dilation = [1, 1], [0, 0], [1, 1]
    stride[3 - dim], padding[3 - dim], dilation[3 - dim] = s, p, d
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = _grouped_rows(xs, ws.narrow(dim, k - taps, taps), dim, stride, padding, dilation, groups)
    ref = F.conv2d(xr, wr.narrow(dim, k - taps, taps), None, stride, padding, dilation, groups)
    assert y.shape == ref.shape and y.shape[dim] == 1
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    gy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    y.backward(gy)
    ref.backward(gy)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k, s, p, d", [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 1), (5, 2, 2, 1), (3, 1, 2, 2), (5, 3, 0, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_row_equals_conv2d(k, s, p, d, channels_last):
    # The one-plane depthwise correction as multiply-adds equals torch's grouped conv2d: values,
    # input and weight gradients (float64).
    from sharded_nn.layers.conv import _depthwise_row, _depthwise_row_ok

    g = torch.Generator().manual_seed(k * 10 + s)
    c, w_in = 5, 13
    x = torch.randn(2, c, 1, w_in, generator=g, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c, 1, 3, k, generator=g, dtype=torch.float64)
    assert _depthwise_row_ok(x, weight, c) and not _depthwise_row_ok(x, weight.repeat(1, 5, 1, 1), 1)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = _depthwise_row(xs, ws.narrow(2, 1, 1), s, p, d)
    ref = F.conv2d(xr, wr.narrow(2, 1, 1), None, (1, s), (0, p), (1, d), c)
    torch.testing.assert_close(y, ref, rtol=1e-13, atol=1e-13)
    gy = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (y * gy).sum().backward()
    (ref * gy).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-13, atol=1e-13)


def _conv_kernels(c, k, s):
    torch.manual_seed(0)
    ref = nn.Conv2d(c, c, k, stride=s, padding=k // 2, groups=c)
    m = mesh(dist.get_world_size())
    model = snn.convert(copy.deepcopy(ref), m)
    x = snn.shard(torch.randn(1, c, 32, 16, generator=torch.Generator().manual_seed(1)), m, dims=(2,), align=s)
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), _overlapped_rules_off():
        model(x)  # warm-up: plans and tap caches
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = model(x)
    return sorted({e.key for e in prof.key_averages()}), tuple(y.shape)


@pytest.mark.parametrize("k, s", [(3, 1), (5, 2)])
def test_depthwise_halo_rows_avoid_grouped_conv1d(run, k, s):
    # float32: the halo rows of a depthwise conv run on conv2d (oneDNN), never on the slow
    # grouped conv1d the folded form used, nor on torch's reference conv kernels.
    for ops, _ in run(2, _conv_kernels, 32, k, s):
        assert "aten::conv1d" not in ops, ops
        assert not [o for o in ops if "slow_conv" in o or "thnn" in o], ops
        assert "aten::mkldnn_convolution" in ops, ops


def _conv_calls(c, k, s, grad):
    torch.manual_seed(0)
    ref = nn.Conv2d(c, c, k, stride=s, padding=k // 2, groups=c)
    m = mesh(dist.get_world_size())
    model = snn.convert(copy.deepcopy(ref), m)
    x = snn.shard(torch.randn(1, c, 40, 16, generator=torch.Generator().manual_seed(1)), m, dims=(2,), align=s)
    x.requires_grad_(grad)
    from torch.profiler import ProfilerActivity, profile

    with torch.set_grad_enabled(grad), _overlapped_rules_off():
        model(x)  # warm-up: plans and tap caches
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::convolution")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("k, s, p", [(3, 1, 2), (5, 1, 2), (7, 1, 2), (7, 2, 3), (7, 1, 3)])
def test_halo_rows_take_one_call_per_halo(run, k, s, p, grad):
    # Every output row that reads a halo is corrected in one convolution per halo (a band of the
    # halo planes and zeros), not one per row: 2 calls on an edge rank, 3 on an inner one.
    calls = run(p, _conv_calls, 8, k, s, grad)
    expected = [2 if r in (0, p - 1) else 3 for r in range(p)]
    if k == 3:  # one depthwise row per halo: shifted multiply-adds, no convolution call
        expected = [1] * p
    if s == 2:  # stride 2, 7 taps, pad 3: rows 0-1 read the left halo, only row 9 the right one
        expected = [1 + (r > 0) + (r < p - 1) for r in range(p)]
    assert calls == expected


@pytest.mark.parametrize("shape", [(1, 1152, 64), (2, 96, 300), (3, 7, 11), (1, 4, 1 << 17)])
def test_blocked_moments_single_block_and_blocked_agree(shape):
    # The one-block fast path (small layers) and the blocked loop (big slabs) both match the
    # float64 statistics, with a mean far from zero (where E[x^2] - E[x]^2 would cancel).
    from sharded_nn.layers.norm import _MOMENT_BLOCK, _blocked_moments

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3 + 1000
    mean, var = _blocked_moments(x)
    rv, rm = torch.var_mean(x.double(), dim=(0, 2), correction=0)
    assert (shape[0] * shape[1] * shape[2] <= _MOMENT_BLOCK) == (shape != (1, 4, 1 << 17))
    torch.testing.assert_close(mean.double(), rm, rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double(), rv, rtol=1e-4, atol=0)


def test_guard_walk_skips_plain_scalars_but_finds_tagged_sizes():
    # The guard's argument walk skips exact ints, floats, bools, strings and None without a call
    # (a conv's stride/padding tuples), but still finds tensors and tagged local sizes (an int
    # subclass) nested in lists and tuples.
    from sharded_nn.forward_guard import LocalDerived, _walk

    t = torch.zeros(1)
    tagged = LocalDerived(5)
    found: list = []
    _walk(((1, 2), [3.0, None, True, "same"], (tagged, (t,)), {"k": t}), found)
    assert len(found) == 3 and found[0] is tagged and found[1] is t and found[2] is t


def _heavy_weights(c, cin, size, sizes, dim, ratio):
    """A 3x3 convolution of ``cin -> c`` channels on a slab of ``size``: exact against torch,
    and whether its rows went through the overlapped copy-free path (``apply_linear``)."""
    with _conv_rules(_SYNC_WEIGHT_RATIO=ratio) as calls:
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Conv2d(cin, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=(2, 1), dilation=(2, 1))).double()
        torch.manual_seed(1)
        x = torch.randn(2, cin, *size, dtype=torch.float64)
        m = mesh(dist.get_world_size())
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": (dim,)}})
        errs = check_against_reference(ref, x, m, dims=(dim,), sizes=sizes, sharded=sharded)
        return errs["out"], len(calls)


@pytest.mark.parametrize("world, sizes, between", [(2, (6, 5), 2.8), (3, (4, 3, 4), 4.5)])
@pytest.mark.parametrize("dim", [2, 3])
def test_heavy_weights_run_synchronously_and_exactly(run, world, sizes, between, dim):
    # Weights many times the slab's bytes (deep dense stages): one convolution of the extended
    # slab on every rank, exact forward and backward; light weights keep the overlapped
    # copy-free path. ``between``: a ratio that the smaller slabs' weights exceed but the
    # largest slab's do not: every rank decides on the largest slab and takes the same path.
    size = (sum(sizes), 7) if dim == 2 else (7, sum(sizes))
    heavy = run(world, _heavy_weights, 24, 16, size, sizes, dim, 2)
    assert all(err <= 1e-10 and calls == 0 for err, calls in heavy), heavy
    light = run(world, _heavy_weights, 24, 16, size, sizes, dim, 1e9)
    assert all(err <= 1e-10 and calls == 2 for err, calls in light), light
    mixed = run(world, _heavy_weights, 24, 16, size, sizes, dim, between)
    assert all(err <= 1e-10 and calls == 2 for err, calls in mixed), mixed


def _grouped_path(size, sizes, dim, max_bytes):
    """Two grouped 3x3 convolutions (4 channels per group) on slabs of ``size``: exact against
    torch, and how many went through the overlapped copy-free path (``apply_linear``)."""
    with _conv_rules(_GROUPED_SYNC_MAX_BYTES=max_bytes) as calls:
        torch.manual_seed(0)
        ref = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.Conv2d(16, 8, 3, padding=1, groups=2)
        ).double()
        torch.manual_seed(1)
        x = torch.randn(2, 16, *size, dtype=torch.float64)
        m = mesh(dist.get_world_size())
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": (dim,)}})
        errs = check_against_reference(ref, x, m, dims=(dim,), sizes=sizes, sharded=sharded)
        return errs["out"], len(calls)


@pytest.mark.parametrize("world, sizes", [(2, (6, 5)), (3, (4, 3, 4))])
@pytest.mark.parametrize("dim", [2, 3])
def test_small_grouped_slabs_run_synchronously_and_exactly(run, world, sizes, dim):
    # Grouped weights with several channels per group on slabs of at most
    # ``_GROUPED_SYNC_MAX_BYTES`` (their edge rows have no fast kernel): one convolution of the
    # extended slab on every rank, exact forward and backward; larger slabs keep the overlapped
    # path. A limit between the smaller and the largest slab's bytes: every rank decides on the
    # largest slab and takes the same (overlapped) path.
    size = (sum(sizes), 7) if dim == 2 else (7, sum(sizes))
    largest = 2 * 16 * max(sizes) * 7 * 8  # float64 bytes of the largest slab of the first layer's input
    small = run(world, _grouped_path, size, sizes, dim, 1 << 20)
    assert all(err <= 1e-10 and calls == 0 for err, calls in small), small
    large = run(world, _grouped_path, size, sizes, dim, -1)
    assert all(err <= 1e-10 and calls == 2 for err, calls in large), large
    between = run(world, _grouped_path, size, sizes, dim, largest - 2 * 16 * 7 * 8 // 2)
    assert all(err <= 1e-10 and calls == 2 for err, calls in between), between


def _forward_path(sizes, grad, max_rows):
    """A 3x3 depthwise, a 3x3 dense and a 7x7 depthwise convolution on slabs of ``sizes`` rows
    along H, with or without autograd: exact against torch (float64; forward and gradients where
    ``grad``), and how many went through the overlapped copy-free path (``apply_linear``)."""
    with _conv_rules(_FORWARD_SYNC_MAX_ROWS=max_rows) as calls:
        torch.manual_seed(0)
        ref = nn.Sequential(
            nn.Conv2d(6, 6, 3, padding=1, groups=6),
            nn.Conv2d(6, 8, 3, padding=1),
            nn.Conv2d(8, 8, 7, padding=3, groups=8),
        ).double()
        x = torch.randn(2, 6, sum(sizes), 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        m = mesh(dist.get_world_size())
        sharded = snn.convert(copy.deepcopy(ref), m)
        if grad:
            return compare_on_slabs(ref, sharded, m, x, sizes, replicated=False), len(calls)
        r = m.get_local_rank("domain")
        with torch.no_grad():
            y = snn.gather(sharded(x.narrow(2, sum(sizes[:r]), sizes[r]).contiguous()), m, dims=(2,))
            y_ref = ref(x)
        torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
        return (y - y_ref).abs().max().item(), len(calls)


@pytest.mark.parametrize("world, sizes", [(2, (6, 5)), (3, (4, 3, 4))])
def test_thin_slabs_run_synchronously_in_inference(run, world, sizes):
    # Without autograd, slabs of at most ``_FORWARD_SYNC_MAX_ROWS`` rows: one convolution of the
    # extended slab on every rank (dense and depthwise weights alike), exact; with autograd, and
    # for thicker slabs, the overlapped copy-free path. A limit under the largest slab's rows but
    # not under the others': every rank decides on the largest slab and takes the same path.
    inference = run(world, _forward_path, sizes, False, 16)
    assert all(err <= 1e-10 and calls == 0 for err, calls in inference), inference
    training = run(world, _forward_path, sizes, True, 16)
    assert all(err <= 1e-10 and calls == 3 for err, calls in training), training
    thick = run(world, _forward_path, sizes, False, -1)
    assert all(err <= 1e-10 and calls == 3 for err, calls in thick), thick
    between = run(world, _forward_path, sizes, False, max(sizes) - 1)
    assert all(err <= 1e-10 and calls == 3 for err, calls in between), between
