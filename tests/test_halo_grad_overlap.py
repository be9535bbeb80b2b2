"""The halo-gradient exchange of an overlapped halo travels while the layer's own backward runs.

A sharded convolution (and pooling) computes its interior on the slab while the halos travel
(``comm.halo_exchange``). In the backward, the halo gradients are complete before the interior's
backward runs: ``_HaloWait.backward`` sends them at once (gloo matches messages by tag), and
``_HaloStart.backward`` only collects what came back. Checked here: the order of events on every
rank (exchange started before the convolution's weight gradient is computed, collected after),
and exactness against the single-device module (float64, uneven slabs, P = 2 and 3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.comm import halo as halo_mod

from .harness import mesh
from .reference import check_against_reference

D = torch.float64


def _rand(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _events(domain: int, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = nn.Conv2d(3, 4, 3, padding=1).double()
    model = snn.convert(copy.deepcopy(ref), m)
    events: list[str] = []
    start, finish = halo_mod._start_halo_grads, halo_mod._finish_halo_grads

    def rec_start(*a, **k):
        events.append("start")
        return start(*a, **k)

    def rec_finish(*a, **k):
        events.append("finish")
        return finish(*a, **k)

    halo_mod._start_halo_grads, halo_mod._finish_halo_grads = rec_start, rec_finish
    try:
        model.weight.register_hook(lambda g: events.append("weight"))
        r = m.get_local_rank("domain")
        x = _rand((2, 3, sum(sizes), 5)).narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
        model(x).sum().backward()
    finally:
        halo_mod._start_halo_grads, halo_mod._finish_halo_grads = start, finish
    return events


@pytest.mark.parametrize("domain,sizes", [(2, (3, 6)), (3, (4, 2, 5))])
def test_halo_grads_start_before_the_layer_backward(run, domain, sizes):
    got = run(domain, _events, domain, sizes)
    assert all(e == ["start", "weight", "finish"] for e in got), got


def _exact(domain: int, sizes, kind: str):
    torch.manual_seed(0)
    ref = {
        "conv": nn.Conv2d(3, 4, 3, padding=1),
        "conv_strided": nn.Conv2d(3, 4, 5, stride=2, padding=2),
        "maxpool": nn.MaxPool2d(3, 1, 1),
        "conv_circular": nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
    }[kind].double()
    if kind == "conv_strided":  # stride 2 needs slabs starting at even rows
        sizes = tuple(2 * s for s in sizes)
    return check_against_reference(ref, _rand((2, 3, sum(sizes), 5)), mesh(domain), sizes=sizes)


@pytest.mark.parametrize("kind", ["conv", "conv_strided", "maxpool", "conv_circular"])
@pytest.mark.parametrize("domain,sizes", [(2, (3, 6)), (3, (4, 2, 5))])
def test_overlapped_halo_grads_are_exact(run, domain, sizes, kind):
    run(domain, _exact, domain, sizes, kind)
