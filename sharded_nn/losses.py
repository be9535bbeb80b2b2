"""Losses over sharded predictions, following the gradient convention.

Each helper returns a scalar whose *value* is the single-device loss of the whole sample (the
same on every rank, convenient for logging) and whose *gradient* is this rank's share: the
per-rank losses sum to the global loss, so ``loss.backward()`` on every rank gives exact input
gradients and partial parameter gradients that ``parallelize`` sums. Calling ``backward`` on
the value of one rank alone is therefore not the global gradient.

Batch dims are reduced as the corresponding torch loss would (mean), assuming every data replica
holds the same number of samples.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_sum
from .mesh import domain_group, domain_size


class _ShareGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient by 1/P: one rank's share of a replicated loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, parts: int):  # noqa: D102
        ctx.parts = parts
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return g / ctx.parts, None


def share(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Turn a value replicated over the domain ranks into this rank's share of it.

    Use it on any loss you compute from replicated tensors (e.g. from ``gather`` or a global
    all-reduce) so that the per-rank losses sum to the global one.
    """
    return _ShareGrad.apply(value, domain_size(mesh))


def domain_sum(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of per-rank partial ``x`` over the domain ranks (replicated, autograd-aware)."""
    return all_reduce_sum(x, domain_group(mesh))


def global_mean(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Mean of all elements of the sharded tensor whose local slab is ``x``."""
    parts = torch.stack([x.sum(), x.new_tensor(float(x.numel()))])
    total = domain_sum(parts, mesh)
    return share(total[0] / total[1], mesh)


def mse_loss(pred: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``F.mse_loss(pred_full, target_full)`` (mean reduction) from local slabs."""
    _check_same_shape(pred, target, "mse_loss")
    return global_mean((pred - target).square(), mesh)


def relative_l2(pred: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh, *, eps: float = 0.0) -> torch.Tensor:
    """Mean over the batch (dim 0) of ``||pred_i - target_i||_2 / ||target_i||_2`` per sample."""
    _check_same_shape(pred, target, "relative_l2")
    b = pred.shape[0]
    err = (pred - target).square().reshape(b, -1).sum(1)
    ref = target.square().reshape(b, -1).sum(1)
    total = domain_sum(torch.stack([err, ref]), mesh)
    return share((total[0].sqrt() / (total[1].sqrt() + eps)).mean(), mesh)


def _check_same_shape(pred: torch.Tensor, target: torch.Tensor, what: str) -> None:
    if pred.shape != target.shape:
        raise ValueError(
            f"{what}: pred and target slabs must have the same shape, got {tuple(pred.shape)} and "
            f"{tuple(target.shape)}. Shard both with the same dims and align."
        )
