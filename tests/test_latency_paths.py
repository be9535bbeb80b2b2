"""The short paths of issue 16: layers that need no agreement make none, and stay exact.

* a pointwise convolution (1x1, stride 1, no padding: bottlenecks, inverted residuals, conv
  MLPs) runs the torch convolution on the slab with no communication, empty slabs included;
* BatchNorm in eval mode with running statistics is a per-channel affine map: no agreement;
* on a one-rank mesh (P=1) a sharded convolution or pooling is the torch layer itself.

Each case compares forward output, input gradient and every parameter gradient with the
single-device module (float64, uneven slabs), and counts the communication calls of the forward
(``comm.traffic.count_traffic``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.comm.traffic import count_traffic

from .harness import mesh
from .reference import reduce_param_grads

D = torch.float64


def _rand(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach())
    return out


def _check(name, shape, sizes, train=True, dim=2):
    """Reference check of ``MAKERS[name]`` on explicit slab ``sizes``; returns the forward's calls by kind."""
    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = MAKERS[name]().double().train(train)
    model = snn.convert(copy.deepcopy(ref), m, dims=(dim,))
    x = _rand(shape).requires_grad_()
    y = ref(x)
    g_out = _rand(y.shape, 1)
    (y * g_out).sum().backward()
    r = m.get_local_rank("domain")
    x_loc = x.detach().narrow(dim, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    with count_traffic() as t:
        y_loc = model(x_loc)
    ys = _all_gather(y_loc)
    torch.testing.assert_close(torch.cat(ys, dim), y.detach(), atol=1e-10, rtol=1e-10)
    off = sum(s.shape[dim] for s in ys[:r])
    (y_loc * g_out.narrow(dim, off, y_loc.shape[dim])).sum().backward()
    torch.testing.assert_close(torch.cat(_all_gather(x_loc.grad), dim), x.grad, atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    return dict(t.calls)


POINTWISE = {
    "conv2d-1x1": (lambda: nn.Conv2d(4, 6, 1), (2, 4, 9, 5)),
    "conv2d-1x1-groups-nobias": (lambda: nn.Conv2d(4, 6, 1, groups=2, bias=False), (2, 4, 9, 5)),
    "conv1d-1": (lambda: nn.Conv1d(4, 3, 1, padding="same"), (2, 4, 9)),
    "conv3d-1x1x1": (lambda: nn.Conv3d(4, 3, 1), (1, 4, 9, 3, 2)),
}


@pytest.mark.parametrize("sizes", [(5, 4), (3, 0, 6), (2, 3, 3, 1)], ids=str)
@pytest.mark.parametrize("name", list(POINTWISE))
def test_pointwise_conv_is_exact_and_silent(run, name, sizes):
    for calls in run(len(sizes), _check, name, POINTWISE[name][1], sizes):
        assert calls == {}, calls  # no agreement, no halo: nothing on the wire


def _bn_stack():
    return nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4, affine=False))


def _with_stats(make):
    def build():
        m = make()
        torch.manual_seed(3)
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-1, 1)
                mod.running_var.uniform_(0.5, 2)
        return m

    return build


@pytest.mark.parametrize("sizes", [(5, 4), (4, 1, 4)], ids=str)
def test_batchnorm_eval_is_exact_and_silent(run, sizes):
    for calls in run(len(sizes), _check, "bn-stack", (2, 4, 9, 5), sizes, False):
        assert calls == {}, calls


def _stack():
    # conv3x3 -> BN -> ReLU -> conv1x1 -> BN -> conv3x3 stride 2: two layers need their layout.
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4),
        nn.Conv2d(4, 2, 3, stride=2, padding=1),
    )


def test_eval_stack_agrees_only_where_a_layout_is_needed(run):
    for calls in run(2, _check, "conv-stack", (1, 3, 10, 6), (6, 4), False):
        # The first 3x3 convolution agrees (convert's layout scope); the second derives its layout.
        assert calls.get("metadata") == 1, calls
        assert "reduction" not in calls, calls


MAKERS = {
    **{name: make for name, (make, _) in POINTWISE.items()},
    "bn-stack": _with_stats(_bn_stack),
    "conv-stack": _with_stats(_stack),
}


def _errors_eval(world: int):
    m = mesh(world)
    out = {}
    bn = snn.convert(nn.BatchNorm2d(4).double().eval(), m)
    conv = snn.convert(nn.Conv2d(4, 3, 1).double(), m)
    x = snn.shard(_rand((2, 4, 9, 5)), m, dims=(2,))
    for what, layer, t in (
        ("bn channels", bn, x[:, :3]),
        ("bn ndim", bn, x[0]),
        ("conv channels", conv, x[:, :3]),
    ):
        try:
            layer(t)
            out[what] = None
        except Exception as e:  # noqa: BLE001 - report whatever was raised
            out[what] = (type(e).__name__, str(e).split(", got")[0])
    return out


def test_pointwise_layers_raise_alike(run):
    res = run(3, _errors_eval, 3)
    for what in res[0]:
        assert res[0][what] is not None and res[0][what][0] == "ShardingError", (what, res[0][what])
        assert all(r[what] == res[0][what] for r in res), [r[what] for r in res]


def _single_rank(mode: str):
    m = mesh(1)
    torch.manual_seed(0)
    out = {}
    for ref in (
        nn.Conv2d(4, 3, 3, padding=1, padding_mode=mode),
        nn.Conv3d(4, 3, 3, stride=2, padding=1, padding_mode=mode),
        nn.MaxPool2d(3, 2, 1, ceil_mode=True),
        nn.AvgPool2d(3, 2, 1, count_include_pad=False),
    ):
        ref = ref.double()
        model = snn.convert(copy.deepcopy(ref), m)
        assert type(model).__name__.startswith("Sharded"), type(model)
        x = _rand((2, 4, 9, 7, 5)[: ref.weight.dim() if hasattr(ref, "weight") else 4])
        out[type(ref).__name__] = _bitwise_at_one_rank(model, ref, x)
    return out


def _bitwise_at_one_rank(model: nn.Module, ref: nn.Module, x: torch.Tensor) -> dict:
    """Forward and input gradient of ``model`` equal ``ref``'s bit for bit; the traffic counted."""
    x = x.requires_grad_()
    xs = x.detach().clone().requires_grad_()
    with count_traffic() as t:
        y = model(xs)
    torch.testing.assert_close(y, ref(x), atol=0, rtol=0)
    y.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(xs.grad, x.grad, atol=0, rtol=0)
    return dict(t.calls)


@pytest.mark.parametrize("mode", ["zeros", "circular"])
def test_one_rank_mesh_is_the_torch_layer(run, mode):
    (calls,) = run(1, _single_rank, mode)
    assert all(c == {} for c in calls.values()), calls


class _SE(nn.Module):
    """Convolutions around a squeeze-excite mean in the model's own forward (what the guard routes
    at P > 1); records whether a forward guard covered each forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 2, 3, padding=1)
        self.seen: list[bool] = []

    def forward(self, x):
        from sharded_nn.forward_guard import guard_active

        self.seen.append(guard_active())
        h = torch.tanh(self.a(x))
        return self.b(h * torch.sigmoid(h.mean((2, 3), keepdim=True)))


def _single_rank_guard():
    torch.manual_seed(0)
    ref = _SE().double()
    model = snn.convert(copy.deepcopy(ref), mesh(1))
    # No per-layer guard work (module hooks, or the sharded layers' own ``_snn_guard_call``): the
    # guard has nothing to follow when every tensor is whole.
    hooked = [
        n for n, m in model.named_modules()
        if m is not model and (m._forward_pre_hooks or m._forward_hooks or "_snn_guard_call" in m.__dict__)
    ]
    calls = _bitwise_at_one_rank(model, ref, _rand((2, 3, 9, 7)))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=n)
    return hooked, model.seen, calls


def test_one_rank_guard_skips_layer_hooks(run):
    (got,) = run(1, _single_rank_guard)
    hooked, seen, calls = got
    assert hooked == [], hooked
    assert seen == [True], seen  # the guard still covers the forward (blocks exact only under it run)
    assert calls == {}, calls


# --- layout scope: layouts agreed once per forward, derived from layer to layer ---------------


class _Net(nn.Module):
    """A small ResNet: stem, a residual block, a strided block with a 1x1 shortcut, pool, head."""

    def __init__(self, norm=nn.BatchNorm2d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm(4), nn.ReLU())
        self.a = nn.Sequential(nn.Conv2d(4, 4, 1), norm(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, groups=2))
        self.b = nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, padding=1), norm(6), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1))
        self.down = nn.Conv2d(4, 6, 1, stride=2)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.a(x))  # a residual add: a new tensor, same layout
        x = self.b(x) + self.down(x)
        return self.head(self.pool(x))


def _scoped_net(sizes, train: bool, domain=None):
    from sharded_nn.comm.sizes import enable_layout_scope

    m = mesh(domain or len(sizes))
    torch.manual_seed(0)
    ref = _with_stats(_Net)().double().train(train)
    model = enable_layout_scope(snn.convert(copy.deepcopy(ref), m))
    x = _rand((2, 3, sum(sizes), 6)).requires_grad_()
    y = ref(x)
    g_out = _rand(y.shape, 1)
    (y * g_out).sum().backward()
    r = m.get_local_rank("domain")
    x_loc = x.detach().narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    calls = []
    for _ in range(2):  # the scope starts empty on every forward
        with count_traffic() as t:
            y_loc = model(x_loc)
        calls.append(dict(t.calls))
    torch.testing.assert_close(y_loc, y.detach(), atol=1e-10, rtol=1e-10)  # replicated logits
    snn.losses.share((y_loc * g_out).sum(), m).backward()
    torch.testing.assert_close(torch.cat(_all_gather(x_loc.grad), 2), x.grad, atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    return calls


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("sizes", [(12, 10), (8, 8, 6), (4, 8, 4, 4)], ids=str)
def test_scope_agrees_once_per_forward(run, sizes, train):
    # Slabs start at multiples of 4 (two stride-2 layers); the last one is short.
    for per_rank in run(len(sizes), _scoped_net, sizes, train):
        for calls in per_rank:
            # One agreement, on the model's input: every later layout is derived.
            assert calls.get("metadata") == 1, calls


def _scope_unit():
    """Remembered layouts that share a local size at some coordinate are answered on no rank."""
    from sharded_nn.comm.sizes import layout_scope, scope_declare, scope_lookup
    from sharded_nn.layout import Layout

    m = mesh(4)
    r = m.get_local_rank("domain")
    a, b, c = Layout((2, 2, 2, 1)), Layout((1, 1, 1, 1)), Layout((3, 3, 3, 2))
    out = {}
    with layout_scope():
        scope_declare(m, (2,), 4, [a])
        out["alone"] = scope_lookup(m, (2,), (1, 1, a.sizes[r], 5))
        scope_declare(m, (2,), 4, [b])  # b.sizes[3] == a.sizes[3]: both ambiguous, on every rank
        scope_declare(m, (2,), 4, [c])
        out["a"] = scope_lookup(m, (2,), (1, 1, a.sizes[r], 5))
        out["b"] = scope_lookup(m, (2,), (1, 1, b.sizes[r], 5))
        out["c"] = scope_lookup(m, (2,), (1, 1, c.sizes[r], 5))
        # The same slab permuted, or with a dim more: a layout does not depend on where its dim sits.
        out["other dims"] = scope_lookup(m, (3,), (1, 1, 5, c.sizes[r]))
        out["other ndim"] = scope_lookup(m, (1,), (1, c.sizes[r], 5))
    out["outside"] = scope_lookup(m, (2,), (1, 1, c.sizes[r], 5))
    return out


def test_scope_answers_only_unambiguous_layouts(run):
    from sharded_nn.layout import Layout

    for res in run(4, _scope_unit):
        assert res["alone"] == (Layout((2, 2, 2, 1)),)
        assert res["a"] is None and res["b"] is None  # even where a rank's own size is unique
        assert res["c"] == (Layout((3, 3, 3, 2)),)
        assert res["other dims"] == res["other ndim"] == (Layout((3, 3, 3, 2)),)
        assert res["outside"] is None


def _undeclared(sizes):
    """A layer that declares no output layout (Upsample) makes the next one agree again."""
    from sharded_nn.comm.sizes import enable_layout_scope

    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(3, 2, 3, padding=1)
    ).double()
    model = enable_layout_scope(snn.convert(copy.deepcopy(ref), m))
    x = _rand((1, 2, sum(sizes), 4))
    x_loc = x.narrow(2, sum(sizes[:m.get_local_rank("domain")]), sizes[m.get_local_rank("domain")])
    with count_traffic() as t:
        y_loc = model(x_loc)
    torch.testing.assert_close(torch.cat(_all_gather(y_loc), 2), ref(x), atol=1e-10, rtol=1e-10)
    return dict(t.calls)


def test_scope_forgets_after_an_undeclared_layout(run):
    for calls in run(3, _undeclared, (3, 3, 2)):
        assert calls.get("metadata") == 3, calls  # conv, upsample, and the conv after it


def _scoped_errors():
    from sharded_nn.comm.sizes import enable_layout_scope

    m = mesh(2)
    r = m.get_local_rank("domain")
    model = enable_layout_scope(snn.convert(_Net().double().eval(), m))
    x = snn.shard(_rand((2, 3, 16, 6)), m, dims=(2,))
    model(x)  # a good forward first: the next one starts from an empty scope all the same
    out = {}
    for what, t in (("dtype on one rank", x.float() if r == 1 else x), ("ndim on one rank", x[None] if r else x)):
        try:
            model(t)
            out[what] = None
        except Exception as e:  # noqa: BLE001 - report whatever was raised
            out[what] = (type(e).__name__, str(e))
    return out


def test_scoped_model_input_raises_alike(run):
    res = run(2, _scoped_errors)
    for what in res[0]:
        assert res[0][what] is not None and res[0][what][0] == "ShardingError", (what, res[0][what])
        assert res[1][what] == res[0][what], (res[0][what], res[1][what])
