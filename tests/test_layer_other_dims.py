"""A sharded layer given a slab along another spatial dim than the one it was converted for.

``convert`` gives every layer the model's sharded dims (dim 2 by default), but a model's own
code can move the sharded dim before a layer: timm's MobileViT-v2 unfolds its feature map into
patches ``(B, C, P, N)`` with the tokens (the sharded rows) in dim 3, then norms and projects
them with a ``GroupNorm`` and 1x1 convolutions. Convolutions and batch, group and instance norms
compute the same on any spatial dims, so the guard runs such a layer as a twin sharding the
input's dims (sharing its parameters and buffers). The converted model must equal the
single-device one, forward, input and parameter gradients, running statistics included.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh
from .reference import compare_on_slabs, error_on_slab


class Transposed(nn.Module):
    """Convolutions and norms applied to the transposed image (the sharded rows in dim 3)."""

    def __init__(self, norm: str = "group") -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, (3, 1), padding=(1, 0), padding_mode="circular")
        self.norm = {"group": nn.GroupNorm(2, 4), "batch": nn.BatchNorm2d(4), "instance": nn.InstanceNorm2d(4, affine=True)}[norm]
        self.point = nn.Conv2d(4, 4, 1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.head = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        t = torch.tanh(self.stem(x)).transpose(2, 3)
        t = self.point(torch.relu(self.norm(self.conv(t))))
        t = self.down(t).transpose(2, 3)
        return self.head(self.up(t))


def _transposed(domain, sizes, norm, train):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Transposed(norm).double().train(train)
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    err = compare_on_slabs(ref, model, m, x, sizes, replicated=False)
    if norm == "batch" and train:
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.norm, name), getattr(ref.norm, name), atol=1e-12, rtol=1e-12)
    r = m.get_local_rank("domain")
    x_local = x.narrow(2, sum(sizes[:r]), sizes[r])
    if norm == "batch" and train:
        # The twin follows the layer's attributes: a momentum changed after its first call.
        model.norm.momentum = ref.norm.momentum = 0.5
        with torch.no_grad():
            model(x_local), ref(x)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(model.norm, name), getattr(ref.norm, name), atol=1e-12, rtol=1e-12)
    # In eval mode (a batch norm then uses its running statistics: any layout, no twin).
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(snn.gather(model(x_local), m, dims=(2,)), ref(x), atol=1e-10, rtol=1e-10)
    return err, sorted(model.conv.__dict__.get("_snn_twins", {}))


@pytest.mark.parametrize("domain, sizes", [(2, [4, 6]), (3, [2, 6, 4])])
@pytest.mark.parametrize("norm, train", [("group", True), ("batch", True), ("batch", False), ("instance", True)])
def test_layers_on_the_other_spatial_dim_are_exact(run, domain, sizes, norm, train):
    for err, twins in run(domain, _transposed, domain, sizes, norm, train):
        assert err < 1e-10
        assert twins == [(3,)]  # the layer ran as a twin sharding dim 3, kept for the next call


def _transposed_pool(domain):
    class Pooled(nn.Module):  # an adaptive pool is not among the layers that take other dims
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d((3, 2))

        def forward(self, x):
            return self.pool(self.conv(x).transpose(2, 3))

    m = mesh(domain)
    model = snn.convert(Pooled().double(), m)
    return error_on_slab(model, torch.randn(1, 2, 10, 6, dtype=torch.float64), m, [4, 6])


def test_other_layers_on_the_other_spatial_dim_are_refused_on_every_rank(run):
    out = run(2, _transposed_pool, 2)
    assert len(set(out)) == 1 and "shards dims (2,) but its input is sharded along dim 3" in out[0], out


def _mobilevitv2(domain, sizes):
    import timm

    from bench.compat import randomise_norms

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model("mobilevitv2_050", pretrained=False, num_classes=5).double().eval()
    randomise_norms(ref)
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 3, sum(sizes), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return compare_on_slabs(ref, model, m, x, sizes)


def test_timm_mobilevitv2_is_exact(run):
    # Patches (B, C, P, N) with the sharded tokens last: GroupNorm1 and 1x1 convolutions on dim 3,
    # a softmax and a sum over the sharded tokens (routed), the fold back into rows.
    pytest.importorskip("timm")
    assert max(run(2, _mobilevitv2, 2, [64, 64])) < 1e-9
