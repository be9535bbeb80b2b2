"""The kept Fourier modes of a sharded tensor and back (``sharded_nn.fft_modes``) against
``torch.fft.rfftn``/``irfftn`` on the whole tensor: forward and gradients (float64), uneven slabs
(empty ones too), world sizes 2 and 3, the halved (last) dim sharded, both grid dims of a 2x2
mesh, 1-D and 3-D transforms, an odd and an even last length with its Nyquist frequency kept;
bad modes refused alike on every rank. (The zoo FNO's use of it: tests/test_zoo_fno.py.)"""

from __future__ import annotations

import pytest
import torch

import sharded_nn as snn
from sharded_nn.fft_modes import irfftn_modes, rfftn_modes

from .harness import mesh
from .reference import error_on_slab


def _compact(spec: torch.Tensor, dims, modes) -> torch.Tensor:
    """The kept modes of a whole spectrum: [:m] then [-m:] per dim but the last, [:m] of the last."""
    for d, m in zip(dims[:-1], modes[:-1]):
        n = spec.shape[d]
        spec = torch.cat([spec.narrow(d, 0, m), spec.narrow(d, n - m, m)], d)
    return spec.narrow(dims[-1], 0, modes[-1])


def _full(z: torch.Tensor, like_shape, dims, modes) -> torch.Tensor:
    """The whole half spectrum holding the compact ``z``, zeros elsewhere (``torch.cat`` of the ends)."""
    for d, m in zip(dims[:-1], modes[:-1]):
        n = like_shape[d]
        gap = list(z.shape)
        gap[d] = n - 2 * m
        z = torch.cat([z.narrow(d, 0, m), z.new_zeros(gap), z.narrow(d, m, m)], d)
    gap = list(z.shape)
    gap[dims[-1]] = like_shape[dims[-1]] // 2 + 1 - modes[-1]
    return torch.cat([z, z.new_zeros(gap)], dims[-1])


def _round_trip(mesh_shape, shape, dims, modes, splits):
    """x -> kept modes (against torch's rfftn, cropped) -> a pointwise weight -> irfftn_modes
    (against torch's irfftn of the zero-filled spectrum), the input's gradient through both, and
    the weight's (summed over ranks) against the single device's."""
    m = mesh(mesh_shape)
    axes = m.mesh_dim_names
    sharded = [d for d, _ in splits]
    coords = [m.get_local_rank(a) for a in axes]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w_ref = torch.randn(_compact(torch.fft.rfftn(x.detach(), dim=dims), dims, modes).shape, dtype=torch.complex128)
    w_ref.requires_grad_()
    z_ref = _compact(torch.fft.rfftn(x, dim=dims), dims, modes)
    y_ref = torch.fft.irfftn(_full(z_ref * w_ref, shape, dims, modes), s=[shape[d] for d in dims], dim=dims)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()

    def block(t):
        for (d, split), c in zip(splits, coords):
            t = t.narrow(d, sum(split[:c]), split[c])
        return t

    x_local = block(x.detach()).clone().requires_grad_()
    w = w_ref.detach().clone().requires_grad_()
    z = rfftn_modes(x_local, m, modes, dims, sharded_dims=sharded)
    torch.testing.assert_close(z, z_ref.detach(), atol=1e-10, rtol=1e-10)
    y = irfftn_modes(z * w, x_local, m, dims, sharded_dims=sharded)
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-10, rtol=1e-10)
    (y * block(g)).sum().backward()
    torch.testing.assert_close(x_local.grad, block(x.grad), atol=1e-10, rtol=1e-10)
    gw = w.grad.clone()
    torch.distributed.all_reduce(gw)  # a replicated weight's gradient: a partial sum per rank
    torch.testing.assert_close(gw, w_ref.grad, atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("world,split", [(2, [3, 7]), (3, [4, 0, 6])])
@pytest.mark.parametrize("dim", [2, 3])
def test_modes_along_one_sharded_dim(run, world, split, dim):
    """A 2-D transform of (2, 3, 10, 10) with (3, 4) modes, H or W (the halved dim) sharded."""
    assert all(run(world, _round_trip, world, (2, 3, 10, 10), [2, 3], [3, 4], [(dim, split)]))


def test_modes_on_a_2x2_mesh(run):
    assert all(run(4, _round_trip, (2, 2), (1, 2, 9, 12), [2, 3], [4, 7], [(2, [5, 4]), (3, [2, 10])]))


@pytest.mark.parametrize(
    "shape,dims,modes,dim,split",
    [
        ((2, 16), [1], [9], 1, [5, 11]),  # 1-D, even length, the Nyquist frequency kept
        ((2, 15), [1], [8], 1, [9, 6]),  # odd length, every frequency kept
        ((1, 2, 6, 5, 9), [2, 3, 4], [3, 2, 5], 3, [2, 3]),  # 3-D, the middle dim sharded
        ((2, 7, 8), [2, 1], [3, 3], 1, [4, 3]),  # dims in another order: dim 1 is the halved one
    ],
)
def test_modes_other_transforms(run, shape, dims, modes, dim, split):
    assert all(run(2, _round_trip, 2, shape, dims, modes, [(dim, split)]))


def _refusals():
    m = mesh(2)
    x = torch.randn(1, 2, 3, 8)  # 6 rows in all
    out = {
        "int modes, no dim": error_on_slab(lambda t: rfftn_modes(t, m, 2), x.repeat(1, 1, 2, 1), m, [3, 3]),
        "overlap": error_on_slab(lambda t: rfftn_modes(t, m, (4, 2)), x.repeat(1, 1, 2, 1), m, [2, 4]),
        "too many": error_on_slab(lambda t: rfftn_modes(t, m, (2, 6)), x.repeat(1, 1, 2, 1), m, [5, 1]),
    }
    z = torch.zeros(1, 2, 4, 3, dtype=torch.complex128)
    out["odd rows"] = error_on_slab(lambda t: irfftn_modes(z[:, :, :3], t, m, (2, 3)), x.repeat(1, 1, 2, 1), m, [3, 3])
    return out


def test_modes_refusals_come_alike_on_every_rank(run):
    a, b = run(2, _refusals)
    assert a == b
    assert "give dim" in a["int modes, no dim"]
    assert "overlap at the two ends" in a["overlap"]
    assert "6 modes along dim 3 need" in a["too many"] and "half spectrum of 5" in a["too many"]
    assert "2 * modes" in a["odd rows"]


def test_public_names():
    assert snn.fft_modes.rfftn_modes is rfftn_modes and snn.fft_modes.irfftn_modes is irfftn_modes
