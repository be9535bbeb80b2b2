"""``snn.plan_memory``: prediction against a traced real run, P scaling, budget parsing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.planner import LiveBytes, parse_bytes, trace_peak


def _conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 16, 3, padding=1, stride=2), nn.GELU(),
        nn.Conv2d(16, 1, 1),
    )  # fmt: skip


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return snn.zoo.create_model("vit_tiny_patch16_224", img_size=64, depth=2)


def _measured(model: nn.Module, shape: tuple[int, ...]) -> int:
    """Real run at P=1: the same live-bytes tracker on real tensors, plus parameters and input."""
    x = torch.randn(shape, requires_grad=True)
    tracker = trace_peak(model, x)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return tracker.peak() + params + x.numel() * x.element_size()


@pytest.mark.parametrize("build,shape", [(_conv, (1, 3, 64, 64)), (_vit, (1, 3, 64, 64))], ids=["conv", "vit"])
def test_prediction_within_15_percent_of_real_run(build, shape):
    model = build()
    plan = snn.plan_memory(model, shape, max_ranks=2)
    # The model itself was not touched: no gradients, real (not fake) parameters.
    assert all(p.grad is None and type(p) is nn.Parameter for p in model.parameters())
    measured = _measured(model, shape)
    assert abs(plan.peak(1) - measured) <= 0.15 * measured, (plan.peak(1), measured)


def _allocator_peak(step) -> int:
    """The CPU allocator's own peak over ``step()`` above its start: every allocation, kernels'
    scratch included, from the profiler's memory events (what the plan must account for)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())  # fmt: skip
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _kernels() -> nn.Module:
    """Convolutions that ATen runs through each CPU backend: the native 3-D and 2-D kernels (few
    channels, a thin grid: their column matrices are 27 and 9 times the input), oneDNN, a
    transposed one and a 1x1 one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(4, 16, 3, padding=1), nn.GELU(), nn.Conv3d(16, 16, 3, padding=1, stride=2), nn.GELU(),
        nn.ConvTranspose3d(16, 8, 2, stride=2), nn.Flatten(1, 2), nn.Conv2d(8 * 24, 8, 3, padding=1), nn.GELU(),
        nn.Conv2d(8, 4, 1),
    )  # fmt: skip


@pytest.mark.parametrize("backward", [True, False])
def test_plan_equals_the_allocators_peak_kernel_scratch_included(backward):
    """The native convolution kernels unfold their input (im2col) into buffers the traced
    tensors do not show (``sharded_nn.conv_workspace``): without them the plan of this model
    was a fraction of the allocator's real peak."""
    model, shape = _kernels(), (1, 4, 24, 24, 24)
    x = torch.randn(shape, requires_grad=backward)

    def step():
        y = model(x)
        if backward:
            y.sum().backward()

    with torch.no_grad() if not backward else torch.enable_grad():
        step()  # first-call allocations (oneDNN's primitives) out of the way
        model.zero_grad(set_to_none=True)
        x.grad = None
        real = _allocator_peak(step)
    plan = snn.plan_memory(model, shape, max_ranks=1, backward=backward)
    # The plan counts parameters and input apart; backward=True: the gradients stay allocated.
    predicted = plan.peak(1) - plan.param_bytes - plan.input_bytes[0]
    assert abs(predicted - real) <= 0.03 * real, (predicted, real)
    blind = LiveBytes(workspaces=False)
    model.zero_grad(set_to_none=True)
    x.grad = None
    with torch.no_grad() if not backward else torch.enable_grad(), blind:
        step()
    assert blind.peak() < 0.8 * real  # the scratch matters here: the test would catch its loss


def test_workspace_of_a_native_3d_convolution_is_its_column_matrix():
    from sharded_nn.conv_workspace import workspace_bytes

    x, w = torch.empty(1, 4, 10, 12, 14), torch.empty(6, 4, 3, 3, 3)  # one sample: native
    conv = torch.ops.aten.convolution.default
    args = (x, w, None, [1, 1, 1], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1)
    assert torch._C._select_conv_backend(x, w, None, *args[3:], None) == torch._C._ConvBackend.Slow3d
    assert workspace_bytes(conv, args) == (4 * 27) * (8 * 10 * 12) * 4  # N * C*k^3 rows * output positions
    assert workspace_bytes(torch.ops.aten.add.Tensor, (x, x)) == 0
    assert workspace_bytes(conv, (x.to("meta"), w.to("meta"), *args[2:])) == 0  # not a CPU kernel


def test_real_tracker_frees_what_autograd_frees():
    """After the step only the parameter gradients stay alive (the timeline returns to them)."""
    model = _conv()
    x = torch.randn(1, 3, 32, 32, requires_grad=True)
    tracker = trace_peak(model, x)
    grads = sum(p.grad.numel() * 4 for p in model.parameters())
    assert tracker.timeline[-1][1] == grads  # replicated: the gradients
    assert tracker.timeline[-1][0] <= x.numel() * 4  # activations freed (x.grad may remain)
    assert tracker.peak() > tracker.timeline[-1][0] + tracker.timeline[-1][1]


def test_keyword_inputs_transolver_within_15_percent():
    torch.manual_seed(0)
    model = snn.zoo.create_model(
        "transolver", functional_dim=3, out_dim=1, embedding_dim=3, n_layers=1, n_hidden=32, n_head=4, slice_num=8
    )
    shape = (1, 2048, 3)
    plan = snn.plan_memory(model, shape, max_ranks=2, dims=1, input_kwargs={"embedding": shape})
    fx, emb = torch.randn(shape, requires_grad=True), torch.randn(shape)

    class Bound(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x, embedding=emb)

    tracker = trace_peak(Bound(), fx)
    params = sum(p.numel() * 4 for p in model.parameters())
    measured = tracker.peak() + params + 2 * fx.numel() * 4
    assert abs(plan.peak(1) - measured) <= 0.15 * measured, (plan.peak(1), measured)
    assert plan.activation_bytes[1] == pytest.approx(plan.activation_bytes[0] / 2, rel=0.01)


def test_two_ranks_halve_the_activations():
    plan = snn.plan_memory(_conv(), (1, 3, 128, 128), max_ranks=4)
    a1, a2, a4 = plan.activation_bytes[0], plan.activation_bytes[1], plan.activation_bytes[3]
    assert a2 == pytest.approx(a1 / 2, rel=0.01) and a4 == pytest.approx(a1 / 4, rel=0.01)
    assert plan.peak(1) > plan.peak(2) > plan.peak(4) > plan.param_bytes
    # Uneven: 127 rows over 2 ranks -> the largest slab has 64 rows.
    uneven = snn.plan_memory(_conv(), (1, 3, 127, 128), max_ranks=2)
    assert uneven.activation_bytes[1] == pytest.approx(uneven.activation_bytes[0] * 64 / 127, rel=0.01)


def test_budget_picks_the_smallest_fitting_p():
    model = _conv()
    plan = snn.plan_memory(model, (1, 3, 128, 128), max_ranks=8)
    target = plan.peak(3)
    fit = snn.plan_memory(model, (1, 3, 128, 128), max_ranks=8, budget=target)
    assert fit.fits == 3 and fit.budget == target
    assert snn.plan_memory(model, (1, 3, 128, 128), max_ranks=2, budget=1).fits is None
    text = str(fit)
    assert "smallest P that fits: 3" in text and "| 8 |" in text


def test_float64_and_forward_only():
    model = _conv()
    f32 = snn.plan_memory(model, (1, 3, 64, 64), max_ranks=1)
    f64 = snn.plan_memory(model, (1, 3, 64, 64), max_ranks=1, dtype=torch.float64)
    fwd = snn.plan_memory(model, (1, 3, 64, 64), max_ranks=1, backward=False)
    # Twice the bytes, and torch's native kernels (oneDNN takes float32 only) add their column
    # matrices on top (``sharded_nn.conv_workspace``).
    assert 2 * f32.peak(1) <= f64.peak(1) <= 2.2 * f32.peak(1)
    assert fwd.peak(1) < f32.peak(1)


@pytest.mark.parametrize(
    "text,expected",
    [("24GiB", 24 * 2**30), ("512 MiB", 512 * 2**20), ("32GB", 32 * 10**9), ("1.5kib", 1536), (4096, 4096)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24 gigs", "", "GiB", "-1GiB", 0, -5, True, "24GiB!"])
def test_bad_budget_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"budget: expected .*24GiB"):
        snn.plan_memory(_conv(), (1, 3, 16, 16), budget=bad)


def _plan_converted():
    from .harness import mesh as make_mesh

    model = snn.convert(_conv(), make_mesh(2))
    with pytest.raises(ValueError, match="expected the plain single-device model, got a converted one"):
        snn.plan_memory(model, (1, 3, 32, 32))
    return True


def test_a_converted_model_is_a_clear_error(run):
    """Its sharded layers made collectives on fake tensors: the transport crashed the process."""
    assert all(run(2, _plan_converted))


def test_bad_dims_and_ranks():
    with pytest.raises(ValueError, match="dims must name a dim of the 4-d input"):
        snn.plan_memory(_conv(), (1, 3, 16, 16), dims=7)
    with pytest.raises(ValueError, match="max_ranks must be >= 1"):
        snn.plan_memory(_conv(), (1, 3, 16, 16), max_ranks=0)


def test_live_bytes_follows_frees_and_marks_replicated_by_identity():
    tracker = LiveBytes()
    with tracker:
        a = torch.ones(4, 4) * 2
        b = torch.ones(4, 4) * 3  # the same shape as a: only identity tells them apart
    tracker.mark_replicated([a])
    # The temporaries (the ones) are freed; a (replicated) and b (activation) remain.
    assert (tracker.act, tracker.rep) == (16 * 4, 16 * 4)
    assert max(x for x, _ in tracker.timeline) == 2 * 16 * 4  # b and its temporary ones
    del a
    assert tracker.rep == 0 and tracker.act == 16 * 4
    del b
    assert tracker.timeline[-1] == (0, 0)


# --------------------------------------------------------------------------------------------
# P=2: the plan against the same tracker on the real sharded model, per rank (issue 12 item 3).


def _case(name: str):
    """(plain model, global input shape, sharded dim, alignment, keyword input shapes) of a small zoo case."""
    from sharded_nn import zoo

    torch.manual_seed(0)
    if name == "vit":
        return zoo.create_model("vit_tiny_patch16_224", img_size=256, depth=2), (1, 3, 256, 256), 2, 16, None
    if name == "unet":
        model = zoo.create_model("unet2d", in_channels=1, out_channels=1, channels=(8, 16, 32))
        return model, (1, 1, 128, 128), 2, 4, None
    if name == "transolver":
        model = zoo.create_model(
            "transolver", functional_dim=3, out_dim=1, embedding_dim=3, n_layers=2, n_hidden=32, n_head=4, slice_num=8
        )
        return model, (1, 8192, 3), 1, 1, {"embedding": (1, 8192, 3)}
    model = nn.Sequential(
        nn.Conv3d(4, 16, 3, padding=1), nn.GELU(), nn.Conv3d(16, 16, 3, stride=2, padding=1, padding_mode="circular"),
        nn.GELU(), nn.Conv3d(16, 1, 1),
    )  # fmt: skip
    return model, (1, 4, 32, 32, 32), 2, 2, None


def _sharded_peak(name: str) -> tuple[int, int]:
    """On each rank: the tracked peak of the converted model's forward+backward, plus parameters and input slab."""
    from .harness import mesh as make_mesh

    model, shape, dim, align, kw = _case(name)
    mesh = make_mesh(2)
    sharded = snn.convert(model, mesh)
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(shape, generator=gen)
    sl = snn.local_slices(shape, mesh, dims=(dim,), align=align)
    x = x_full[sl].clone().requires_grad_()
    emb = x.detach().clone()  # Transolver's coordinates: a second input, sharded like the first

    class Bound(nn.Module):
        def forward(self, inp):
            return sharded(inp, embedding=emb) if kw else sharded(inp)

    tracker = trace_peak(Bound(), x, params=list(sharded.parameters()))
    params = sum(p.numel() * p.element_size() for p in sharded.parameters())
    inputs = x.numel() * x.element_size() * (2 if kw else 1)
    return tracker.peak() + params + inputs, x.shape[dim]


@pytest.mark.parametrize("name", ["vit", "unet", "transolver", "cnn"])
def test_p2_prediction_within_15_percent_of_the_sharded_model(run, name):
    measured = max(peak for peak, _ in run(2, _sharded_peak, name))
    model, shape, dim, _, kw = _case(name)
    plan = snn.plan_memory(model, shape, max_ranks=2, dims=dim, input_kwargs=kw)
    assert abs(plan.peak(2) - measured) <= 0.15 * measured, (name, plan.peak(2), measured)
