"""Swin Transformers (timm V1, V2, V2-CR; torchvision; MONAI's SwinUNETR) converted, against the originals.

Shifted-window attention on slabs (``sharded_nn.layers.swin``): logits, input gradients and
parameter gradients (summed over the domain) in float64, on uneven window-aligned slabs of H,
meshes of 2, 3 and 4 ranks and 2 x 2 meshes (H and W sharded); the shift crosses slab boundaries
in every shifted block.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .harness import mesh as make_mesh
from .reference import reduce_param_grads

SMALL = dict(embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4, drop_path_rate=0.0)

# name -> (timm model, kwargs, global image (H, W)). Patch 4, window 4: stage 0 is H/4 x W/4
# tokens in windows of 4 (align 16), stage 1 H/8 x W/8 (align 32 at the image).
CASES = {
    "v1": ("swin_tiny_patch4_window7_224", dict(SMALL, img_size=(224, 64)), (224, 64)),
    # dynamic_mask: the shift mask is made at run time from the (global) padded grid.
    "v1_dynamic": ("swin_tiny_patch4_window7_224", dict(SMALL, img_size=(224, 64), strict_img_size=False), (224, 64)),
    # One stage of 42 x 12 tokens: the last rank pads its slab to whole windows (as timm pads the image).
    "v1_padded": ("swin_tiny_patch4_window7_224", dict(SMALL, depths=(2,), num_heads=(2,), img_size=(168, 48)), (168, 48)),
    "v2": ("swinv2_tiny_window8_256", dict(SMALL, img_size=(224, 64)), (224, 64)),
    "v2_cr": ("swinv2_cr_tiny_ns_224", dict(SMALL, img_size=(224, 64)), (224, 64)),
}
# V1 at P = 2, 3, 4; each variant at one or two more (the suite's time: about 2 s a run).
TIMM_RUNS = [("v1", 2), ("v1", 3), ("v1", 4), ("v1_dynamic", 3), ("v1_padded", 2), ("v1_padded", 3), ("v2", 2),
             ("v2_cr", 3)]  # fmt: skip


def _build(name, kwargs):
    import timm

    torch.manual_seed(0)
    ref = timm.create_model(name, **kwargs).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every parameter matters (relative position tables start at zero)
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return ref


def _reference(ref, x, gen):
    """The single-device output, a random output gradient ``g``, and the input gradient of ``(y * g).sum()``."""
    xr = x.clone().requires_grad_()
    y = ref(xr)
    g = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    (y * g).sum().backward()
    return y.detach(), g, xr.grad


def _compare_classifier(ref, model, x, mesh, dims, align, gen):
    """Replicated logits, the input gradient and the summed parameter gradients against ``ref``."""
    logits, g, gx_ref = _reference(ref, x, gen)
    assert gx_ref.abs().max() > 0
    xl = snn.shard(x, mesh, dims=dims, align=align).requires_grad_()
    out = model(xl)
    torch.testing.assert_close(out, logits, atol=1e-10, rtol=1e-10)
    snn.losses.share((out * g).sum(), mesh).backward()
    torch.testing.assert_close(snn.gather(xl.grad, mesh, dims=dims), gx_ref, atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, mesh)
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, atol=1e-10, rtol=1e-8, msg=lambda m, n=pname: f"{n}: {m}")
    return xl, out, logits


def _check(domain, case):
    name, kwargs, (h, w) = CASES[case]
    mesh = make_mesh(domain)
    dims = (2,)
    ref = _build(name, kwargs)
    model = snn.convert(copy.deepcopy(ref), mesh)
    align = snn.alignment(ref, dims=dims, input_shape=(1, 3, h, w))
    assert all(a % 16 == 0 for a in align), align  # windows of 4 tokens of 4 pixels at least
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    xl, out, logits = _compare_classifier(ref, model, x, mesh, dims, align, gen)
    return tuple(xl.shape), (out - logits).abs().max().item()


@pytest.mark.parametrize("case, domain", TIMM_RUNS, ids=str)
def test_swin_matches_timm(run, case, domain):
    results = run(domain, _check, domain, case)
    shapes = [r[0] for r in results]
    assert len(set(shapes)) > 1, shapes  # uneven slabs
    assert all(r[1] < 1e-10 for r in results)


def _dropout_masks(domain):
    """Projection-dropout masks of one window attention in training, as each rank drew them."""
    import timm

    mesh = make_mesh(domain)
    torch.manual_seed(0)  # every rank seeded alike, as data-parallel scripts do
    ref = timm.create_model("swin_tiny_patch4_window7_224", **dict(SMALL, img_size=(256, 64), proj_drop_rate=0.5))
    model = snn.convert(ref, mesh).train()
    seen = []
    model.layers[0].blocks[0].attn.proj_drop.register_forward_hook(lambda m, a, out: seen.append(out == 0))
    x = torch.randn(1, 3, 256, 64, generator=torch.Generator().manual_seed(3))
    model(snn.shard(x, mesh, dims=(2,), align=64))
    return seen[0]


def test_window_dropout_draws_independently_on_each_rank(run):
    a, b = run(2, _dropout_masks, 2)
    assert a.shape == b.shape  # even slabs: the same number of windows on both ranks
    assert 0.4 < a.float().mean().item() < 0.6 and 0.4 < b.float().mean().item() < 0.6
    assert not torch.equal(a, b)  # a shared stream drew the same mask for every rank's windows


def _misaligned(domain):
    mesh = make_mesh(domain)
    name, kwargs, (h, w) = CASES["v1"]
    model = snn.convert(_build(name, kwargs), mesh)
    x = torch.randn(1, 3, h, w, dtype=torch.float64)
    try:
        model(snn.shard(x, mesh, dims=(2,), align=16))  # stage 1 needs 32: its windows would span slabs
    except ShardingError as e:
        return str(e)
    return "no error"


def test_window_spanning_two_slabs_is_refused_on_every_rank(run):
    out = run(3, _misaligned, 3)
    assert len(set(out)) == 1, out
    assert "must start on window boundaries of 4 tokens" in out[0] and "snn.alignment" in out[0], out[0]


def test_alignment_counts_the_windows():
    import timm

    m = timm.create_model("swin_tiny_patch4_window7_224", img_size=(448, 224))
    # Stage 3 (1/32) has 14 x 7 tokens in windows of 7: slabs of H start on multiples of 32 * 7.
    assert snn.alignment(m, dims=(2,), input_shape=(1, 3, 448, 224)) == (224,)


def _check_2x2(case):
    """H and W sharded (a 2 x 2 mesh): the shift crosses the slabs along both, the patch merging's
    channels-last reshape and the MLP's flattened tokens run under the guard (merged dims)."""
    name, kwargs, (h, w) = CASES[case]
    mesh = make_mesh((2, 2))
    dims = (2, 3)
    ref = _build(name, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reported by convert either
        model = snn.convert(copy.deepcopy(ref), mesh)
    align = snn.alignment(ref, dims=dims, input_shape=(1, 3, h, w))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    xl, out, logits = _compare_classifier(ref, model, x, mesh, dims, align, gen)
    return tuple(xl.shape), (out - logits).abs().max().item()


@pytest.mark.parametrize("case", ["v1", "v1_dynamic", "v1_padded", "v2", "v2_cr"])
def test_swin_on_a_2x2_mesh_matches_timm(run, case):
    results = run(4, _check_2x2, case)
    assert len({r[0] for r in results}) > 1, results  # uneven slabs
    assert all(r[1] < 1e-10 for r in results)


# --------------------------------------------------------------------------- MONAI SwinUNETR

# name -> (SwinUNETR kwargs, image shape without H or D, rows per alignment unit). Window 4 (2-D)
# or 2 (3-D) at patch 2 and four stages: the alignment is 64 (2-D) or 32 (3-D) rows.
MONAI = {
    "2d": (dict(spatial_dims=2, window_size=4), (1, 1, None, 64), 64),
    "2d_v2": (dict(spatial_dims=2, window_size=4, use_v2=True, downsample="mergingv2"), (1, 1, None, 64), 64),
    "3d": (dict(spatial_dims=3, window_size=2), (1, 1, None, 32, 32), 32),
}


def _check_monai(domain, case):
    from monai.networks.nets import SwinUNETR

    kw, shape, unit = MONAI[case]
    mesh = make_mesh(domain)
    world = domain if isinstance(domain, int) else domain[0] * domain[1]
    dims = (2,) if isinstance(domain, int) else (2, 3)
    shape = list(shape)
    shape[2] = unit * (world + 1)  # uneven slabs on 1-D meshes: one rank holds two units
    if not isinstance(domain, int):
        shape[2], shape[3] = 2 * unit, 2 * unit
    torch.manual_seed(0)
    ref = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(2, 2, 2, 2), num_heads=(1, 1, 1, 1),
                    **kw).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    model = snn.convert(copy.deepcopy(ref), mesh)
    align = snn.alignment(ref, dims=dims, input_shape=tuple(shape))
    assert align == (unit,) * len(dims), align
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y, g, gx_ref = _reference(ref, x, gen)
    xl = snn.shard(x, mesh, dims=dims, align=align).requires_grad_()
    yl = model(xl)
    torch.testing.assert_close(snn.gather(yl, mesh, dims=dims), y, atol=1e-12, rtol=1e-10)
    (yl * snn.shard(g, mesh, dims=dims, align=align)).sum().backward()
    torch.testing.assert_close(snn.gather(xl.grad, mesh, dims=dims), gx_ref, atol=1e-12, rtol=1e-10)
    grads = reduce_param_grads(model, mesh)
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, atol=1e-10, rtol=1e-8, msg=lambda m, n=pname: f"{n}: {m}")
    return tuple(xl.shape)


# 2-D at P = 3 and on a 2 x 2 mesh (H and W sharded), V2 (residual conv stages, mergingv2) at
# P = 2, 3-D at P = 2 (D sharded): every stage has a shifted block whose roll crosses the slabs.
MONAI_RUNS = [("2d", 3), ("2d", (2, 2)), ("2d_v2", 2), ("3d", 2)]


@pytest.mark.parametrize("case, domain", MONAI_RUNS, ids=str)
def test_monai_swin_unetr_matches_monai(run, case, domain):
    world = domain if isinstance(domain, int) else domain[0] * domain[1]
    shapes = run(world, _check_monai, domain, case)
    if isinstance(domain, int):
        assert len(set(shapes)) > 1, shapes  # uneven slabs


# --------------------------------------------------------------------------- torchvision Swin


def _check_torchvision(domain, version, shape):
    import torchvision.models.swin_transformer as tvs

    mesh = make_mesh(domain)
    dims = (2,) if isinstance(domain, int) else (2, 3)
    extra = dict(block=tvs.SwinTransformerBlockV2, downsample_layer=tvs.PatchMergingV2) if version == 2 else {}
    torch.manual_seed(0)
    ref = tvs.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2, 2], num_heads=[1, 2, 2],
                              window_size=[4, 4], stochastic_depth_prob=0.0, **extra).double().eval()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    model = snn.convert(copy.deepcopy(ref), mesh)
    align = snn.alignment(ref, dims=dims, input_shape=shape)
    assert align == (64,) * len(dims), align  # 16 pixels per token at stage 2, windows of 4
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    xl, _, _ = _compare_classifier(ref, model, x, mesh, dims, align, gen)
    return tuple(xl.shape)


# V1 at P = 3 (slabs 128, 128, 64 rows) and on a 2 x 2 mesh, V2 at P = 2 (128, 64).
TORCHVISION_RUNS = [(1, 3, (2, 3, 320, 64)), (1, (2, 2), (1, 3, 256, 128)), (2, 2, (1, 3, 192, 64))]


@pytest.mark.parametrize("version, domain, shape", TORCHVISION_RUNS, ids=str)
def test_torchvision_swin_matches_torchvision(run, version, domain, shape):
    world = domain if isinstance(domain, int) else domain[0] * domain[1]
    shapes = run(world, _check_torchvision, domain, version, shape)
    if isinstance(domain, int):
        assert len(set(shapes)) > 1, shapes  # uneven slabs
