"""convert's layout scope (issue 16, item 2): layouts agreed at most once per forward, safely.

A converted model runs every forward in a ``comm.sizes.layout_scope``: the first sharded layer
agrees on the model's input together with the model's entry facts (grad mode, autocast, input
dtypes, parameters, train/eval modes); later layers derive their layouts without a collective.

* whole models (a timm RegNet, the zoo UNet) make a small constant number of metadata
  all-gathers per forward and none in backward, where they made one per layer before, and stay
  exact against the single-device model (float64, uneven slabs, P=2 and 3);
* every fact a layer used to agree per call still raises on every rank alike when one rank
  differs: at the model's entry, in the one all-gather of the forward;
* a model with two slab inputs derives nothing (each input needs its agreement), and a sharded
  layer used on its own agrees per call, as before.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.comm.traffic import count_traffic

from .harness import mesh
from .reference import reduce_param_grads
from .test_latency_paths import _all_gather, _rand

T = 300  # whole-model cases on a loaded 2-core machine


def _regnet():
    timm = pytest.importorskip("timm")
    return timm.create_model("regnetx_002", num_classes=3)


def _unet():
    from sharded_nn.zoo import UNet

    return UNet(2, 2, 3, channels=(4, 8, 8), norm="batch")


def _mobilenet():
    # Squeeze-excite blocks: their global means are calls inside timm's forward, routed by the
    # forward guard to sharded_nn.reductions, which read the layout from the scope too.
    timm = pytest.importorskip("timm")
    return timm.create_model("mobilenetv3_small_050", num_classes=3)


MODELS = {"regnetx_002": (_regnet, 3, True), "unet": (_unet, 2, False), "mobilenetv3_small_050": (_mobilenet, 3, True)}


def _run(name: str, sizes, width: int, scope: bool, train: bool):
    """Forward + backward of the converted model on explicit slabs ``sizes`` (dim 2), against the
    single-device model; returns the metadata calls of (forward, backward) and the layers' count."""
    make, cin, replicated_out = MODELS[name]
    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = make().double().train(train)
    model = snn.convert(copy.deepcopy(ref), m, layout_scope=scope)
    x = _rand((2, cin, sum(sizes), width)).requires_grad_()
    y = ref(x)
    g_out = _rand(y.shape, 1)
    (y * g_out).sum().backward()
    r = m.get_local_rank("domain")
    x_loc = x.detach().narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    with count_traffic() as fwd:
        y_loc = model(x_loc)
    if replicated_out:  # logits after a global pool: the same on every rank
        torch.testing.assert_close(y_loc, y.detach(), atol=1e-9, rtol=1e-9)
        loss = snn.losses.share((y_loc * g_out).sum(), m)
    else:
        torch.testing.assert_close(torch.cat(_all_gather(y_loc), 2), y.detach(), atol=1e-9, rtol=1e-9)
        off = sum(sizes[:r])
        loss = (y_loc * g_out.narrow(2, off, y_loc.shape[2])).sum()
    with count_traffic() as bwd:
        loss.backward()
    torch.testing.assert_close(torch.cat(_all_gather(x_loc.grad), 2), x.grad, atol=1e-9, rtol=1e-9)
    grads = reduce_param_grads(model, m)
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, atol=1e-9, rtol=1e-9, msg=lambda s, n=pname: f"{n}: {s}")
    layers = sum(type(mod).__name__.startswith("Sharded") for mod in model.modules())
    return fwd.calls.get("metadata", 0), bwd.calls.get("metadata", 0), layers


# Slabs start at multiples of the model's alignment (32 for the RegNet's five stride-2 stages,
# 4 for the UNet's two downsamplings); the last one is short or long.
CASES = [
    ("regnetx_002", (64, 32), 32),
    ("regnetx_002", (32, 64, 32), 32),
    ("mobilenetv3_small_050", (64, 32), 32),
    ("unet", (12, 8), 12),
    ("unet", (8, 4, 12), 12),
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("name", "sizes", "width"), CASES, ids=lambda v: str(v))
def test_converted_model_agrees_once_per_forward(run, name, sizes, width, train):
    for fwd, bwd, layers in run(len(sizes), _run, name, sizes, width, True, train, timeout=T):
        assert layers > 10, layers
        if name != "unet":
            # One agreement on the model's input (with the entry facts): every later layout is derived.
            assert fwd == 1, (fwd, layers)
        else:
            # The zoo UNet agrees on its input at the far-edge pad (with the entry facts) and
            # once more on the unpadded input at the crop (the scope no longer holds it there);
            # every other layout is declared.
            assert fwd == 2, (fwd, layers)
        assert bwd == 0, bwd


def test_without_the_scope_layers_agree_per_call(run):
    # The same model with layout_scope=False: one agreement per layer that needs its layout.
    for fwd, bwd, layers in run(2, _run, "regnetx_002", (64, 32), 32, False, True, timeout=T):
        assert fwd > 10, (fwd, layers)
        assert bwd == 0, bwd


# --- misuse: a per-call fact that one rank changes raises on every rank alike ---------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 3, stride=2, padding=1))

    def forward(self, x):
        return self.b(self.a(x))


def _misuse(case: str):
    m = mesh(2)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    model = snn.convert(_Net().double(), m)
    x = snn.shard(_rand((2, 3, 12, 6)), m, dims=(2,))
    model(x).sum().backward()  # a good step first: the scope starts afresh on every forward
    if r == 1:
        if case == "frozen layer":
            model.b[0].weight.requires_grad_(False)
        elif case == "float layer":
            model.b[0].float()
        elif case == "eval mode":
            model.b.eval()
    ctx = torch.no_grad() if case == "no_grad" and r == 1 else contextlib.nullcontext()
    auto = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" and r == 1 else contextlib.nullcontext()
    xs = x.float() if case == "input dtype" and r == 1 else x
    try:
        with ctx, auto, count_traffic() as t:
            model(xs)
    except Exception as e:  # noqa: BLE001 - report whatever was raised
        return type(e).__name__, str(e)
    return "no error", dict(t.calls)


MISUSE = ["frozen layer", "float layer", "eval mode", "no_grad", "autocast", "input dtype"]


@pytest.mark.parametrize("case", MISUSE)
def test_one_rank_changes_raise_alike(run, case):
    res = run(2, _misuse, case)
    assert res[0][0] == "ShardingError", res
    assert res[1] == res[0], res  # the same error on every rank, in the forward's one agreement
    assert "disagree" in res[0][1], res[0][1]


def _model_changed_alike():
    """Entry facts changed on every rank alike are no error: the forward agrees and derives."""
    m = mesh(2)
    torch.manual_seed(0)
    ref = _Net().double()
    model = snn.convert(copy.deepcopy(ref), m)
    model.b[0].weight.requires_grad_(False)
    ref.b[0].weight.requires_grad_(False)
    x = snn.shard(_rand((2, 3, 12, 6)), m, dims=(2,))
    with count_traffic() as t:
        y = model(x)
    torch.testing.assert_close(snn.gather(y, m, dims=(2,)), ref(_rand((2, 3, 12, 6))))
    return t.calls.get("metadata")


def test_entry_facts_changed_alike_is_fine(run):
    assert run(2, _model_changed_alike) == [1, 1]


class _PointwiseFirst(nn.Module):
    """1x1 convolutions first (they agree on nothing), then means over the slab that the guard
    routes to scoped reductions: the first reduction checks the entry facts, the later ones
    answer from the scope."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        h = self.a(x)
        h = h - h.mean((2, 3), keepdim=True)
        h = self.b(h)
        h = h * torch.sigmoid(h.mean((2, 3), keepdim=True))
        return self.c(h) + h.mean((2, 3), keepdim=True)[:, :2]


def _pointwise_first(sizes, case=None):
    m = mesh(len(sizes))
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = _PointwiseFirst().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = _rand((2, 3, sum(sizes), 5)).requires_grad_()
    y = ref(x)
    g = _rand(y.shape, 1)
    (y * g).sum().backward()
    xl = x.detach().narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    gl = g.narrow(2, sum(sizes[:r]), sizes[r])
    if case is not None:  # one rank calls the model differently: every rank raises alike
        ctx = torch.no_grad() if case == "no_grad" and r == 1 else contextlib.nullcontext()
        if case == "eval mode" and r == 1:
            model.eval()
        try:
            with ctx:
                model(xl)
        except Exception as e:  # noqa: BLE001 - report whatever was raised
            return type(e).__name__, str(e)
        return "no error", None
    with count_traffic() as fwd:
        y_loc = model(xl)
    torch.testing.assert_close(torch.cat(_all_gather(y_loc), 2), y.detach(), atol=1e-10, rtol=1e-10)
    with count_traffic() as bwd:
        (y_loc * gl).sum().backward()
    torch.testing.assert_close(torch.cat(_all_gather(xl.grad), 2), x.grad, atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, atol=1e-10, rtol=1e-10)
    return fwd.calls.get("metadata", 0), bwd.calls.get("metadata", 0)


@pytest.mark.parametrize("sizes", [(5, 3), (2, 6, 3)], ids=str)
def test_pointwise_first_model_agrees_once_per_forward(run, sizes):
    # Three routed means; before session 46 each one gathered the layout again (the entry facts
    # stayed unchecked, so the scope answered nothing): three metadata all-gathers per forward.
    assert run(len(sizes), _pointwise_first, sizes) == [(1, 0)] * len(sizes)


@pytest.mark.parametrize("case", ["no_grad", "eval mode"])
def test_pointwise_first_model_entry_misuse_raises_alike(run, case):
    # (An input of another dtype on one rank fails there in torch's own 1x1 convolution, before
    # any collective: that rank raises at once and the others at the transport's timeout.)
    res = run(2, _pointwise_first, (5, 3), case)
    assert res[0][0] == "ShardingError", res
    assert res[1] == res[0], res
    assert "disagree" in res[0][1] and "at its entry" in res[0][1], res[0][1]


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)
        self.c = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x, cond):
        return self.c(self.a(x) + self.b(cond))


def _two_inputs(sizes, cond_sizes):
    """Two slab inputs of one layout: agreed together at the entry, then derived; exact."""
    m = mesh(len(sizes))
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = _TwoInputs().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x, cond = _rand((1, 2, sum(sizes), 5)), _rand((1, 2, sum(sizes), 5), 1)
    xl = x.narrow(2, sum(sizes[:r]), sizes[r])
    cl = cond.narrow(2, sum(sizes[:r]), sizes[r])
    with count_traffic() as t:
        y = model(xl, cl)
    torch.testing.assert_close(torch.cat(_all_gather(y), 2), ref(x, cond), atol=1e-10, rtol=1e-10)
    return t.calls.get("metadata")


def test_two_slab_inputs_agree_once_at_the_entry(run):
    # Both inputs' layouts in one all-gather at the model's entry (with the entry facts); every
    # layer derives. Before session 46 such a forward derived nothing: three agreements.
    assert run(3, _two_inputs, (3, 5, 2), None) == [1, 1, 1]


class _TwoFields(nn.Module):
    """Two slab inputs of different lengths (so different layouts), pooled apart and summed."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(2, 3, 3, padding=1)
        self.c = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x, cond):
        return self.c(self.a(x)).mean((2, 3)) + self.b(cond).mean((2, 3))


def _two_fields(sizes, cond_sizes, cond_width=(5, 5, 5)):
    m = mesh(len(sizes))
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = _TwoFields().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x, cond = _rand((1, 2, sum(sizes), 5)), _rand((1, 2, sum(cond_sizes), cond_width[0]), 1)
    xl = x.narrow(2, sum(sizes[:r]), sizes[r])
    cl = cond.narrow(2, sum(cond_sizes[:r]), cond_sizes[r])
    if cond_width[r] != cond_width[0]:  # one rank's second input has another unsharded size
        cl = _rand((1, 2, cond_sizes[r], cond_width[r]), 2)
    try:
        with count_traffic() as t:
            y = model(xl, cl)
    except Exception as e:  # noqa: BLE001 - report whatever was raised
        return type(e).__name__, str(e)
    torch.testing.assert_close(y, ref(x, cond), atol=1e-10, rtol=1e-10)
    return t.calls.get("metadata")


def test_two_slab_inputs_of_different_layouts_are_exact(run):
    # Both layouts remembered at the entry: each layer answers from the one its input names
    # unambiguously at every rank's coordinate, or agrees.
    got = run(3, _two_fields, (3, 5, 2), (4, 2, 6))
    assert got[0] == got[1] == got[2] and 1 <= got[0] <= 4, got


def test_an_input_without_a_layout_raises_alike_where_a_layer_takes_it(run):
    # One rank's second input has another width: no layout at the entry, so nothing is
    # remembered and the layer that takes it agrees and raises on every rank, as before.
    res = run(3, _two_fields, (3, 5, 2), (4, 2, 6), (5, 6, 5))
    assert res[0][0] == "ShardingError" and res[1] == res[0] == res[2], res


def _two_inputs_misuse():
    """One rank in no_grad: the entry agreement of the two inputs raises on every rank, and the
    next forward (the scope closed by the root's always-called hook) runs and is exact."""
    m = mesh(2)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    ref = _TwoInputs().double()
    model = snn.convert(copy.deepcopy(ref), m)
    x, cond = _rand((1, 2, 8, 5)), _rand((1, 2, 8, 5), 1)
    xl, cl = x.narrow(2, 4 * r, 4), cond.narrow(2, 4 * r, 4)
    try:
        with torch.no_grad() if r == 1 else contextlib.nullcontext():
            model(xl, cl)
        err = ("no error", "")
    except Exception as e:  # noqa: BLE001 - report whatever was raised
        err = (type(e).__name__, str(e))
    with count_traffic() as t:
        y = model(xl, cl)
    torch.testing.assert_close(torch.cat(_all_gather(y), 2), ref(x, cond), atol=1e-10, rtol=1e-10)
    return err, t.calls.get("metadata")


def test_two_slab_inputs_entry_misuse_raises_alike(run):
    res = run(2, _two_inputs_misuse)
    assert res[0][0][0] == "ShardingError" and res[0][0] == res[1][0], res
    assert "disagree" in res[0][0][1] and "at its entry" in res[0][0][1], res
    assert res[0][1] == res[1][1] == 1, res


def _single_layer():
    """A sharded layer converted on its own (or used directly) agrees on every call."""
    m = mesh(2)
    conv = snn.convert(nn.Conv2d(2, 2, 3, padding=1).double(), m)
    x = snn.shard(_rand((1, 2, 9, 4)), m, dims=(2,))
    with count_traffic() as t:
        conv(conv(x))
    return t.calls.get("metadata")


def test_single_layer_agrees_per_call(run):
    assert run(2, _single_layer) == [2, 2]


def _scope_answers(seqs):
    """Declares each sequence of layouts in a fresh scope; returns, per sequence, what the scope
    answers for this rank's local sizes of every declared layout and what the all-pairs rule
    says it must (a layout is answered where no other declared one has the same local sizes at
    any coordinate)."""
    from sharded_nn.comm.sizes import layout_scope, scope_declare, scope_lookup
    from sharded_nn.layout import Layout

    m = mesh(3)
    r = m.get_local_rank("domain")
    out = []
    for seq in seqs:
        with layout_scope():
            for sizes in seq:
                scope_declare(m, (2,), 4, [Layout(sizes)])
            got = [scope_lookup(m, (2,), (1, 1, s[r], 1)) for s in seq]
        known = list(dict.fromkeys(seq))
        want = [
            (Layout(s),) if not any(o != s and any(o[c] == s[c] for c in range(3)) for o in known)
            and not any(o != s and o[r] == s[r] for o in known) else None
            for s in seq
        ]
        # (a lookup by local size returns the layout answered for it, whichever declared one it is)
        got = [g if g is None or g[0].sizes == s else "other" for g, s in zip(got, seq)]
        out.append((got, want))
    return out


def test_scope_answers_only_layouts_every_rank_can_tell_apart(run):
    seqs = [
        [(4, 4, 4), (2, 2, 2), (4, 4, 4)],  # distinct everywhere: both answered
        [(4, 4, 4), (4, 3, 5), (2, 2, 2)],  # the first two share rank 0's size: neither answered
        [(1, 2, 3), (3, 2, 1), (2, 3, 1), (5, 5, 5)],  # pairwise clashes at some coordinate
        [(3, 3, 2), (2, 2, 3), (3, 2, 3), (1, 1, 1), (3, 3, 2)],  # a later clash undoes an answer
    ]
    for rank in run(3, _scope_answers, seqs):
        for got, want in rank:
            assert got == want, (got, want)


class _CropThenReduce(nn.Module):
    """Differences of the rows (crops of the first and the last row: new layouts, and the first
    agreement of the forward is on one of them), then a mean of a tensor in the input's layout."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 3, 1)
        self.b = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        dy = (y[:, :, 1:] - y[:, :, :-1]).abs().mean()  # a total variation along the sharded rows
        dx = (y[..., 1:] - y[..., :-1]).abs().mean()  # along the columns: the input's layout
        z = F.pad(y, (0, 0, 0, 2))  # the last rank grows: a layout the others cannot tell apart
        return self.b(y) * (dy + dx) + self.b(z[:, :, :-2])  # a layer on the input's layout after it


def _crop_then_reduce(sizes):
    from .reference import check_against_reference

    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = _CropThenReduce().double()
    x = _rand((2, 3, sum(sizes), 5))
    return max(check_against_reference(ref, x, m, sizes=sizes).values()) < 1e-10


@pytest.mark.parametrize("sizes", [(4, 3), (3, 2, 2), (2, 4, 4)], ids=str)
def test_new_layouts_in_a_forward_never_answer_an_old_one(run, sizes):
    # The scope answers a lookup by the local sizes. It first agreed on the crop y[:, :, :-1]
    # (the last rank one row short) and then answered a slab of the input's layout with it on
    # the ranks the crop left alone, while the last rank agreed: the ranks paired an all-reduce
    # with an all-gather (a TransportError, or a hang), before session 63. Likewise a layer on
    # the input's layout after a pad at the far edge. Now a call that makes a layout it does not
    # declare ends the scope's answers for the rest of the forward.
    assert all(run(len(sizes), _crop_then_reduce, sizes))


class _SpaceToDepth(nn.Module):
    """A strided convolution of a slab, and beside it the same slab's row pairs folded into its
    channels (space-to-depth) by a view, by views of its channels-last permute, or by
    ``F.pixel_unshuffle``, then a layer that needs the folded slab's layout."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.w = nn.Conv2d(4, 4, 3, stride=2, padding=(0, 1))
        self.z = nn.Conv2d(16 if how == "unshuffle" else 8, 3, 3, padding=1)

    def forward(self, x):
        a = self.a(x)
        w = self.w(a)
        n, c, h, wd = a.shape
        g = w.mean()
        if self.how == "view":
            s = a.view(n, c, h // 2, 2, wd).transpose(2, 3).reshape(n, 2 * c, h // 2, wd)
        elif self.how == "flatten":  # the slab's rows merged with its columns (tokens) and back
            s = torch.cat([a, (a.flatten(2).transpose(1, 2) * 2).transpose(1, 2).reshape(n, c, h, wd)], 1)
        elif self.how == "fold":  # the slab's rows merged behind its channels (a fold), and back
            s = torch.cat([a, (a.flatten(1) * 2).view(n, c, h, wd)], 1)
        elif self.how == "shuffle_back":  # unshuffled and shuffled back (its backward unshuffles)
            s = torch.cat([a, F.pixel_shuffle(F.pixel_unshuffle(a, 2), 2)], 1)
        elif self.how == "windows":  # 2x2 windows folded into the batch (batch-major) and back by a -1
            win = a.view(n, c, h // 2, 2, wd // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, c, 2, 2) * 2
            s = torch.cat([a, win.view(-1, h // 2, wd // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, wd)], 1)
        elif self.how == "window_tokens":  # windows' tokens (B_, N, C) viewed by B_ = x.shape[0] and a -1
            win = a.view(n, c, h // 2, 2, wd // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(-1, 4, c)
            b_, t, _ = win.shape
            y = (win * 2).reshape(b_, t, -1).view(n, h // 2, wd // 2, 2, 2, c)
            s = torch.cat([a, y.permute(0, 5, 1, 3, 2, 4).reshape(n, c, h, wd)], 1)
        elif self.how == "fft_columns":  # a transform along the whole columns of the slab, and back
            s = torch.cat([a, torch.fft.irfft(torch.fft.rfft(a, dim=3) * 2, n=wd, dim=3)], 1)
        elif self.how == "view_minus_one":  # a -1 beside the size read from the slab, then for it
            s = a.view(n, c, h // 2, 2, -1).transpose(2, 3).reshape(n, 2 * c, -1, wd)
        elif self.how == "channels_last":
            t = a.permute(0, 2, 3, 1)
            g = g + t.mean(1).mean()  # (a mean along the rows of the channels-last slab: its layout is agreed there)
            t = t.reshape(n, h // 2, 2, wd, c).transpose(2, 3)
            s = t.reshape(n, h // 2, wd, 2 * c).permute(0, 3, 1, 2)
        else:
            s = F.pixel_unshuffle(a, 2)
        return self.z(s) * g


def _space_to_depth(sizes, how):
    from .reference import check_against_reference

    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = _SpaceToDepth(how).double()
    x = _rand((2, 2, sum(sizes), 6))
    return max(check_against_reference(ref, x, m, sizes=sizes).values()) < 1e-10


@pytest.mark.parametrize("how", ["view", "channels_last", "unshuffle"])
@pytest.mark.parametrize("sizes", [(6, 4), (6, 6, 6)], ids=str)
def test_a_view_that_halves_the_slabs_never_answers_an_old_layout(run, sizes, how):
    # The view halves the slabs (6, 6, 6 -> 3, 3, 3) while the strided convolution declared
    # 3, 3, 2: the ranks whose halved length matched it skipped the agreement the last rank
    # made before session 65 (an all-reduce paired with an all-gather: a TransportError, or a
    # hang). Now such a view declares the halved layout (derived from its input's) or forgets,
    # and a layout is remembered whichever dims it sits on (the channels-last view is looked up
    # after a permute back).
    assert all(run(len(sizes), _space_to_depth, sizes, how))


@pytest.mark.parametrize("how", ["view", "view_minus_one", "flatten", "fold", "channels_last", "unshuffle",
                                 "shuffle_back", "windows", "window_tokens", "fft_columns"])
@pytest.mark.parametrize("sizes", [(4, 4, 0), (6, 0)], ids=str)
def test_a_view_of_an_empty_slab_maps_as_on_the_other_ranks(run, sizes, how):
    # A rank whose slab is empty (a deep stage with fewer rows than ranks) mapped the view by
    # its zero-length dims, which group with anything: its result's layout was lost and the
    # next layer refused it on that rank alone while the others went on to that layer's
    # agreement (a TransportError here, a hang under gloo), before session 66. On that rank
    # torch also refused a -1 (no elements to infer it from) and returned an empty input's
    # shape unchanged from pixel_unshuffle (the channels not multiplied). The rows merged
    # behind the channels (a fold) were lost on that rank alike until session 67, and a
    # pixel_shuffle's backward there failed (torch unshuffled the empty gradient to its own shape),
    # a window view's -1 beside a zero size was ambiguous to torch there, and torch's transforms
    # raise on any empty tensor.
    assert all(run(len(sizes), _space_to_depth, sizes, how))
