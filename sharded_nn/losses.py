"""Losses over sharded predictions, following the gradient convention.

The convention (DESIGN.md section 3): every rank runs the same backward and the *global* loss is
the **sum of the per-rank losses**. Each helper here returns a scalar whose *value* is the
single-device loss of the whole sample (the same on every rank, convenient for logging) and whose
*gradient* is this rank's share: call ``loss.backward()`` on every rank. That gives exact input
gradients and partial parameter gradients that ``parallelize`` sums. Calling ``backward`` on one
rank alone is therefore not the global gradient.

Any loss you compute yourself from a *replicated* value (the output of ``gather``, of a reduction
in ``sharded_nn.reductions``, of ``domain_sum``) is computed identically on every rank that holds
the copy: pass it through ``share`` so that it is counted once, then call ``backward()`` on every
rank. A loss computed from this rank's slab alone (a partial sum) needs no ``share``.

Batch dims are reduced as the corresponding torch loss would (mean), assuming every data replica
holds the same number of samples.

Precision: sums and counts accumulate in float32 for fp16/bf16 inputs (counts are exact
integers), as torch's own losses do; the result has the input dtype.

Validation: shapes are compared across all domain ranks (one small all-gather), so a mismatch on
one rank raises the same ``ValueError`` on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_sum, comm_device
from .comm.collectives import all_gather_stacked
from .mesh import axis_size, domain_axes, domain_group, group_over
from .reductions import accumulation_dtype

# Shapes of more dims are compared exactly but shown truncated in error messages.
_SHOWN_NDIM = 12


class _ShareGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient by 1/parts: one rank's share of a replicated loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, parts: int):  # noqa: D102
        ctx.parts = parts
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return g / ctx.parts, None


def _mesh_axes(mesh: DeviceMesh, mesh_axes: str | Sequence[str] | None, what: str) -> tuple[str, ...]:
    axes = domain_axes(mesh)
    if mesh_axes is None:
        return axes
    chosen = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    bad = [a for a in chosen if a not in axes]
    if bad or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"{what}: mesh_axes={chosen!r} must be distinct domain axes of the mesh {axes}; got {bad or chosen}. "
            "The data axis is averaged by parallelize, never shared here."
        )
    return chosen


def share(value: torch.Tensor, mesh: DeviceMesh, *, mesh_axes: str | Sequence[str] | None = None) -> torch.Tensor:
    """Turn a value replicated over ``mesh_axes`` into this rank's share of it.

    The forward is the identity; the backward divides the gradient by the number of ranks along
    ``mesh_axes``. Use it on any loss computed from replicated tensors (e.g. from ``gather`` or a
    reduction) so that the per-rank losses sum to the global one, then call ``backward()`` on
    every rank.

    Args:
        value: a tensor computed identically on every rank along ``mesh_axes``.
        mesh: the mesh.
        mesh_axes: the domain axes over which ``value`` is replicated; default all domain axes.
            E.g. on a 2x2 mesh, a loss computed from a tensor reduced over H (replicated along
            ``"domain0"``) but still sharded along W (by ``"domain1"``) is a partial sum over
            ``"domain1"`` and a replica over ``"domain0"``: ``share(loss, mesh, mesh_axes="domain0")``.
    """
    axes = _mesh_axes(mesh, mesh_axes, "share")
    return _ShareGrad.apply(value, math.prod(axis_size(mesh, a) for a in axes))


def domain_sum(x: torch.Tensor, mesh: DeviceMesh, *, mesh_axes: str | Sequence[str] | None = None) -> torch.Tensor:
    """Sum of per-rank partial ``x`` over the domain ranks (replicated, autograd-aware).

    The result is a replicated value (see ``share``): its backward sums the per-rank partial
    gradients, so a loss built from it must be shared.

    Args:
        x: this rank's partial value (same shape on every rank).
        mesh: the mesh.
        mesh_axes: the domain axes to sum over; default all domain axes.
    """
    return all_reduce_sum(x, group_over(mesh, _mesh_axes(mesh, mesh_axes, "domain_sum")))


def _mean_acc(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Mean over all elements of the sharded tensor, in the accumulation dtype, not yet shared."""
    # float64 across ranks: the count is then an exact integer far beyond float32's 2**24, and
    # the partial sums (accumulated in at least float32 locally) lose nothing when added.
    local = x.sum(dtype=accumulation_dtype(x.dtype)).to(torch.float64)
    parts = torch.stack([local, local.new_tensor(float(x.numel()))])
    total = domain_sum(parts, mesh)
    return (total[0] / total[1]).to(accumulation_dtype(x.dtype))


def global_mean(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Mean of all elements of the sharded tensor whose local slab is ``x``: shared, ready for ``backward``.

    Equals ``share(reductions.mean(x, mesh, dims=None), mesh)`` in value and gradient, with any
    layout of ``x`` (it only needs the slabs to partition the tensor).
    """
    return share(_mean_acc(x, mesh), mesh).to(x.dtype)


def mse_loss(pred: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``F.mse_loss(pred_full, target_full)`` (mean reduction) from local slabs; shared."""
    _check_same_shape(pred, target, mesh, "mse_loss")
    diff = pred - target
    return share(_mean_acc(diff.to(accumulation_dtype(diff.dtype)).square(), mesh), mesh).to(diff.dtype)


def relative_l2(pred: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh, *, eps: float = 0.0) -> torch.Tensor:
    """Mean over the batch (dim 0) of ``||pred_i - target_i||_2 / ||target_i||_2`` per sample; shared."""
    _check_same_shape(pred, target, mesh, "relative_l2")
    b = pred.shape[0]
    diff = pred - target
    acc = accumulation_dtype(diff.dtype)
    err = diff.to(acc).square().reshape(b, -1).sum(1)
    ref = target.to(acc).square().reshape(b, -1).sum(1)
    total = domain_sum(torch.stack([err, ref]), mesh)
    return share((total[0].sqrt() / (total[1].sqrt() + eps)).mean(), mesh).to(diff.dtype)


def _check_same_shape(pred: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh, what: str) -> None:
    """Raise the same ``ValueError`` on every domain rank if any rank's slabs differ in shape."""
    group = domain_group(mesh)
    row = [int(pred.shape != target.shape), pred.dim(), target.dim()]
    for shape in (pred.shape, target.shape):
        shown = list(shape[:_SHOWN_NDIM])
        row += shown + [-1] * (_SHOWN_NDIM - len(shown))
    rows = all_gather_stacked(torch.tensor(row, dtype=torch.int64, device=comm_device(group)), group).tolist()
    if any(r[0] for r in rows):
        shapes = []
        for r in rows:
            p = tuple(r[3 : 3 + min(r[1], _SHOWN_NDIM)])
            t = tuple(r[3 + _SHOWN_NDIM : 3 + _SHOWN_NDIM + min(r[2], _SHOWN_NDIM)])
            shapes.append(f"{p} vs {t}")
        bad = [i for i, r in enumerate(rows) if r[0]]
        raise ValueError(
            f"{what}: pred and target slabs must have the same shape on every rank, but they differ on "
            f"domain rank(s) {bad}; (pred vs target) per domain rank: {shapes}. Shard both with the same "
            "dims and align."
        )
