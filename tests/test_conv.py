"""ShardedConv1d/2d/3d against the torch layers on the full tensor, forward and backward."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


@dataclass(frozen=True)
class Cfg:
    nd: int = 2
    kernel: int | tuple = 3
    stride: int | tuple = 1
    padding: int | tuple | str = 1
    dilation: int | tuple = 1
    groups: int = 1
    bias: bool = True
    mode: str = "zeros"
    size: tuple = (23, 9, 6)  # spatial sizes, first nd used
    cin: int = 4
    cout: int = 6
    batch: int = 2
    domain: int | tuple = 2
    dims: tuple = (2,)
    overlap: bool = True

    def module(self) -> nn.Module:
        torch.manual_seed(0)
        return CONV[self.nd](
            self.cin, self.cout, self.kernel, stride=self.stride, padding=self.padding, dilation=self.dilation,
            groups=self.groups, bias=self.bias, padding_mode=self.mode,
        ).double()

    def input(self) -> torch.Tensor:
        torch.manual_seed(1)
        return torch.randn(self.batch, self.cin, *self.size[: self.nd], dtype=torch.float64)

    def align(self) -> tuple[int, ...]:
        s = (self.stride,) * self.nd if isinstance(self.stride, int) else self.stride
        return tuple(s[d - 2] for d in self.dims)


def _check(cfg: Cfg, sizes=None):
    ref, m = cfg.module(), mesh(cfg.domain)
    # The plan passes the sharded dims to the layer (the default is the first spatial dims).
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": cfg.dims, "overlap": cfg.overlap}})
    return check_against_reference(ref, cfg.input(), m, dims=cfg.dims, align=cfg.align(), sizes=sizes, sharded=sharded)


def world(domain) -> int:
    return domain if isinstance(domain, int) else domain[0] * domain[1]


# Every option of the torch layers, on uneven slabs (23 = 6+6+6+5 on 4 ranks, 8+8+7 on 3).
OPTION_CASES = [
    Cfg(kernel=1, padding=0),
    Cfg(kernel=2, padding=0),
    Cfg(kernel=2, padding=1),
    Cfg(kernel=4, padding="same"),
    Cfg(kernel=5, padding="same", dilation=2),
    Cfg(kernel=3, padding="valid"),
    Cfg(kernel=(5, 3), padding=(2, 0)),
    Cfg(kernel=(4, 3), padding=(3, 1)),
    Cfg(kernel=3, stride=2, padding=1),
    Cfg(kernel=4, stride=2, padding=1),
    Cfg(kernel=2, stride=2, padding=0),
    Cfg(kernel=1, stride=3, padding=0, size=(24, 9, 6)),
    Cfg(kernel=5, stride=3, padding=0, size=(24, 9, 6)),
    Cfg(kernel=3, stride=(2, 1), padding=(0, 1), dilation=(2, 1)),
    Cfg(kernel=3, dilation=3, padding=3),
    Cfg(kernel=1, stride=3, padding=2, size=(24, 9, 6)),  # padding wider than the kernel
    Cfg(kernel=2, stride=2, padding=3, size=(24, 9, 6)),
    Cfg(nd=1, kernel=2, stride=2, padding=1, mode="reflect", size=(24,)),  # reflect pad + trim
    Cfg(kernel=3, groups=2, bias=False),
    Cfg(kernel=3, groups=4, cout=8),
    *[Cfg(kernel=k, padding=p, mode=m, stride=s)
      for m in ("reflect", "replicate", "circular")
      for k, p, s in ((3, 1, 1), (5, 2, 1), (4, 2, 2), (3, (2, 1), 1))],
    Cfg(nd=1, kernel=3, padding=1),
    Cfg(nd=1, kernel=4, stride=2, padding=1, mode="circular"),
    Cfg(nd=1, kernel=7, padding="same", mode="reflect", size=(40,)),
    Cfg(nd=3, kernel=3, padding=1, size=(13, 5, 4)),
    Cfg(nd=3, kernel=(2, 3, 1), stride=(2, 1, 1), padding=(0, 1, 0), mode="replicate", size=(14, 5, 4)),
    # Depth-padded Conv3d (its own weight-gradient path on CPU) with stride, dilation, groups;
    # halo corrections with several taps per row; reflect; and the volume sharded along H.
    Cfg(nd=3, kernel=3, stride=(2, 1, 1), padding=1, dilation=(1, 2, 1), groups=2, cout=4, size=(14, 5, 4)),
    Cfg(nd=3, kernel=(5, 3, 3), padding=(2, 1, 1), size=(16, 5, 4)),
    Cfg(nd=3, kernel=3, padding=1, mode="reflect", size=(13, 5, 4)),
    Cfg(nd=3, kernel=3, padding=1, dims=(3,), size=(5, 13, 4)),
]


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", OPTION_CASES, ids=lambda c: f"{c.nd}d-k{c.kernel}-s{c.stride}-p{c.padding}-d{c.dilation}-g{c.groups}-{c.mode}")
def test_conv_matches_torch_1d_mesh(run, cfg, domain):
    cfg = Cfg(**{**cfg.__dict__, "domain": domain})
    errs = run(world(domain), _check, cfg)
    assert all(e["out"] <= 1e-10 for e in errs)


@pytest.mark.parametrize("cfg", OPTION_CASES[::2], ids=str)
def test_conv_without_overlap(run, cfg):
    # The synchronous path (halo_cat) gives the same answer as the overlapped default.
    run(3, _check, Cfg(**{**cfg.__dict__, "domain": 3, "overlap": False}))


MESH2D_CASES = [
    Cfg(kernel=3, padding=1, size=(11, 9, 6)),
    Cfg(kernel=4, stride=2, padding=1, size=(12, 10, 6)),
    Cfg(kernel=5, padding=2, mode="circular", size=(11, 9, 6)),
    Cfg(kernel=3, padding=1, mode="reflect", size=(11, 9, 6)),
    Cfg(kernel=(3, 2), padding="same", mode="replicate", size=(11, 9, 6)),
    Cfg(nd=3, kernel=3, padding=1, size=(9, 7, 5)),
    Cfg(nd=3, kernel=3, stride=2, padding=1, mode="circular", size=(10, 8, 5)),
]


@pytest.mark.parametrize("cfg", MESH2D_CASES, ids=str)
def test_conv_matches_torch_2x2_mesh(run, cfg):
    cfg = Cfg(**{**cfg.__dict__, "domain": (2, 2), "dims": (2, 3)})
    run(4, _check, cfg)


def test_conv_shards_a_later_dim(run):
    # A 1-D domain can shard any spatial dim, e.g. W of an image.
    run(2, _check, Cfg(kernel=3, padding=1, dims=(3,), size=(7, 12, 6)))


def test_conv_3d_shards_two_dims_of_three(run):
    run(4, _check, Cfg(nd=3, kernel=3, padding=1, domain=(2, 2), dims=(3, 4), size=(5, 8, 7)))


# No shrinking: a failing example restarts the worker pool, which makes shrinking crawl; the
# failing example and its remote traceback are reported as found.
@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    data=st.data(),
    nd=st.sampled_from([1, 2]),
    kernel=st.integers(1, 5),
    stride=st.integers(1, 3),
    dilation=st.integers(1, 2),
    mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
    p=st.integers(1, 4),
)
def test_conv_property_random_splits(pools, data, nd, kernel, stride, dilation, mode, p):
    """Random conv configs on random aligned (not just balanced) splits."""
    span = dilation * (kernel - 1) + 1
    pad = data.draw(st.integers(0, span - 1 if mode == "zeros" else min(span - 1, 2)))
    # Slab sizes: multiples of the stride except the last, each wide enough for the halos.
    need = max(pad, span - stride - pad, stride, pad + 1 if mode == "reflect" else 1)
    blocks = [data.draw(st.integers(-(-need // stride), -(-need // stride) + 3)) for _ in range(p)]
    sizes = [b * stride for b in blocks]
    # The last slab must also leave at least one output: n_last + 2 * pad >= span.
    sizes[-1] = max(need, span - 2 * pad, sizes[-1] - data.draw(st.integers(0, stride - 1)))
    length = sum(sizes)
    if (length + 2 * pad - span) < 0:
        return
    cfg = Cfg(nd=nd, kernel=kernel, stride=stride, padding=pad, dilation=dilation, mode=mode, domain=p,
              size=(length, span + 2, 4), cin=2, cout=3)
    pools.run(p, _check, cfg, tuple(sizes))


# --- bad input: the same clear error on every rank ------------------------------------------


@pytest.mark.parametrize(
    "cfg,sizes,match",
    [
        (Cfg(kernel=3, stride=2, padding=1, domain=2, size=(20, 5, 4)), (9, 11), "start at a multiple of 2"),
        # Truly impossible, on one device too: torch refuses these on the full tensor.
        (Cfg(kernel=5, padding=4, mode="reflect", domain=2, size=(4, 5, 4)), (2, 2), "at most 3"),
        (Cfg(kernel=7, padding=0, domain=2, size=(5, 5, 4)), (3, 2), "no output at all"),
    ],
    ids=["misaligned", "reflect-wider-than-dim", "window-wider-than-dim"],
)
def test_bad_layout_raises_on_every_rank(run, cfg, sizes, match):
    assert all(run(len(sizes), _expect_layer_error, cfg, sizes, match))


def _expect_layer_error(cfg: Cfg, sizes, match):
    # The sharded layer alone: torch itself refuses some of these layouts on the full tensor.
    m = mesh(cfg.domain)
    layer = snn.convert(cfg.module(), m)
    r = m.get_local_rank("domain")
    x_loc = cfg.input().narrow(2, sum(sizes[:r]), sizes[r])
    with pytest.raises(snn.ShardingError, match=match):
        layer(x_loc)
    return True


@pytest.mark.parametrize(
    "cfg,sizes",
    [
        (Cfg(kernel=7, padding=3, domain=4, size=(8, 5, 4)), (2, 2, 2, 2)),
        (Cfg(kernel=5, padding=2, mode="reflect", domain=2, size=(12, 5, 4)), (2, 10)),
        (Cfg(kernel=5, padding=2, mode="circular", domain=3, size=(7, 5, 4)), (1, 5, 1)),
    ],
    ids=["halo-spans-three-ranks", "reflect-thin-edge", "circular-thin-edges"],
)
def test_formerly_refused_thin_slabs_are_exact(run, cfg, sizes):
    # These raised "halo wider than the slab" before multi-hop halos (comm.halo_gather).
    run(len(sizes), _check, cfg, sizes)


def _bad_construction():
    m = mesh(2)
    with pytest.raises(snn.ShardingError, match="not spatial dims"):
        snn.ShardedConv2d(3, 3, 3, mesh=m, dims=(4,))
    with pytest.raises(TypeError, match="DeviceMesh"):
        snn.ShardedConv2d(3, 3, 3, mesh="domain")
    conv = snn.ShardedConv2d(3, 3, 3, padding=1, mesh=m).double()
    with pytest.raises(ValueError, match="expected a 4-d"):
        conv(torch.zeros(1, 1, 3, 4, 5, 6, dtype=torch.float64))
    return True


def test_bad_construction_and_input(run):
    assert all(run(2, _bad_construction))


def _standalone():
    m = mesh(2)
    torch.manual_seed(0)
    conv = snn.ShardedConv3d(4, 4, 3, padding=1, mesh=m).double()
    ref = nn.Conv3d(4, 4, 3, padding=1).double()
    ref.load_state_dict(conv.state_dict())
    assert list(conv.state_dict()) == list(ref.state_dict())
    assert "mesh_axes=('domain',)" in repr(conv)
    x = torch.randn(1, 4, 9, 5, 5, dtype=torch.float64)
    return check_against_reference(ref, x, m, sharded=conv)


def test_standalone_constructor(run):
    run(2, _standalone)


def _unbatched():
    torch.manual_seed(0)
    ref = nn.Conv1d(2, 3, 3, padding=1).double()
    conv = snn.convert(copy.deepcopy(ref), mesh(2))
    x = torch.randn(2, 13, dtype=torch.float64)
    y = snn.gather(conv(snn.shard(x, mesh(2), dims=(1,))), mesh(2), dims=(1,))
    torch.testing.assert_close(y, ref(x))
    return True


def test_unbatched_input(run):
    assert all(run(2, _unbatched))


def _float32_stack():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                        nn.ReLU(), nn.Conv2d(8, 2, 1))
    x = torch.randn(1, 3, 30, 11)
    return check_against_reference(ref, x, mesh(3), align=2, atol=1e-5, rtol=1e-4)


def test_float32_stack(run):
    run(3, _float32_stack)


def test_world_sizes_cover_itertools():
    # Guard: the matrix above really spans several world sizes and modes.
    modes = {c.mode for c in OPTION_CASES}
    assert modes == {"zeros", "reflect", "replicate", "circular"}
    assert any(c.stride != 1 for c in OPTION_CASES) and any(c.groups > 1 for c in OPTION_CASES)
    assert list(itertools.islice(range(4), 2)) == [0, 1]


def _double_backward(nd):
    """Second derivatives (a gradient penalty) through converted convs."""
    m = mesh(dist.get_world_size())
    torch.manual_seed(0)
    ref = nn.Sequential(CONV[nd](2, 3, 3, padding=1), nn.Tanh(), CONV[nd](3, 2, 3, padding=1)).double()
    sharded = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 2, 8, 5, *((4,) if nd == 3 else ()), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(ref(xr).pow(2).sum(), xr, create_graph=True)
    g.pow(2).sum().backward()
    xl = snn.shard(x, m, dims=(2,)).requires_grad_()
    (gl,) = torch.autograd.grad(sharded(xl).pow(2).sum(), xl, create_graph=True)
    if dist.get_world_size() > 1:
        # The halo exchange's backward is not recorded: a clear error, never a wrong answer.
        with pytest.raises(RuntimeError, match="differentiate twice"):
            gl.pow(2).sum().backward()
        return True
    gl.pow(2).sum().backward()
    torch.testing.assert_close(xl.grad, xr.grad, atol=1e-10, rtol=1e-10)
    for a, b in zip(ref.parameters(), sharded.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("nd", [2, 3])
def test_double_backward(run, world, nd):
    assert all(run(world, _double_backward, nd))



# --- the depth-padded Conv3d weight-gradient paths ---------------------------------------------

#: The 3-D cases that pad along depth (the sharded dim), strided, dilated, grouped and reflect.
DEPTH_PADDED = [c for c in OPTION_CASES if c.nd == 3 and c.dims == (2,) and c.padding not in (0, (0, 1, 0))]


def _with_depth_padding(explicit: bool, fn, *args):
    """``fn(*args)`` with the explicitly padded weight gradient forced on or off (this rank)."""
    from sharded_nn.layers import conv

    saved = conv._EXPLICIT_DEPTH_PAD
    conv._EXPLICIT_DEPTH_PAD = explicit
    try:
        return fn(*args)
    finally:
        conv._EXPLICIT_DEPTH_PAD = saved


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("domain", [1, 2, 3])
def test_depth_padded_conv3d_both_paths(run, domain, explicit):
    # Which path runs depends on the CPU (see layers/conv.py::_conv); both must be exact anywhere.
    assert len(DEPTH_PADDED) >= 4
    for cfg in DEPTH_PADDED:
        run(domain, _with_depth_padding, explicit, _check, Cfg(**{**cfg.__dict__, "domain": domain}))


def test_depth_padded_conv3d_double_backward_explicit(run):
    assert all(run(1, _with_depth_padding, True, _double_backward, 3))


def test_depth_padding_choice_follows_onednn_isa(monkeypatch):
    from sharded_nn.layers import conv

    def decide(capability, cap_env):
        monkeypatch.setattr(conv, "_EXPLICIT_DEPTH_PAD", None)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        if cap_env is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap_env)
        return conv._explicit_depth_padding()

    assert decide("AVX2", None) is True
    assert decide("DEFAULT", None) is True
    assert decide("AVX512", None) is False
    assert decide("AVX512", "AVX512_CORE_AMX") is False
    assert decide("AVX512", "avx2") is True  # oneDNN held below AVX-512



# --- float32 volumes that torch would convolve on its reference kernel --------------------------

#: (input shape, weight shape, stride, padding, dilation): one-sample float32 geometries that
#: torch sends to slow_conv3d (N*C*S0*S1 <= 20480); the sharded conv runs them on oneDNN.
ONEDNN_GEOMETRIES = [
    ((1, 4, 9, 6, 5), (6, 4, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
    ((1, 4, 10, 6, 5), (4, 4, 4, 3, 2), (2, 1, 1), (2, 1, 0), (1, 1, 1)),
    # Dilated along the cut (torch picks oneDNN itself for dilated convs; the cut is checked anyway).
    ((1, 3, 11, 7, 5), (5, 3, 3, 3, 3), (1, 2, 1), (2, 1, 1), (2, 1, 1)),
    ((1, 3, 1, 7, 5), (5, 3, 1, 3, 3), (1, 1, 1), (0, 1, 1), (1, 1, 1)),  # one plane: cut along H
    ((1, 4, 2, 3, 3), (4, 4, 3, 3, 3), (3, 1, 1), (1, 1, 1), (1, 1, 1)),
    ((1, 1, 8, 6, 5), (4, 1, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),  # one channel: torch's kernel in training
]


@pytest.mark.parametrize("geometry", ONEDNN_GEOMETRIES, ids=str)
def test_reference_kernel_geometries_run_on_onednn_exactly(geometry):
    from sharded_nn.layers import conv

    xs, ws, stride, padding, dilation = geometry
    torch.manual_seed(0)
    x = torch.randn(xs, requires_grad=True)
    w = torch.randn(ws, requires_grad=True)
    b = torch.randn(ws[0], requires_grad=True)
    assert conv._on_reference_kernel(x, w, stride, padding, dilation, 1) == (dilation == (1, 1, 1))
    want = torch.nn.functional.conv3d(x, w, b, stride, padding, dilation)
    with torch.no_grad():  # forward only: oneDNN's convolution called directly
        direct = conv._conv3d_on_onednn(x, w, b, stride, padding, dilation, 1)
    torch.testing.assert_close(direct, want, atol=2e-5, rtol=1e-5)
    got = conv._conv3d_on_onednn(x, w, b, stride, padding, dilation, 1)
    if xs[1] == 1:
        assert got is None  # the caller keeps torch's convolution
        return
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    g = torch.randn(want.shape)
    # Double backward (a gradient penalty) through the cut: differentiable ops only.
    grads = torch.autograd.grad((got * g).sum(), (x, w, b), create_graph=True)
    ref_grads = torch.autograd.grad((want * g).sum(), (x, w, b), create_graph=True)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=5e-5, rtol=1e-5)
    second = torch.autograd.grad(grads[0].square().sum(), w)[0]
    ref_second = torch.autograd.grad(ref_grads[0].square().sum(), w)[0]
    torch.testing.assert_close(second, ref_second, atol=1e-3, rtol=1e-4)


def test_reference_kernel_choice_is_torch_own():
    from sharded_nn.layers import conv

    one = [1, 1, 1]
    w = torch.randn(8, 8, 3, 3, 3)
    assert conv._on_reference_kernel(torch.randn(1, 8, 8, 16, 16), w, one, one, one, 1)  # 8*8*16 <= 20480
    assert not conv._on_reference_kernel(torch.randn(1, 8, 24, 128, 16), w, one, one, one, 1)  # above it
    assert not conv._on_reference_kernel(torch.randn(2, 8, 8, 16, 16), w, one, one, one, 1)  # a batch
    assert not conv._on_reference_kernel(torch.randn(1, 8, 8, 16, 16).double(), w.double(), one, one, one, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not conv._on_reference_kernel(torch.randn(1, 8, 8, 16, 16), w, one, one, one, 1)
    # One-tap kernels keep torch's choice (its own kernel, deliberately, on one thread).
    assert not conv._on_reference_kernel(torch.randn(1, 8, 8, 16, 16), w[..., :1, :1, :1], [2, 2, 2], [0] * 3, one, 1)
    torch.backends.mkldnn.enabled = False  # the user switched oneDNN off: respected
    try:
        assert not conv._on_reference_kernel(torch.randn(1, 8, 8, 16, 16), w, one, one, one, 1)
    finally:
        torch.backends.mkldnn.enabled = True


def _thin_float32_volume(explicit_depth_pad: bool):
    """A float32 Conv3d stack on slabs thin enough for torch's reference kernel, against torch."""
    from sharded_nn.layers import conv

    calls = []
    original = conv._conv3d_on_onednn

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    conv._conv3d_on_onednn = counted
    try:
        m = mesh(dist.get_world_size())
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.GELU(), nn.Conv3d(8, 4, 3, stride=(2, 1, 1), padding=1))
        x = torch.randn(1, 4, 13, 10, 9)
        errs = _with_depth_padding(
            explicit_depth_pad, lambda: check_against_reference(ref, x, m, align=2, atol=1e-4, rtol=1e-4)
        )
    finally:
        conv._conv3d_on_onednn = original
    if dist.get_world_size() > 1:
        assert calls, "the thin slabs did not take the oneDNN path"
    return errs


@pytest.mark.parametrize("explicit_depth_pad", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_thin_float32_volumes_match_torch(run, world, explicit_depth_pad):
    run(world, _thin_float32_volume, explicit_depth_pad)


# --- bounded caches, keyed by facts every rank shares ---------------------------------------


def _many_geometries():
    """Ten input lengths: the plan cache stays bounded and every result stays exact.

    Balanced slabs of consecutive lengths often change only one rank's slab: the plans are
    keyed by the gathered layout, so every rank misses (and plans) together.
    """
    from sharded_nn.layers import conv as conv_module

    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Conv1d(2, 3, 5, padding=2).double()
    conv = snn.convert(copy.deepcopy(ref), m)
    for length in range(8, 18):
        x = torch.randn(1, 2, length, dtype=torch.float64)
        y = snn.gather(conv(snn.shard(x, m, dims=(2,))), m, dims=(2,))
        torch.testing.assert_close(y, ref(x), atol=1e-12, rtol=1e-12)
    return len(conv._plans), conv_module._PLAN_CACHE_SIZE


def test_plan_cache_is_bounded(run):
    for n_plans, bound in run(2, _many_geometries):
        assert n_plans == bound < 10


def _reconfigured(world):
    # A converted conv whose torch attributes change after a call (padding, dilation, kernel
    # read by the halo plans) must plan afresh, not reuse the plans of the old configuration.
    m = mesh(world)
    torch.manual_seed(0)
    ref = nn.Conv2d(2, 3, 3, padding=1).double()
    conv = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 2, 13, 6, dtype=torch.float64)
    for padding, dilation in [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((2, 2), (2, 1)), ((0, 1), (1, 1))]:
        for module in (ref, conv):
            module.padding, module.dilation = padding, dilation
        y = snn.gather(conv(snn.shard(x, m, dims=(2,))), m, dims=(2,))
        torch.testing.assert_close(y, ref(x), atol=1e-12, rtol=1e-12)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_changed_configuration_is_planned_afresh(run, world):
    assert all(run(world, _reconfigured, world))


def test_halo_tap_cache_is_bounded():
    from sharded_nn.layers import window
    from sharded_nn.layers.base import BoundedCache

    cache = BoundedCache(3)
    for k in range(5):
        assert cache.get(k, pow, k, 2) == k * k
    assert len(cache) == 3 and cache.get(2, int, -1) == 4 and cache.get(0, int, -1) == -1
    assert isinstance(window._HALO_TAPS, BoundedCache) and window._HALO_TAPS.maxsize <= 1024
    # No functools cache in the layers: unbounded, and Dynamo warns on lru_cache wrappers.
    import pathlib

    for path in pathlib.Path(window.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "functools.cache" not in text and "lru_cache" not in text and "@cache" not in text, path


def _channels_last(batch: int, overlap: bool):
    """A channels-last input keeps channels-last strides through the sharded convolutions."""
    m = mesh(dist.get_world_size())
    torch.manual_seed(0)
    # Depthwise (halo corrections), reflect padding (edge pieces) and stride 2 on uneven slabs
    # (the interior/edge split of apply_overlapped).
    ref = nn.Sequential(
        nn.Conv2d(8, 8, 7, padding=3, groups=8), nn.Conv2d(8, 4, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(4, 4, 4, stride=2, padding=1),
    ).double()
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"overlap": overlap}})
    x = torch.randn(batch, 8, 22, 9, dtype=torch.float64).to(memory_format=torch.channels_last)
    sl = snn.local_slices(x.shape, m, dims=(2,), align=2)
    xs = x[sl].clone(memory_format=torch.channels_last).requires_grad_()
    h = xs
    for layer, plain in zip(sharded, ref):
        # What torch's own layer gives for a channels-last input of this shape.
        want_cl = plain(h.detach()).is_contiguous(memory_format=torch.channels_last)
        h = layer(h)
        assert want_cl and h.is_contiguous(memory_format=torch.channels_last), (batch, h.shape, h.stride())
    xr = x.detach().requires_grad_()
    y_ref = ref(xr)
    torch.testing.assert_close(h, y_ref[snn.local_slices(y_ref.shape, m, dims=(2,))], rtol=1e-10, atol=1e-10)
    h.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad[sl], rtol=1e-10, atol=1e-10)
    assert xs.grad.is_contiguous(memory_format=torch.channels_last)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("overlap", [True, False])
def test_channels_last_input_stays_channels_last(run, world, batch, overlap):
    # A ConvNeXt's depthwise convolutions take channels-last activations (its LayerNorm2d
    # permutes). The halo path once returned a view whose batch stride torch no longer read as
    # channels-last, for a batch of one: every such convolution copied its slab to NCHW and ran
    # the NCHW kernel, 3.4x slower (issue 16).
    assert all(run(world, _channels_last, batch, overlap))


# --------------------------------------------------------------------------------------------
# The functional form: weights computed by the caller (weight standardisation, fixed filters)

FUNCTIONAL_CASES = [
    # (spatial dims, kernel, stride, padding, dilation, groups, bias)
    (1, 3, 1, 1, 1, 1, True),
    (2, 3, 1, 1, 1, 1, True),
    (2, 3, 2, 2, 2, 2, False),
    (2, 5, 1, "same", 1, 4, True),
    (2, 1, 2, 0, 1, 1, True),
    (3, 3, 1, 1, 1, 1, True),
    # padding_mode (an option beyond F.conv*d's): padding of the full input from the edge slabs
    (2, 3, 2, 1, 1, 4, False, "reflect"),
    (2, 3, 1, 1, 2, 1, True, "circular"),
    (1, 5, 1, 2, 1, 1, True, "replicate"),
]


def _functional(nd, kernel, stride, padding, dilation, groups, bias, mode, sizes):
    import torch.nn.functional as F

    m = mesh(len(sizes))
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    x = torch.randn(2, 4, sum(sizes), *[7, 5][: nd - 1], dtype=torch.float64)
    # Weights computed from parameters, as a weight-standardised convolution does: the gradient
    # must reach the parameter through the computation.
    p = torch.randn(8, 4 // groups, *([kernel] * nd), dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True) if bias else None

    def weight():
        return (p - p.mean(tuple(range(1, p.dim())), keepdim=True)) * 0.5

    xr = x.clone().requires_grad_()
    if mode == "zeros":
        y = fn(xr, weight(), b, stride, padding, dilation, groups)
    else:  # what nn.Conv*d does with a padding mode
        y = fn(F.pad(xr, [padding] * (2 * nd), mode=mode), weight(), b, stride, 0, dilation, groups)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    want = [p.grad.clone(), None if b is None else b.grad.clone()]
    p.grad = None
    if b is not None:
        b.grad = None
    xs = x.narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    ys = snn.functional.conv(xs, weight(), b, stride, padding, dilation, groups, mesh=m, padding_mode=mode)
    full = snn.gather(ys, m, dims=(2,))
    torch.testing.assert_close(full, y.detach(), rtol=1e-10, atol=1e-10)
    gl = g.narrow(2, sum(snn.gather(torch.tensor([ys.shape[2]]), m, dims=(0,))[:r].tolist()), ys.shape[2])
    (ys * gl).sum().backward()
    torch.testing.assert_close(snn.gather(xs.grad, m, dims=(2,)), xr.grad, rtol=1e-10, atol=1e-10)
    # The weight and bias gradients are this rank's partial sums (gradient convention).
    for got, ref in zip((p.grad, None if b is None else b.grad), want):
        if ref is not None:
            dist.all_reduce(got)
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    # A second call with the same configuration reuses the geometry-only layer (and its plans):
    # the same values bit for bit under autograd; without it (inference: thin slabs may take the
    # synchronous path, ``layers/conv.py: _sync_cheaper``) the same to rounding.
    again = snn.functional.conv(xs.detach().requires_grad_(), weight(), b, stride, padding, dilation, groups, mesh=m,
                                padding_mode=mode)
    torch.testing.assert_close(again, ys, rtol=0, atol=0)
    with torch.no_grad():
        frozen = snn.functional.conv(xs, weight(), b, stride, padding, dilation, groups, mesh=m, padding_mode=mode)
    torch.testing.assert_close(snn.gather(frozen, m, dims=(2,)), y.detach(), rtol=1e-10, atol=1e-10)
    return True


@pytest.mark.parametrize("sizes", [(6, 4), (6, 4, 4), (8,)], ids=str)
@pytest.mark.parametrize("case", FUNCTIONAL_CASES, ids=str)
def test_functional_conv_matches_torch(run, case, sizes):
    case = case if len(case) == 8 else (*case, "zeros")
    assert all(run(len(sizes), _functional, *case, sizes))


def _bad_weight():
    with pytest.raises(snn.ShardingError, match="expected a 3-d, 4-d or 5-d weight"):
        snn.functional.conv(torch.randn(1, 2, 4, 4), torch.randn(3, 2), mesh=mesh(2))
    with pytest.raises(snn.ShardingError, match="local input shape"):
        snn.functional.conv(torch.randn(4, 4), torch.randn(3, 2, 3, 3), mesh=mesh(2))
    return True


def test_functional_conv_rejects_a_bad_weight(run):
    assert all(run(2, _bad_weight))
