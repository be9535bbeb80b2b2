"""Zoo models under bf16 / fp16 autocast: the sharded error is not larger than single-device autocast's.

For each zoo model (ViT, UNet, Transolver; small sizes) the float32 model gives the reference.
The same weights then run under ``torch.autocast("cpu", dtype)`` on one device and, converted,
on P = 2-4 ranks. We measure both errors against float32 (output and input gradient, max abs)
and assert ``e_sharded <= 1.5 * e_single + atol``:

- 1.5x: the sharded model rounds some intermediate sums at other places than torch does (a
  per-rank partial sum of the point reduction, a halo strip computed in its own convolution,
  ring attention's blockwise merge in float32), so its error is *another* draw of rounding
  errors of the same size, not the same bits; a systematic loss of precision (a norm's
  statistics or an attention merge accumulated in bf16) makes it several times larger.
- ``atol`` = one unit in the last place (``eps``) of the autocast dtype at the reference's
  scale: the results themselves are rounded to that dtype, so two correct computations can
  differ by a final rounding each way. It matters where the single-device error is itself
  about one final rounding (measured for the ViT logits over 5 seeds: single-device 0.5-1.5
  ulp, sharded 1.3-2.7x that); a systematic precision loss costs many ulps.

Every layer family on its own is checked the same way in ``tests/test_autocast.py``; this file
covers the whole models, at P = 2, 3 and 4.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

FACTOR = 1.5


def _vit() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", embed_dim=32, depth=2, num_heads=2, img_size=(64, 32),
                             num_classes=5)


def _unet() -> nn.Module:
    from sharded_nn.zoo import UNet

    return UNet(2, 2, 3, channels=(4, 8, 8))


def _transolver() -> nn.Module:
    from sharded_nn.zoo import Transolver

    return Transolver(functional_dim=2, out_dim=2, embedding_dim=3, n_layers=2, n_hidden=16, n_head=2, mlp_ratio=2,
                      slice_num=4)


# name -> (factory, input shape, sharded dim, alignment, output replicated)
MODELS = {
    "vit": (_vit, (2, 3, 64, 32), 2, 16, True),
    "unet": (_unet, (1, 2, 32, 12), 2, 4, False),
    "transolver": (_transolver, (2, 40, 2), 1, 1, False),
}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    with torch.no_grad():  # non-trivial values everywhere (timm's layer scales and prefix tokens start tiny)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _call(name: str, model: nn.Module, x: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
    return model(x, embedding=emb) if name == "transolver" else model(x)


def _errors(name: str, world: int, dtype_name: str, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """{what: (sharded error, single-device error, scale of the reference)} for output and input grad."""
    dtype = getattr(torch, dtype_name)
    _, shape, dim, align, replicated = MODELS[name]
    m = mesh(world)
    ref = _model(name, seed)
    sharded = snn.convert(copy.deepcopy(ref), m)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=gen)
    emb = torch.randn(*shape[:2], 3, generator=gen) if name == "transolver" else None
    with torch.no_grad():
        g = torch.randn(_call(name, ref, x, emb).shape, generator=gen)

    def single(autocast: bool):
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            y = _call(name, ref, xr, emb)
        (y.float() * g).sum().backward()
        return y.detach().float(), xr.grad

    def shard(t):
        return snn.shard(t, m, dims=(dim,), align=align) if t is not None else None

    y32, gx32 = single(False)
    y1, gx1 = single(True)
    xl = shard(x).requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        yl = _call(name, sharded, xl, shard(emb))
    yl = yl.float()
    if replicated:  # logits: the same on every rank, a share of the loss each
        snn.losses.share((yl * g).sum(), m).backward()
        ys = yl.detach()
    else:
        (yl * shard(g)).sum().backward()
        ys = snn.gather(yl.detach(), m, dims=(dim,))
    gxs = snn.gather(xl.grad.float(), m, dims=(dim,))
    out = {}
    for what, r32, r1, rs in (("out", y32, y1, ys), ("grad_in", gx32, gx1, gxs)):
        out[what] = ((rs - r32).abs().max().item(), (r1 - r32).abs().max().item(), r32.abs().max().item())
    return out


def _check(name: str, world: int, dtype_name: str) -> dict:
    report = _errors(name, world, dtype_name)
    eps = torch.finfo(getattr(torch, dtype_name)).eps
    for what, (e_sharded, e_single, scale) in report.items():
        assert e_single > 0, (name, what, "autocast had no effect: the comparison would be vacuous")
        atol = eps * scale
        assert e_sharded <= FACTOR * e_single + atol, (name, world, dtype_name, what, e_sharded, e_single, atol)
    return report


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_autocast_at_two_ranks(run, name, dtype_name):
    run(2, _check, name, 2, dtype_name)


@pytest.mark.parametrize("name, world", [("vit", 4), ("unet", 4), ("transolver", 3)])
def test_zoo_bf16_autocast_at_more_ranks(run, name, world):
    run(world, _check, name, world, "bfloat16")
