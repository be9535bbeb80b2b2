"""timm's TF-style "SAME" convolution (``Conv2dSame``), converted: padding from the global size.

``Conv2dSame`` pads in ``forward`` by amounts computed from the input's size; on a slab that
is the local size. Converted, the padding comes from the global size (asymmetric where TF's
rule makes it so), forward, input and parameter gradients equal timm's layer on the full
tensor, on uneven slabs at P = 2, 3, 4 and on a 2x2 mesh; at P = 1 the layer is timm's.
The weight-standardised ``StdConv2dSame`` and ``ScaledStdConv2dSame`` (NFNets) and the
anti-aliasing ``BlurPool2d`` likewise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.layers import create_conv2d
from timm.layers.conv2d_same import Conv2dSame
from timm.layers.std_conv import ScaledStdConv2dSame, StdConv2dSame

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


def _standardised(case, domain, cls_name):
    # Weight-standardised TF-"SAME" convolutions (BiT stems, DeepMind NFNets): the sharded class
    # standardises the weights as timm does and pads from the global size. Stride 1 gives a
    # static padding (same_pad False), a plain sharded convolution of the standardised weights.
    k, s, d, g, h, w = case
    m = mesh(domain)
    torch.manual_seed(0)
    cls = {"std": StdConv2dSame, "scaled": ScaledStdConv2dSame}[cls_name]
    ref = cls(4, 8, k, stride=s, dilation=d, groups=g, bias=True).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # a gain other than 1, a bias other than 0
    x = torch.randn(2, 4, h, w, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    expected = {"std": snn.layers.ShardedStdConv2dSame, "scaled": snn.layers.ShardedScaledStdConv2dSame}[cls_name]
    assert isinstance(model, expected) and model.same_pad == ref.same_pad
    assert sorted(model.state_dict()) == sorted(ref.state_dict())
    if isinstance(domain, int):
        errs = check_against_reference(ref, x, m, sharded=model, sizes=_split(h, domain, s))
    else:
        errs = check_against_reference(ref, x, m, sharded=model, align=s)
    return max(errs.values())


@pytest.mark.parametrize("cls_name", ["std", "scaled"])
@pytest.mark.parametrize("domain", [1, 2, 3, (2, 2)])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=str)
def test_standardised_same_convs_match_timm(run, case, domain, cls_name):
    world = domain if isinstance(domain, int) else 4
    assert max(run(world, _standardised, case, domain, cls_name)) < 1e-10


def _blur(cfg, domain):
    # timm's BlurPool2d: a (reflect) pad, then a strided depthwise blur; one sharded convolution.
    from timm.layers.blur_pool import BlurPool2d

    channels, filt, stride, mode, h, w = cfg
    m = mesh(domain)
    ref = BlurPool2d(channels, filt_size=filt, stride=stride, pad_mode=mode).double()
    x = torch.randn(2, 4, h, w, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    assert isinstance(model, snn.layers.ShardedBlurPool2d)
    if isinstance(domain, int):
        errs = check_against_reference(ref, x, m, sharded=model, sizes=_split(h, domain, stride))
    else:
        errs = check_against_reference(ref, x, m, sharded=model, align=stride)
    return max(errs.values())


BLUR = [
    (4, 3, 2, "reflect", 20, 9),
    (None, 3, 2, "reflect", 19, 8),  # channels from the input
    (4, 5, 2, "replicate", 24, 10),
    (4, 4, 2, "constant", 16, 11),
    (4, 3, 1, "reflect", 15, 7),
]


@pytest.mark.parametrize("domain", [1, 2, 3, (2, 2)])
@pytest.mark.parametrize("cfg", BLUR, ids=str)
def test_blur_pool_matches_timm(run, cfg, domain):
    world = domain if isinstance(domain, int) else 4
    assert max(run(world, _blur, cfg, domain)) < 1e-10


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


def _errors(cls_name):
    # Bad inputs raise the same ShardingError on every rank (facts every rank shares).
    m = mesh(2)
    torch.manual_seed(0)  # the same weights on every rank (else that is the error: tests/test_weights.py)
    if cls_name == "blur":
        from timm.layers.blur_pool import BlurPool2d

        conv = snn.convert(BlurPool2d(4, filt_size=3, stride=2), m)
    else:
        cls = {"same": Conv2dSame, "std": StdConv2dSame, "scaled": ScaledStdConv2dSame}[cls_name]
        conv = snn.convert(cls(4, 8, 3, stride=2), m)
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


@pytest.mark.parametrize("cls_name", ["same", "std", "scaled", "blur"])
def test_errors_raise_alike_on_every_rank(run, cls_name):
    got = run(2, _errors, cls_name)
    for what in got[0]:
        assert got[0][what] is not None and got[0][what] == got[1][what], (what, got)
    assert "expected 4 input channels" in got[0]["channels"][1]
    assert "multiple of 2" in got[0]["misaligned"][1]
