"""Positions picked by index tensors along sharded dims inside a converted model's forward.

Sensor and station readings, probe points and the rows a loss compares: ``u[:, :, iy, ix]``
with plain index tensors (the same on every rank), ``u[:, :, [0, -1]]``, ``u.index_select(2,
rows)``. On a slab the local call reads the slab's own rows at those numbers (or raises where
they pass its end on some ranks only); the guard refused it as advanced indexing before session 63.
Now each position is read from the rank that owns it: every rank indexes its slab at the
positions it holds (global positions less its start, the others clamped into range and masked
to zero), and one all-reduce over the indexed dims' mesh axes sums the owners' values, as
``x[:, 0]`` already was. The result is the single device's, replicated along the indexed axes
(a dim that no index names stays sharded where the rules of advanced indexing keep its place);
the gradient reaches each position's owner (the library's convention for replicated results).

Refused alike on every rank: an index tensor that is itself a slab (it differs by rank), boolean
masks (a result of data-dependent length), an index mixing integers, ``None`` or partial slices
with the index tensors. Indices out of range raise torch's ``IndexError`` on every rank (the
positions are checked against the global length, which every rank knows).
"""

from __future__ import annotations

import torch

from . import forward_guard as fg

__all__ = ["PickCalls"]


class PickCalls:
    """The forward guard's picking of positions along sharded dims (mixed into ``_GuardMode``)."""

    def _pick_global(self, x, st, items):
        """``x[items]`` where ``items`` index sharded dims of ``x`` with plain integer tensors or
        lists (every other item a whole slice or one ``...``), or None where they do not."""
        if type(st) is not tuple or sum(1 for i in items if i is Ellipsis) > 1:
            return None
        if any(i is None or isinstance(i, (bool, int)) or (isinstance(i, slice) and not fg._full_slice(i))
               for i in items if i is not Ellipsis):
            return None
        n_real = sum(1 for i in items if i is not Ellipsis)
        expanded: list = []
        for i in items:
            expanded += [slice(None)] * (x.dim() - n_real) if i is Ellipsis else [i]
        if len(expanded) > x.dim():
            return None
        expanded += [slice(None)] * (x.dim() - len(expanded))
        adv = [d for d, i in enumerate(expanded) if isinstance(i, (torch.Tensor, list, tuple))]
        hit = [d for d in adv if d in st]
        if not hit:
            return None
        index = {}
        for d in adv:
            i = expanded[d]
            if isinstance(i, torch.Tensor):
                if self.states.get(i) is not None or fg._is_tagged(i):
                    self.fail("indexing", f"the positions along dim {d} are a slab (they differ by rank)",
                              "index by a plain tensor, the same on every rank")
                if i.dtype == torch.bool or i.is_floating_point() or i.is_complex():
                    return None
                index[d] = i.to(x.device)
            else:
                if not all(fg._plain_int(v) and type(v) is int for v in i):
                    return None
                index[d] = torch.tensor(list(i), dtype=torch.long, device=x.device)
        self._routing("indexing")
        spans = dict(zip(hit, self._axis_span(x, st, hit, "positions picked by index tensors")))
        shape = torch.broadcast_shapes(*(t.shape for t in index.values()))
        owned = torch.ones(shape, dtype=torch.bool, device=x.device)
        src = x
        for d in hit:
            s0, n, total = spans[d]
            g = index[d].long()
            if bool(((g < -total) | (g >= total)).any()):
                bad = int(g[(g < -total) | (g >= total)][0])
                raise IndexError(f"index {bad} is out of bounds for dimension {d} with size {total}")
            g = torch.where(g < 0, g + total, g)
            owned = owned & (g >= s0) & (g < s0 + n)
            if n == 0:
                # No rows here: read a zero row (masked anyway), still through ``x``'s graph.
                src = torch.cat([src, src.new_zeros([*src.shape[:d], 1, *src.shape[d + 1:]])], d)
            index[d] = (g - s0).clamp(0, max(n - 1, 0))
        picked = src[tuple(index.get(d, expanded[d]) for d in range(x.dim()))]
        contiguous = adv == list(range(adv[0], adv[-1] + 1))
        at = adv[0] if contiguous else 0  # where torch puts the index dims in the result
        mask = owned.view([1] * at + list(shape) + [1] * (picked.dim() - at - len(shape)))
        picked = torch.where(mask, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
        from .comm import all_reduce_sum
        from .mesh import group_over

        summed = {st.index(d) for d in hit}  # (in the mesh's order: a group over axes names them so)
        axes = [a for k, a in enumerate(self.guard.axes) if k in summed]
        out = all_reduce_sum(picked, group_over(self.guard.mesh, axes))
        rest = [d for d in range(x.dim()) if d not in adv]

        def place(d):  # the result's dim of ``x``'s dim ``d``, which no index names
            if contiguous:
                return d if d < adv[0] else d - len(adv) + len(shape)
            return len(shape) + rest.index(d)

        state = tuple(None if (e is None or e in adv) else place(e) for e in st)
        self._set(out, None if all(e is None for e in state) else state)
        return out
