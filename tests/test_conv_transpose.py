"""ShardedConvTranspose1d/2d/3d against the torch layers on the full tensor, forward and backward."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference

CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@dataclass(frozen=True)
class Cfg:
    nd: int = 2
    kernel: int | tuple = 4
    stride: int | tuple = 2
    padding: int | tuple = 1
    output_padding: int | tuple = 0
    dilation: int | tuple = 1
    groups: int = 1
    bias: bool = True
    size: tuple = (11, 5, 4)  # spatial sizes, first nd used
    cin: int = 4
    cout: int = 6
    batch: int = 2
    dims: tuple = (2,)

    def module(self) -> nn.Module:
        torch.manual_seed(0)
        return CONVT[self.nd](
            self.cin, self.cout, self.kernel, stride=self.stride, padding=self.padding,
            output_padding=self.output_padding, dilation=self.dilation, groups=self.groups, bias=self.bias,
        ).double()

    def input(self) -> torch.Tensor:
        torch.manual_seed(1)
        return torch.randn(self.batch, self.cin, *self.size[: self.nd], dtype=torch.float64)


def _check_many(cfgs, domain, dims=(2,), sizes=None):
    m = mesh(domain)
    out = []
    for cfg in cfgs:
        ref = cfg.module()
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
        out.append(check_against_reference(ref, cfg.input(), m, dims=dims, sizes=sizes, sharded=sharded)["out"])
    return out


CASES = [
    Cfg(kernel=4, stride=2, padding=1),  # the decoder upsampler
    Cfg(kernel=3, stride=2, padding=1, output_padding=1),
    Cfg(kernel=2, stride=2, padding=0),
    Cfg(kernel=3, stride=1, padding=1),
    Cfg(kernel=1, stride=2, padding=0),  # gaps between the scattered windows
    Cfg(kernel=1, stride=3, padding=0, output_padding=2),
    Cfg(kernel=5, stride=2, padding=3, output_padding=1),
    Cfg(kernel=3, stride=3, padding=2),
    Cfg(kernel=3, stride=2, padding=0, dilation=2, output_padding=1),
    Cfg(kernel=(4, 3), stride=(2, 1), padding=(1, 1), output_padding=(1, 0), dilation=(1, 2)),
    Cfg(kernel=4, stride=2, padding=1, groups=2, bias=False),
    Cfg(kernel=3, stride=2, padding=1, groups=2, cout=4),
    Cfg(nd=1, kernel=4, stride=2, padding=1, size=(13,)),
    Cfg(nd=1, kernel=7, stride=3, padding=2, output_padding=2, size=(13,)),
    Cfg(nd=3, kernel=4, stride=2, padding=1, size=(9, 4, 3)),
    Cfg(nd=3, kernel=(3, 2, 2), stride=2, padding=(1, 0, 0), output_padding=(1, 0, 0), size=(9, 4, 3)),
]


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
def test_conv_transpose_matches_torch_1d_mesh(run, domain):
    errs = run(domain, _check_many, CASES, domain)
    assert all(e <= 1e-10 for rank in errs for e in rank)


def test_conv_transpose_uneven_explicit_slabs(run):
    # Slabs of any size: a transposed conv needs no alignment of its input.
    cfgs = [Cfg(kernel=4, stride=2, padding=1), Cfg(kernel=3, stride=2, padding=1, output_padding=1),
            Cfg(kernel=5, stride=1, padding=2)]
    run(3, _check_many, cfgs, 3, (2,), (3, 5, 3))


def test_conv_transpose_2x2_mesh(run):
    cfgs = [Cfg(kernel=4, stride=2, padding=1, size=(9, 7, 3)),
            Cfg(kernel=3, stride=2, padding=1, output_padding=1, size=(9, 7, 3)),
            Cfg(kernel=2, stride=2, padding=0, size=(9, 7, 3)),
            Cfg(nd=3, kernel=3, stride=(2, 2, 1), padding=1, output_padding=(1, 0, 0), size=(6, 5, 3))]
    run(4, _check_many, cfgs, (2, 2), (2, 3))


def _output_size():
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1).double()
    sharded = snn.ShardedConvTranspose2d.from_module(copy.deepcopy(ref), m)
    x = torch.randn(1, 3, 7, 5, dtype=torch.float64)
    y_ref = ref(x, output_size=(14, 10))
    y = snn.gather(sharded(snn.shard(x, m, dims=(2,)), output_size=(14, 10)), m, dims=(2,))
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    assert list(sharded.state_dict()) == list(ref.state_dict())
    assert "mesh_axes=('domain',)" in repr(sharded)
    return True


def test_output_size_argument_and_state_dict(run):
    assert all(run(2, _output_size))


def _float32_decoder():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(8, 8, 4, 2, 1), nn.GELU(),
                        nn.ConvTranspose2d(8, 4, 2, 2), nn.Conv2d(4, 2, 3, padding=1))
    return check_against_reference(ref, torch.randn(1, 3, 10, 6), mesh(3), atol=1e-5, rtol=1e-4)


def test_float32_decoder_stack(run):
    run(3, _float32_decoder)


def test_strip_spanning_several_ranks_is_exact(run):
    # Span 11, stride 2, padding 5: 4 outputs spill to the right, where the neighbour's output
    # slab holds 2: they are added into the two ranks they span (comm.halo_scatter).
    cfg = Cfg(kernel=11, stride=2, padding=5, size=(9, 5, 4))
    run(3, _check_many, [cfg], 3, (2,), (4, 1, 4))


def _empty_global_output():
    m = mesh(2)
    layer = snn.ShardedConvTranspose1d(2, 2, 2, padding=3, mesh=m)
    x = torch.randn(1, 2, 3)
    x_loc = x[..., :2] if m.get_local_rank("domain") == 0 else x[..., 2:]
    with pytest.raises(snn.ShardingError, match=r"global output is empty \(input size 3\)"):
        layer(x_loc)
    return True


def test_empty_global_output_raises_on_every_rank(run):
    # Padding crops more than the whole output: torch refuses it on one device too.
    assert run(2, _empty_global_output) == [True, True]


def _unsupported():
    module = nn.ConvTranspose2d(2, 2, 3)
    module.padding_mode = "reflect"  # torch's constructor refuses it; a hand-edited module may not
    with pytest.raises(snn.ShardingNotImplementedError, match="padding_mode"):
        snn.ShardedConvTranspose2d.from_module(module, mesh(2))
    return True


def test_unsupported_padding_mode(run):
    assert all(run(2, _unsupported))


def _halo_add_is_adjoint(periodic):
    # <halo_add(x), g> == <x, halo_cat(g)> for random x and g: the backward of one is the other.
    ring = snn.comm.axis_peers(mesh(3), "domain")
    core = (4, 3, 5)
    spec = snn.comm.HaloSpec(2, (2 if periodic else 0, 1, 3), (2, 1, 1 if periodic else 0), periodic)
    r = ring.index
    gen = torch.Generator().manual_seed(r)
    x = torch.randn(1, 2, spec.left[r] + core[r] + spec.right[r], dtype=torch.float64, generator=gen)
    g = torch.randn(1, 2, core[r], dtype=torch.float64, generator=gen)
    x.requires_grad_()
    y = snn.comm.halo_add(x, spec, ring)
    (y * g).sum().backward()
    lhs = snn.losses.domain_sum((y * g).sum().detach(), mesh(3))
    rhs = snn.losses.domain_sum((x * snn.comm.halo_cat(g, spec, ring)).sum().detach(), mesh(3))
    torch.testing.assert_close(lhs, rhs)
    torch.testing.assert_close(x.grad, snn.comm.halo_cat(g, spec, ring))
    return True


@pytest.mark.parametrize("periodic", [False, True])
def test_halo_add_is_the_adjoint_of_halo_cat(run, periodic):
    assert all(run(3, _halo_add_is_adjoint, periodic))
