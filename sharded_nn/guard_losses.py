"""Loss functions inside a converted model's own forward: the forward guard's loss calls.

A model written for one device often returns its loss (``forward(x, target)`` ending in
``F.mse_loss(y, target)``, a segmentation head's ``F.cross_entropy(logits, labels,
ignore_index=255)``). On slabs the local call runs and is silently wrong: ``mean`` divides by
this slab's count. The guard computes each such call as one device does: torch's own loss with
``reduction="none"`` on the slabs (exact, position by position, in the slabs' layout), then the
reduction over the whole sample through ``sharded_nn.reductions`` (``sum``; ``mean`` by the
global count, or by the global sum of the weights where torch divides by it: ``cross_entropy``
and ``nll_loss`` with class weights or ignored positions, ``mse_loss``/``l1_loss`` with
``weight``). The result is a replicated value with the library's gradient convention, as
``x.mean()`` in a forward gives: share it before ``backward`` (``sharded_nn.losses.share``), or
the backward warns where a rank seeds it with ones, and raises under ``convert(...,
strict=True)`` (``sharded_nn.losses``' check of replicated outputs). ``reduction="none"`` keeps the slabs' layout.

Refused alike on every rank: the class dim of ``cross_entropy``/``nll_loss`` sharded, a target
laid out unlike its input, operands whose layouts do not line up, and the losses called through ``torch``'s internal forms
(``torch._C._nn``, ``torch.binary_cross_entropy_with_logits``) rather than ``torch.nn.functional``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .comm import all_reduce_max
from .errors import ShardingError
from .mesh import domain_group

__all__ = ["LOSS_NAMES", "LossCalls"]

#: Elementwise losses -> how torch's ``mean`` divides: "count" (the number of elements) or
#: "weights" (the sum of ``weight`` where one is given: ``mse_loss``/``l1_loss``'s weighted form).
_ELEMENTWISE = {
    "mse_loss": "weights", "l1_loss": "weights", "huber_loss": "count", "smooth_l1_loss": "count",
    "binary_cross_entropy": "count", "binary_cross_entropy_with_logits": "count", "soft_margin_loss": "count",
    "poisson_nll_loss": "count", "gaussian_nll_loss": "count", "kl_div": "count",
}  # fmt: skip
#: Losses over a class dim (dim 1, or dim 0 of an unbatched input).
_CLASSES = frozenset(["cross_entropy", "nll_loss"])
LOSS_NAMES = frozenset(_ELEMENTWISE) | _CLASSES
#: The routed callables: ``torch.nn.functional``'s (which ``nn.MSELoss`` and the other modules call).
_FUNCS = {getattr(F, name): name for name in LOSS_NAMES}
#: Arguments of the legacy reduction form.
_LEGACY = ("size_average", "reduce")
#: Arguments torch's own dispatch leaves out: ``F.l1_loss`` passes ``weight`` to
#: ``handle_torch_function`` in its relevant tensors but not in its arguments (torch 2.14), so
#: under any torch function mode a weighted L1 loss would lose its weights, silently, even on
#: whole tensors. They are read back from ``F.l1_loss``'s own frame (``_restore_dropped``).
_DROPPED = {"l1_loss": ("weight",)}


class LossCalls:
    """The forward guard's loss handler (mixed into ``_GuardMode``)."""

    def _h_loss(self, func, base, args, kwargs, stateful):
        call = f"`F.{base}`"
        if base in _DROPPED and _FUNCS.get(func) == base:
            kwargs = _restore_dropped(base, kwargs)
        if not stateful:
            return self._plain_or_fail(func, base, args, kwargs, stateful)
        if _FUNCS.get(func) != base:
            self.fail(f"`{base}`", "this internal form of the loss is not routed over slabs",
                      f"call torch.nn.functional.{base}, which the guard routes")
        self._require_known(base, stateful)
        reduction = kwargs.get("reduction", "mean")
        if any(kwargs.get(k) is not None for k in _LEGACY):
            from torch.nn import _reduction

            reduction = _reduction.legacy_get_string(kwargs.get("size_average"), kwargs.get("reduce"))
        if reduction not in ("none", "mean", "sum") and not (base == "kl_div" and reduction == "batchmean"):
            return func(*args, **kwargs)  # torch's own error, alike on every rank
        if reduction != "none":
            self._routing(base)  # (refused inside torch.utils.checkpoint, before any collective)
        kw = {**kwargs, "reduction": "none", **{k: None for k in _LEGACY if k in kwargs}}
        if base in _CLASSES:
            out, st = self._loss_by_class(func, call, args, kw)
        else:
            out = self._local_loss(func, call, args, kw)
            st = self._broadcast(base, args, kw, out)
            if not isinstance(st, tuple):
                self.fail(call, "its operands' layouts do not line up (or the guard lost one)",
                          "give the input, the target and any weight the same layout")
        if reduction == "none":
            self._set(out, st)
            return out
        every = tuple(range(out.dim()))
        if reduction == "sum":
            return self._route_reduce("sum", out, every, False, st)
        if base in _CLASSES:
            return self._class_mean(out, st, args, kwargs)
        weight = kwargs.get("weight")
        if reduction == "batchmean":  # kl_div's: the sum over the (global) length of dim 0
            total = self._route_reduce("sum", out, every, False, st)
            if 0 in st:  # (tokens sharded along dim 0): their global count
                count = out.new_ones(out.shape[0])
                return total / self._route_reduce("sum", count, (0,), False, tuple(0 if d == 0 else None for d in st))
            return total / out.shape[0] if out.dim() else total
        if weight is not None and _ELEMENTWISE[base] == "weights":
            # torch: sum(weight * loss) / sum(weight); ``weight`` has the input's shape and layout.
            if self._st(weight) != st:
                self.fail(call, "its weight is not laid out as its input", "shard the weight with the input")
            total = self._route_reduce("sum", out, every, False, st)
            return total / self._route_reduce("sum", weight.detach(), every, False, st)
        return self._route_reduce("mean", out, every, False, st)

    def _loss_by_class(self, func, call: str, args, kw):
        """``cross_entropy``/``nll_loss`` with ``reduction="none"`` on the slabs, and the layout of
        the per-position losses: the input's with the class dim (1) dropped."""
        x = args[0] if args else kw.get("input")
        target = args[1] if len(args) > 1 else kw.get("target")
        st = self._st(x)
        if not isinstance(st, tuple):
            self.fail(call, "its input (the class scores) is not a slab while its target is",
                      "shard the scores with the target")
        class_dim = 1 if x.dim() > 1 else 0
        if class_dim in st:
            self.fail(call, f"it normalises over the class dim {class_dim}, which is sharded here",
                      "shard the spatial (or token) dims, not the classes")
        dropped = tuple(None if d is None else (d if d < class_dim else d - 1) for d in st)
        # Class probabilities (a floating target) have the input's shape; class indices its
        # shape without the class dim: either way laid out as the input.
        expected = st if target.is_floating_point() else dropped
        if self._st(target) != expected:
            self.fail(
                call, f"its target is laid out as {self.describe(self._st(target))} where its input's layout "
                f"asks for {self.describe(expected)}", "shard the target along the same spatial dims as the input",
            )
        weight = kw.get("weight")
        if weight is not None and self._st(weight) is not None:
            self.fail(call, "its class weights are a slab", "pass the class weights whole (one per class)")
        return self._local_loss(func, call, args, kw), dropped

    def _local_loss(self, func, call: str, args, kw):
        """torch's loss on this rank's slabs, where every rank learns whether some rank's raised.

        torch checks values (a class index out of range, a probability outside [0, 1], a
        negative variance): a bad value in one slab would raise on its rank alone and leave the
        others in the reduction's collective. One small all-reduce makes the error every rank's.
        """
        try:
            out, error = func(*args, **kw), None
        except (RuntimeError, ValueError, IndexError) as e:
            out, error = None, e
        device = next(t.device for t in (*args, *kw.values()) if isinstance(t, torch.Tensor))
        flag = torch.tensor([0.0 if error is None else 1.0], device=device)
        if float(all_reduce_max(flag, domain_group(self.guard.mesh))) > 0:
            here = f"{type(error).__name__}: {error}" if error is not None else "no error"
            try:
                self.fail(call, "torch's loss raised on the slab of at least one rank",
                          "check the values of the targets (and weights) there")
            except ShardingError as e:  # (the same message on every rank, then this rank's own cause)
                raise ShardingError(f"{e} This rank: {here}") from None
        return out

    def _class_mean(self, out, st, args, kwargs):
        """torch's ``mean`` of ``cross_entropy``/``nll_loss``: the sum of the losses over the sum of
        the weights of the targets counted (``weight[target]``, 1 without class weights; ignored
        positions count 0), or over the positions for class probabilities."""
        every = tuple(range(out.dim()))
        target = args[1] if len(args) > 1 else kwargs.get("target")
        if target.is_floating_point():
            return self._route_reduce("mean", out, every, False, st)
        acc = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
        counted = target != kwargs.get("ignore_index", -100)
        weight = kwargs.get("weight")
        if weight is None:
            weights = counted.to(acc)
        else:
            weights = weight.detach().to(acc)[torch.where(counted, target, 0)] * counted
        total = self._route_reduce("sum", out.to(acc), every, False, st)
        return (total / self._route_reduce("sum", weights, every, False, st)).to(out.dtype)


def _restore_dropped(base: str, kwargs: dict) -> dict:
    """``kwargs`` with the arguments torch's dispatch of ``F.<base>`` left out (``_DROPPED``), read
    from that function's frame, the nearest caller running its code."""
    code = getattr(F, base).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return kwargs
    found = {n: frame.f_locals[n] for n in _DROPPED[base] if kwargs.get(n) is None and frame.f_locals.get(n) is not None}
    return {**kwargs, **found} if found else kwargs
