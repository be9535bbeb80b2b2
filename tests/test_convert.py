"""convert(): registry, plan globs, idempotence, state_dict keys, hazard warnings."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.conv(x))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"),
        nn.ReLU(),
        Block(8),
        nn.Sequential(nn.Conv2d(8, 8, 4, stride=2, padding=1), nn.SiLU(), nn.Dropout(0.0)),
        nn.Conv2d(8, 2, 1),
    ).double()


def _convert_cnn():
    m = mesh(2)
    ref = _cnn()
    keys = list(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain CNN of convs and pointwise layers raises no warning
        model = snn.convert(copy.deepcopy(ref), m)
    assert list(model.state_dict()) == keys
    assert isinstance(model[2].conv, snn.ShardedConv2d) and isinstance(model[3][0], snn.ShardedConv2d)
    assert type(model[1]) is nn.ReLU
    again = snn.convert(model, m)  # idempotent
    assert again is model and isinstance(model[0], snn.ShardedConv2d)
    assert not isinstance(model[0].weight, type(None)) and model[0].weight is model[0]._parameters["weight"]
    # Parameters are shared with nothing else: the deepcopy's, in place.
    x = torch.randn(2, 3, 14, 9, dtype=torch.float64)
    return check_against_reference(ref, x, m, align=2, sharded=model)


def test_convert_plain_cnn_matches_torch(run):
    run(2, _convert_cnn)


def _plan_and_root():
    m = mesh(2)
    model = _cnn()
    snn.convert(model, m, plan={"2.*": None, "0": {"dims": (3,)}})
    assert type(model[2].conv) is nn.Conv2d  # skipped by the plan
    assert model[0].dims == (3,)
    assert isinstance(model[4], snn.ShardedConv2d) and model[4].dims == (2,)
    root = snn.convert(nn.Conv3d(2, 2, 3), m)  # the root itself is swapped
    assert isinstance(root, snn.ShardedConv3d)
    return True


def test_plan_globs_and_root(run):
    assert all(run(2, _plan_and_root))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        # Leaf layers that mix positions and have no sharded class.
        self.pool = nn.PixelShuffle(2)
        self.norm = nn.Softmax(dim=2)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc(self.flat(self.norm(self.pool(self.conv(x)))))


def _hazards():
    m = mesh(2)
    with pytest.warns(snn.ShardingWarning, match=r"pool \(PixelShuffle\).*norm \(Softmax\).*flat \(Flatten\)"):
        snn.convert(Head(), m)
    with pytest.raises(snn.ShardingNotImplementedError, match="PixelShuffle"):
        snn.convert(Head(), m, strict=True)
    # Reviewed layers (plan entry None) are neither converted nor reported.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snn.convert(Head(), m, plan={"pool": None, "norm": None, "flat": None}, strict=True)
    return True


def test_hazard_warning_and_strict(run):
    assert all(run(2, _hazards))


class Smooth(nn.Module):
    """A user layer that mixes neighbours: a 3-tap moving average along H."""

    def forward(self, x):
        return nn.functional.avg_pool2d(nn.functional.pad(x, (0, 0, 1, 1)), (3, 1), stride=1)


def _user_registration():
    m = mesh(3)

    @snn.register(Smooth)
    class ShardedSmooth(Smooth):
        """User-written sharded layer built from a library conv (sharing its halo logic)."""

        def __init__(self, mesh) -> None:
            super().__init__()
            self.conv = snn.ShardedConv2d(1, 1, (3, 1), padding=(1, 0), bias=False, mesh=mesh).double()
            with torch.no_grad():
                self.conv.weight.fill_(1 / 3)
            self.conv.weight.requires_grad_(False)

        @classmethod
        def from_module(cls, module, mesh, **options):
            return cls(mesh)

        def forward(self, x):
            n, c = x.shape[:2]
            return self.conv(x.reshape(n * c, 1, *x.shape[2:])).reshape(n, c, -1, x.shape[-1])

    torch.manual_seed(0)  # every rank must start from the same parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = snn.convert(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), Smooth()).double(), m)
    assert isinstance(model[1], ShardedSmooth)
    ref = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), Smooth()).double()
    ref[0].load_state_dict(model[0].state_dict())
    x = torch.randn(1, 2, 17, 4, dtype=torch.float64)
    return check_against_reference(ref, x, m, sharded=model)


def test_user_registered_layer(run):
    run(3, _user_registration)


def test_register_rejects_bad_input():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        snn.register(int)
    with pytest.raises(TypeError, match="from_module"):
        snn.register(nn.Conv2d)(object)


def _mesh_without_domain():
    m = init_device_mesh("cpu", (2,), mesh_dim_names=("foo",))
    with pytest.raises(ValueError, match="needs a mesh with a 'domain' axis"):
        snn.convert(nn.Conv2d(1, 1, 3), m)
    return True


def test_mesh_without_domain_axis(run):
    assert all(run(2, _mesh_without_domain))
