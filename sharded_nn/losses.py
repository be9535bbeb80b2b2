"""Losses over sharded predictions, following the gradient convention.

The convention (DESIGN.md section 3): every rank runs the same backward and the *global* loss is
the **sum of the per-rank losses**. Each helper here returns a scalar whose *value* is the
single-device loss of the whole sample (the same on every rank, convenient for logging) and whose
*gradient* is this rank's share: call ``loss.backward()`` on every rank. That gives exact input
gradients and partial parameter gradients that ``parallelize`` sums. Calling ``backward`` on one
rank alone is therefore not the global gradient.

Helpers: ``mse_loss``, ``relative_l2``, ``dice_loss``, ``global_mean`` and ``global_sum`` return
shared losses; ``domain_sum`` returns a replicated value; ``global_loss_value`` averages a loss
over the data replicas for logging (detached). ``snn.batch_slice`` gives each data replica its
samples of the global batch.

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
import warnings
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_max, all_reduce_sum
from .errors import ShardingError, ShardingWarning
from .comm.peers import domain_peers
from .comm.ring_pass import gather_ints
from .mesh import axis_group, axis_size, data_axis, domain_axes, group_over
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


class _SeededOnce(torch.autograd.Function):
    """Identity on a replicated model output whose backward flags the seed of an unshared loss.

    A value replicated over ``ranks`` ranks (a loss a converted model returns, a pooled head's
    logits) counts once per rank under the gradient convention: ``out.backward()`` on every rank
    gives ``ranks`` times the gradient, silently. A rank seeding its backward with ones is that
    mistake (a shared loss seeds ``1/ranks``, a loss built further from the output other
    values): a ``ShardingWarning`` says so on that rank (a timing run that backs up
    ``out.sum()`` on purpose gets the warning only). With ``strict`` (``convert(...,
    strict=True)``) the ranks agree on it (one one-element all-reduce per backward; on a GPU also
    one host synchronisation) and all raise the same ``ShardingError`` where every rank seeded
    ones.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, ranks: int, what: str, strict: bool):  # noqa: D102
        ctx.group, ctx.ranks, ctx.what, ctx.strict = group, ranks, what, strict
        return x.clone()  # (not a view: a user may scale the logits in place, ``out.div_(t)``)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        ones = bool((g == 1).all())
        message = (
            f"backward: {ctx.what} is replicated over {ctx.ranks} domain ranks, and {{who}} seeded its backward "
            "with ones (backward() called on it directly). Under the gradient convention each rank counts a "
            f"replicated value once, so this is {ctx.ranks} times the single device's gradient. Expected a shared "
            "loss: call sharded_nn.losses.share(loss, mesh).backward() on every rank (or seed it with "
            f"1/{ctx.ranks} by hand); see the README, 'Gradient convention'."
        )
        if ctx.strict:
            unshared = torch.ones(1, device=g.device) if ones else torch.zeros(1, device=g.device)
            if float(-all_reduce_max(-unshared, ctx.group)) == 1:  # the minimum: every rank seeded ones
                raise ShardingError(message.format(who="every rank"))
        elif ones:
            warnings.warn(message.format(who="this rank"), ShardingWarning, stacklevel=2)
        return g, None, None, None, None


def check_seeded(value: torch.Tensor, group, ranks: int, what: str, strict: bool = False) -> torch.Tensor:
    """``value`` (replicated over the ``ranks`` ranks of ``group``) with ``_SeededOnce``'s check on its backward."""
    return _SeededOnce.apply(value, group, ranks, what, strict)


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
    # ``new_full``, not ``new_tensor``: a fill kernel, where a copy of a host number would stall
    # a GPU at every loss (a copy from pageable memory waits for the stream).
    parts = torch.stack([local, local.new_full((), float(x.numel()))])
    total = domain_sum(parts, mesh)
    return (total[0] / total[1]).to(accumulation_dtype(x.dtype))


def global_mean(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Mean of all elements of the sharded tensor whose local slab is ``x``: shared, ready for ``backward``.

    Equals ``share(reductions.mean(x, mesh, dims=None), mesh)`` in value and gradient, with any
    layout of ``x`` (it only needs the slabs to partition the tensor).
    """
    return share(_mean_acc(x, mesh), mesh).to(x.dtype)


def global_sum(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of all elements of the sharded tensor whose local slab is ``x``: a loss, shared.

    The value is the single-device ``x_full.sum()`` on every rank; the gradient is this rank's
    share, so ``global_sum(x, mesh).backward()`` on every rank gives each element of ``x`` the
    gradient 1, as on one device. There is no ``share`` to forget: the helper applies it. For a
    sum that feeds further computation (a normaliser, a value), use ``domain_sum`` of a local
    sum or ``snn.reductions.sum``, which return replicated *values*.
    """
    return share(domain_sum(x.sum(dtype=accumulation_dtype(x.dtype)), mesh), mesh).to(x.dtype)


def dice_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    mesh: DeviceMesh,
    *,
    smooth_nr: float = 1e-5,
    smooth_dr: float = 1e-5,
    squared_pred: bool = False,
    include_background: bool = True,
    reduction: str = "mean",
) -> torch.Tensor:
    """Soft Dice loss of a sharded segmentation, per sample and class, from local slabs; shared.

    ``1 - (2 * sum(p * t) + smooth_nr) / (sum(p) + sum(t) + smooth_dr)`` with the sums over every
    spatial position of the *whole* sample (MONAI's ``DiceLoss`` formula and defaults), one value
    per (sample, class). The three sums are taken on the slab and summed over the domain ranks
    in one all-reduce, so any layout of the spatial dims works.

    Args:
        pred: ``(N, C, S...)`` slab of class probabilities (apply ``softmax``/``sigmoid`` over C
            first: it is pointwise, so it runs on the slab unchanged).
        target: the same slab of the labels: ``(N, C, S...)`` one-hot or soft labels, or integer
            class indices ``(N, S...)`` / ``(N, 1, S...)`` (one-hot over the C of ``pred``; an
            index outside ``[0, C)`` matches no class).
        mesh: the mesh.
        smooth_nr: added to the numerator (keeps an empty class's Dice finite).
        smooth_dr: added to the denominator.
        squared_pred: sum ``p**2`` and ``t**2`` in the denominator (the V-Net form).
        include_background: keep class 0; ``False`` drops it.
        reduction: ``"mean"`` (over samples and classes), ``"sum"``, or ``"none"`` (the ``(N, C)``
            losses, each shared: reduce them with ``mean``/``sum`` before ``backward``).

    Returns:
        The loss: its value is the single-device loss of the whole sample on every rank, its
        gradient this rank's share (call ``backward()`` on every rank; DESIGN.md section 3).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"dice_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    if pred.dim() < 3:
        raise ValueError(f"dice_loss: pred must be (N, C, S...) with spatial dims, got shape {tuple(pred.shape)}.")
    classes = pred.shape[1]
    as_indices = target.dim() == pred.dim() - 1 or (target.dim() == pred.dim() and target.shape[1] == 1 < classes)
    if not target.is_floating_point() and as_indices:
        labels = target if target.dim() == pred.dim() - 1 else target.squeeze(1)
        # A comparison, not F.one_hot: an out-of-range label on one rank must not raise there alone.
        ids = torch.arange(classes, device=labels.device).view(1, classes, *(1,) * (labels.dim() - 1))
        target = labels.unsqueeze(1) == ids
    _check_same_shape(pred, target, mesh, "dice_loss")
    acc = accumulation_dtype(pred.dtype)
    p, t = pred.to(acc), target.to(acc)
    if not include_background:
        p, t = p[:, 1:], t[:, 1:]
    spatial = tuple(range(2, p.dim()))
    local = torch.stack([(p * t).sum(spatial), (p.square() if squared_pred else p).sum(spatial),
                         (t.square() if squared_pred else t).sum(spatial)])  # (3, N, C)
    inter, p_sum, t_sum = domain_sum(local, mesh)
    loss = 1 - (2 * inter + smooth_nr) / (p_sum + t_sum + smooth_dr)
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    return share(loss, mesh).to(pred.dtype)


def global_loss_value(loss: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The loss of the whole global batch, for logging: the mean of ``loss`` over the data replicas.

    ``loss`` is a loss helper's result (its value is already global over the domain ranks, the
    mean over this replica's samples). Replicas hold equal numbers of samples (``batch_slice``),
    so their mean is the global batch's loss, the number single-device training on that batch
    would log. Returns a detached tensor, the same on every rank; without a data axis it is
    ``loss.detach()``. One all-reduce over the data axis: call it on every rank.
    """
    value = loss.detach()
    axis = data_axis(mesh)
    if axis is None or axis_size(mesh, axis) == 1:
        return value
    total = all_reduce_sum(value.to(accumulation_dtype(value.dtype)), axis_group(mesh, axis))
    return (total / axis_size(mesh, axis)).to(value.dtype)


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
    row = [int(pred.shape != target.shape), pred.dim(), target.dim()]
    for shape in (pred.shape, target.shape):
        shown = list(shape[:_SHOWN_NDIM])
        row += shown + [-1] * (_SHOWN_NDIM - len(shown))
    # On the CPU over gloo (``gather_ints``): a gather of device tensors read back with
    # ``tolist`` would synchronise the GPU at every loss; with one rank nothing travels.
    rows = [list(r) for r in gather_ints(row, domain_peers(mesh))]
    if any(r[0] for r in rows):
        raise ValueError(_shape_mismatch_message(rows, what))


def _shape_mismatch_message(rows: list[list[int]], what: str) -> str:
    """Say which dims differ between pred and target, and whether the split or the size differs.

    ``rows`` are every domain rank's ``[differs, ndim_pred, ndim_target, pred_shape..., target_shape...]``.
    """
    pred = [tuple(r[3 : 3 + min(r[1], _SHOWN_NDIM)]) for r in rows]
    target = [tuple(r[3 + _SHOWN_NDIM : 3 + _SHOWN_NDIM + min(r[2], _SHOWN_NDIM)]) for r in rows]
    bad = [i for i, r in enumerate(rows) if r[0]]
    shapes = [f"{p} vs {t}" for p, t in zip(pred, target)]
    head = (
        f"{what}: pred and target slabs must have the same shape on every rank, but they differ on domain "
        f"rank(s) {bad}; (pred vs target) per domain rank: {shapes}."
    )
    if len({(r[1], r[2]) for r in rows}) != 1 or rows[0][1] != rows[0][2]:
        return f"{head} pred has {rows[0][1]} dims and target {rows[0][2]}: compute both for the same tensor layout."
    details = []
    for d in range(min(rows[0][1], _SHOWN_NDIM)):
        p_sizes = [s[d] for s in pred]
        t_sizes = [s[d] for s in target]
        if p_sizes == t_sizes:
            continue
        if sum(p_sizes) == sum(t_sizes):
            # Both cover the same global size: only the split differs. A model whose layers move
            # rows between ranks (an explicit pad + unpadded conv) leaves a drifted layout.
            details.append(
                f"along dim {d} the slab sizes differ (pred {p_sizes}, target {t_sizes} by rank) while the "
                "totals agree: the two are split differently. If the target was cut with snn.local_slices, the "
                f"model's output layout drifted: rebalance pred with snn.reshard(pred, mesh, dims=({d},)) or cut "
                f"the target with snn.local_slices(pred, mesh, dims=({d},))"
            )
        elif (len(set(p_sizes)) == 1) != (len(set(t_sizes)) == 1):
            same, other = ("pred", "target") if len(set(p_sizes)) == 1 else ("target", "pred")
            details.append(
                f"along dim {d} {same} has the same size on every rank and {other} does not (pred {p_sizes}, "
                f"target {t_sizes} by rank): Shard both with the same dims and align"
            )
        elif len(set(p_sizes)) == 1 and len(set(t_sizes)) == 1:
            details.append(
                f"along dim {d} pred has size {p_sizes[0]} and target {t_sizes[0]} on every rank: the model "
                "output does not have the target's size"
            )
        else:
            details.append(
                f"along dim {d} the slab sizes differ (pred {p_sizes}, target {t_sizes} by rank) and so do the "
                "global sizes: the model output does not have the target's size (e.g. a convolution without "
                "padding shrinks the sharded dim)"
            )
    return f"{head} {'; '.join(details)}." if details else head
