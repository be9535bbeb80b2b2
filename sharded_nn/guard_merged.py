"""Slabs of several mesh axes flattened into one dim: the forward guard's "merged" layout.

Attention written for one device flattens the grid into tokens, ``x.flatten(2).transpose(1, 2)``
of ``(B, C, H, W)``. With one domain axis sharding ``H``, this rank's tokens are one contiguous
run of the single device's sequence (an ordinary slab). On a 2-D domain mesh sharding ``H`` and
``W`` they are not: this rank's ``(h, w)`` block, flattened row-major, is ``h`` runs of ``w``
tokens with the other ranks' tokens between them on one device. The guard follows this as
``Merged``:

    dim ``dim`` holds ``outer`` blocks, each this rank's parts of the sharded dims of mesh axes
    ``axes`` (outermost first; local lengths ``lengths``) times ``inner``, flattened row-major.

Every position of that dim lies on one rank, so the calls that keep its rows apart are exact as
on a fold (``guard_folds``, the same whitelist; window partitions of a batch on a 2-D mesh are
merged dims with ``outer`` > 1). Where ``outer`` is 1 (the tokens of one sample), the ranks'
rows are a partition of the single device's rows, and the calls along the dim that do not
depend on their order are exact too:

- sums and means over it: the local sum, summed over the merged axes' ranks;
- attention over keys along it: ring attention over the merged axes' ranks (each query's output
  depends only on the set of keys, not their order);
- an operand needed whole (the keys of attention written out, ``q @ k.transpose(-2, -1)``, then
  the values of ``probs @ v``): gathered and reassembled into the single device's order, so that
  what follows (a softmax over the keys, a bias table of the whole sequence) sees the single
  device's keys; other reductions along the dim (softmax over it, ``amax``, ``var``, ...) run on
  the gathered whole and keep this rank's block where the dim stays.

Views unflatten it back into slabs (``t.transpose(1, 2).reshape(b, c, h, w)`` with ``h, w`` read
from the slab) or move it (heads split off). Anything else along the dim (indexing or cropping
it, a class token concatenated in front, positions counted by it, a tensor created with its
size) is refused on every rank. Decisions depend on the layout and on shapes with each sharded
factor scaled by a probe prime of its own, the same on every rank whatever its lengths; the
local ``lengths`` only shape the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from . import forward_guard as fg

__all__ = ["Merged", "MergedCalls", "map_merged_reshape", "merged_of_reshape"]

#: Probe factors, one per merged axis (primes no real size shares), so that two sharded factors
#: scaled together still group apart.
_PRIMES = (1_000_003, 1_000_033, 1_000_037, 1_000_039)


@dataclass(frozen=True)
class Merged:
    """Layout state: dim ``dim`` holds ``outer`` blocks of (this rank's parts of the sharded dims
    of mesh axes ``axes``, outermost first, of local lengths ``lengths``) x ``inner``, flattened
    row-major; ``naxes``: the number of domain axes (the length of a slab state tuple)."""

    axes: tuple
    dim: int
    # (Not compared: two states are one layout whatever this rank's lengths, so that every rank
    # decides alike; where two operands must hold the same positions, the lengths are checked
    # on every rank alike: ``_same_positions``.)
    lengths: tuple = field(compare=False)
    outer: int
    inner: int
    naxes: int
    #: Plain rows in front of the owner's block (class and register tokens: ``torch.cat((cls,
    #: x), dim=1)``): the owner, the rank at coordinate 0 along every merged axis, holds them
    #: before its block, as the single device holds them before the grid's tokens.
    prefix: int = 0

    @property
    def axis(self) -> int:
        """The axis the merged dim's sizes are tagged with (``MergedLength``; its ``axes`` say all)."""
        return self.axes[0]

    @property
    def slab(self) -> tuple:
        """A slab state with every merged axis on the merged dim (the random stream's key, dim maps)."""
        return tuple(self.dim if k in self.axes else None for k in range(self.naxes))

    @property
    def tokens(self) -> bool:
        """Whether its rows partition the single device's rows of one dim (``outer`` == 1)."""
        return self.outer == 1

    def at(self, dim: int) -> Merged:
        return replace(self, dim=dim)

    def length(self, n: int):
        return fg.MergedLength(n, self.axes)

    def describe(self, axes) -> str:
        names = ", ".join(repr(axes[k]) for k in self.axes)
        what = ("tokens of a multi-axis domain mesh" if self.tokens
                else f"{self.outer} blocks: windows of several samples")
        front = f", {self.prefix} plain rows in front on the first rank" if self.prefix else ""
        return (f"dim {self.dim} merging the slabs of mesh axes ({names}) into one ({what}{front}), whose rows are "
                "not one block of the single device's")

    #: What the guard computes on such a tensor (for messages).
    allowed = ("pointwise calls, linear layers and norms over other dims, views that move it or unflatten it back "
               "into the grid, and (tokens of one sample) sums and means over it, attention over it and operands "
               "gathered whole along it")
    todo = "Reshape the tokens back into the grid first, or shard the domain along one mesh axis"

    def factors(self) -> list:
        """The merged dim's sizes written out: ``[outer], *lengths, [inner]`` (ones left out)."""
        outer = [self.outer] if self.outer != 1 else []
        return outer + list(self.lengths) + ([self.inner] if self.inner != 1 else [])

    def virtual(self, shape) -> tuple:
        """``(shape, state)``: ``shape`` with the merged dim written as its factors, and the slab
        state of that virtual tensor (axis ``axes[i]`` on its factor)."""
        fd = self.dim
        first = fd + (self.outer != 1)
        st = [None] * self.naxes
        for i, k in enumerate(self.axes):
            st[k] = first + i
        return (*shape[:fd], *self.factors(), *shape[fd + 1 :]), tuple(st)


# ------------------------------------------------------------------------------- views


def _merged_request_dim(request, axes) -> int | None:
    """The output dim of a view request that takes the merged factors: the one size computed
    from the slab lengths of exactly these axes (``h * w``) or read from a merged dim of them, or
    else (no size read from slabs) the one -1."""
    axes = set(axes)

    def covers(v) -> bool:
        leaves = v._leaves or ()
        seen = set()
        for leaf in leaves:
            if isinstance(leaf, fg.MergedLength):
                seen |= set(leaf.axes)
            elif isinstance(leaf, fg.FoldLength) or not isinstance(leaf, fg.LocalLength):
                return False
            else:
                seen.add(leaf.axis)
        return bool(leaves) and seen == axes

    tagged = [o for o, v in enumerate(request) if fg._is_tagged(v)]
    named = [o for o in tagged if covers(request[o])]
    if len(named) == 1 and len(tagged) == 1:
        return named[0]
    if not tagged and list(request).count(-1) == 1:
        return list(request).index(-1)
    return None


def merged_of_reshape(in_shape, out_shape, st, request):
    """The ``Merged`` layout a view makes of a slab sharded along several mesh axes (state
    ``st``) where their dims merge into the one output dim the request names
    (``_merged_request_dim``), or ``UNKNOWN``. Unsharded dims may merge with them before
    (``outer``: a batch of windows) and after (``inner``), not between them. Decided on the
    shapes with each sharded dim scaled by its own probe prime."""
    sharded = sorted((d, k) for k, d in enumerate(st) if d is not None)
    if len(sharded) < 2 or len(sharded) > len(_PRIMES) or 0 in in_shape or request is None:
        return fg.UNKNOWN
    if len(request) != len(out_shape):
        return fg.UNKNOWN
    o = _merged_request_dim(request, [k for _, k in sharded])
    if o is None:
        return fg.UNKNOWN
    in_p, out_p = list(in_shape), list(out_shape)
    for (d, _), p in zip(sharded, _PRIMES):
        in_p[d] *= p
    out_p[o] *= math.prod(_PRIMES[: len(sharded)])
    dims = [d for d, _ in sharded]
    group = next(((gi, go) for gi, go in fg._groups(tuple(in_p), tuple(out_p)) if dims[0] in gi), None)
    if group is None:
        return fg.UNKNOWN
    gi, go = group
    if any(d not in gi for d in dims) or [j for j in go if out_p[j] != 1] != [o]:
        return fg.UNKNOWN
    if any(in_shape[j] != 1 for j in gi if dims[0] < j < dims[-1] and j not in dims):
        return fg.UNKNOWN  # an unsharded dim between two sharded ones: not one block per rank
    outer = math.prod(in_shape[j] for j in gi if j < dims[0])
    inner = math.prod(in_shape[j] for j in gi if j > dims[-1])
    return Merged(tuple(k for _, k in sharded), o, tuple(int(in_shape[d]) for d in dims), outer, inner, len(st))


def map_merged_reshape(in_shape, out_shape, merged: Merged, request):
    """The layout after a view of a merged tensor: a slab state (the view unflattens the merged
    dim into one dim per axis, each named by a size read from that axis' slab: ``t.reshape(b, c,
    h, w)``), a ``Merged`` (it moves the dim or splits and merges others around it:
    ``qkv.reshape(b, n, 3, heads, c // heads)``), or ``UNKNOWN``. Mapped on the virtual shape with
    the merged dim written as its factors."""
    if merged.prefix:
        return _moved_whole(in_shape, out_shape, merged, request)
    if in_shape[merged.dim] != math.prod(merged.factors()) or 0 in in_shape:
        return fg.UNKNOWN
    virtual, st = merged.virtual(in_shape)
    if request is not None and len(request) == len(out_shape):
        named = [fg._sharded_request_dim(request, k) for k in merged.axes]
        if all(o is not None for o in named) and len(set(named)) == len(named):
            mapped = fg._map_reshape(virtual, tuple(out_shape), st, request)
            if mapped is not fg.UNKNOWN and all(mapped[k] == o for k, o in zip(merged.axes, named)):
                return mapped
    return merged_of_reshape(virtual, tuple(out_shape), st, request)


def _moved_whole(in_shape, out_shape, merged: Merged, request):
    """A view of a merged dim with plain rows in front: followed only where it keeps that dim
    whole as one output dim (heads split off around it: ``qkv.reshape(b, n, 3, h, d)``), named
    by the request (its size read from the dim, or the -1); decided on the shapes with the dim
    scaled by a probe prime."""
    if request is None or len(request) != len(out_shape) or 0 in in_shape:
        return fg.UNKNOWN
    o = _merged_request_dim(request, merged.axes)
    if o is None:
        return fg.UNKNOWN
    in_p, out_p = list(in_shape), list(out_shape)
    in_p[merged.dim] *= _PRIMES[0]
    out_p[o] *= _PRIMES[0]
    group = next(((gi, go) for gi, go in fg._groups(tuple(in_p), tuple(out_p)) if merged.dim in gi), None)
    if group is None or [j for j in group[0] if in_p[j] != 1] != [merged.dim]:
        return fg.UNKNOWN
    if [j for j in group[1] if out_p[j] != 1] != [o]:
        return fg.UNKNOWN
    return merged.at(o)


# ------------------------------------------------------------------------------- calls


class MergedCalls:
    """The guard mode's calls along a merged dim (a mixin of ``forward_guard._GuardMode``; the
    calls that keep its rows apart are ``guard_folds.FoldCalls``')."""

    # -- the whole merged dim, in the single device's order

    def _merged_grid(self, merged: Merged, call: str):
        """``(group, coords, sizes, index)`` for ``comm.all_gather_grid`` over the ranks of the
        merged axes that share this rank's other coordinates: every rank's lengths of the merged
        factors (one small all-gather), checked to tile the grid (the lengths along an axis the
        same for every coordinate of the others) alike on every rank."""
        from .mesh import group_over

        if not merged.tokens:
            self._fold_fail(call.strip("`"), merged,
                            "its rows hold windows of several samples, which have no single order")
        n = len(self.guard.axes)
        rows = self._gather_with_coords(list(merged.lengths), f"forward guard: {call} (whole merged dim)")
        mine = [fg.axis_index(self.guard.mesh, a) for a in self.guard.axes]
        rows = [r for r in rows if all(r[i] == mine[i] for i in range(n) if i not in merged.axes)]
        sizes = []
        for i, k in enumerate(merged.axes):
            per = {}
            for r in rows:
                per.setdefault(r[k], set()).add(r[n + i])
            if any(len(v) != 1 for v in per.values()):
                self._fold_fail(call.strip("`"), merged, f"its slabs along mesh axis {self.guard.axes[k]!r} differ "
                                "in length across the other axes (not one grid of blocks)")
            sizes.append([next(iter(per[c])) for c in sorted(per)])
        order = sorted(merged.axes)  # the group's ranks: row-major over the axes in mesh order
        ranked = sorted(rows, key=lambda r: [r[k] for k in order])
        coords = [[r[k] for k in merged.axes] for r in ranked]
        index = next(j for j, r in enumerate(ranked) if all(r[k] == mine[k] for k in order))
        group = group_over(self.guard.mesh, [self.guard.axes[k] for k in order])
        return group, coords, sizes, index

    def _gather_merged(self, t: torch.Tensor, call: str, grid_out: list | None = None) -> torch.Tensor:
        """The whole of ``t`` along its merged dim, in the single device's order (a plain
        tensor); differentiable (its backward sums the ranks' gradients and keeps this rank's
        block)."""
        from .comm import all_gather_grid

        merged = self.states.get(t)
        self._routing(call)
        grid = self._merged_grid(merged, call)
        if grid_out is not None:
            grid_out.append(grid)  # (for ``_own_block`` of this tensor's layout: no second gather)
        group, coords, sizes, index = grid
        first = merged.dim
        head = None
        if merged.prefix:
            # The plain rows in front: the owner's, summed over the ranks (zeros elsewhere).
            head = self._from_owner(t, merged, lambda src: src.narrow(first, 0, merged.prefix), group)
            if self._owner(merged):
                t = t.narrow(first, merged.prefix, t.shape[first] - merged.prefix)
        virtual, _ = merged.virtual(tuple(t.shape))
        dims = tuple(range(first, first + len(merged.axes)))
        full = all_gather_grid(t.reshape(virtual), group, dims, coords, sizes, index)
        out = full.flatten(first, first + len(merged.factors()) - 1)
        if head is not None:
            out = torch.cat([head, out], first)
        self.states.pop(out, None)
        return out

    def _owner(self, merged: Merged) -> bool:
        """Whether this rank holds the plain rows in front (coordinate 0 along every merged axis)."""
        return all(fg.axis_index(self.guard.mesh, self.guard.axes[k]) == 0 for k in merged.axes)

    def _from_owner(self, t: torch.Tensor, merged: Merged, pick, group) -> torch.Tensor:
        """``pick(t)`` of the owner's rows in front, on every rank: the owner's, summed over the
        merged axes' ranks with zeros elsewhere (every rank runs the same differentiable sum, so
        the backward's sums pair up too; the gradient reaches the owner's rows)."""
        from .comm import all_reduce_sum

        if self._owner(merged):
            src = t
        else:
            shape = list(t.shape)
            shape[merged.dim] = merged.prefix
            src = t.new_zeros(shape).requires_grad_(t.requires_grad)
        return all_reduce_sum(pick(src), group)

    def _own_block(self, full: torch.Tensor, dim: int, merged: Merged, call: str, whole: bool = False,
                   grid=None) -> torch.Tensor:
        """This rank's block of ``full`` (a plain tensor whose dim ``dim`` holds the whole merged
        dim in the single device's order), merged as ``merged`` at ``dim``. ``whole``: check
        that it does (else refuse alike: a plain operand of another length along the dim)."""
        _, coords, sizes, index = grid if grid is not None else self._merged_grid(merged, call)
        grid = [sum(s) for s in sizes]
        p = merged.prefix
        if whole and full.shape[dim] != p + math.prod(grid) * merged.inner:
            self._fold_fail(call.strip("`"), merged, f"a plain operand has {full.shape[dim]} positions along it, "
                            f"where the whole merged dim has {p + math.prod(grid) * merged.inner}")
        t = full.narrow(dim, p, full.shape[dim] - p) if p else full
        t = t.unflatten(dim, (*grid, *([merged.inner] if merged.inner != 1 else [])))
        for i, c in enumerate(coords[index]):
            t = t.narrow(dim + i, sum(sizes[i][:c]), sizes[i][c])
        out = t.flatten(dim, dim + len(grid) - (merged.inner == 1))
        if p and self._owner(merged):
            out = torch.cat([full.narrow(dim, 0, p), out], dim)
        self._set_fold(out, merged.at(dim))
        return out

    def _merged_global_view(self, x: torch.Tensor, merged: Merged, request, base: str) -> torch.Tensor:
        """``x.view(sizes)`` with every size a constant, on a merged tensor: the sizes are the
        single device's (MONAI UNETR's ``proj_feat`` folds its tokens back into its fixed feature
        grid). The whole merged dim written as its global factors must regroup into the request
        with each sharded factor the outermost of its output dim (the grid restored: a slab
        state); this rank's view is the request with those dims scaled to its block. Decided on
        global sizes (one small all-gather), so alike on every rank."""
        call = f"`{base}`"
        if not merged.tokens or merged.prefix:
            self._fold_fail(base, merged, "it views windows of several samples, or tokens with plain rows in front, "
                            "by constant sizes")
        _, _, sizes, _ = self._merged_grid(merged, call)
        grid = [sum(s) for s in sizes]
        glob_virtual, st = merged.virtual(tuple(x.shape))
        glob_virtual = list(glob_virtual)
        for i, k in enumerate(merged.axes):
            glob_virtual[st[k]] = grid[i]
        if math.prod(glob_virtual) != math.prod(request):
            self._fold_fail(base, merged, f"the requested shape {tuple(request)} does not fit the whole sample's "
                            f"shape {tuple(glob_virtual)} (constant sizes are read as the whole sample's)")
        mapped = fg._map_reshape(tuple(glob_virtual), tuple(request), st, None)
        if mapped is fg.UNKNOWN:
            self._fold_fail(base, merged, f"the requested shape {tuple(request)} does not restore the grid of the "
                            "merged dims (each one the outermost of an output dim)")
        local = list(request)
        for i, k in enumerate(merged.axes):
            o = mapped[k]
            local[o] = request[o] // grid[i] * merged.lengths[i]
        out = x.view(local) if base == "view" else x.reshape(local)
        self._set(out, mapped)
        return out

    # -- rows in front: class and register tokens

    def _m_cat(self, func, base, args, kwargs, stateful, merged):
        """``torch.cat((cls, x), dim)`` along the merged dim, plain tensors (class and register
        tokens, the same on every rank) in front of one merged tensor: the owner holds them before
        its block (``Merged.prefix``), the other ranks their blocks alone, as the single device
        holds them before the grid's tokens."""
        tensors = list(fg._arg(args, kwargs, 0, "tensors"))
        nd = tensors[0].dim() if tensors and isinstance(tensors[0], torch.Tensor) else 0
        dim = fg._arg(args, kwargs, 1, "dim", 0) % max(nd, 1)
        states = [self.states.get(t) for t in tensors]
        folded = [i for i, st in enumerate(states) if st is not None]
        if base == "stack" or len(folded) != 1 or type(states[folded[0]]) is not Merged \
                or states[folded[0]].dim != dim:
            return self._f_cat(func, base, args, kwargs, stateful, merged)
        i = folded[0]
        m = states[i]
        if not m.tokens or i != len(tensors) - 1:
            self._fold_fail(base, m, "it joins plain tensors along the merged dim other than in front of its tokens")
        k = sum(int(t.shape[dim]) for t in tensors[:i])
        self._routing(f"`{base}`")
        out = func(*args, **kwargs) if self._owner(m) else tensors[i].clone()
        self._set_fold(out, replace(m, prefix=m.prefix + k))
        return out

    def _m_getitem(self, func, base, args, kwargs, stateful, merged):
        """Indexing along a merged dim with plain rows in front: ``x[:, 0]`` and ``x[:, :k]``
        within them give the owner's rows on every rank (replicated), ``x[:, k:]`` at their end
        drops them (the tokens' blocks); other dims taken whole. Anything else as on a fold."""
        x, idx = args[0], args[1]
        m = self._fold_of(x)
        items = idx if isinstance(idx, tuple) else (idx,)
        if m is None or type(m) is not Merged or not m.prefix or any(i is None for i in items):
            return self._f_getitem(func, base, args, kwargs, stateful, merged)
        n_real = sum(1 for i in items if i is not Ellipsis)
        expanded: list = []
        for i in items:
            expanded += [slice(None)] * (x.dim() - n_real) if i is Ellipsis else [i]
        expanded += [slice(None)] * (x.dim() - len(expanded))
        full = slice(None)
        if len(expanded) != x.dim() or any(not (isinstance(e, slice) and e == full)
                                           for j, e in enumerate(expanded) if j != m.dim):
            return self._f_getitem(func, base, args, kwargs, stateful, merged)
        e, p = expanded[m.dim], m.prefix
        from .mesh import group_over

        group = group_over(self.guard.mesh, [self.guard.axes[k] for k in sorted(m.axes)])
        if type(e) is int and 0 <= e < p or (isinstance(e, slice) and e.step in (None, 1) and type(e.start) in
                                              (int, type(None)) and type(e.stop) is int and 0 <= (e.start or 0)
                                              < e.stop <= p):
            self._routing("indexing")
            out = self._from_owner(x, m, lambda src: src[tuple(expanded)], group)
            self._set(out, None)
            return out
        if isinstance(e, slice) and e.start == p and e.stop is None and e.step in (None, 1):
            out = x.narrow(m.dim, p, x.shape[m.dim] - p) if self._owner(m) else x.view_as(x)
            self._set_fold(out, replace(m, prefix=0))
            return out
        return self._f_getitem(func, base, args, kwargs, stateful, merged)

    # -- element-wise

    def _m_pointwise(self, func, base, args, kwargs, stateful, merged):
        """As on a fold, but a plain operand sized for the whole merged dim (a position
        embedding of every token, ``x + self.pos_embed``) gives this rank's block of it, as
        slabs take their rows (decided on the plain operand's shape, alike on every rank)."""
        found: list = []
        fg._walk((args, kwargs), found)
        tensors = [t for t in found if isinstance(t, torch.Tensor)]
        ref = next((t for t in tensors if self._fold_of(t) is not None), None)
        if ref is not None and type(self._fold_of(ref)) is Merged:
            m = self._fold_of(ref)
            nd = max(t.dim() for t in tensors)
            at = m.dim + nd - ref.dim()
            blocks = {}
            for t in tensors:
                i = at - (nd - t.dim())
                if self.states.get(t) is None and 0 <= i < t.dim() and t.shape[i] > 1 and m.tokens:
                    blocks[id(t)] = self._own_block(t, i, m, f"`{base}`", whole=True)
            if blocks:
                args, kwargs, _ = self._with_rows(blocks, args, kwargs, found)
        return self._f_pointwise(func, base, args, kwargs, stateful, merged)

    # -- reductions

    def _m_reduce(self, func, base, args, kwargs, stateful, merged):
        x = args[0]
        m = self._fold_of(x)
        dim = self._reduce_dim_arg(base, args, kwargs)
        along = m is not None and (dim is None or (isinstance(dim, (list, tuple)) and not dim)
                                   or m.dim in fg._norm_dims(dim, x.dim()))
        if not along or type(m) is not Merged or any(self.states.get(t) is not None for t in stateful if t is not x):
            return self._f_reduce(func, base, args, kwargs, stateful, merged)
        if self._over_factors(base, m, dim):
            return self._reduce_over_factors(func, base, args, kwargs, m, dim)
        if not m.tokens:
            self._fold_fail(base, m, "it acts along a dim of windows of several samples")
        if base in ("sum", "mean", "nansum", "nanmean") and dim is not None and not (
                isinstance(dim, (list, tuple)) and not dim):
            from .comm import all_reduce_sum
            from .mesh import group_over

            self._routing(f"`{base}`")
            dims = fg._norm_dims(dim, x.dim())
            keepdim = bool(fg._arg(args, kwargs, 2, "keepdim", False))
            dtype = kwargs.get("dtype")
            summed = (torch.nansum if base.startswith("nan") else torch.sum)(x, dims, keepdim=keepdim, dtype=dtype)
            group = group_over(self.guard.mesh, [self.guard.axes[k] for k in sorted(m.axes)])
            out = all_reduce_sum(summed, group)
            if base == "mean":
                # The single device's count: the reduced positions of every rank of the group.
                local = math.prod(x.shape[d] for d in dims)
                rows = self._gather_with_coords([local], f"forward guard: `{base}` (count)")
                n = len(self.guard.axes)
                mine = [fg.axis_index(self.guard.mesh, a) for a in self.guard.axes]
                out = out / sum(r[n] for r in rows if all(r[i] == mine[i] for i in range(n) if i not in m.axes))
            elif base == "nanmean":
                count = x.detach().isnan().logical_not().to(out.dtype)
                out = out / all_reduce_sum(torch.sum(count, dims, keepdim=keepdim), group)
            self._set(out, None)
            return out
        # Any other reduction or normalisation along it (softmax over the tokens, amax, var,
        # logsumexp, ...): on the whole dim in the single device's order.
        grid: list = []
        full = self._gather_merged(x, f"`{base}`", grid)
        out = func(full, *args[1:], **kwargs)
        return self._blocks_of(out, x.dim(), m, full.shape[m.dim], base, grid[0])

    def _blocks_of(self, out, nd: int, merged: Merged, n: int, call: str, grid=None):
        """Outputs of a call on the gathered whole: those that keep the merged dim whole (at its
        place, ``n`` positions) back to this rank's block; the others replicated."""
        outs = [out] if isinstance(out, torch.Tensor) else fg._flat_tensors(out)
        kept = [t for t in outs if t.dim() == nd and t.shape[merged.dim] == n]
        if not kept:
            self._set(out, None)
            return out
        blocks = {id(t): self._own_block(t, merged.dim, merged, call, grid=grid) for t in kept}
        for t in outs:
            if id(t) not in blocks:
                self._set(t, None)
        if isinstance(out, torch.Tensor):
            return blocks[id(out)]
        if isinstance(out, tuple) and hasattr(out, "_fields"):
            return type(out)(*(blocks.get(id(t), t) for t in out))
        if isinstance(out, (tuple, list)):
            return type(out)(blocks.get(id(t), t) for t in out)
        self._fold_fail(call, merged, "its output is not a tensor or a tuple of tensors")

    # -- products

    def _m_matmul(self, func, base, args, kwargs, stateful, merged):
        a, b = (args[1], args[0]) if base == "rmatmul" else (args[0], args[1])
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (a, b)):
            self._fold_fail(base, merged, "an operand is a vector")
        fa, fb = self._fold_of(a), self._fold_of(b)
        if fb is not None and type(fb) is Merged and fb.dim == b.dim() - 2 and fa is not None and fa.dim == a.dim() - 1:
            # Contracting the merged dim of both (linear attention's ``k^T v``): the local
            # products summed over the merged axes' ranks, where both hold the same positions.
            if fa != fb.at(fa.dim):
                self._fold_fail(base, merged, "its operands merge the contracted dim differently")
            self._same_positions(base, [fa, fb])
            return self._summed(func(a, b) if base != "rmatmul" else func(b, a), fa, base)
        if fa is not None and type(fa) is Merged and fa.dim == a.dim() - 1:
            self._fold_fail(base, merged, "it contracts the merged dim with an operand that holds it whole")
        swap = (lambda x, y: func(y, x)) if base == "rmatmul" else func
        rows = fa is not None and type(fa) is Merged and fa.dim == a.dim() - 2
        if fb is not None and type(fb) is Merged and fb.dim >= b.dim() - 2:
            if fa is not None and not rows:
                self._fold_fail(base, merged, "its operands are merged along different dims")
            if fb.dim == b.dim() - 2 or rows:
                # The values of ``probs @ v`` (b's rows, contracted against a's whole keys), the
                # keys of ``q @ k^T`` (b's columns, for this rank's query rows): whole.
                b, fb = self._gather_merged(b, "`matmul`"), None
            else:
                # b's columns merged, a plain (DaViT's channel attention, ``attn @ q^T``): every
                # output column comes from that column of b alone.
                out = swap(a, b)
                self._set_fold(out, fb.at(out.dim() - 1))
                return out
        if rows:
            # This rank's rows of the product (query rows); b is plain now.
            if fb is not None:
                self._fold_fail(base, merged, "both operands are merged")
            out = swap(a, b)
            self._set_fold(out, fa.at(out.dim() - 2))
            return out
        new = (b, a) if base == "rmatmul" else (a, b)
        return self._f_matmul(func, base, (*new, *args[2:]), kwargs, stateful, merged)

    def _same_positions(self, call: str, states) -> None:
        """Refuse, on every rank alike, unless the merged ``states`` (one layout) hold the same
        positions on every rank (equal lengths; one small all-gather)."""
        first = list(states[0].lengths)
        rows = self._gather_with_coords([int(any(list(s.lengths) != first for s in states[1:]))],
                                        f"forward guard: {call} (merged positions)")
        if any(r[-1] for r in rows):
            self._fold_fail(call, states[0], "its operands merge grids of different sizes along that dim")

    def _summed(self, out: torch.Tensor, merged: Merged, call: str) -> torch.Tensor:
        """``out`` (a sum over this rank's positions of the merged dim) summed over its ranks."""
        from .comm import all_reduce_sum
        from .mesh import group_over

        if not merged.tokens:
            self._fold_fail(call, merged, "it sums along a dim of windows of several samples")
        self._routing(f"`{call}`")
        out = all_reduce_sum(out, group_over(self.guard.mesh, [self.guard.axes[k] for k in sorted(merged.axes)]))
        self._set(out, None)
        return out

    def _m_einsum(self, func, base, args, kwargs, stateful, merged):
        """``torch.einsum`` with merged operands, by subscript letter: the first merged letter
        that reaches the output is kept (its operand's rows); another operand's different merged
        letter is gathered whole; a letter merged alike in two operands and summed is summed
        over the merged axes' ranks (as is one summed in its only operand); a merged letter
        summed against an operand that holds it whole is gathered. Explicit subscripts only."""
        eq = args[0] if args else kwargs.get("equation")
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        if not isinstance(eq, str) or "..." in eq or any(not isinstance(t, torch.Tensor) for t in ops):
            self._fold_fail(base, merged, "only explicit subscripts (no '...', no sublist form) are mapped")
        lhs, arrow, rhs = eq.replace(" ", "").partition("->")
        subs = lhs.split(",")
        if not arrow:
            rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
        if len(subs) != len(ops) or any(len(s) != t.dim() for s, t in zip(subs, ops)):
            return func(*args, **kwargs)  # torch's own error
        if any(self.states.get(t) is not None and type(self.states.get(t)) is not Merged for t in ops):
            self._fold_fail(base, merged, "it combines the merged tensor with a slab of another layout")
        kept = summed = None
        alike: list = []  # merged operands that must hold the same positions
        for i in range(len(ops)):
            m = self._fold_of(ops[i])
            if m is None:
                continue
            letter = subs[i][m.dim]
            if letter in rhs:
                if kept is None:
                    kept = (letter, m)
                    continue
                if kept[0] == letter and kept[1].at(m.dim) == m:
                    alike += [kept[1], m]
                    continue  # the same rows, as an element-wise product
            elif summed is None or summed[0] == letter:
                holders = [j for j in range(len(ops)) if j != i and letter in subs[j]]
                if all(self._fold_of(ops[j]) is not None and self._fold_of(ops[j]).at(m.dim) == m
                       and subs[j][self._fold_of(ops[j]).dim] == letter for j in holders):
                    summed = (letter, m)  # held alike by every operand that has it: local, then summed
                    alike.append(m)
                    continue
            ops[i] = self._gather_merged(ops[i], "`einsum`")
        if kept is not None:
            for j, t in enumerate(ops):
                if kept[0] in subs[j] and self._fold_of(t) is None:
                    self._fold_fail(base, merged, f"operand {j} holds the merged letter {kept[0]!r} whole")
        if len(alike) > 1:
            self._same_positions("einsum", alike)
        out = torch.einsum(eq, *ops)
        if summed is not None:
            if kept is not None:
                self._fold_fail(base, merged, "it both keeps one merged letter and sums another")
            return self._summed(out, summed[1], "einsum")
        if kept is None:
            self._set(out, None)
        else:
            self._set_fold(out, kept[1].at(rhs.index(kept[0])))
        return out

    # -- attention

    def _m_sdpa(self, func, base, args, kwargs, stateful, merged):
        """Attention over keys along a merged dim: ring attention over the domain's ranks (the
        merged axes must be all of them); replicated queries attend over every rank's keys.
        Queries merged along their tokens with plain keys: each query row on its own."""
        from .comm.peers import domain_peers
        from .functional import _replicated_query_attention, ring_attention

        q, k, v = args[0], args[1], args[2]
        fq, fk, fv = (self._fold_of(t) for t in (q, k, v))
        tok = q.dim() - 2
        at_tokens = [f is not None and f.dim == (t.dim() - 2) for f, t in ((fq, q), (fk, k), (fv, v))]
        if not any(at_tokens):
            return self._f_sdpa(func, base, args, kwargs, stateful, merged)
        name = "scaled_dot_product_attention"
        mask = fg._arg(args, kwargs, 3, "attn_mask")
        dropout_p = float(fg._arg(args, kwargs, 4, "dropout_p", 0.0))
        is_causal = bool(fg._arg(args, kwargs, 5, "is_causal", False))
        scale = fg._arg(args, kwargs, 6, "scale")
        gqa = bool(fg._arg(args, kwargs, 7, "enable_gqa", False))
        if is_causal:
            self._fold_fail(name, merged, "it is causal, which needs the single device's order")
        if fk is None and fv is None:
            # Queries merged, keys and values plain (whole): every query row on its own.
            if fq.dim != tok or type(fq) is not Merged:
                self._fold_fail(name, merged, "its queries are merged along other than their token dim")
            out = self._draw(func, args, kwargs, fq.slab, q.device) if dropout_p > 0 else func(*args, **kwargs)
            self._set_fold(out, fq)
            return out
        if (not (at_tokens[1] and at_tokens[2]) or type(fk) is not Merged or type(fv) is not Merged
                or fk != fv.at(fk.dim) or not fk.tokens):
            self._fold_fail(name, merged, "its keys and values are not merged alike along their token dim only")
        if sorted(fk.axes) != list(range(len(self.guard.axes))):
            self._fold_fail(name, merged, "its keys merge only some of the domain's mesh axes")
        if fq is not None and (not at_tokens[0] or type(fq) is not Merged or sorted(fq.axes) != sorted(fk.axes)
                               or not fq.tokens):
            self._fold_fail(name, merged, "its queries are not merged along their tokens by the keys' mesh axes")
        if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
            self._fold_fail(name, merged, "it needs (N, L, E) or (N, H, L, E) operands")
        self._routing(f"`{name}`")
        if mask is not None:
            return self._m_sdpa_masked(q, k, v, mask, fq, dropout_p, scale, gqa, merged)
        q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v)) if q.dim() == 3 else (q, k, v)
        if q4.shape[0] != k4.shape[0] or k4.shape[:2] != v4.shape[:2] or (
                q4.shape[1] != k4.shape[1] and not (gqa and q4.shape[1] % k4.shape[1] == 0)):
            self._fold_fail(name, merged, f"its batch or head sizes (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                            f"v {tuple(v.shape)}) do not pair up")
        mesh = self.guard.mesh
        if fq is None:
            if dropout_p > 0:
                self._fold_fail(name, merged, "attention dropout of replicated queries is not routed")
            out = _replicated_query_attention(q4, k4, v4, domain_peers(mesh), scale)
            state = None
        else:
            out = ring_attention(q4, k4, v4, mesh, False, scale, **self._ring_dropout(dropout_p))
            state = fq
        out = out.squeeze(1) if q.dim() == 3 else out
        if state is None:
            self._set(out, None)
        else:
            self._set_fold(out, state)
        return out

    def _m_sdpa_masked(self, q, k, v, mask, fq, dropout_p, scale, gqa, merged):
        """Attention with an ``attn_mask`` (a relative-position bias of the whole sequence:
        timm's relative-position ViTs) over merged keys: every rank gathers the whole keys and
        values in the single device's order and attends with its query rows of the mask (a plain
        mask sized for every token along the query dim gives this rank's block; one query row
        broadcasts). Exact, at the single device's memory for K and V."""
        name = "scaled_dot_product_attention"
        if dropout_p > 0:
            self._fold_fail(name, merged, "attention dropout together with an attn_mask is not routed")
        sm = self.states.get(mask) if isinstance(mask, torch.Tensor) else None
        if sm is not None:
            self._fold_fail(name, merged, "its attn_mask is itself sharded")
        kf = self._gather_merged(k, "`scaled_dot_product_attention`")
        vf = self._gather_merged(v, "`scaled_dot_product_attention`")
        if fq is not None and isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.shape[-2] > 1:
            mask = self._own_block(mask, mask.dim() - 2, fq.at(mask.dim() - 2), "`scaled_dot_product_attention`",
                                   whole=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, scale=scale, enable_gqa=gqa)
        if fq is None:
            self._set(out, None)
        else:
            self._set_fold(out, fq)
        return out
