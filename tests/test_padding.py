"""Sharded padding layers and ``pad`` against torch on the full tensor, forward and backward."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.layers.padding import pad

from .harness import mesh
from .reference import check_against_reference

SIZES = {1: (17,), 2: (14, 6), 3: (9, 5, 4)}


def _cases():
    out = []
    for nd in (1, 2, 3):
        pads = {1: [(2, 3), 1], 2: [(1, 2, 3, 1), 2], 3: [(1, 2, 0, 1, 2, 1), 1]}[nd]
        for p in pads:
            out += [
                (partial(getattr(nn, f"ZeroPad{nd}d"), p), nd),
                (partial(getattr(nn, f"ConstantPad{nd}d"), p, 1.5), nd),
                (partial(getattr(nn, f"ReflectionPad{nd}d"), p), nd),
                (partial(getattr(nn, f"ReplicationPad{nd}d"), p), nd),
                (partial(getattr(nn, f"CircularPad{nd}d"), p), nd),
            ]
    # Negative padding (cropping), as torch allows: of W and (since session 60) of the sharded H,
    # left, right and both, with padding on the other side.
    out.append((partial(nn.ConstantPad2d, (-1, 2, 1, 1), 0.5), 2))
    out.append((partial(nn.ConstantPad2d, (1, 0, -2, -1), 0.5), 2))
    out.append((partial(nn.ReplicationPad2d, (0, 1, -3, 2)), 2))
    out.append((partial(nn.ReflectionPad2d, (1, -1, 2, -4)), 2))
    return out


CASES = _cases()


def _check_layers(domain, dims, nds):
    m = mesh(domain)
    for factory, nd in CASES:
        if nd not in nds:
            continue
        ref = factory()
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
        assert type(sharded).__name__ == f"Sharded{type(ref).__name__}"
        torch.manual_seed(nd)
        x = torch.randn(2, 3, *SIZES[nd], dtype=torch.float64)
        check_against_reference(ref, x, m, dims=dims, sharded=sharded)
    return True


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
def test_padding_layers_1d_mesh(run, domain):
    assert all(run(domain, _check_layers, domain, (2,), (1, 2, 3)))


def test_padding_layers_2x2_mesh(run):
    assert all(run(4, _check_layers, (2, 2), (2, 3), (2, 3)))


def test_padding_a_later_dim(run):
    assert all(run(2, _check_layers, 2, (3,), (2,)))


def _functional():
    # pad() is F.pad on slabs, also on unbatched-looking layouts such as (C, L) via dims.
    m = mesh(3)
    torch.manual_seed(0)
    x = torch.randn(4, 14, dtype=torch.float64)
    for mode, value in (("constant", 2.0), ("reflect", None), ("replicate", None), ("circular", None)):
        # torch's non-constant modes want a batch dim in front of (C, L).
        want = F.pad(x.unsqueeze(0), (3, 2), mode, value).squeeze(0)
        got = pad(snn.shard(x, m, dims=(1,)), (3, 2), m, mode, value, dims=(1,))
        torch.testing.assert_close(snn.gather(got, m, dims=(1,)), want)
    return True


def test_functional_pad(run):
    assert all(run(3, _functional))


def _errors():
    m = mesh(2)
    x = snn.shard(torch.randn(1, 2, 5, 4), m, dims=(2,))  # slabs of 3 and 2
    # Wider than the global dim: torch refuses these on one device too.
    with pytest.raises(snn.ShardingError, match=r"reflect padding \(0, 5\) along sharded dim 2 must be at most 4"):
        pad(x, (0, 0, 0, 5), m, "reflect")
    with pytest.raises(snn.ShardingError, match=r"circular padding \(6, 0\) .* at most 5"):
        pad(x, (0, 0, 6, 0), m, "circular")
    with pytest.raises(snn.ShardingNotImplementedError, match="circular padding with a negative"):
        pad(x, (0, 0, -1, 0), m, "circular")  # (torch crops first, then wraps around the cropped dim)
    with pytest.raises(snn.ShardingError, match=r"crops more than the 5 positions of sharded dim 2"):
        pad(x, (0, 0, -4, -2), m)
    with pytest.raises(snn.ShardingError, match="unknown mode"):
        pad(x, (1, 1), m, "wrap")
    with pytest.raises(snn.ShardingError, match="only valid with mode='constant'"):
        pad(x, (1, 1), m, "reflect", 3.0)
    return True


def test_bad_input_raises_on_every_rank(run):
    assert all(run(2, _errors))


def _thin_edges():
    # Padding wider than the edge slabs (these raised before multi-hop halos): the edge ranks
    # read the rows from every rank they span; forward and backward against torch.
    m = mesh(3)
    x = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    for ref in (nn.ReflectionPad1d((3, 4)), nn.CircularPad1d((5, 4)), nn.ReflectionPad2d((1, 1, 4, 2))):
        inp = x[..., 0] if isinstance(ref, (nn.ReflectionPad1d, nn.CircularPad1d)) else x
        check_against_reference(ref, inp, m, sizes=(1, 3, 1))
    return True


def test_padding_wider_than_edge_slabs(run):
    assert all(run(3, _thin_edges))


# --------------------------------------------------------------------------------------------
# A padding layer then a window without padding: the output is on the input's layout


class _PadConvResidual(nn.Module):
    """CycleGAN/pix2pix's ResnetBlock: ``x + conv(pad(relu(conv(pad(x)))))`` with convs of padding 0."""

    def __init__(self, pad_cls, width: int = 1) -> None:
        super().__init__()
        k = 2 * width + 1
        self.body = nn.Sequential(pad_cls(width), nn.Conv2d(2, 2, k), nn.ReLU(), pad_cls(width), nn.Conv2d(2, 2, k))

    def forward(self, x):
        return x + self.body(x)


class _PadPoolSkip(nn.Module):
    """MONAI's SubpixelUpsample tail (pad the left edges, average-pool 2x2 with stride 1) beside a
    skip, and a pad then a stride-2 conv (its slabs must stay aligned to 2)."""

    def __init__(self, pad) -> None:
        super().__init__()
        self.pool = nn.Sequential(pad, nn.AvgPool2d(2, stride=1))
        self.down = nn.Sequential(nn.ZeroPad2d((0, 1, 1, 0)), nn.Conv2d(2, 2, 2, stride=2))

    def forward(self, x):
        return torch.cat([x, self.pool(x)], 1), self.down(x)


def _pad_then_window(domain, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    cases = [_PadConvResidual(cls, w) for cls in (nn.ReflectionPad2d, nn.ZeroPad2d, nn.ReplicationPad2d,
                                                    nn.CircularPad2d) for w in (1, 2)]  # fmt: skip
    cases += [_PadPoolSkip(nn.ConstantPad2d((1, 0, 1, 0), 0.0)), _PadPoolSkip(nn.ReflectionPad2d((1, 0, 1, 0)))]
    for ref in cases:
        ref = ref.double()
        x = torch.randn(2, 2, sum(sizes), 7, dtype=torch.float64)
        if isinstance(ref, _PadPoolSkip):
            for i in range(2):  # each output alone (the reference checks one output)
                single = _Pick(ref, i)
                check_against_reference(single, x, m, sizes=sizes, sharded=snn.convert(copy.deepcopy(single), m))
        else:
            check_against_reference(ref, x, m, sizes=sizes)
    return True


class _Pick(nn.Module):
    def __init__(self, model, i):
        super().__init__()
        self.model, self.i = model, i

    def forward(self, x):
        return self.model(x)[self.i]


@pytest.mark.parametrize("domain,sizes", [(2, (4, 6)), (3, (2, 4, 4)), (4, (2, 2, 2, 4))])
def test_pad_then_unpadded_window_keeps_the_layout(run, domain, sizes):
    # The rows move one rank on by the left padding, so that x + conv(pad(x)) adds slabs of one
    # layout (before: the first rank held `pl` rows more, the last fewer, and the add failed on
    # some ranks only: a transport error or a hang), and a stride-2 conv after a pad of 1 sees
    # slabs that start at even rows.
    assert all(run(domain, _pad_then_window, domain, sizes, timeout=300))
