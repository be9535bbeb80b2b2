"""Checkpoints: converted state_dicts equal unsharded ones; safe files; DCP training state across P.

- Every zoo model (ViT, UNet, Transolver): the converted model's ``state_dict`` has the plain
  model's keys (in order), shapes and values.
- ``snn.checkpoint.save`` on one rank, ``load`` into plain and converted models alike; the loaded
  converted model computes the plain model's output.
- Loading never unpickles: a pickle whose ``__reduce__`` would run code is refused on every rank
  and its payload never runs; a rank that loads another file raises on every rank.
- Model + Adam through DCP (``save_training_state``) at P=2, resumed at P=2 (the identical next
  loss, bit for bit) and at P=3 and P=1 (the same next loss to float64 rounding).
"""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn import checkpoint as ckpt

from .harness import mesh

D = torch.float64


def zoo_models() -> dict[str, tuple]:
    """name -> (plain model factory, converted-model plan kwargs); small float64 zoo models."""
    from sharded_nn.zoo import Transolver, UNet

    def vit():
        import timm

        return timm.create_model("vit_tiny_patch16_224", embed_dim=32, depth=2, num_heads=2, img_size=(64, 32),
                                 num_classes=3)

    def unet():
        return UNet(2, 2, 3, channels=(4, 8, 8))

    def transolver():
        return Transolver(functional_dim=2, out_dim=1, embedding_dim=3, n_layers=2, n_hidden=16, n_head=2,
                          mlp_ratio=2, slice_num=4)

    return {"vit": vit, "unet": unet, "transolver": transolver}


def _randomized(factory, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = factory().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _state_dicts_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b), (list(a)[:5], list(b)[:5])
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def _state_dict_case(name: str) -> bool:
    m = mesh(2)
    plain = _randomized(zoo_models()[name], 0)
    converted = snn.convert(copy.deepcopy(plain), m)
    assert any(type(mod).__name__.startswith("Sharded") for mod in converted.modules())
    _state_dicts_equal(converted.state_dict(), plain.state_dict())
    # The zoo factory's converted model has the plain model's keys and shapes too.
    kw = {"vit": None, "unet": ("unet2d", dict(in_channels=2, out_channels=3, channels=(4, 8, 8))),
          "transolver": ("transolver", dict(functional_dim=2, out_dim=1, embedding_dim=3, n_layers=2, n_hidden=16,
                                            n_head=2, mlp_ratio=2, slice_num=4))}[name]
    if kw is not None:
        made = snn.zoo.create_model(kw[0], mesh=m, **kw[1]).double()
        assert [(k, v.shape) for k, v in made.state_dict().items()] == [
            (k, v.shape) for k, v in plain.state_dict().items()
        ]
    return True


@pytest.mark.parametrize("name", ["vit", "unet", "transolver"])
def test_converted_state_dict_equals_unsharded(run, name):
    assert all(run(2, _state_dict_case, name))


# --------------------------------------------------------------------------- save / load


def _forward(name: str, model: nn.Module, m=None) -> torch.Tensor:
    """The full output of ``model`` on a fixed input; sharded (and gathered) when ``m`` is given."""
    gen = torch.Generator().manual_seed(5)
    if name == "vit":
        x = torch.randn(1, 3, 64, 32, generator=gen, dtype=D)
        return model(snn.shard(x, m, align=16)) if m is not None else model(x)  # logits: replicated
    if name == "unet":
        x = torch.randn(1, 2, 20, 12, generator=gen, dtype=D)
        return snn.gather(model(snn.shard(x, m, align=4)), m) if m is not None else model(x)
    fx, emb = torch.randn(1, 30, 2, generator=gen, dtype=D), torch.randn(1, 30, 3, generator=gen, dtype=D)
    if m is None:
        return model(fx, embedding=emb)
    y = model(snn.shard(fx, m, dims=(1,)), embedding=snn.shard(emb, m, dims=(1,)))
    return snn.gather(y, m, dims=(1,))


def _save_load_case(name: str, path: str) -> bool:
    m = mesh(2)
    factory = zoo_models()[name]
    trained = snn.convert(_randomized(factory, 0), m)
    ckpt.save(trained, path, mesh=m)  # written by rank 0 only
    plain = ckpt.load(_randomized(factory, 1), path, mesh=m)
    converted = ckpt.load(snn.convert(_randomized(factory, 2), m), path, mesh=m)
    _state_dicts_equal(plain.state_dict(), trained.state_dict())
    _state_dicts_equal(converted.state_dict(), trained.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(_forward(name, converted.eval(), m), _forward(name, plain.eval()),
                                   atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("name", ["vit", "unet", "transolver"])
def test_save_on_one_rank_load_into_sharded_and_plain(run, tmp_path, name):
    assert all(run(2, _save_load_case, name, str(tmp_path / f"{name}.safetensors")))


class _Payload:
    """Unpickling this runs ``open(path, "w")``: the file appears if code executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _refuses_pickle(path: str, sentinel: str):
    m = mesh(2)
    model = nn.Linear(3, 2)
    try:
        ckpt.load(model, path, mesh=m)
    except snn.ShardingError as e:
        return type(e).__name__, str(e).replace(" This rank:", "\n").split("\n")[0], os.path.exists(sentinel)
    return None


def test_load_never_unpickles(run, tmp_path):
    path, sentinel = tmp_path / "evil.pt", tmp_path / "ran"
    with open(path, "wb") as f:
        pickle.dump({"weight": _Payload(str(sentinel))}, f)
    results = run(2, _refuses_pickle, str(path), str(sentinel))
    assert results[0] is not None and all(r == results[0] for r in results), results
    assert results[0][0] == "ShardingError" and not results[0][2], results
    assert not sentinel.exists()


# --------------------------------------------------------------------------- training state (DCP)


def _unet(seed: int = 0) -> nn.Module:
    from sharded_nn.zoo import UNet

    torch.manual_seed(seed)
    return UNet(2, 2, 1, channels=(4, 8)).double()


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(1, 2, 24, 8, generator=gen, dtype=D), torch.randn(1, 1, 24, 8, generator=gen, dtype=D)


def _step(model, opt, m, step: int) -> float:
    x, t = _batch(step)
    opt.zero_grad()
    if m is None:
        loss = torch.nn.functional.mse_loss(model(x), t)
    else:
        loss = snn.losses.mse_loss(model(snn.shard(x, m, align=2)), snn.shard(t, m, align=2), m)
    loss.backward()
    opt.step()
    return loss.item()


def _train_and_save(path: str, steps: int) -> list[float]:
    m = mesh(2)
    model = snn.parallelize(_unet(), m)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = [_step(model, opt, m, s) for s in range(steps)]
    ckpt.save_training_state(path, model, opt, extra={"step": steps})
    losses.append(_step(model, opt, m, steps))  # the next loss after the save
    return losses


def _resume(path: str, world: int) -> tuple[float, int]:
    m = mesh(world) if world > 1 else None
    model = _unet(seed=7)  # other initial weights: everything must come from the checkpoint
    model = snn.parallelize(model, m) if m is not None else model
    opt = torch.optim.Adam(model.parameters(), lr=0.5)  # other lr: param_groups come from the checkpoint
    extra = ckpt.load_training_state(path, model, opt)
    return _step(model, opt, m, extra["step"]), extra["step"]


def test_training_state_resumes_at_same_and_other_world_size(run, tmp_path):
    path = str(tmp_path / "state")
    saved = run(2, _train_and_save, path, 2)
    assert saved[0] == saved[1]
    want = saved[0][-1]
    files = os.listdir(path)
    assert not any(f.endswith((".pt", ".pkl", ".metadata")) for f in files), files
    # Same P: the identical next loss (same reduction order, bit for bit).
    same = run(2, _resume, path, 2)
    assert all(r == (want, 2) for r in same), (same, want)
    # Other P: the same loss up to float64 rounding of the other reduction order.
    for world in (3, 1):
        got = run(world, _resume, path, world)
        for loss, step in got:
            assert step == 2 and loss == pytest.approx(want, rel=1e-12, abs=1e-14), (world, loss, want)
