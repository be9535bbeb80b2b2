"""Demo: a small 3-D CNN sharded over 2 local processes equals the single-device model.

Run: ``python bench/demo.py``. Each rank reads only its slab of the sample (``local_slices``),
the converted model runs forward and backward on slabs, and the gathered output, input
gradient and reduced parameter gradients are compared with the single-device model.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

import sharded_nn as snn

SHAPE = (1, 4, 48, 40, 40)  # (N, C, D, H, W): D is sharded


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(4, 16, 3, padding=1),
        nn.GELU(),
        nn.Conv3d(16, 16, 3, stride=2, padding=1, padding_mode="circular"),
        nn.GELU(),
        nn.Conv3d(16, 16, 5, padding="same", padding_mode="reflect"),
        nn.GELU(),
        nn.Conv3d(16, 1, 1),
    ).double()


def sample() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=gen, dtype=torch.float64)


def run() -> dict[str, float]:
    mesh = snn.init_mesh(domain=2)
    ref = build_model()
    model = snn.parallelize(copy.deepcopy(ref), mesh)

    # Single-device reference (every rank computes it here, only to compare).
    x = sample().requires_grad_()
    target = torch.zeros(1, 1, 24, 20, 20, dtype=torch.float64)
    loss_ref = nn.functional.mse_loss(ref(x), target)
    loss_ref.backward()

    # Sharded: each rank holds only its slab of D (align=2: the network's stride).
    sl = snn.local_slices(SHAPE, mesh, dims=(2,), align=2)
    x_local = sample()[sl].clone().requires_grad_()
    t0 = time.perf_counter()
    y_local = model(x_local)
    loss = snn.losses.mse_loss(y_local, snn.shard(target, mesh), mesh)
    loss.backward()
    elapsed = time.perf_counter() - t0

    out = snn.gather(y_local.detach(), mesh)
    grad_in = snn.gather(x_local.grad, mesh)
    return {
        "slab": tuple(x_local.shape),
        "loss (sharded / single)": (loss.item(), loss_ref.item()),
        "max |output diff|": (out - ref(x).detach()).abs().max().item(),
        "max |input grad diff|": (grad_in - x.grad).abs().max().item(),
        "max |weight grad diff|": max(
            (p.grad - q.grad).abs().max().item() for p, q in zip(model.module.parameters(), ref.parameters())
        ),
        "sharded fwd+bwd seconds": elapsed,
    }


def main() -> None:
    print(f"sharded_nn demo: a 3-D CNN on a {SHAPE} sample, split along D over 2 processes")
    result = snn.launch(run, 2, threads=1)
    for k, v in result.items():
        print(f"  {k:28s} {v}")
    worst = max(result["max |output diff|"], result["max |input grad diff|"], result["max |weight grad diff|"])
    print("OK: sharded == single device" if worst < 1e-10 else f"MISMATCH: {worst}")


if __name__ == "__main__":
    main()
