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


# ---------------------------------------------------------------------------------------------
# Pointwise-ness from the dims a layer acts on against the sharded dims
# ---------------------------------------------------------------------------------------------


def _no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def _seq(*layers):
    return nn.Sequential(*layers).double()


def _last_dim_layers_1d_mesh():
    m = mesh(2)
    # (N, C, L): the last dim is the sharded L, so Linear and GLU() mix positions.
    with pytest.warns(snn.ShardingWarning, match=r"1 \(Linear\) acts on dim\(s\) \(2,\).*2 \(GLU\)") as rec:
        snn.convert(_seq(nn.Conv1d(2, 4, 3), nn.Linear(8, 8), nn.GLU(), nn.GLU(dim=1), nn.GELU()), m)
    assert "3 (GLU" not in str(rec[0].message) and "GELU" not in str(rec[0].message)
    with pytest.raises(snn.ShardingNotImplementedError, match=r"Linear"):
        snn.convert(_seq(nn.Conv1d(2, 4, 3), nn.Linear(8, 8)), m, strict=True)
    _no_warning(snn.convert, _seq(nn.Conv1d(2, 4, 3), nn.Linear(8, 8)), m, plan={"1": None}, strict=True)
    # (N, C, H, W) with H sharded: a Linear on W (or on channels after a permute) is fine.
    _no_warning(snn.convert, _seq(nn.Conv2d(2, 4, 3), nn.Linear(8, 8), nn.Softmax(dim=1), nn.GLU(-1)), m)
    # ... unless W is the sharded dim: convert(dims=...) says so, and sets it on the layers.
    with pytest.warns(snn.ShardingWarning, match=r"1 \(Linear\) acts on dim\(s\) \(3,\)"):
        model = snn.convert(_seq(nn.Conv2d(2, 4, 3), nn.Linear(8, 8)), m, dims=(3,))
    assert model[0].dims == (3,)
    with pytest.warns(snn.ShardingWarning, match=r"1 \(Softmax\) acts on dim\(s\) \(2,\)"):
        snn.convert(_seq(nn.Conv2d(2, 4, 3), nn.Softmax(dim=-2)), m)
    # Tokens (B, L, C) without grid layers, L sharded: Linear / LayerNorm over C are pointwise,
    # convert(dims=) reaches the layers that take dims and not the attention (which has none).
    model = _no_warning(
        snn.convert,
        _seq(nn.Linear(4, 8), nn.MultiheadAttention(8, 2, batch_first=True), nn.LayerNorm(8), nn.GELU()),
        m,
        dims=(1,),
    )
    assert isinstance(model[1], snn.ShardedMultiheadAttention) and model[2].dims == (1,)
    return True


def test_last_dim_layers_on_a_1d_mesh(run):
    assert all(run(2, _last_dim_layers_1d_mesh))


def _last_dim_layers_2x2_mesh():
    m = mesh((2, 2))
    # On a 2x2 mesh W is sharded: a Linear on the last dim of (N, C, H, W) mixes positions.
    with pytest.warns(snn.ShardingWarning, match=r"1 \(Linear\) acts on dim\(s\) \(3,\)"):
        snn.convert(_seq(nn.Conv2d(2, 4, 3), nn.Linear(8, 8)), m)
    _no_warning(snn.convert, _seq(nn.Conv2d(2, 4, 3), nn.GLU(dim=1), nn.ReLU()), m)
    return True


def test_last_dim_layers_on_a_2x2_mesh(run):
    assert all(run(4, _last_dim_layers_2x2_mesh))


def _timm_layers():
    timm = pytest.importorskip("timm")
    from timm.layers import activations, activations_me, norm, norm_act

    m = mesh(2)
    acts = [
        cls()
        for mod in (activations, activations_me)
        for cls in vars(mod).values()
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == mod.__name__
    ]
    assert len(acts) >= 10  # GELU, SiLU/Swish, HardSwish, QuickGELU, Mish, ... and the *Me ones
    channel_norms = [norm.LayerNorm2d(4), norm.RmsNorm2d(4), norm.LayerNorm(6), norm.RmsNorm(6)]
    _no_warning(snn.convert, _seq(nn.Conv2d(4, 4, 3), *acts, *channel_norms, norm_act.LayerNormAct2d(4)), m)
    # Statistics over positions: timm's norm(+act) classes have sharded classes of their own
    # (layers/timm_norm_act.py), swapped in training and eval alike, with no warning.
    bn = _seq(nn.Conv2d(4, 4, 3), norm_act.BatchNormAct2d(4))
    assert isinstance(_no_warning(snn.convert, bn, m)[1], snn.layers.ShardedBatchNormAct2d)
    _no_warning(snn.convert, bn.eval(), m)
    gn = _no_warning(snn.convert, _seq(nn.Conv2d(4, 4, 3), norm_act.GroupNormAct(4, 2)), m)
    assert isinstance(gn[1], snn.layers.ShardedGroupNormAct)

    # ConvNeXt: every GELU and LayerNorm2d is pointwise, the convs and the global pool are
    # swapped, the head after the pool runs on replicated features: nothing to report, and
    # the converted model equals the single-device one.
    torch.manual_seed(0)
    ref = timm.create_model("convnext_atto", num_classes=3).double()
    model = _no_warning(snn.convert, copy.deepcopy(ref), m)
    assert isinstance(model.head.global_pool.pool, snn.ShardedAdaptiveAvgPool2d)
    x = torch.randn(1, 3, 256, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model.eval(), ref.eval()
    with torch.no_grad():
        y = model(snn.shard(x, m, align=32))
    torch.testing.assert_close(y, ref(x).detach(), atol=1e-10, rtol=1e-10)
    return True


def test_timm_activations_norms_and_convnext(run):
    assert all(run(2, _timm_layers))


def _convnext_2x2():
    timm = pytest.importorskip("timm")
    _no_warning(snn.convert, timm.create_model("convnext_atto"), mesh((2, 2)))
    return True


def test_convnext_no_hazard_on_2x2(run):
    assert all(run(4, _convnext_2x2))


# ---------------------------------------------------------------------------------------------
# Plan diagnostics
# ---------------------------------------------------------------------------------------------


def _plan_warnings():
    m = mesh(2)
    with pytest.warns(snn.ShardingWarning, match=r"plan glob 'stem\.\*' matches no module"):
        snn.convert(_cnn(), m, plan={"stem.*": {"dims": (2,)}})
    with pytest.warns(snn.ShardingWarning, match=r"plan glob '1' gives options \{'dims': \(3,\)\} only to modules that are not swapped \(1\)"):
        snn.convert(_cnn(), m, plan={"1": {"dims": (3,)}})
    # A glob whose options reach swapped layers (and also others) is fine; so is None.
    model = _no_warning(snn.convert, _cnn(), m, plan={"2.*": None, "*": {"dims": (3,)}})
    assert model[0].dims == (3,) and type(model[2].conv) is nn.Conv2d
    return True


def test_plan_warnings(run):
    assert all(run(2, _plan_warnings))


def test_convert_swaps_zoo_families_without_importing_the_zoo(tmp_path):
    """A fresh ``import sharded_nn`` (zoo not imported) still swaps a timm ViT as a whole.

    Otherwise convert would descend into the ViT and leave its position-embedding code running on
    slabs: a silently wrong answer.
    """
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys, torch, torch.distributed as dist, timm
        import sharded_nn as snn
        assert "sharded_nn.zoo" not in sys.modules
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
        mesh = snn.init_mesh(domain=1, device_type="cpu")
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, embed_dim=16, num_heads=2)
        out = snn.convert(vit, mesh)
        print(type(out).__name__)
        dist.destroy_process_group()
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "ShardedVisionTransformer"


def test_import_is_light_and_timm_layers_load_on_first_use(tmp_path):
    """``import sharded_nn`` imports no model library (timm pulls in torchvision and torch's
    compiler: seconds on every rank of every launch); timm's sharded layers still register when
    ``convert`` meets a timm module, and their public names still resolve."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys, torch, torch.distributed as dist
        import sharded_nn as snn
        heavy = [m for m in ("timm", "torchvision", "torch_geometric", "sharded_nn.zoo", "torch._dynamo") if m in sys.modules]
        assert not heavy, heavy
        assert "ShardedBatchNormAct2d" in snn.layers.__all__ and "ShardedTimmAttention" in snn.__all__
        import timm.layers
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
        mesh = snn.init_mesh(domain=1, device_type="cpu")
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), timm.layers.BatchNormAct2d(4))
        out = snn.convert(model, mesh)
        print(type(out[1]).__name__, snn.ShardedBatchNormAct2d is type(out[1]), snn.ShardedTimmAttention.__name__)
        dist.destroy_process_group()
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "ShardedBatchNormAct2d True ShardedTimmAttention"


def _parametrized(domain, train: bool):
    # torch's parametrizations compute a weight from others (never an activation): no hazard is
    # reported, the parametrized convolutions run under the forward guard (their F.conv2d on
    # slabs), and spectral norm's power-iteration buffers advance alike on every rank.
    from torch.nn.utils import parametrizations as P

    m = mesh(domain)
    torch.manual_seed(0)
    ref = nn.Sequential(
        P.spectral_norm(nn.Conv2d(2, 4, 3, padding=1)), nn.GELU(),
        P.weight_norm(nn.Conv2d(4, 3, 3, padding=2, dilation=2)), P.orthogonal(nn.Conv2d(3, 3, 1)),
    ).double().train(train)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sharded = snn.convert(copy.deepcopy(ref), m)
    assert not w, [str(a.message) for a in w]
    x = torch.randn(2, 2, 13, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sizes = {2: (7, 6), 3: (5, 4, 4)}[domain]
    check_against_reference(ref, x, m, sharded=sharded, sizes=sizes)
    for (name, a), b in zip(sharded.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("train", [True, False])
def test_parametrized_layers_are_exact_and_not_hazards(run, domain, train):
    assert all(run(domain, _parametrized, domain, train))


def _lazy():
    m = mesh(2)
    model = nn.Sequential(nn.LazyConv2d(3, 3, padding=1), nn.GELU())
    try:
        snn.convert(model, m)
    except snn.ShardingError as e:
        return str(e)
    return "converted"


def test_lazy_modules_are_refused_with_the_fix(run):
    # A lazy module would draw its weights at its first forward, each rank its own.
    res = run(2, _lazy)
    assert all("uninitialized (lazy) parameters: 0 (LazyConv2d)" in r and "sync_weights" in r for r in res), res
