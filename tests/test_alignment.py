"""alignment(model, dims): the slab alignment from the model's strided layers along its graph."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
import torchvision

import sharded_nn as snn
from sharded_nn.alignment import alignment
from sharded_nn.zoo import UNet, create_model

from .harness import mesh
from .reference import check_against_reference


@pytest.mark.parametrize("levels", [1, 2, 3, 4])
@pytest.mark.parametrize("down", ["conv", "maxpool", "avgpool"])
def test_unet_alignment_is_two_to_the_depth(levels, down):
    channels = (4, 8, 8, 8)[:levels]
    assert alignment(UNet(2, 1, 1, channels=channels, down=down), (2, 3)) == (2 ** (levels - 1),) * 2
    assert alignment(UNet(3, 1, 1, channels=channels, down=down), 4) == 2 ** (levels - 1)


def test_parallel_strided_branches_are_not_multiplied():
    # ResNet-18: five stride-2 steps on the main path; each strided block also has a strided
    # 1x1 shortcut beside it, which a product over the module tree would count twice.
    assert alignment(torchvision.models.resnet18(), (2, 3)) == (32, 32)


def test_per_dim_strides_upsampling_and_declared_needs():
    class Declared(nn.Module):
        alignment_multiple = (3, 2)

        def forward(self, x):
            return x

    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, stride=(2, 1), padding=1),  # H: 2; output factors (2, 1)
        nn.Upsample(scale_factor=2),  # factors (1, 1/2)
        nn.Conv2d(2, 2, 3, stride=2, padding=1),  # H: 1 * 2, W: 1/2 * 2; factors (2, 1)
        nn.MaxPool2d(kernel_size=3, stride=(1, 3), padding=1),  # W: 1 * 3; factors (2, 3)
        Declared(),  # H: 2 * 3 = 6, W: 3 * 2 = 6
    )
    assert alignment(model, (2, 3), input_shape=(1, 1, 96, 96)) == (6, 6)
    assert alignment(model, 3, input_shape=(1, 1, 96, 96)) == 6


def test_patch_embedding_and_shape_errors():
    vit = timm.create_model("vit_tiny_patch16_224", img_size=64, pretrained=False, num_classes=0)
    with pytest.raises(ValueError, match="Pass input_shape="):
        alignment(vit, (2, 3))  # the 1024-pixel probe does not fit a ViT built for 64 pixels
    assert alignment(vit, (2, 3), input_shape=(1, 3, 64, 64)) == (16, 16)
    with pytest.raises(ValueError, match="cannot guess the input shape"):
        alignment(nn.Sequential(nn.Linear(3, 3)), (2,))
    with pytest.raises(ValueError, match="spatial dims"):
        alignment(UNet(2, 1, 1), (1,))


def test_third_party_unet():
    from monai.networks.nets import UNet as MonaiUNet  # in the test extras

    net = MonaiUNet(3, 1, 1, channels=(4, 8, 16, 32), strides=(2, 2, 2), num_res_units=2)
    assert alignment(net, (2, 3, 4)) == (8, 8, 8)


def _converted(domain):
    m = mesh(domain)
    plain = UNet(2, 1, 1, channels=(4, 8, 8), attention_levels=(1,))
    model = create_model("unet2d", mesh=m, in_channels=1, out_channels=1, channels=(4, 8, 8), attention_levels=(1,))
    resnet = snn.convert(torchvision.models.resnet18(), m, strict=True)
    # Nothing communicates: ranks may call it alone (here only rank 0 calls it twice).
    if m.get_local_rank("domain") == 0:
        assert alignment(model, (2,)) == alignment(plain, (2,))
    out = (alignment(model, (2, 3)), alignment(resnet, 2))
    # The model still runs sharded afterwards (its own forwards were put back).
    torch.manual_seed(0)
    ref = UNet(2, 1, 1, channels=(4, 8)).double()
    check_against_reference(ref, torch.randn(1, 1, 12, 4, dtype=torch.float64), m, align=alignment(ref, (2,)))
    return out


def test_converted_models_give_the_same_alignment(run):
    assert run(2, _converted, 2) == [((4, 4), 32)] * 2


class _KeepsLastOutput(nn.Module):
    """Stores its last output in an attribute and a shared list, and shares a child module."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.again = self.down  # the same module under two names
        self.history: list[torch.Tensor] = [torch.zeros(1)]

    def forward(self, x):
        y = self.again(self.down(x))
        self.last = y
        self.history[0] = y
        return y


def test_probe_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    m = _KeepsLastOutput()
    x = torch.randn(1, 2, 16, 8)
    y0 = m(x)
    assert snn.alignment(m, 2) == 4
    # No meta tensor left behind in parameters, buffers or attributes; the model still runs.
    assert all(t.device.type == "cpu" for t in (*m.parameters(), *m.buffers(), m.last, m.history[0]))
    assert torch.equal(m(x), y0)


def test_monai_dynunet_runs_after_alignment():
    nets = pytest.importorskip("monai.networks.nets")
    m = nets.DynUNet(spatial_dims=3, in_channels=1, out_channels=2, kernel_size=(3, 3, 3), strides=(1, 2, 2),
                     upsample_kernel_size=(2, 2), filters=(4, 8, 16)).eval()  # fmt: skip
    x = torch.randn(1, 1, 16, 12, 8)
    y0 = m(x)
    assert snn.alignment(m, 2) == 4
    assert torch.equal(m(x), y0)


class _Views(nn.Module):
    """A stride-2 convolution, then one view of the model's own code, chosen by ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)

    def forward(self, x):
        x = self.conv(x)
        b, c, h, w = x.shape
        if self.kind == "windows":  # windows of 3 (channels last, padded to whole windows, as timm's DaViT)
            t = torch.nn.functional.pad(x.permute(0, 2, 3, 1), (0, 0, 0, (3 - w % 3) % 3, 0, (3 - h % 3) % 3))
            h, w = t.shape[1:3]
            t = t.view(b, h // 3, 3, w // 3, 3, c)
            return t.permute(0, 1, 3, 2, 4, 5).reshape(-1, 9, c)
        if self.kind == "space_to_depth":
            return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        if self.kind == "patches":  # patch rows of 2 folded with the channels (timm MobileViT's unfold)
            return x.reshape(b * c * (h // 2), 2, w // 2, 2)
        if self.kind == "tokens":  # flattened tokens back into rows of the current width
            return x.flatten(2).transpose(1, 2).reshape(b, h, w, c)
        return x.view(b, 2, 3, h, w)  # channels split into groups


@pytest.mark.parametrize("kind, expected", [("windows", 6), ("space_to_depth", 4), ("patches", 4), ("tokens", 2),
                                            ("channels", 2)])
def test_windows_cut_by_views_in_the_model_code(kind, expected):
    # A view whose inner factors stay constant when any input dim grows cuts windows: slabs must
    # hold whole windows at that scale (stride 2 x window 3 = 6 rows). The rows of the current
    # width (tokens) and channel groups are no windows.
    model = _Views(kind)
    assert alignment(model, 2) == expected
    assert alignment(model, (2, 3)) == (expected, expected)
    # A given input shape (a model built for a fixed size) is not grown: strides only.
    assert alignment(model, 2, input_shape=(1, 3, 64, 64)) == 2


@pytest.mark.parametrize("name, kwargs", [
    ("davit_tiny", dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8), window_size=4)),
    ("tiny_vit_5m_224", dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8),
                             window_sizes=(4, 4, 4, 4))),
    ("twins_svt_small", dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_heads=(1, 2, 4, 8),
                             wss=(4, 4, 4, 4))),
    ("davit_tiny", {}),  # windows of 7 down to 1/32: 224 rows
])  # fmt: skip
def test_timm_window_attention_alignment(name, kwargs):
    expected = 32 * (kwargs.get("window_size") or (kwargs.get("window_sizes") or kwargs.get("wss") or (7,))[0])
    assert alignment(timm.create_model(name, pretrained=False, **kwargs), (2, 3)) == (expected, expected)


def test_timm_mobilevit_alignment():
    # Patches of 2 at its last transformer stage (1/32), cut by a view that folds the patch rows
    # of the slab with the channels and splits off the rows inside a patch: 64 rows.
    assert alignment(timm.create_model("mobilevit_xxs", pretrained=False), (2, 3)) == (64, 64)
