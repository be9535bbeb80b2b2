"""The zoo FNO (``create_model("fno2d" | "fno3d")``) against the plain model: forward, input and
parameter gradients (float64), uneven slabs, world sizes 2 and 3, a 3-D FNO on a 2x2 mesh
sharding D and H, a 2-D one sharding H and W (the halved dim) and one sharding W only, modes
whose two ends overlap (the whole spectrum's route); built with ``strict=True`` (no layer left
unreported); bad modes refused alike."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.forward_guard import mark_guarded
from sharded_nn.zoo.fno import FNO, ShardedSpectralConv, SpectralConv

from .harness import mesh
from .reference import compare_on_slabs

OPTIONS = {"in_channels": 2, "out_channels": 1, "width": 6, "modes": 3, "depth": 2, "projection": 8}


def _one_axis(world, name, sizes, rest):
    m = mesh(world)
    torch.manual_seed(0)
    ref = snn.zoo.create_model(name, **OPTIONS).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict convert, and no warning either
        model = snn.zoo.create_model(name, mesh=m, **OPTIONS).double()
    model.load_state_dict(ref.state_dict())
    assert all(type(b.spectral) is ShardedSpectralConv for b in model.blocks)  # swapped by convert
    assert snn.alignment(copy.deepcopy(ref), dims=(2,)) == (1,)
    x = torch.randn(2, 2, sum(sizes), *rest, dtype=torch.float64)
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


@pytest.mark.parametrize("name,rest", [("fno2d", (8,)), ("fno3d", (5, 6))])
@pytest.mark.parametrize("world,sizes", [(2, [7, 3]), (3, [1, 5, 4])])
def test_zoo_fno_is_exact(run, name, rest, world, sizes):
    assert max(run(world, _one_axis, world, name, sizes, rest)) < 1e-10


def _on_blocks(mesh_shape, name, dims, shape, splits, options=OPTIONS):
    """``name`` converted for a mesh of ``mesh_shape`` sharding ``dims`` (one per mesh axis, each
    cut into ``splits[k]``) against the plain model: forward, input and summed parameter gradients."""
    m = mesh(mesh_shape)
    axes = m.mesh_dim_names
    coords = [m.get_local_rank(a) for a in axes]
    torch.manual_seed(0)
    ref = snn.zoo.create_model(name, **options).double()
    model = snn.zoo.create_model(name, mesh=m, dims=dims, **options).double()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y_ref = ref(x)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()

    def block(t):
        for d, split, c in zip(dims, splits, coords):
            t = t.narrow(d, sum(split[:c]), split[c])
        return t

    x_local = block(x.detach()).clone().requires_grad_()
    y = model(x_local)
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-10, rtol=1e-10)
    (y * block(g)).sum().backward()
    torch.testing.assert_close(x_local.grad, block(x.grad), atol=1e-10, rtol=1e-10)
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=pname: f"{n}: {s}")
    return True


def test_zoo_fno3d_on_a_2x2_mesh(run):
    assert all(run(4, _on_blocks, (2, 2), "fno3d", (2, 3), (1, 2, 7, 7, 6), ([4, 3], [2, 5])))


def test_zoo_fno2d_on_a_2x2_mesh_shards_both_grid_dims(run):
    # The last grid dim (halved by the real transform) sharded too: only the kept modes are made.
    assert all(run(4, _on_blocks, (2, 2), "fno2d", (2, 3), (2, 2, 9, 11), ([6, 3], [4, 7])))


@pytest.mark.parametrize("world,cols", [(2, [3, 6]), (3, [5, 1, 4])])
def test_zoo_fno2d_sharded_along_its_last_dim(run, world, cols):
    assert all(run(world, _on_blocks, world, "fno2d", (3,), (2, 2, 8, sum(cols)), (cols,)))


def test_zoo_fno_modes_whose_ends_overlap(run):
    # 4 modes on 7 rows: both ends of the spectrum overlap (the corners are assigned one after the
    # other on one device); that takes the whole spectrum's route (all-to-alls), exact as well.
    options = {**OPTIONS, "modes": (4, 3)}
    assert all(run(3, _on_blocks, 3, "fno2d", (2,), (2, 2, 7, 6), ([2, 4, 1],), options))


def test_fno_options_are_checked():
    with pytest.raises(ValueError, match="modes"):
        FNO(2, 1, 1, modes=(4, 4, 4))
    with pytest.raises(ValueError, match="spatial_dims"):
        SpectralConv(4, 1, 1, 2)
    assert len(SpectralConv(3, 2, 2, 2).corners()) == 4


def _standalone(world, sizes):
    """The sharded layer on its own (no convert, no guard): 2-D, uneven slabs, modes at both ends."""
    m = mesh(world)
    torch.manual_seed(0)
    ref = SpectralConv(2, 3, 4, (3, 2)).double()
    layer = ShardedSpectralConv(2, 3, 4, (3, 2), mesh=m).double()
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, sum(sizes), 7, dtype=torch.float64)
    return compare_on_slabs(ref, layer, m, x, sizes, replicated=False)


@pytest.mark.parametrize("world,sizes", [(2, [1, 8]), (3, [4, 1, 5])])
def test_sharded_spectral_conv_on_its_own(run, world, sizes):
    assert max(run(world, _standalone, world, sizes)) < 1e-10


def _bad_layer():
    m = mesh(2)
    layer = ShardedSpectralConv(2, 1, 1, 6, mesh=m)
    with pytest.raises(snn.ShardingError, match="6 modes along dim 2 need a grid of at least that many"):
        layer(torch.randn(1, 1, 2, 12))  # 4 rows in all
    layer = ShardedSpectralConv(2, 1, 1, 6, mesh=m, dims=(3,))
    with pytest.raises(snn.ShardingError, match="6 modes along dim 3 need .* a half spectrum of 5"):
        layer(torch.randn(1, 1, 12, 4))  # 8 columns in all
    layer = ShardedSpectralConv(2, 1, 1, (4, 2), mesh=m, dims=(3,))
    with pytest.raises(snn.ShardingError, match="overlap at the two ends .* the last grid dim .* is sharded"):
        layer(torch.randn(1, 1, 7, 4))  # 4 modes of 7 rows: the whole spectrum's route
    return True


def test_sharded_spectral_conv_refuses_alike(run):
    assert all(run(2, _bad_layer))


class MyFourierLayer(nn.Module):
    """A user's own spectral filter, plain torch code the guard follows."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.complex128))

    def forward(self, x):
        f = torch.fft.rfft2(x)
        g = f.clone()
        g[:, :, :3] = f[:, :, :3] * self.w[:, None]
        return torch.fft.irfft2(g, s=(x.shape[2], x.shape[3]))


@mark_guarded
class MyMarkedFourierLayer(MyFourierLayer):
    pass


def _strict(world, sizes):
    m = mesh(world)
    torch.manual_seed(0)
    with pytest.raises(snn.ShardingNotImplementedError):
        snn.convert(nn.Sequential(nn.Conv2d(2, 2, 1), MyFourierLayer()).double(), m, strict=True)
    ref = nn.Sequential(nn.Conv2d(2, 2, 1), MyMarkedFourierLayer()).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)  # marked: not reported
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


def test_mark_guarded_lets_strict_convert_follow_a_fourier_layer(run):
    assert max(run(2, _strict, 2, [2, 5])) < 1e-10
