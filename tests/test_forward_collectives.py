"""What one forward of a converted CNN puts on the wire at P>1, pinned to exact counts (issue 16).

A converted model agrees on its input's layout once per forward (one small all-gather, together
with the model's entry facts: grad mode, dtypes, parameters, train/eval flags) and derives every
later layer's layout; each 3x3 convolution then makes one halo exchange with its neighbours in the
forward and one in the backward; the 1x1 convolution and the eval-mode BatchNorm communicate
nothing. Any extra round trip on the path (a per-layer agreement, a guard or scope collective)
changes these numbers. Each run also compares the output, the input gradient and every
parameter gradient with the single-device model (float64, uneven slabs), on repeated forwards
(the second and third forward must cost what the first does, and stay exact).

Also: the forward guard's per-forward tensor -> layout map (``forward_guard._States``) never
hands a tensor's state to a new tensor that reuses a dead one's ``id``.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.comm.traffic import count_traffic
from sharded_nn.forward_guard import _States

from .harness import mesh
from .reference import reduce_param_grads
from .test_latency_paths import _all_gather, _rand



def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 1),
        nn.Conv2d(8, 4, 3, padding=1),
    )


def _strided_cnn() -> nn.Module:
    # The 1x1 convolution of stride 2 (a ResNet or RegNet downsample) reads no halo on any rank:
    # it must not exchange (empty) halos either.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 1, stride=2),
        nn.Conv2d(8, 4, 3, padding=1),
    )


def _counts(sizes: tuple[int, ...], repeats: int, build=_small_cnn) -> list[tuple[dict, dict, dict]]:
    """Per forward: the calls of the no-grad forward, the grad forward and its backward, by kind."""
    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = build().double().eval()
    with torch.no_grad():
        ref[1].running_mean.uniform_(-1, 1)
        ref[1].running_var.uniform_(0.5, 2)
    model = snn.convert(copy.deepcopy(ref), m)
    shape = (2, 3, sum(sizes), 5)
    x = _rand(shape).requires_grad_()
    y = ref(x)
    g_out = _rand(y.shape, 1)
    (y * g_out).sum().backward()
    r = m.get_local_rank("domain")
    off = sum(sizes[:r])
    out = []
    for _ in range(repeats):
        model.zero_grad()
        x_loc = x.detach().narrow(2, off, sizes[r]).clone()
        with torch.no_grad(), count_traffic() as t_ng:
            y_ng = model(x_loc)
        x_loc.requires_grad_()
        with count_traffic() as t_fwd:
            y_loc = model(x_loc)
        # The same values to rounding: without autograd, thin slabs take the synchronous path
        # (``layers/conv.py: _sync_cheaper``), which sums the halo rows in another order.
        torch.testing.assert_close(y_ng, y_loc.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(torch.cat(_all_gather(y_loc), 2), y.detach(), atol=1e-10, rtol=1e-10)
        with count_traffic() as t_bwd:
            # Output slabs: the input's divided by the model's stride (even slabs in the strided case).
            k = sum(sizes) // y.shape[2]
            (y_loc * g_out.narrow(2, off // k, sizes[r] // k)).sum().backward()
        torch.testing.assert_close(torch.cat(_all_gather(x_loc.grad), 2), x.grad, atol=1e-10, rtol=1e-10)
        grads = reduce_param_grads(model, m)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
        out.append((dict(t_ng.calls), dict(t_fwd.calls), dict(t_bwd.calls)))
    return out


@pytest.mark.parametrize("sizes", [(7, 4), (3, 5, 4)], ids=str)
def test_converted_cnn_forward_collectives_are_pinned(run, sizes):
    for per_rank in run(len(sizes), _counts, sizes, 3):
        for no_grad, fwd, bwd in per_rank:
            # One agreement per forward (layouts + entry facts), one halo exchange per 3x3 conv.
            assert no_grad == {"metadata": 1, "halo": 2}, no_grad
            assert fwd == {"metadata": 1, "halo": 2}, fwd
            # Backward: one halo-gradient exchange per 3x3 conv, no agreement.
            assert bwd == {"halo": 2}, bwd


@pytest.mark.parametrize("sizes", [(6, 4), (4, 2, 6)], ids=str)
def test_strided_pointwise_conv_exchanges_nothing(run, sizes):
    for per_rank in run(len(sizes), _counts, sizes, 2, _strided_cnn):
        for no_grad, fwd, bwd in per_rank:
            assert no_grad == {"metadata": 1, "halo": 2}, no_grad
            assert fwd == {"metadata": 1, "halo": 2}, fwd
            assert bwd == {"halo": 2}, bwd


def test_states_ignore_a_reused_id():
    states = _States()
    a = torch.zeros(3)
    states[a] = (2,)
    assert a in states and states.get(a) == (2,) and states[a] == (2,)
    # A dead tensor whose id a new tensor reuses: its entry (a weak reference that no longer
    # names the tensor in hand) is what the new tensor finds under its id.
    b = torch.zeros(3)
    states._d[id(b)] = (weakref.ref(a), (3,))
    assert b not in states
    assert states.get(b, "missing") == "missing"
    assert states.pop(b, "missing") == "missing"
    with pytest.raises(KeyError):
        states[b]
    states[b] = None  # a tracked "replicated" state is not a missing one
    assert b in states and states.pop(b, "x") is None and b not in states
    ident = id(a)
    del a
    gc.collect()
    assert states._d[ident][0]() is None  # dead: ignored, whatever later takes the id
