"""Similarities and distances inside a converted model's forward: ``F.cosine_similarity``,
``F.pairwise_distance``, ``torch.dist`` and ``F.one_hot`` on slabs.

Feature-similarity maps (cosine similarity along channels), contrastive and perceptual terms
and segmentation losses (``F.one_hot(labels, C)`` of a label slab) call these in a forward
written for one device. Each reduces along one dim (or, ``torch.dist``, over all of them) of the
broadcast operands, or adds one: along unsharded dims torch's own call on the slabs is exact;
along a sharded dim the guard computes torch's own formula with the norms and sums over the
whole sample (``sharded_nn.reductions``), so the result is the single device's, a slab or a
replicated value as the remaining dims say. The operands' layouts are checked as in any
pointwise call (two slabs line up, a plain operand broadcasts with size 1 along sharded dims).

``one_hot`` without ``num_classes`` infers the count from the largest label of the whole sample
(one all-reduce), as one device does from the whole tensor; each slab's own maximum gave ranks
tensors of different widths before (refused). A negative label, or one past ``num_classes``,
raises torch's error on every rank.
"""

from __future__ import annotations

import torch

from . import forward_guard as fg
from . import reductions

__all__ = ["DistanceCalls"]


class DistanceCalls:
    """The forward guard's similarity, distance and one-hot handlers (mixed into ``_GuardMode``)."""

    def _operands(self, base, x1, x2):
        """``x1``, ``x2`` broadcast to one shape (each, as torch's ``expand_outplace``), and their layout."""
        e1, e2 = torch.broadcast_tensors(x1, x2)
        st = self._broadcast(base, (x1, x2), {}, e1)
        if st is fg.UNKNOWN or type(st) in fg.FOLDED:
            self.fail(f"`{base}`", f"an operand is {self.describe(st)}", "")
        return e1, e2, st

    def _h_similarity(self, func, base, args, kwargs, stateful):
        if not stateful:
            return self._plain_or_fail(func, base, args, kwargs, stateful)
        self._require_known(base, stateful)
        mesh = self.guard.mesh
        if base == "dist":  # torch.dist(input, other, p=2): the p-norm of the difference, over all elements
            x1, x2 = fg._arg(args, kwargs, 0, "input"), fg._arg(args, kwargs, 1, "other")
            p = fg._arg(args, kwargs, 2, "p", 2)
            e1, e2, st = self._operands(base, x1, x2)
            if st is None:
                return func(*args, **kwargs)
            self._routing(base)
            out = reductions.norm(e1 - e2, mesh, None, p, sharded_dims=self._leading_dims(base, st))
            self._set_reduced(out, tuple(range(e1.dim())), False, st)
            return out
        x1, x2 = fg._arg(args, kwargs, 0, "x1"), fg._arg(args, kwargs, 1, "x2")
        e1, e2, st = self._operands(base, x1, x2)
        nd = e1.dim()
        if base == "cosine_similarity":
            dim = fg._arg(args, kwargs, 2, "dim", 1)
            eps = fg._arg(args, kwargs, 3, "eps", 1e-8)
            keepdim = False
        else:  # pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False): along the last dim
            p = fg._arg(args, kwargs, 2, "p", 2.0)
            eps = fg._arg(args, kwargs, 3, "eps", 1e-6)
            keepdim = bool(fg._arg(args, kwargs, 4, "keepdim", False))
            dim = nd - 1
        dim = fg._norm_dims(dim, nd)[0] if nd else 0
        if st is None:
            return func(*args, **kwargs)
        if dim not in st:
            return self._unrouted(func, args, kwargs, (dim,), keepdim, st)
        self._routing(base)
        active = self._leading_dims(base, st)
        if base == "pairwise_distance":
            out = reductions.norm(e1 - e2 + eps, mesh, (dim,), p, keepdim=keepdim, sharded_dims=active)
        else:
            # torch's own formula (ATen ``cosine_similarity``): each operand divided by its norm
            # along ``dim``, clamped below by ``eps`` outside autograd, then the sum of the products.
            if not e1.is_floating_point():
                common = torch.result_type(x1, x2)
                e1, e2 = e1.to(common), e2.to(common)
            n1 = reductions.norm(e1, mesh, (dim,), 2, keepdim=True, sharded_dims=active).clone()
            n2 = reductions.norm(e2, mesh, (dim,), 2, keepdim=True, sharded_dims=active).clone()
            with torch.no_grad():
                n1.clamp_min_(eps)
                n2.clamp_min_(eps)
            out = reductions.sum((e1 / n1) * (e2 / n2), mesh, (dim,), sharded_dims=active)
        self._set_reduced(out, (dim,), keepdim, st)
        return out

    def _h_one_hot(self, func, base, args, kwargs, stateful):
        x = fg._arg(args, kwargs, 0, "input")
        st = self._st(x) if isinstance(x, torch.Tensor) else None
        if st is None:
            return self._plain_or_fail(func, base, args, kwargs, stateful)
        self._require_known(base, stateful)
        if type(st) in fg.FOLDED:
            self.fail("`one_hot`", f"its labels are {self.describe(st)}", "")
        n = fg._arg(args, kwargs, 1, "num_classes", -1)
        # The whole sample's smallest and largest labels (one all-reduce): one device infers the
        # class count from the largest, and raises on a negative label or one past
        # ``num_classes``, which a slab holds on some ranks only (they raised alone: a hang).
        self._routing("one_hot")
        from .comm import all_reduce_max
        from .mesh import group_over

        axes = [a for a, d in zip(self.guard.axes, st) if d is not None]
        low = torch.iinfo(torch.int64).min
        local = torch.stack([x.amax(), -x.amin()]) if x.numel() else torch.tensor([low, low], device=x.device)
        top, neg = (int(v) for v in all_reduce_max(local.long(), group_over(self.guard.mesh, axes)).tolist())
        if -neg < 0 or (n != -1 and top >= n):
            func(torch.tensor([-neg if -neg < 0 else top], device=x.device), n)  # torch's own error, alike
        out = func(x, top + 1 if n == -1 else n)
        self._set(out, st)  # the class dim is appended: the slab's dims keep their places
        return out
