"""Model-level checks: whole CNNs (including one nobody here wrote) converted and compared."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchvision

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference


def _resnet18_case(domain: int):
    torch.manual_seed(0)
    # torchvision's ResNet-18 (random init): BatchNorm, maxpool k3 s2 p1, strided convs, an
    # adaptive global average pool, torch.flatten and a Linear head on replicated features.
    ref = torchvision.models.resnet18(num_classes=5).double()
    model = snn.convert(copy.deepcopy(ref), mesh(domain), strict=True)
    torch.manual_seed(1)
    # H = 160 = 5 blocks of the network's total stride 32: uneven slabs on 2, 3 and 4 ranks.
    x = torch.randn(2, 3, 160, 64, dtype=torch.float64)
    # The logits are replicated on every rank: compare them directly (no gather).
    return _check_replicated_output(ref, model, x, mesh(domain), align=32)


def _check_replicated_output(ref, model, x, m, align):
    from .reference import reduce_param_grads

    x = x.detach().clone().requires_grad_()
    y = ref(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    (y * g).sum().backward()
    x_local = snn.shard(x.detach(), m, dims=(2,), align=align).requires_grad_()
    y_local = model(x_local)
    torch.testing.assert_close(y_local, y.detach(), atol=1e-10, rtol=1e-10)
    snn.losses.share((y_local * g).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), x.grad, atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-9, rtol=1e-9, msg=lambda s, n=name: f"{n}: {s}")
    # Running statistics of every BatchNorm match the single-device ones.
    for (name, b_ref), b in zip(ref.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, b_ref, atol=1e-12, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("domain", [2, 3, 4])
def test_torchvision_resnet18(run, domain):
    assert all(run(domain, _resnet18_case, domain))


class EncoderDecoder3d(nn.Module):
    """A small 3-D UNet-like network: GroupNorm, strided conv down, ConvTranspose up, skip."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(2, c, 3, padding=1), nn.GroupNorm(2, c), nn.GELU())
        self.down = nn.Sequential(nn.Conv3d(c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(2, 2 * c), nn.GELU())
        self.mid = nn.Conv3d(2 * c, 2 * c, 3, padding=1, padding_mode="replicate")
        # The three decoder geometries: k=2 s=2; k=4 s=2 p=1; k=3 s=2 p=1 output_padding=1.
        self.up2 = nn.ConvTranspose3d(2 * c, c, 2, stride=2)
        self.up4 = nn.ConvTranspose3d(2 * c, c, 4, stride=2, padding=1)
        self.up3 = nn.ConvTranspose3d(2 * c, c, 3, stride=2, padding=1, output_padding=1)
        self.dec = nn.Sequential(nn.Conv3d(2 * c, c, 3, padding=1), nn.GroupNorm(1, c), nn.SiLU())
        self.out = nn.Conv3d(c, 1, 1)

    def forward(self, x):
        e = self.enc(x)
        m = self.mid(self.down(e))
        u = self.up2(m) + self.up4(m) + self.up3(m)
        return self.out(self.dec(torch.cat([e, u], dim=1)))


def _encdec_case(domain: int):
    torch.manual_seed(0)
    ref = EncoderDecoder3d().double()
    model = snn.convert(copy.deepcopy(ref), mesh(domain), strict=True)
    torch.manual_seed(1)
    x = torch.randn(1, 2, 14, 6, 6, dtype=torch.float64)
    return check_against_reference(ref, x, mesh(domain), align=2, sharded=model)


@pytest.mark.parametrize("domain", [2, 3, 4])
def test_encoder_decoder_3d(run, domain):
    run(domain, _encdec_case, domain)
