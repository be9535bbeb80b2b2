"""timm's TF-style "SAME" convolution (``Conv2dSame``), converted: padding from the global size.

``Conv2dSame`` pads in ``forward`` by amounts computed from the input's size; on a slab that
is the local size. Converted, the padding comes from the global size (asymmetric where TF's
rule makes it so), forward, input and parameter gradients equal timm's layer on the full
tensor, on uneven slabs at P = 2, 3, 4 and on a 2x2 mesh; at P = 1 the layer is timm's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.layers import create_conv2d
from timm.layers.conv2d_same import Conv2dSame

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference

# (kernel, stride, dilation, groups, global H, W): odd and even sizes, so that the TF padding is
# symmetric in some cases and one more on the right/bottom in others.
CASES = [
    (3, 2, 1, 1, 16, 9),
    (5, 2, 1, 4, 16, 10),
    (3, 1, 2, 1, 15, 7),
    (4, 1, 1, 2, 14, 8),
    (7, 2, 1, 4, 20, 11),
]
#: Uneven slab proportions of the sample's rows per world size (cut at multiples of the stride).
SPLITS = {1: (1.0,), 2: (0.6, 0.4), 3: (0.4, 0.25, 0.35), 4: (0.25, 0.25, 0.4, 0.1)}


def _split(h: int, domain: int, stride: int) -> list[int]:
    sizes = [stride * round(f * h / stride) for f in SPLITS[domain][:-1]]
    return sizes + [h - sum(sizes)]


def _same(case, domain):
    k, s, d, g, h, w = case
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Conv2dSame(4, 8, k, stride=s, dilation=d, groups=g).double()
    x = torch.randn(2, 4, h, w, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    assert isinstance(model, snn.layers.ShardedConv2dSame)
    if isinstance(domain, int):
        errs = check_against_reference(ref, x, m, sharded=model, sizes=_split(h, domain, s))
    else:  # H and W sharded: balanced slabs cut at multiples of the stride
        errs = check_against_reference(ref, x, m, sharded=model, align=s)
    return max(errs.values())


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv2d_same_matches_timm(run, case, domain):
    assert max(run(domain, _same, case, domain)) < 1e-10


@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_conv2d_same_on_a_2x2_mesh(run, case):
    assert max(run(4, _same, case, (2, 2))) < 1e-10


def _efficientnet_stem(domain):
    # How timm builds it: create_conv2d(..., padding="same") with a stride gives a Conv2dSame.
    m = mesh(domain)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        create_conv2d(3, 8, 3, stride=2, padding="same"), torch.nn.SiLU(),
        create_conv2d(8, 8, 5, stride=2, padding="same", depthwise=True),
    ).double()
    assert isinstance(ref[0], Conv2dSame) and isinstance(ref[2], Conv2dSame)
    x = torch.randn(1, 3, 30, 13, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    # Slabs cut at multiples of 4 (the product of the strides), uneven.
    return max(check_against_reference(ref, x, m, sharded=model, sizes=(16, 14) if domain == 2 else (16, 12, 2)).values())


@pytest.mark.parametrize("domain", [2, 3])
def test_tf_same_stem_of_two_strided_convs(run, domain):
    assert max(run(domain, _efficientnet_stem, domain)) < 1e-10


def _errors():
    # Bad inputs raise the same ShardingError on every rank (facts every rank shares).
    m = mesh(2)
    conv = snn.convert(Conv2dSame(4, 8, 3, stride=2), m)
    out = {}
    for what, x in (
        ("channels", torch.randn(1, 3, 8, 8)),  # 3 channels, the layer expects 4
        ("misaligned", torch.randn(1, 4, 5 if m.get_local_rank("domain") == 0 else 6, 8)),  # slab 1 starts at 5
    ):
        try:
            conv(x)
            out[what] = None
        except snn.ShardingError as e:
            out[what] = (type(e).__name__, str(e))
    return out


def test_errors_raise_alike_on_every_rank(run):
    got = run(2, _errors)
    for what in got[0]:
        assert got[0][what] is not None and got[0][what] == got[1][what], (what, got)
    assert "expected 4 input channels" in got[0]["channels"][1]
    assert "multiple of 2" in got[0]["misaligned"][1]
