"""Converted models under ``torch.compile`` give the eager results.

Sharded layers run eagerly when a compiled forward calls them (``sharded_nn/compile_boundary.py``:
one graph break each); the code between them compiles. The backend is a parameter:
``aot_eager`` (traces forward and backward through AOTAutograd, no C++ toolchain) runs in
seconds; ``inductor`` (the default) compiles C++ on CPU, which takes minutes on this shared
2-core machine, so the tests use ``aot_eager``; the graphs and graph breaks are the same, only
code generation differs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn

from .harness import assert_compiled_cleanly, mesh
from .reference import check_against_reference


def _layers(kind: str) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind == "norms":  # conv, every norm family, pool
        return [
            nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(4),
            nn.GroupNorm(2, 4),
            nn.MaxPool2d(3, stride=1, padding=1),
            nn.LayerNorm([4, 6, 5]),
        ]
    if kind == "taps":  # halo-row corrections: one row (3x3), a band of rows (5x5, 7x7 depthwise)
        return [nn.Conv2d(3, 4, 5, padding=2), nn.Conv2d(4, 4, 7, padding=3, groups=4), nn.Conv2d(4, 2, 3, padding=1)]
    if kind == "conv3d":  # depth-padded Conv3d: the custom weight-gradient path on CPU
        return [nn.Conv3d(3, 4, 3, padding=1), nn.Conv3d(4, 2, (3, 1, 3), padding=(1, 0, 1), groups=2)]
    return [nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 4)]  # for the 2-D mesh


class _Step(nn.Module):
    """A layer and the user's own code after it (elementwise: exact on slabs without the guard).

    Compiled, the code after the layer is the graph; the sharded layer runs eagerly between
    graphs. ``direct``: the forward calls ``layer.forward(x)`` itself, not ``layer(x)``.
    """

    def __init__(self, layer: nn.Module, direct: bool = False) -> None:
        super().__init__()
        self.layer, self.direct = layer, direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer.forward(x) if self.direct else self.layer(x)
        return y + 0.25 * torch.tanh(y) * y


def _check(domain, dims, kind, how="steps"):
    if kind == "conv3d":
        # The explicitly padded weight-gradient Function, forced on (this CPU may not take it).
        from sharded_nn.layers import conv

        saved, conv._EXPLICIT_DEPTH_PAD = conv._EXPLICIT_DEPTH_PAD, True
        try:
            return _check_compiled(domain, dims, kind, how)
        finally:
            conv._EXPLICIT_DEPTH_PAD = saved
    return _check_compiled(domain, dims, kind, how)


def _check_compiled(domain, dims, kind, how):
    """``how``: "steps" (each layer in a ``_Step``, converted with ``guard=False``: the user's code
    between the layers is elementwise), "direct" (the same, calling ``layer.forward``), or
    "sequential" (an ``nn.Sequential`` of the layers and ReLUs, guarded: it compiles as it is)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = mesh(domain)
    if how == "sequential":
        ref = nn.Sequential(*(z for layer in _layers(kind) for z in (layer, nn.ReLU()))).double()
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
    else:
        ref = nn.Sequential(*(_Step(layer, how == "direct") for layer in _layers(kind))).double()
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}}, guard=False)
    # nn.Module.compile compiles in place: parameter names (and the reference check) unchanged.
    sharded.compile(backend="aot_eager")
    torch.manual_seed(1)
    graphs = []
    for _ in range(2):  # the second call reuses the compiled graphs
        for p in (*ref.parameters(), *sharded.parameters()):
            p.grad = None
        # Uneven slabs: taps 6, 4, 4 at P=3; conv3d 6, 4 at P=2; the others 6, 6 and 6x5 on 2x2.
        rows = {"taps": 14, "conv3d": 10}.get(kind, 12)
        x = torch.randn(2, 3, rows, 10, *((6,) if kind == "conv3d" else ()), dtype=torch.float64)
        check_against_reference(ref, x, m, dims=dims, align=2, sharded=sharded, atol=1e-9, rtol=1e-9)
        graphs.append(counters["stats"]["unique_graphs"])
    for a, b in zip(ref.buffers(), sharded.buffers()):
        torch.testing.assert_close(b, a)
    assert_compiled_cleanly(graphs=how != "sequential")
    # Dynamo broke its graphs only at the sharded layers' eager calls: it traced none of their
    # internals (each of their collectives broke a graph before session 66).
    others = [k.splitlines()[0][:120] for k in counters["graph_break"] if "disable" not in k]
    assert not others, others
    # No recompilation on the second call (a layer's state leaking into a guard would).
    assert graphs[0] == graphs[1], graphs
    return True


def test_compiled_norm_pool_stack(run):
    assert all(run(2, _check, 2, (2,), "norms"))


def test_compiled_guarded_sequential_of_sharded_layers(run):
    # Sharded layers and ReLUs in containers: no call of the model's own to guard, so the
    # converted model compiles as it is (nothing between the layers for a graph to hold).
    assert all(run(2, _check, 2, (2,), "norms", "sequential"))


@pytest.mark.parametrize("how", ["steps", "direct"])
def test_compiled_halo_row_corrections(run, how):
    # Three ranks, uneven slabs of 14 rows: the middle rank corrects rows from both halos; the
    # 5x5 and 7x7 kernels read 2 and 3 rows from each neighbour (one band call per halo).
    assert all(run(3, _check, 3, (2,), "taps", how))


def test_compiled_conv_norm_2x2_mesh(run):
    assert all(run(4, _check, (2, 2), (2, 3), "small"))


def test_compiled_conv3d_stack(run):
    assert all(run(2, _check, 2, (2,), "conv3d"))


class _FunctionalUser(nn.Module):
    """A model of the user's own that calls ``sharded_nn.functional``'s grid functions itself."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(torch.randn(3, 2, 5, 3, dtype=torch.float64))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = snn.functional
        y = fn.conv(fn.pad(torch.tanh(x), (1, 1, 2, 2), self.mesh, mode="reflect"), self.weight, mesh=self.mesh)
        y = fn.group_norm(y * 2.0, 1, self.scale, mesh=self.mesh)
        return fn.interpolate(torch.sigmoid(y), self.mesh, scale_factor=2, mode="bilinear")


def _check_compiled_functional(domain: int):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = mesh(domain)
    torch.manual_seed(0)
    model = _FunctionalUser(m)
    x = torch.randn(2, 2, 13, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y_ref = torch.tanh(x)
    import torch.nn.functional as F

    y_ref = F.conv2d(F.pad(y_ref, (1, 1, 2, 2), mode="reflect"), model.weight)
    y_ref = F.group_norm(y_ref * 2.0, 1, model.scale)
    y_ref = F.interpolate(torch.sigmoid(y_ref), scale_factor=2, mode="bilinear")
    g = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (y_ref * g).sum().backward()
    want_w, want_s = model.weight.grad.clone(), model.scale.grad.clone()
    model.compile(backend="aot_eager")
    sl = snn.local_slices(x.shape, m, dims=(2,))
    for _ in range(2):
        model.weight.grad = model.scale.grad = None
        xl = x.detach()[sl].clone().requires_grad_()
        y = model(xl)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, y.shape[2])
        start = sum(rows[: dist.get_rank()])
        (y * g[:, :, start : start + y.shape[2]]).sum().backward()
        ys, gx = [None] * len(rows), [None] * len(rows)
        dist.all_gather_object(ys, y.detach())
        dist.all_gather_object(gx, xl.grad)
        torch.testing.assert_close(torch.cat(ys, 2), y_ref.detach(), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(torch.cat(gx, 2), x.grad, atol=1e-10, rtol=1e-10)
        for p, want in ((model.weight, want_w), (model.scale, want_s)):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # partial sums over the domain ranks
            torch.testing.assert_close(grad, want, atol=1e-10, rtol=1e-10)
    assert_compiled_cleanly()
    others = [k.splitlines()[0][:120] for k in counters["graph_break"] if "disable" not in k]
    assert not others, others
    return True


def test_compiled_model_calling_functional_grid_functions(run):
    # conv / pad / group_norm / interpolate of sharded_nn.functional in a compiled forward of
    # the user's own: each runs eagerly; tanh, the scaling, sigmoid and the sum compile.
    assert all(run(2, _check_compiled_functional, 2))


def _eager_model_compiled_part(domain: int):
    # An eager, guarded model with a compiled submodule that changes the slabs' layout (a pad
    # of the last rows: 6, 6, 5 -> 6, 6, 6) before another layer. The layout scope must not
    # answer that layer from the layouts it remembered before the compiled part (6, 6, 5 on the
    # ranks whose slabs kept their size, an agreement on the others): that mispaired the
    # collectives (a TransportError here; a hang under gloo) until session 66.
    torch._dynamo.reset()
    m = mesh(domain)
    torch.manual_seed(0)
    ref = _PadBetween().double()
    sharded = snn.convert(copy.deepcopy(ref), m)
    sharded.sub.compile(backend="aot_eager")
    x = torch.randn(1, 2, 34, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for p in (*ref.parameters(), *sharded.parameters()):
            p.grad = None
        check_against_reference(ref, x, m, dims=(2,), sharded=sharded, sizes=(12, 12, 10), atol=1e-10, rtol=1e-10)
    return True


class _PadBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.sub = nn.Sequential(nn.ZeroPad2d((0, 0, 0, 1)), nn.ReLU())
        self.b = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.sub(self.a(x)) * 1.5)


def test_compiled_submodule_of_an_eager_model_leaves_no_stale_layout(run):
    assert all(run(3, _eager_model_compiled_part, 3))


class _LayoutsInForward(nn.Module):
    """A forward that agrees on layouts itself (as zoo helpers and reductions do)."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (lay,) = snn.comm.gather_layouts(x.shape, self.mesh, (2,), what="probe")
        return x * float(lay.size)


def _no_lru_cache_warning():
    import warnings

    from torch._dynamo.utils import warn_once_cache

    torch._dynamo.reset()
    warn_once_cache.clear()  # Dynamo warns once per message and process
    m = mesh(2)
    model = _LayoutsInForward(m)
    model.compile(backend="aot_eager")
    x = torch.randn(1, 2, 5 if m.get_local_rank("domain") == 0 else 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = model(x)
    torch.testing.assert_close(y, x * 9.0)
    # The cause is gone (sizes.py keeps its layouts in a plain bounded dict), not silenced.
    return [str(w.message)[:200] for w in caught if "lru_cache" in str(w.message)]


def test_no_lru_cache_warning_under_compile(run):
    assert run(2, _no_lru_cache_warning, timeout=300) == [[], []]


def _check_compiled_vit(domain: int):
    # timm's own ViT, converted, under torch.compile (aot_eager): ring attention, the position
    # embedding slices, the token pooling and the replicated logits, in float64 against timm.
    import timm
    from torch._dynamo.utils import counters

    from sharded_nn import zoo

    torch._dynamo.reset()
    counters.clear()
    m = mesh(domain)
    kw = dict(img_size=64, depth=2, num_classes=5)
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", **kw).double()
    sharded = zoo.create_model("vit_tiny_patch16_224", mesh=m, **kw).double()
    sharded.load_state_dict(ref.state_dict())
    sharded.compile(backend="aot_eager")
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    g = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (ref(x) * g).sum().backward()
    y_ref = ref(x).detach()
    # 4 patch rows: uneven patch-aligned slabs at P=3 (2, 1, 1).
    x_local = x.detach()[snn.local_slices(x.shape, m, dims=(2,), align=16)].clone()
    for _ in range(2):  # the second call reuses the compiled graphs
        for p in sharded.parameters():
            p.grad = None
        xl = x_local.clone().requires_grad_()
        y = sharded(xl)
        snn.losses.share((y * g).sum(), m).backward()
        torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
        gx = [None] * dist.get_world_size()
        dist.all_gather_object(gx, xl.grad)
        torch.testing.assert_close(torch.cat(gx, 2), x.grad, atol=1e-10, rtol=1e-10)
        for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # parameter gradients are partial sums over the domain ranks
            torch.testing.assert_close(grad, q.grad, atol=1e-10, rtol=1e-10, msg=name)
    assert_compiled_cleanly()
    # Ring attention ran eagerly (sharded_nn/compile_boundary.py): Dynamo traced none of its
    # point-to-point exchanges (33 graphs at P=2 while it did, 10 now).
    traced = [k.splitlines()[0][:120] for k in counters["graph_break"] if "P2P" in k or "context manager" in k]
    assert not traced, traced
    return True


def test_compiled_vit(run):
    assert all(run(3, _check_compiled_vit, 3, timeout=300))


def _check_compiled_unet(domain: int):
    # The zoo UNet (strided convs, transposed convs, GroupNorm, skip concatenations, the far-edge
    # pad and crop for a size that is no multiple of its alignment), converted and compiled.
    from torch._dynamo.utils import counters

    from sharded_nn.zoo import UNet, create_model

    torch._dynamo.reset()
    counters.clear()
    m = mesh(domain)
    kw = dict(channels=(4, 8))
    torch.manual_seed(0)
    ref = UNet(2, 2, 3, **kw).double()
    sharded = create_model("unet2d", mesh=m, in_channels=2, out_channels=3, **kw).double()
    sharded.load_state_dict(ref.state_dict())
    sharded.compile(backend="aot_eager")
    align = snn.alignment(ref, dims=(2,))
    for _ in range(2):
        for p in (*ref.parameters(), *sharded.parameters()):
            p.grad = None
        x = torch.randn(1, 2, 21, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        check_against_reference(ref, x, m, dims=(2,), align=align, sharded=sharded, atol=1e-9, rtol=1e-9)
    assert_compiled_cleanly()
    return True


def test_compiled_unet(run):
    assert all(run(2, _check_compiled_unet, 2, timeout=300))


class _SqueezeExcite(nn.Module):
    """A block whose own forward mixes positions (a mean over H and W): exact only under the guard."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        return x + h * torch.sigmoid(h.mean((2, 3), keepdim=True))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 3, padding=1)
        self.block = _SqueezeExcite()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.relu(self.stem(x)))


def _check_compiled_routed(domain: int, what: str):
    # Before session 35 a compiled converted model ran its own calls without the guard: the
    # squeeze-excite mean was taken over each slab alone (an error of about 1e-2, silently).
    torch._dynamo.reset()
    m = mesh(domain)
    torch.manual_seed(0)
    ref = _Outer().double()
    sharded = snn.convert(copy.deepcopy(ref), m)
    if what == "root":
        sharded.compile(backend="aot_eager")
    else:
        sharded.block.compile(backend="aot_eager")
    x = torch.randn(2, 3, 10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for p in (*ref.parameters(), *sharded.parameters()):
            p.grad = None
        check_against_reference(ref, x, m, dims=(2,), sharded=sharded, sizes=(6, 4), atol=1e-10, rtol=1e-10)
    return "forward" in sharded.__dict__


@pytest.mark.parametrize("what", ["root", "block"])
def test_compiled_model_with_own_position_mixing_calls_is_exact(run, what):
    # The root's forward runs eagerly under the guard (its instance ``forward`` says so).
    assert all(run(2, _check_compiled_routed, 2, what, timeout=300))


def _compile_decision(domain: int):
    m = mesh(domain)
    plain = snn.convert(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.GELU(), nn.BatchNorm2d(2)), m)
    routed = snn.convert(_Outer(), m)
    unguarded = snn.convert(_Outer(), m, guard=False)
    return ["forward" in model.__dict__ for model in (plain, routed, unguarded)]


def test_only_models_with_calls_to_guard_run_eagerly_under_compile(run):
    assert run(2, _compile_decision, 2) == [[False, True, False]] * 2
