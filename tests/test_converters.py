"""Checkpoint loading and adaptation against timm's own pretrained loading (local files only)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import sharded_nn as snn
import sharded_nn.zoo  # noqa: F401 - registers the sharded ViT classes with convert
from sharded_nn import converters, zoo

from .harness import mesh as make_mesh

TINY = dict(embed_dim=32, depth=2, num_heads=2)
FAMILIES = [
    "vit_tiny_patch16_224",
    "deit3_small_patch16_224",
    "deit_tiny_distilled_patch16_224",
    "vit_small_patch14_reg4_dinov2",
    "eva02_tiny_patch14_224",
]


def _save(state_dict, path):
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path))
    else:
        torch.save(state_dict, path)


def _source(name, img_size=224, **kw):
    import timm

    torch.manual_seed(0)
    m = timm.create_model(name, img_size=img_size, **TINY, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def _timm_pretrained(name, path, **kw):
    import timm

    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY, **kw)


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".bin"])
@pytest.mark.parametrize("name", FAMILIES)
def test_create_model_matches_timm_pretrained(tmp_path, name, suffix):
    path = tmp_path / f"w{suffix}"
    _save(_source(name).state_dict(), path)
    size = 448 if "patch16" in name else 434  # a larger grid (28 and 31 patches)
    ours = zoo.create_model(name, mesh=None, img_size=size, pretrained_file=str(path), **TINY)
    _assert_same_state(ours, _timm_pretrained(name, path, img_size=size))


def test_deit3_original_layer_scale_keys_match_timm(tmp_path):
    """DeiT-3's original checkpoints name layer scales ``gamma_1``: timm's deit entry points remap them."""
    import re

    sd = {re.sub(r"ls([12])\.gamma", r"gamma_\1", k): v for k, v in _source("deit3_small_patch16_224").state_dict().items()}
    assert any("gamma_1" in k for k in sd)
    path = tmp_path / "deit3.pth"
    _save(sd, path)
    ours = zoo.create_model("deit3_small_patch16_224", mesh=None, img_size=320, pretrained_file=str(path), **TINY)
    _assert_same_state(ours, _timm_pretrained("deit3_small_patch16_224", path, img_size=320))


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "eva02_tiny_patch14_224"])
def test_new_patch_size_and_classes_match_timm(tmp_path, name):
    path = tmp_path / "w.safetensors"
    _save(_source(name).state_dict(), path)
    kw = dict(img_size=320, patch_size=10, num_classes=7)
    ours = zoo.create_model(name, mesh=None, pretrained_file=str(path), **TINY, **kw)
    ref = _timm_pretrained(name, path, **kw)
    sd_o, sd_r = ours.state_dict(), ref.state_dict()
    for k in sd_o:
        if not k.startswith("head."):  # the new 7-class head is freshly initialised in both
            assert torch.equal(sd_o[k], sd_r[k]), k
    assert sd_o["patch_embed.proj.weight"].shape[-2:] == (10, 10)


def test_resample_without_model_matches_adapt(tmp_path):
    src = _source("vit_tiny_patch16_224").state_dict()
    import timm

    target = timm.create_model("vit_tiny_patch16_224", img_size=(320, 160), patch_size=8, **TINY)
    adapted = converters.adapt_state_dict(src, target)
    free = converters.resample_vit_state_dict(src, new_grid=(40, 20), new_patch=(8, 8), num_prefix_tokens=1)
    assert torch.equal(adapted["pos_embed"], free["pos_embed"])
    assert torch.equal(adapted["patch_embed.proj.weight"], free["patch_embed.proj.weight"])
    # Pure: the input is not modified.
    assert src["pos_embed"].shape == (1, 197, 32)


def test_load_checkpoint_unwraps_and_strips_prefixes(tmp_path):
    sd = {"a.weight": torch.ones(2), "b": torch.zeros(3)}
    path = tmp_path / "w.pth"
    torch.save({"model": {f"module.{k}": v for k, v in sd.items()}, "epoch": 3}, path)
    out = converters.load_checkpoint(path)
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)


def _side_effect(path):
    with open(path, "w") as f:
        f.write("executed")
    return {}


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_side_effect, (self.path,))


def test_pickled_code_is_never_executed(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"w": _Payload(str(marker))}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        converters.load_checkpoint(path)
    assert not marker.exists()


def test_unknown_suffix_and_missing_file(tmp_path):
    (tmp_path / "w.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="unknown suffix"):
        converters.load_checkpoint(tmp_path / "w.npz")
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        converters.load_checkpoint(tmp_path / "nothing.safetensors")


def test_mismatch_lists_every_key(tmp_path):
    import timm

    src = _source("vit_tiny_patch16_224").state_dict()
    src.pop("blocks.1.mlp.fc2.bias")
    src["extra.weight"] = torch.zeros(1)
    path = tmp_path / "w.safetensors"
    _save(src, path)
    target = timm.create_model("vit_tiny_patch16_224", img_size=224, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2)
    with pytest.raises(converters.CheckpointMismatchError) as info:
        converters.load_pretrained(target, path)
    msg = str(info.value)
    assert "missing keys ['blocks.1.mlp.fc2.bias']" in msg
    assert "unexpected keys ['extra.weight']" in msg
    assert "blocks.0.mlp.fc1.weight: (128, 32) in the checkpoint" in msg and "(64, 32) in the model" in msg


def _sharded_from_checkpoint(domain, name, path, size):
    mesh = make_mesh(domain)
    patch = _PIXELS_PER_TOKEN.get(name, 16 if "patch16" in name else 14)
    model = zoo.create_model(name, mesh=mesh, img_size=size, pretrained_file=path, **TINY).double().eval()
    ref = _timm_pretrained(name, path, img_size=size).double().eval()
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    xl = snn.shard(x, mesh, dims=(2,), align=patch)
    torch.testing.assert_close(model(xl), ref(x), atol=1e-10, rtol=1e-10)
    return type(model).__name__


#: Image pixels per token of the hybrid ViTs (backbone reduction 4 times patch 8).
_PIXELS_PER_TOKEN = {"vit_tiny_r_s16_p8_224": 32}


@pytest.mark.parametrize("name", ["vit_small_patch14_reg4_dinov2", "eva02_tiny_patch14_224", "vit_tiny_r_s16_p8_224"])
def test_sharded_model_from_checkpoint_equals_timm(run, tmp_path, name):
    path = tmp_path / "w.safetensors"
    _save(_source(name).state_dict(), path)
    # A larger grid than the checkpoint's (the hybrid: 9 tokens of 32 pixels from 7 at 224^2).
    size = {"vit_tiny_r_s16_p8_224": 288}.get(name, 112 if "patch16" in name else 126)
    out = run(3, _sharded_from_checkpoint, 3, name, str(path), size)
    assert out[0] in ("ShardedVisionTransformer", "ShardedEva") and len(set(out)) == 1


def test_zoo_refuses_download():
    with pytest.raises(ValueError, match="pretrained_file"):
        zoo.create_model("vit_tiny_patch16_224", mesh=None, pretrained=True)


def test_plain_model_for_mesh_none():
    import timm

    m = zoo.create_model("vit_tiny_patch16_224", mesh=None, img_size=64, **TINY)
    assert type(m) is timm.models.vision_transformer.VisionTransformer
    assert m.patch_embed.img_size == (64, 64)
    assert os.path.basename(converters.io.__file__) == "io.py"
