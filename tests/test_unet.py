"""sharded_nn.zoo.UNet: single-device model code, converted, equal to the single-device model.

Every case builds the plain UNet in float64, converts a copy (``create_model`` or ``convert``),
shards the input on uneven aligned slabs and compares the gathered output, the input gradient
and every parameter gradient (summed over the domain ranks) with the single-device ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.alignment import alignment
from sharded_nn.zoo import UNet, create_model

from .harness import mesh, world_of
from .reference import check_against_reference

#: Harness timeout per call: these whole-model cases take a few seconds alone, much longer on a
#: loaded 2-core machine.
T = 300


def _unet(spatial_dims=2, cin=2, cout=3, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("channels", (4, 8, 8))
    return UNet(spatial_dims, cin, cout, **kw).double()


def _case(domain, shape, dims, unet_kw, spatial_dims=2, seed=1):
    m = mesh(domain)
    unet_kw = {"channels": (4, 8, 8), **unet_kw}
    ref = _unet(spatial_dims, **unet_kw)
    model = create_model(f"unet{spatial_dims}d", mesh=m, dims=dims, in_channels=2, out_channels=3, **unet_kw)
    model.load_state_dict(ref.state_dict())
    model.double()
    torch.manual_seed(seed)
    x = torch.randn(*shape, dtype=torch.float64)
    align = alignment(ref, dims=dims)
    assert align == (ref.alignment,) * len(dims)
    check_against_reference(ref, x, m, dims=dims, align=align, sharded=model, atol=1e-9, rtol=1e-9)
    # BatchNorm running statistics are the single-device ones (statistics over all slabs).
    for (name, b_ref), b in zip(ref.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, b_ref, atol=1e-12, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    return True


# --------------------------------------------------------------------------------------------
# Single device


def test_plain_unet_any_size_and_options():
    for spatial_dims, shape in ((1, (2, 2, 13)), (2, (1, 2, 21, 30)), (3, (1, 2, 9, 10, 7))):
        for kw in (
            {},
            {"down": "maxpool", "up": "nearest", "norm": "batch", "num_res_blocks": 2},
            {"down": "avgpool", "up": "linear", "norm": "instance", "attention_levels": (1,), "num_heads": 2},
            {"norm": None, "padding_mode": ("replicate",) * (spatial_dims - 1) + ("circular",)},
        ):
            net = _unet(spatial_dims, **kw)
            y = net(torch.randn(*shape, dtype=torch.float64))
            assert y.shape == (shape[0], 3, *shape[2:]), (spatial_dims, kw, y.shape)
    assert _unet(channels=(4, 8, 16, 32)).alignment == 8


def test_plain_unet_circular_longitude_is_periodic():
    # A periodic longitude with no other padding: rolling the input rolls the output (W a
    # multiple of the alignment, so no far-edge padding breaks the symmetry).
    net = _unet(padding_mode=("replicate", "circular"), down="avgpool", up="nearest")
    x = torch.randn(1, 2, 10, 16, dtype=torch.float64)
    torch.testing.assert_close(net(x.roll(4, 3)), net(x).roll(4, 3))


def test_unet_bad_arguments():
    for kw, match in (
        ({"norm": "layer"}, "norm must be one of"),
        ({"down": "stride"}, "down one of"),
        ({"padding_mode": ("zeros",)}, "one per spatial dim"),
        ({"padding_mode": "wrap"}, "padding_mode must be"),
        ({"attention_levels": (3,)}, "attention_levels"),
        ({"attention_levels": (0,), "num_heads": 3}, "num_heads dividing"),
    ):
        with pytest.raises(ValueError, match=match):
            _unet(**kw)
    with pytest.raises(ValueError, match="expected a 4-d"):
        _unet()(torch.randn(1, 2, 8, 8, 8, dtype=torch.float64))


def test_create_model_without_mesh_is_the_plain_model():
    net = create_model("unet3d", mesh=None, in_channels=1, out_channels=2, channels=(4, 8))
    assert type(net) is UNet and net.spatial_dims == 3
    assert "unet2d" in snn.zoo.list_models() and "unet3d" in snn.zoo.list_models()


# --------------------------------------------------------------------------------------------
# Sharded against single device


@pytest.mark.parametrize("domain", [2, 3, 4])
def test_unet2d_uneven_slabs(run, domain):
    # H = 22, align 4: slabs 12/10, 8/8/6, 8/8/4/2; the last rank pads its tail to a multiple of
    # 4 and crops it back; W = 6 (unsharded) is padded to 8 locally.
    assert all(run(domain, _case, domain, (1, 2, 22, 6), (2,), {}, timeout=T))


@pytest.mark.parametrize(
    "unet_kw",
    [
        {"down": "maxpool", "up": "nearest", "norm": "batch", "num_res_blocks": 2},
        {"down": "avgpool", "up": "linear", "norm": "instance"},
        {"down": "conv", "up": "linear", "norm": None},
        {"down": "maxpool", "up": "transpose", "norm": "group", "padding_mode": "reflect"},
        {"down": "conv", "up": "nearest", "norm": "group", "padding_mode": ("zeros", "replicate")},
    ],
    ids=["maxpool-nearest-batch-2blocks", "avgpool-linear-instance", "conv-linear-nonorm", "reflect",
         "zeros-replicate"],
)
def test_unet2d_options(run, unet_kw):
    assert all(run(3, _case, 3, (2, 2, 22, 5), (2,), unet_kw, timeout=T))


@pytest.mark.parametrize("domain,dims", [(2, (2,)), (3, (2,)), ((2, 2), (2, 3))], ids=["D-2", "D-3", "DxH-2x2"])
def test_unet3d_volumes(run, domain, dims):
    kw = {"channels": (4, 6)}
    assert all(run(world_of(domain), _case, domain, (1, 2, 11, 10, 5), dims, kw, 3, timeout=T))


@pytest.mark.parametrize(
    "domain,dims", [(2, (3,)), (3, (3,)), (4, (3,)), ((2, 2), (2, 3))], ids=["lon-2", "lon-3", "lon-4", "2x2"]
)
def test_unet2d_periodic_longitude(run, domain, dims):
    # Latitude clamped, longitude periodic: the circular padding wraps around the ring of ranks.
    kw = {"padding_mode": ("replicate", "circular")}
    assert all(run(world_of(domain), _case, domain, (1, 2, 9, 28), dims, kw, timeout=T))


@pytest.mark.parametrize(
    "domain,dims", [(2, (2,)), (3, (3,)), ((2, 2), (2, 3))], ids=["H-2", "W-3", "2x2"]
)
def test_unet2d_attention(run, domain, dims):
    # Ring attention over the flattened slab tokens at both levels.
    kw = {"attention_levels": (0, 1), "num_heads": 2, "channels": (4, 8)}
    assert all(run(world_of(domain), _case, domain, (1, 2, 10, 12), dims, kw, timeout=T))


def _misaligned():
    m = mesh(3)
    model = create_model("unet2d", mesh=m, in_channels=2, out_channels=1, channels=(4, 8, 8))
    x = torch.randn(1, 2, 22, 6, dtype=torch.float64)
    x_local = snn.shard(x, m, dims=(2,), align=1)  # 8, 7, 7: starts 0, 8, 15 (needs multiples of 4)
    try:
        model.double()(x_local)
    except snn.ShardingError as e:
        return str(e)
    return None


def test_misaligned_slabs_raise_on_every_rank(run):
    msgs = run(3, _misaligned)
    assert all(m is not None and "multiple of 4" in m and "snn.alignment" in m for m in msgs), msgs
    assert len(set(msgs)) == 1


def _create_model_converts():
    m = mesh(2)
    kw = {"in_channels": 1, "out_channels": 1, "channels": (4, 8), "attention_levels": (1,)}
    net = create_model("unet2d", mesh=m, dims=(3,), **kw)
    convs = [mod for mod in net.modules() if isinstance(mod, snn.ShardedConv2d)]
    assert convs and all(c.dims == (3,) for c in convs)
    assert isinstance(net.encoder[1].attn.attn, snn.ShardedMultiheadAttention)
    assert list(net.state_dict()) == list(UNet(2, 1, 1, channels=(4, 8), attention_levels=(1,)).state_dict())
    return True


def test_create_model_with_mesh_converts_every_layer(run):
    assert all(run(2, _create_model_converts))


# --------------------------------------------------------------------------------------------
# Weather grids


def _weather(domain, dims, shape, kw, backward):
    """The UNet on a weather grid, against the single-device model (computed once per rank)."""
    m = mesh(domain)
    ref = _unet(cin=2, cout=2, **kw)
    model = snn.convert(copy.deepcopy(ref), m, plan=snn.zoo.unet.dims_plan(ref, dims), strict=True)
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64)
    align = alignment(ref, dims=dims)
    if backward:
        return check_against_reference(ref, x, m, dims=dims, align=align, sharded=model, atol=1e-9, rtol=1e-9)
    with torch.no_grad():
        y = snn.gather(model(snn.shard(x, m, dims=dims, align=align)), m, dims=dims)
        torch.testing.assert_close(y, ref(x), atol=1e-10, rtol=1e-10)
    return True


_LATLON = {"channels": (4, 8), "padding_mode": ("replicate", "circular")}
_CONUS = {"channels": (4, 8)}


def test_global_latlon_721x1440_longitude_sharded_forward(run):
    # The 0.25-degree global grid: latitude 721 (padded to 722 at the far edge and cropped back),
    # longitude 1440 sharded over 2 ranks, periodic across the ring. Forward at full size.
    assert all(run(2, _weather, 2, (3,), (1, 2, 721, 1440), _LATLON, False, timeout=300))


@pytest.mark.parametrize("domain", [2, 3])
def test_global_latlon_longitude_sharded_backward(run, domain):
    # Backward on the 1-degree grid (181 x 360): same geometry (odd latitude, periodic longitude).
    assert all(run(domain, _weather, domain, (3,), (1, 2, 181, 360), _LATLON, True))


def test_conus_1024x1792_on_2x2_mesh_forward(run):
    # The 3 km CONUS grid sharded on both axes of a 2x2 domain mesh; forward at full size.
    assert all(run(4, _weather, (2, 2), (2, 3), (1, 2, 1024, 1792), _CONUS, False, timeout=300))


def test_conus_on_2x2_mesh_backward(run):
    # Backward on the grid downsized 8x per axis (128 x 224), same aspect ratio.
    assert all(run(4, _weather, (2, 2), (2, 3), (1, 2, 128, 224), _CONUS, True))


# --------------------------------------------------------------------------------------------
# Training with DDP over a data axis


def _train(domain, data, steps):
    m = mesh(domain, data)
    d = m.get_local_rank("data")
    kw = {"channels": (4, 8), "norm": "batch", "attention_levels": (1,)}
    ref = _unet(**kw)
    model = create_model("unet2d", mesh=m, in_channels=2, out_channels=3, **kw).double()
    model.load_state_dict(ref.state_dict())
    ddp = snn.parallelize(model, m)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    n_local = 1
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(n_local * data, 2, 10, 6, dtype=torch.float64, generator=gen)
        target = torch.randn(n_local * data, 3, 10, 6, dtype=torch.float64, generator=gen)
        opt_ref.zero_grad()
        F.mse_loss(ref(x), target).backward()
        batch = slice(d * n_local, (d + 1) * n_local)
        opt.zero_grad()
        out = ddp(snn.shard(x[batch], m, align=2))
        # Per-rank share of this replica's mean loss; DDP sums over the domain, averages over data.
        snn.losses.mse_loss(out, snn.shard(target[batch], m, align=2), m).backward()
        for (name, p_ref), p in zip(ref.named_parameters(), ddp.module.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
        opt_ref.step()
        opt.step()
    for (name, a), b in zip(ref.state_dict().items(), ddp.module.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n} after {steps} steps: {s}")
    return True


def test_ddp_training_matches_single_device(run):
    assert all(run(4, _train, 2, 2, 3))
