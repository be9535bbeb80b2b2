"""Popular models whose own forward mixes positions, converted as a new user would (issue 14).

timm's ``mobilenetv3_small_100`` (squeeze-excite ``x.mean((2, 3))`` in its blocks) and
torchvision's ``lraspp_mobilenet_v3_large`` (``F.interpolate(size=input_shape)`` from the local
input shape, squeeze-excitation, an adaptive pool) are exact at P = 2 in float64, eval mode, with
randomised norm statistics: forward, input gradient and every parameter gradient. MONAI's 2-D
``SwinUNETR`` (window pads from local sizes, shifted-window masks) is refused on every rank with
an error naming the call, the module and the source line, never silently wrong.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import sharded_nn as snn
from bench.compat import randomise_norms

from .harness import mesh, world_of
from .reference import check_against_reference


def _exact(builder: str, shape):
    m = mesh(2)
    torch.manual_seed(0)
    if builder == "mobilenetv3":
        import timm

        ref = timm.create_model("mobilenetv3_small_075", pretrained=False)
        for name in ("global_pool", "conv_head", "norm_head", "classifier"):  # unused by forward_features
            setattr(ref, name, torch.nn.Identity())
    else:
        from torchvision.models.segmentation import lraspp_mobilenet_v3_large

        ref = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)
    ref = ref.double().eval()
    randomise_norms(ref)
    align = snn.alignment(ref, dims=(2,))

    class Out(torch.nn.Module):  # the segmentation model returns {"out": ...}
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if hasattr(self.inner, "forward_features"):  # timm: the feature map (a slab), SE blocks included
                return self.inner.forward_features(x)
            return self.inner(x)["out"]

    ref = Out(ref)
    model = snn.convert(copy.deepcopy(ref), m)  # the guard sits on the root that the caller calls
    x = torch.randn(*shape, dtype=torch.float64)
    errs = check_against_reference(ref, x, m, align=align, sharded=model, atol=1e-9, rtol=1e-9)
    return max(errs.values())


def test_timm_squeeze_excite_model_is_exact(run):
    # 128 rows: the 5x5 convs at 1/32 resolution need slabs of 2 rows.
    assert max(run(2, _exact, "mobilenetv3", (1, 3, 128, 32))) < 1e-9


def test_torchvision_lraspp_local_size_interpolate_is_exact(run):
    assert max(run(2, _exact, "lraspp", (1, 3, 128, 32))) < 1e-9


def _swin():
    from monai.networks.nets import SwinUNETR

    m = mesh(2)
    torch.manual_seed(0)
    ref = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=2, depths=(1, 1, 1, 1),
                    num_heads=(1, 1, 1, 1)).double().eval()  # fmt: skip
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 1, 64, 64, dtype=torch.float64)
    try:
        model(snn.shard(x, m))  # slabs of 32 rows: 16 tokens, not whole windows of 7
    except snn.ShardingError as e:
        return str(e)
    return "no error"


def test_monai_swin_unetr_off_window_slabs_are_refused_on_every_rank(run):
    # Sharded since session 38 (tests/test_swin.py); before, its pads from local sizes were refused.
    out = run(2, _swin)
    assert len(set(out)) == 1, out
    msg = out[0]
    assert msg.startswith("ShardedMonaiBasicLayer: along token dim 1 the slabs (16, 16)"), msg
    assert "must start on window boundaries of 7 tokens" in msg and "snn.alignment" in msg, msg


class _Features(torch.nn.Module):
    """A timm model's feature map (a slab): ``forward_features``, or for XCiT its blocks before
    the class-attention layers (whose class token is replicated), as a grid."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        m = self.inner
        if not hasattr(m, "cls_attn_blocks"):
            return m.forward_features(x)
        b = x.shape[0]
        t, (hp, wp) = m.patch_embed(x)
        t = t + m.pos_embed(b, hp, wp).reshape(b, -1, t.shape[1]).permute(0, 2, 1)
        for blk in m.blocks:
            t = blk(t, hp, wp)
        return t.transpose(1, 2).reshape(b, -1, hp, wp)


def _timm_forward_calls(name: str, kwargs: dict, shape, domain: int):
    """A timm model whose own forward makes a call the guard routes, at P = ``domain``: forward,
    input gradient and every parameter gradient against the single-device model (float64, eval,
    randomised norm statistics)."""
    import timm

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, **kwargs).double().eval()
    randomise_norms(ref)
    ref = _Features(ref)
    with warnings.catch_warnings():
        # Nothing to report: the guard computes these calls (convert once listed MetaFormer's
        # GroupNorm1NoBias layers as hazards although the guard routes their F.group_norm).
        warnings.simplefilter("error", snn.ShardingWarning)
        model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(*shape, dtype=torch.float64)
    align = snn.alignment(ref, dims=(2,))[0]
    errs = check_against_reference(ref, x, m, align=align, sharded=model, atol=1e-9, rtol=1e-9)
    return max(errs.values())


# Found by session 52's sweep of one model per timm family, refused before:
_ROUTED_MODELS = {
    # MetaFormer's GroupNorm1NoBias (a GroupNorm1 subclass whose forward is F.group_norm): the
    # guard routes F.group_norm to the sharded group norm.
    "poolformerv2_s12": ({}, (1, 3, 64, 32)),
    # Its Fourier position encoding takes a running sum (`cumsum`) of a mask over the rows:
    # `snn.reductions.cumsum`.
    "edgenext_xx_small": ({}, (1, 3, 64, 32)),
    # Its position grid is `arange(1, H + 1)` and `arange(1, W + 1).repeat(1, H, 1)` of the
    # slab's token rows: the rows of the global grid.
    "xcit_nano_12_p8_224": ({"depth": 2}, (1, 3, 64, 32)),
}


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("name", sorted(_ROUTED_MODELS))
def test_timm_models_with_routed_calls_are_exact(run, name, domain):
    kwargs, shape = _ROUTED_MODELS[name]
    if domain == 3:
        shape = (*shape[:2], 96, *shape[3:])  # slabs of 32 rows, whole at the models' 1/32 stage
    assert max(run(domain, _timm_forward_calls, name, kwargs, shape, domain)) < 1e-9


def _timm_vgg_head(domain: int):
    """timm's VGG at 64x32 rows per two ranks: its head pools the thin feature map to 7 x 7
    (``ConvMlp``'s adaptive pool: more bins than positions, bins shared by neighbours), the
    compatibility sweep's "VGG's head at this size" refused in session 34; exact (checked in
    session 67). Logits and input gradient against timm."""
    import timm

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model("vgg11", pretrained=False, num_classes=5, mlp_ratio=0.01).double().eval()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 3, 64 * domain // 2, 32, dtype=torch.float64, requires_grad=True)
    y = ref(x)
    g = torch.randn(y.shape, dtype=torch.float64)
    (y * g).sum().backward()
    xl = snn.shard(x.detach(), m, dims=(2,)).requires_grad_()
    yl = model(xl)
    snn.losses.share((yl * g).sum(), m).backward()
    torch.testing.assert_close(yl, y.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(snn.gather(xl.grad, m, dims=(2,)), x.grad, atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("domain", [2])
def test_timm_vgg_head_is_exact(run, domain):
    pytest.importorskip("timm")
    assert all(run(domain, _timm_vgg_head, domain))


def _timm_volo(domain: int, rows: int):
    """timm's VOLO (outlook attention: ``nn.Unfold`` and ``F.fold`` of 3x3 neighbourhoods, then
    transformer and class-attention blocks with a class token): refused before session 67 (the
    unfold read positions by index). Logits and input gradient against timm, no convert
    warning."""
    import timm

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model("volo_d1_224", pretrained=False, num_classes=5, img_size=(rows, 32)).double().eval()
    randomise_norms(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error", snn.ShardingWarning)
        model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 3, rows, 32, dtype=torch.float64, requires_grad=True)
    y = ref(x)
    g = torch.randn(y.shape, dtype=torch.float64)
    (y * g).sum().backward()
    xl = snn.shard(x.detach(), m, dims=(2,), align=16).requires_grad_()  # whole 1/16 tokens
    yl = model(xl)
    snn.losses.share((yl * g).sum(), m).backward()
    torch.testing.assert_close(yl, y.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(snn.gather(xl.grad, m, dims=(2,)), x.grad, atol=1e-10, rtol=1e-10)
    return True


def _timm_halo_attention(sizes):
    """timm's ``HaloAttn`` (HaloNet: each 4 x 4 block of queries attends over its block and a
    halo of 1, keys cut by ``Tensor.unfold``, relative position logits inside the block) between
    two convolutions, on slabs of whole blocks: refused before session 67 at its position
    logits' ``q.reshape(-1, bs, bs, d)`` (constants splitting the block's tokens beside a -1
    were read as the whole sample's sizes). No convert warning."""
    from timm.layers.halo_attn import HaloAttn

    m = mesh(len(sizes))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), HaloAttn(16, 16, num_heads=2, block_size=4, halo_size=1),
        torch.nn.Conv2d(16, 4, 3, padding=1),
    ).double().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", snn.ShardingWarning)
        model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(2, 3, sum(sizes), 8, dtype=torch.float64)
    return max(check_against_reference(ref, x, m, sizes=sizes, sharded=model, atol=1e-10, rtol=1e-10).values())


@pytest.mark.parametrize("sizes", [(8, 8), (4, 12), (8, 4, 4)], ids=str)
def test_timm_halo_attention_is_exact(run, sizes):
    # (halonet26t at 512 x 256 is exact too at P = 2: 2e-15, checked in session 67; too slow here.)
    pytest.importorskip("timm")
    assert max(run(len(sizes), _timm_halo_attention, sizes)) < 1e-10


def test_timm_volo_is_exact(run):
    pytest.importorskip("timm")
    assert all(run(3, _timm_volo, 3, 80))  # slabs of 32, 32 and 16 rows


@pytest.mark.parametrize(
    "name,domain",
    [("tv/convnext_tiny", 2), ("tv/swin_t", 2), ("tv/shufflenet_v2_x0_5", 2), ("timm/resnest14d", 2),
     ("timm/ghostnet_100", 2), ("tv/convnext_tiny", (2, 2)), ("tv/swin_t", (2, 2)), ("timm/convformer_s18", (2, 2)), ("timm/caformer_s18", (2, 2))],
)  # fmt: skip
def test_convert_reports_no_false_hazards(run, name, domain):
    # Layers the guard follows (torchvision's Permute, nn.Flatten, ResNeSt's RadixSoftmax) and
    # empty Sequentials (identity shortcuts) were listed as position-mixing hazards before
    # session 52: a warning that trains users to ignore warnings. With guard=False the
    # followed ones are still reported. On a 2x2 mesh (session 58): torchvision's ConvNeXt
    # (its LayerNorm2d and the channels-last Linear layers of its blocks, 33 false alarms),
    # torchvision's Swin blocks (their MLPs over channels-last tokens, 24), MetaFormer's
    # LayerNorm2dNoBias (ConvFormer, 28) and CAFormer's channels-last attention blocks (72).
    assert all(run(world_of(domain), _no_false_hazards, name, domain))


def _no_false_hazards(name, domain):
    from bench.compat import MODELS

    m = mesh(domain)
    if name in MODELS:
        make = MODELS[name][0]
    else:
        import timm

        def make():
            return timm.create_model(name.split("/", 1)[1], pretrained=False)

    with warnings.catch_warnings():
        warnings.simplefilter("error", snn.ShardingWarning)
        snn.convert(make().eval(), m)
    return True


def _metaformer_2x2(name: str):
    """A small ConvFormer / CAFormer (CAFormer's last two stages attend over channels-last
    tokens) on a 2x2 mesh: exact, and convert reports nothing."""
    from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, SepConv

    m = mesh((2, 2))
    torch.manual_seed(0)
    # The named models' layers (timm's convformer_s18 / caformer_s18), fewer and narrower.
    mixers = SepConv if name == "convformer" else [SepConv, SepConv, Attention, Attention]
    norms = LayerNorm2dNoBias if name == "convformer" else [LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2
    ref = MetaFormer(depths=(1, 1, 1, 1), dims=(8, 16, 32, 32), token_mixers=mixers, norm_layers=norms,
                     num_classes=0).double().eval()  # fmt: skip
    randomise_norms(ref)
    ref = _Features(ref)  # the feature map (forward_features), sharded like the input
    with warnings.catch_warnings():
        warnings.simplefilter("error", snn.ShardingWarning)
        model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 3, 96, 64, dtype=torch.float64)
    errs = check_against_reference(ref, x, m, dims=(2, 3), align=snn.alignment(ref, dims=(2, 3)), sharded=model,
                                   atol=1e-9, rtol=1e-9)  # fmt: skip
    return max(errs.values())


@pytest.mark.parametrize("name", ["convformer", "caformer"])
def test_metaformers_on_a_2x2_mesh_are_exact(run, name):
    assert max(run(4, _metaformer_2x2, name)) < 1e-9
