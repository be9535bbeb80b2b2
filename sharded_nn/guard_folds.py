"""Windows of several samples folded into one dim: the forward guard's "fold" layout.

Window attention written with views (timm's DaViT, TinyViT, Twins-SVT, EfficientViT-M) folds
the batch and the windows into one dim: ``x.view(b, h // ws, ws, w // ws, ws, c)``, a permute,
then ``.view(-1, ws, ws, c)``. On a slab along ``h`` with a batch of one, this rank's windows are
one block of that dim (an ordinary slab). With a batch of ``b > 1`` they are not: the dim holds,
in order, ``b`` blocks of [this rank's window rows x the ``w // ws`` window columns], and the
other ranks' rows sit between them on one device. The guard follows this as a ``Fold``:

    dim ``dim`` holds ``outer`` blocks, each this rank's part of the sharded dim of mesh axis
    ``axis`` times ``inner`` (``outer`` and ``inner`` are sizes of unsharded dims, the same on
    every rank; ``outer > 1``).

Every window lies on one rank, so a call that keeps the rows of that dim apart is exact on it:
pointwise calls, ``Linear``, matmul and attention batched over it, reductions, softmax and norms
over other dims, convolutions, pools and per-sample norms where it is the batch dim, dropout
(from the slab's random stream), indexing, splits and concatenations along other dims, and
views that fold more dims into it or unfold it again (back to a slab when the view puts the
sharded factor outermost, as ``window_reverse`` does). Anything else on a folded tensor (a
reduction or an index along it, a crop, a position grid sized by it) is refused on every rank:
the rows of that dim are not in the single device's order, nor one contiguous block of it.

The decisions depend on the layout (the same on every rank) and on shapes with this rank's
part of the sharded dim replaced by a probe factor no real size shares, so every rank takes
the same one whatever its slab length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import forward_guard as fg

__all__ = ["Fold", "FoldCalls", "fold_of_reshape", "map_folded_reshape"]


@dataclass(frozen=True)
class Fold:
    """Layout state: dim ``dim`` holds ``outer`` blocks of (this rank's part of mesh axis
    ``axis``' sharded dim) x ``inner``; ``naxes``: the number of domain axes (the length of a
    slab state tuple)."""

    axis: int
    dim: int
    outer: int
    inner: int
    naxes: int

    @property
    def slab(self) -> tuple:
        """The slab state with the same axis on the same dim (the random stream's key, dim maps)."""
        return tuple(self.dim if k == self.axis else None for k in range(self.naxes))

    def at(self, dim: int) -> Fold:
        return replace(self, dim=dim)

    def virtual(self, shape) -> tuple:
        """``(shape, state)``: ``shape`` with the folded dim written as its factors ``outer``, this
        rank's part of the sharded dim and ``inner`` (ones left out), and the slab state of that
        virtual tensor (the axis on its factor)."""
        d = self.dim
        factors = [self.outer] * (self.outer != 1) + [shape[d] // (self.outer * self.inner)]
        factors += [self.inner] * (self.inner != 1)
        st = tuple(d + (self.outer != 1) if k == self.axis else None for k in range(self.naxes))
        return (*shape[:d], *factors, *shape[d + 1 :]), st

    def length(self, n: int):
        """The size of the folded dim as ``x.shape`` gives it to the model's code."""
        return fg.FoldLength(n, self.axis)

    #: What the guard computes on such a tensor, and what to do instead (for messages).
    allowed = ("pointwise calls, linear layers, matmul and attention batched over it, reductions and norms over "
               "other dims, per-sample layers where it is the batch dim, views that fold or unfold it")
    todo = "Unfold the windows first (the reverse view), or run with a batch of one per domain group"

    def describe(self, axes) -> str:
        return (f"dim {self.dim} folding {self.outer} blocks of the slab of mesh axis {axes[self.axis]!r} "
                f"(times {self.inner}), whose rows are not in one device's order (windows of several samples, or "
                "the sharded dim flattened with dims in front of it)")


# ------------------------------------------------------------------------------- views


def _named_dim(request, axis: int) -> int | None:
    """The output dim of a view request that takes the sharded factor (``_sharded_request_dim``:
    the one size read from this axis' local lengths, slab or fold ones, or else the one -1),
    where no other size is read from local lengths."""
    o = None if request is None else fg._sharded_request_dim(request, axis)
    if o is None or any(fg._is_tagged(v) for j, v in enumerate(request) if j != o):
        return None
    return o


def _refined(shape, d: int, request, o: int):
    """For a request of constants around one -1 (at ``o``): ``(shape, d)`` with the unsharded dims
    split where the constants split them, or None where the request does not fit every rank's
    slab alike. Fits: the constants before the -1 are products of (parts of) the dims before the
    sharded dim ``d``, taken from the outside in, and those after it of the dims after ``d``;
    the -1 then holds the sharded dim and what is left of its neighbours, the same on every rank
    but for the slab length (``_minus_one_takes_sharded``, with unsharded dims also split: a
    fold's ``inner`` back into a window's tokens). Splitting an input dim keeps the memory order,
    so the view maps alike on the refined shape."""

    def side(consts, dims):
        dims, out, rem = list(dims), [], 1
        for c in consts:
            need = int(c)
            while need > 1:
                if rem == 1:
                    if not dims:
                        return None
                    rem = dims.pop(0)
                if rem % need == 0:
                    out.append(need)
                    rem, need = rem // need, 1
                elif need % rem == 0:
                    out.append(rem)
                    need, rem = need // rem, 1
                else:
                    return None
        return out + ([rem] if rem != 1 else []) + dims

    left = side(request[:o], shape[:d])
    right = side(list(reversed(request[o + 1 :])), list(reversed(shape[d + 1 :])))
    if left is None or right is None:
        return None
    return (*left, shape[d], *reversed(right)), len(left)


def _fold_in_group(in_p, out_p, d: int, o: int):
    """(outer, inner) where input dim ``d`` (the sharded factor) merges with unsharded neighbours
    into output dim ``o`` alone, on probe shapes; None otherwise."""
    group = next(((gi, go) for gi, go in fg._groups(in_p, out_p) if d in gi), None)
    if group is None:
        return None
    gi, go = group
    if [j for j in go if out_p[j] != 1] != [o]:
        return None  # the group splits again: not one dim
    outer = math.prod(in_p[j] for j in gi if j < d)
    inner = math.prod(in_p[j] for j in gi if j > d)
    return (outer, inner) if outer > 1 else None


def _probe(in_shape, out_shape, d: int, local: int, o: int):
    """Both shapes with the sharded factor (``local`` positions at input dim ``d``, inside output
    dim ``o``) scaled by the probe factor: the same grouping of dims on every rank (a local size
    of 1 groups with either neighbour by sizes alone; scaled, it groups as larger ones do)."""
    in_p = tuple(n * fg._PROBE_FACTOR if i == d else n for i, n in enumerate(in_shape))
    out_p = tuple(n * fg._PROBE_FACTOR if i == o else n for i, n in enumerate(out_shape))
    return in_p, out_p


def _tail_split(in_p, out_p, d: int, o: int, request, local: int) -> int | None:
    """The factor ``q`` the sharded dim splits off behind the named output dim ``o``: MobileViT's
    ``x.reshape(b * c * (h // ph), ph, w // pw, pw)`` takes the patch rows of the sharded rows
    into ``o`` and the rows inside a patch into the next dim. Only for a size computed by floor
    division or rounding (``h // ph``), where torch's own view fits exactly the slabs that are
    whole patches (the others are refused alike by ``_reshape_rounded``'s agreement); None
    where the view does not split it so."""
    v = request[o]
    if not (fg._is_tagged(v) and v._lossy):
        return None
    gi, go = next((gi, go) for gi, go in fg._groups(in_p, out_p) if d in gi)
    tail = [j for j in go if j > o and out_p[j] != 1]
    if o not in go or not tail or any(fg._is_tagged(request[j]) or request[j] == -1 for j in tail):
        return None
    q = math.prod(out_p[j] for j in tail)
    after = math.prod(in_p[j] for j in gi if j > d)
    if q % after or q // after < 2 or local % (q // after):
        return None
    return q // after


def _named_probe(in_shape, out_shape, d: int, local: int, request, axis: int):
    """``(o, in_p, out_p, d)``: the output dim ``o`` the request names for the sharded factor
    (``local`` positions at input dim ``d``) and both shapes as every rank has them
    (``_probe``; dims the request's constants split, split: ``_refined``; the sharded dim split
    where the view splits it: ``_tail_split``), or None where the request names no dim or does
    not fit every rank alike."""
    o = _named_dim(request, axis)
    if o is None or len(request) != len(out_shape):
        return None
    if request[o] == -1:
        refined = _refined(in_shape, d, request, o)
        if refined is None:
            return None
        in_shape, d = refined
    in_p, out_p = _probe(in_shape, out_shape, d, local, o)
    q = _tail_split(in_p, out_p, d, o, request, local)
    if q is not None:
        in_shape = (*in_shape[:d], local // q, q, *in_shape[d + 1 :])
        in_p, out_p = _probe(in_shape, out_shape, d, local // q, o)
    return o, in_p, out_p, d


def _flatten_request(base: str, args, kwargs, in_shape) -> list | None:
    """A view request equivalent to ``flatten`` / ``unflatten`` (its merged dim as -1)."""
    nd = len(in_shape)
    if base == "flatten":
        s = fg._arg(args, kwargs, 1, "start_dim", 0) % max(nd, 1)
        e = fg._arg(args, kwargs, 2, "end_dim", -1) % max(nd, 1)
        return [*in_shape[:s], -1, *in_shape[e + 1 :]]
    if base == "unflatten":
        dim = fg._arg(args, kwargs, 1, "dim") % nd
        return [*in_shape[:dim], *fg._arg(args, kwargs, 2, "sizes"), *in_shape[dim + 1 :]]
    return None


def fold_of_reshape(in_shape, out_shape, st, request):
    """The ``Fold`` a view makes of a slab (state ``st``), or ``UNKNOWN``: the sharded dim merges
    with unsharded dims before it (the batch) into the one output dim the request names by a
    size read from local lengths or by its -1 (``windows.view(-1, ws, ws, c)`` of ``(b, nh, nw,
    ws, ws, c)``). Where the merge keeps it outermost the view is an ordinary slab
    (``_map_reshape``); this covers the other case."""
    sharded = [(k, d) for k, d in enumerate(st) if d is not None]
    if len(sharded) != 1:
        return fg.UNKNOWN  # two mesh axes folded together: not a layout the guard follows
    (k, d), = sharded
    if 0 in in_shape:
        # An empty slab groups with anything by sizes: mapped on lengths in the view's ratio
        # (as ``_map_reshape`` does), or it was refused on its rank alone (a hang; session 67).
        scaled = fg._empty_slab_probe(in_shape, out_shape, st)
        if scaled is None:
            return fg.UNKNOWN
        in_shape, out_shape = scaled
    named = _named_probe(in_shape, out_shape, d, in_shape[d], request, k)
    if named is None:
        return fg.UNKNOWN
    o, in_p, out_p, d = named
    found = _fold_in_group(in_p, out_p, d, o)
    if found is None:
        return fg.UNKNOWN
    return Fold(k, o, found[0], found[1], len(st))


def map_folded_reshape(in_shape, out_shape, fold: Fold, request):
    """The layout after a view of a folded tensor: a slab state (the view unfolds it and puts the
    sharded factor outermost of its output dim: ``window_reverse``), a ``Fold`` (it folds more
    dims in, or moves it: ``x.view(-1, ws * ws, c)``, ``qkv.reshape(b_, n, 3, h, c // h)``), or
    ``UNKNOWN``. Mapped on the virtual shape with the folded dim written as its three factors."""
    fd = fold.dim
    block = fold.outer * fold.inner
    if in_shape[fd] % block:
        return fg.UNKNOWN
    local = in_shape[fd] // block
    virtual = (*in_shape[:fd], fold.outer, local, *((fold.inner,) if fold.inner != 1 else ()), *in_shape[fd + 1 :])
    if 0 in virtual:
        # An empty slab's fold: its factor scaled in the view's ratio, as in ``fold_of_reshape``.
        scaled = fg._empty_slab_probe(virtual, out_shape, replace(fold, dim=fd).virtual(in_shape)[1])
        if scaled is None:
            return fg.UNKNOWN
        virtual, out_shape = scaled
        local = virtual[fd + 1]
    named = _named_probe(virtual, out_shape, fd + 1, local, request, fold.axis)
    if named is None:
        return fg.UNKNOWN
    o, in_p, out_p, d = named
    st = tuple(d if k == fold.axis else None for k in range(fold.naxes))
    mapped = fg._map_reshape(in_p, out_p, st, None)
    if mapped is not fg.UNKNOWN:
        return mapped if mapped[fold.axis] == o else fg.UNKNOWN
    found = _fold_in_group(in_p, out_p, d, o)
    return fg.UNKNOWN if found is None else replace(fold, dim=o, outer=found[0], inner=found[1])


def _empty_fold_minus_one(in_shape, fold: Fold, request) -> list | None:
    """A view request with its -1 resolved as the ranks with data resolve it, for an empty fold
    (a deep stage left this rank without rows): torch refuses a -1 beside a zero size
    (``y.reshape(B_, N, -1)`` with ``B_ = x.shape[0]`` zero here), which left this rank alone
    with an error (session 67). Where every other size is a constant or the folded dim's own
    length (it scales with the fold as the input does), the -1 is what is left, the same for any
    fold length: evaluated at two probe lengths; None otherwise (torch's own call then)."""
    req = list(request)
    if req.count(-1) != 1 or 0 not in [int(v) for v in req]:
        return None
    values = set()
    for local in (fg._PROBE_FACTOR * 720720, fg._PROBE_FACTOR * 720720 * 2):
        n = fold.outer * local * fold.inner
        total = math.prod(n if i == fold.dim else int(v) for i, v in enumerate(in_shape))
        others = 1
        for v in req:
            if fg._is_tagged(v):
                if type(v) is not fg.FoldLength or v.axis != fold.axis:
                    return None
                others *= n
            elif v != -1:
                others *= int(v)
        if others == 0 or total % others:
            return None
        values.add(total // others)
    if len(values) != 1:
        return None
    return [values.pop() if (not fg._is_tagged(v) and v == -1) else int(v) for v in req]


# ------------------------------------------------------------------------------- calls


def _dim_of(args, kwargs, i: int, name: str, default, nd: int) -> int | None:
    dim = fg._arg(args, kwargs, i, name, default)
    return None if dim is None else dim % nd


#: Calls over the whole folded or merged dim computed on its factors (``FoldCalls._reduce_over_factors``):
#: order-free reductions (``max``/``min`` without a dim only: with one, they return indices in
#: the single device's order), and the normalisations along it.
_ALONG = frozenset(["softmax", "log_softmax", "softmin"])
_OVER_FACTORS = frozenset(["sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "logsumexp", "any",
                           "all", "count_nonzero", "aminmax", "norm", "linalg_vector_norm", "var", "std", "var_mean",
                           "std_mean"]) | _ALONG


class FoldCalls:
    """The guard mode's calls on folded tensors (a mixin of ``forward_guard._GuardMode``)."""

    def _fold_fail(self, base: str, fold: Fold, why: str = "") -> None:
        self.fail(
            f"`{base}`",
            f"it receives a tensor sharded along {fold.describe(self.guard.axes)}; on such a tensor the guard "
            f"computes only {fold.allowed}" + (f", and {why}" if why else ""),
            fold.todo,
        )

    def _fold_of(self, t):
        st = self.states.get(t) if isinstance(t, torch.Tensor) else None
        return st if type(st) in fg.FOLDED else None

    def _kept(self, func, args, kwargs, fold):
        """``func(*args, **kwargs)``, its output folded as its input (a call checked to keep the
        rows of the folded dim apart and the dim where it is)."""
        out = func(*args, **kwargs)
        self._set_fold(out, fold)
        return out

    def _set_fold(self, out, fold) -> None:
        """Give every output tensor ``fold``."""
        for t in [out] if isinstance(out, torch.Tensor) else fg._flat_tensors(out):
            self.states[t] = fold

    def _fold_call(self, kind: str, func, base: str, args, kwargs, stateful):
        """A torch call with a folded tensor among its arguments (``_GuardMode.__torch_function__``)."""
        states = [self.states.get(t) for t in stateful]
        folds = [s for s in states if type(s) in fg.FOLDED]
        fold = folds[0]
        handler = (_FOLD_HANDLERS if type(fold) is Fold else fg.MERGED_HANDLERS).get(kind)
        if handler is None:
            self._fold_fail(base, fold)
        if kind not in ("cat", "stack", "copy", "view_as") and any(
                s is not None and type(s) not in fg.FOLDED for s in states):
            self._fold_fail(base, fold, "it combines that tensor with a slab of another layout")
        return handler(self, func, base, args, kwargs, stateful, fold)

    # -- metadata

    def _f_passive(self, func, base, args, kwargs, stateful, fold):
        return func(*args, **kwargs)

    def _f_shape(self, func, base, args, kwargs, stateful, fold):
        out = func(*args, **kwargs)
        x = args[0]
        if self._fold_of(x) is None:
            return out
        if isinstance(out, torch.Size):
            return torch.Size([fold.length(v) if i == fold.dim else v for i, v in enumerate(out)])
        dim = fg._arg(args, kwargs, 1, "dim")
        if isinstance(out, int) and dim is not None and dim % x.dim() == fold.dim:
            return fold.length(out)
        return out

    def _f_len(self, func, base, args, kwargs, stateful, fold):
        out = func(*args, **kwargs)
        return fold.length(out) if fold.dim == 0 else out

    def _f_numel(self, func, base, args, kwargs, stateful, fold):
        out = func(*args, **kwargs)
        return fold.length(args[0].shape[fold.dim]) * (out // args[0].shape[fold.dim])

    def _f_data(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        if base == "iter" and self._fold_of(x) is not None and fold.dim > 0:
            # ``q, k, v = qkv``: the tensors along dim 0, each folded one dim lower.
            outs = list(func(*args, **kwargs))
            self._set_fold(outs, fold.at(fold.dim - 1))
            return iter(outs)
        self._fold_fail(base, fold, "it reads values into Python, where they differ by rank")

    # -- element-wise

    def _f_pointwise(self, func, base, args, kwargs, stateful, fold):
        found: list = []
        fg._walk((args, kwargs), found)
        if any(fg._is_tagged(v) for v in found):
            args, kwargs = self._globalise(f"`{base}`", args, kwargs)
        out = func(*args, **kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else fg._flat_tensors(out)
        if not outs:
            return out
        nd = outs[0].dim()
        at = None
        for t in (t for t in found if isinstance(t, torch.Tensor)):
            f = self._fold_of(t)
            if f is None:
                continue
            shifted = f.at(f.dim + nd - t.dim())
            if at is None:
                at = shifted
            elif at != shifted:
                self._fold_fail(base, fold, "its folded operands are folded differently")
        for t in (t for t in found if isinstance(t, torch.Tensor)):
            i = at.dim - (nd - t.dim())
            if self._fold_of(t) is None and 0 <= i < t.dim() and t.shape[i] > 1:
                self._fold_fail(base, fold, f"a plain tensor of shape {tuple(t.shape)} varies along the folded dim")
        self._set_fold(out, at)
        return out

    def _f_random(self, func, base, args, kwargs, stateful, fold):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if kwargs.get("generator") is not None or len(stateful) != 1 or self._fold_of(x) is None:
            self._fold_fail(base, fold, "it draws with a generator of its own, or for several tensors")
        if base in ("dropout", "alpha_dropout") or base in fg._FEATURE_DROPOUT:
            p = float(fg._arg(args, kwargs, 1, "p", 0.5))
            if not fg._arg(args, kwargs, 2, "training", True) or p == 0.0:
                return self._kept(func, args, kwargs, fold)
        elif base not in ("rand_like", "randn_like", "bernoulli", "randint_like"):
            self._fold_fail(base, fold)
        # Every window is drawn by the one rank that holds it, from the slab's stream (the law of
        # element-wise draws on one device, as for slabs).
        out = self._draw(func, args, kwargs, fold.slab, x.device)
        self._set_fold(out, fold)
        return out

    # -- dims moved, views

    def _f_dim_map(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        remap = fg._HANDLERS[fg._classify_cached(func)[0]].remap
        call = getattr(remap, "call", None)  # (``squeeze``: never the folded dim, as for slabs)
        out = func(*args, **kwargs) if call is None or self._fold_of(x) is None else call(x, fold.slab, args, kwargs)
        mapped = remap(self, x, out, fold.slab, base, args, kwargs)
        if mapped is fg.UNKNOWN or mapped[fold.axis] is None:
            self._fold_fail(base, fold, "it drops the folded dim")
        self._set_fold(out, fold.at(mapped[fold.axis]))
        return out

    def _f_reshape(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        if self._fold_of(x) is None:
            self._fold_fail(base, fold, "it views a tensor as the shape of a folded one")
        in_shape = tuple(x.shape)
        if base in ("view_as", "reshape_as"):
            request = self._sizes_of(args[1])  # (``u.view_as(h)``: h's sizes, read as the model would)
        elif base in ("view", "reshape"):
            request = fg._reshape_request(args, kwargs)
        else:
            # (The folded dim's size tagged: where the flatten or unflatten leaves it alone, it
            # names the dim that holds it.)
            request = _flatten_request(base, args, kwargs, self._sizes_of(x))
        if request is None:
            self._fold_fail(base, fold, "it views the values as another dtype")
        if (type(fold) is not Fold and base in ("view", "reshape") and -1 not in request
                and not any(fg._is_tagged(v) for v in request) and not fg._called_from_local_shape_library()):
            # Constant sizes only: the whole sample's, as for slabs (UNETR's ``proj_feat``).
            out = self._merged_global_view(x, fold, request, base)
            self._forget_if_slab(out)
            return out
        if any(fg._is_tagged(v) and v._lossy for v in request):
            # As for slabs (``_reshape_rounded``): sizes computed by floor division fit on some
            # ranks only where the slabs are not whole windows; every rank says, all refuse alike.
            resolve = (lambda sizes: func(x, sizes)) if base in ("view", "reshape") else None
            out, misfits = self._fits_everywhere(lambda: func(*args, **kwargs), base, request, resolve)
            if misfits:
                self._fold_fail(base, fold, f"the requested shape does not fit the windows of domain ranks {misfits}")
        else:
            resolved = None
            if type(fold) is Fold and base in ("view", "reshape") and x.numel() == 0:
                resolved = _empty_fold_minus_one(in_shape, fold, request)
            out = func(*args, **kwargs) if resolved is None else func(x, resolved)
        if type(fold) is Fold:
            mapped = map_folded_reshape(in_shape, tuple(out.shape), fold, request)
        else:
            from .guard_merged import map_merged_reshape

            mapped = map_merged_reshape(in_shape, tuple(out.shape), fold, request)
        if mapped is fg.UNKNOWN:
            self._fold_fail(base, fold, "the view splits or merges the folded dim in a way "
                            "the guard cannot follow (its size must be read from the tensor's shape, or be the -1)")
        if type(mapped) in fg.FOLDED:
            self._set_fold(out, mapped)
        else:
            self._set(out, mapped)
            self._forget_if_slab(out)
        return out

    def _forget_if_slab(self, out) -> None:
        """Windows or merged axes put back into a slab: its lengths are the windows' rows, which
        the layout scope cannot derive from a remembered layout; it forgets (alike on every rank:
        the state is mapped alike), as for any slab of a new layout (``_GuardMode._scope_resized``)."""
        from .comm.sizes import scope_active, scope_forget

        if scope_active() and isinstance(out, torch.Tensor) and type(self.states.get(out)) is tuple:
            scope_forget()

    def _sizes_of(self, t) -> list:
        """``t.shape`` with the sizes along its sharded or folded dims tagged (what ``t.shape``
        gives the model's code under the guard)."""
        st = self.states.get(t)
        if type(st) in fg.FOLDED:
            return [st.length(n) if i == st.dim else n for i, n in enumerate(t.shape)]
        if isinstance(st, tuple):
            pos = {d: k for k, d in enumerate(st) if d is not None}
            return [fg.LocalLength(n, pos[i]) if i in pos else n for i, n in enumerate(t.shape)]
        return list(t.shape)

    def _f_expand(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        out = func(*args, **kwargs)
        at = fold.dim + out.dim() - x.dim()
        if out.shape[at] != x.shape[fold.dim]:
            self._fold_fail(base, fold, "it expands the folded dim")
        self._set_fold(out, fold.at(at))
        return out

    # -- indexing, splitting, joining

    def _f_getitem(self, func, base, args, kwargs, stateful, fold):
        x, idx = args[0], args[1]
        if self._fold_of(x) is None:
            self._fold_fail("indexing", fold, "it indexes with a folded tensor")
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(not (i is None or i is Ellipsis or type(i) is int or isinstance(i, slice)) for i in items) or any(
                isinstance(i, slice) and any(fg._is_tagged(v) for v in (i.start, i.stop, i.step)) for i in items):
            self._fold_fail("indexing", fold, "its index is a tensor, a list or a size read from a slab")
        n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
        expanded: list = []
        for i in items:
            expanded += [slice(None)] * (x.dim() - n_real) if i is Ellipsis else [i]
        src = out_dim = 0
        new = None
        for i in expanded:
            if i is None:
                out_dim += 1
                continue
            if src == fold.dim:
                if not (isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1)):
                    self._fold_fail("indexing", fold, "it indexes along the folded dim")
                new = out_dim
            if isinstance(i, slice):
                out_dim += 1
            src += 1
        if new is None:
            new = out_dim + fold.dim - src
        out = func(*args, **kwargs)
        self._set_fold(out, fold.at(new))
        return out

    def _f_split(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        dim = _dim_of(args, kwargs, 2 if base in ("split", "chunk", "tensor_split", "split_with_sizes") else 1,
                      "dim", 0, x.dim())
        if dim == fold.dim:
            self._fold_fail(base, fold, "it splits along the folded dim")
        out = func(*args, **kwargs)
        self._set_fold(out, fold.at(fold.dim - (base == "unbind" and fold.dim > dim)))
        return out

    def _f_cat(self, func, base, args, kwargs, stateful, fold):
        tensors = list(fg._arg(args, kwargs, 0, "tensors"))
        if any(self.states.get(t) != fold for t in tensors):
            self._fold_fail(base, fold, "its tensors are not all folded alike")
        out = func(*args, **kwargs)
        dim = fg._arg(args, kwargs, 1, "dim", 0) % out.dim()
        if base == "stack":
            self._set_fold(out, fold.at(fold.dim + (fold.dim >= dim)))
        elif dim == fold.dim:
            self._fold_fail(base, fold, "it joins along the folded dim")
        else:
            self._set_fold(out, fold)
        return out

    def _f_copy(self, func, base, args, kwargs, stateful, fold):
        out = func(*args, **kwargs)
        src = self.states.get(args[1]) if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if src is None:
            self.states.pop(args[0], None)
        else:
            self.states[args[0]] = src
        return out

    # -- reductions and norms over other dims

    def _f_reduce(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        if self._fold_of(x) is None:
            self._fold_fail(base, fold)
        if base in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return self._f_pointwise(func, base, args, kwargs, stateful, fold)
        nd = x.dim()
        keep = base in ("softmax", "log_softmax", "softmin", "normalize", "cumsum", "cumprod", "logcumsumexp",
                        "cummax", "cummin", "sort", "argsort", "topk", "kthvalue", "diff")
        dim = self._reduce_dim_arg(base, args, kwargs)
        whole = dim is None or (isinstance(dim, (list, tuple)) and not dim)
        if (whole or fold.dim in fg._norm_dims(dim, nd)) and self._over_factors(base, fold, None if whole else dim):
            return self._reduce_over_factors(func, base, args, kwargs, fold, None if whole else dim)
        if whole:
            self._fold_fail(base, fold, "it reduces over every dim, the folded one among them")
        dims = fg._norm_dims(dim, nd)
        if fold.dim in dims:
            self._fold_fail(base, fold, "it acts along the folded dim")
        keepdim = keep or bool(fg._arg(args, kwargs, 3 if base in ("quantile", "nanquantile") else 2, "keepdim",
                                       False))
        out = func(*args, **kwargs)
        self._set_fold(out, fold.at(fold.dim if keepdim else fold.dim - sum(r < fold.dim for r in dims)))
        return out

    def _over_factors(self, base: str, layout, dim) -> bool:
        """Whether ``base`` over (or along) the whole folded or merged dim is computed on its
        factors (``_reduce_over_factors``)."""
        return (base in _OVER_FACTORS and not getattr(layout, "prefix", 0)
                and (base not in ("max", "min") or dim is None) and (base not in _ALONG or dim is not None))

    def _reduce_over_factors(self, func, base, args, kwargs, layout, dim):
        """A reduction over the whole folded or merged dim (or a softmax along it) on that dim
        written out as its factors: ``x.flatten(1).mean(1)`` of ``(B, C, H, W)`` with ``H`` sharded (a
        per-sample mean or norm, LpLoss's ``x.reshape(b, -1)``), windows of several samples
        summed, the tokens of a 2-D mesh. Every position of that dim lies on one rank and
        these calls do not depend on the positions' order, so the slab reductions
        (``sharded_nn.reductions``, through the guard's own routing) over the factors are the
        single device's, without gathering anything. (Before session 62: refused where the dim
        held several blocks, and on the tokens of a 2-D mesh computed on the gathered whole dim.)"""
        x = args[0]
        nd = x.dim()
        shape, st = layout.virtual(tuple(x.shape))
        extra = len(shape) - nd
        md = layout.dim
        span = tuple(range(md, md + extra + 1))
        xv = x.reshape(shape)
        self._set(xv, st)
        if base in _ALONG:
            if fg._norm_dims(dim, nd) != (md,):
                self._fold_fail(base, layout, "it acts along that dim and others together")
            dtype = kwargs.get("dtype") or next((a for a in args[2:] if isinstance(a, torch.dtype)), None)
            src = xv.to(dtype) if dtype is not None else xv
            src = -src if base == "softmin" else src
            self._set(src, st)
            lse = self._h_reduce(torch.logsumexp, "logsumexp", (src, span, True), {}, (src,))
            out = src - lse
            out = (out if base == "log_softmax" else out.exp()).reshape(x.shape)
            self._set(out, layout)
            return out
        args = list(args)
        args[0] = xv
        kwargs = dict(kwargs)
        if dim is not None:
            vdims: list[int] = []
            for d in fg._norm_dims(dim, nd):
                vdims.extend(span if d == md else (d if d < md else d + extra,))
            at = 2 if base in ("norm", "linalg_vector_norm") else 1
            if "dim" in kwargs or len(args) <= at:
                kwargs["dim"] = tuple(vdims)
            else:
                args[at] = tuple(vdims)
        out = self._h_reduce(func, base, tuple(args), kwargs, (xv,))

        def back(t):  # keepdim: the factors' ones written as the dim's one
            if isinstance(t, torch.Tensor) and t.dim() == nd + extra:
                t = t.reshape(*t.shape[:md], 1, *t.shape[md + extra + 1 :])
            self._set(t, None)  # every sharded factor reduced: replicated
            return t

        if isinstance(out, torch.Tensor):
            return back(out)
        parts = tuple(back(t) for t in out)
        return type(out)(parts)  # (a tuple, or torch's named tuples, which take one too)

    @staticmethod
    def _reduce_dim_arg(base: str, args, kwargs):
        """The ``dim`` argument of a reduction or normalisation call (None: every dim)."""
        if base == "normalize":
            return kwargs.get("dim", args[2] if len(args) > 2 else 1)
        if base in ("sort", "argsort"):
            return fg._arg(args, kwargs, 1, "dim", -1)
        if base in ("topk", "kthvalue", "quantile", "nanquantile"):
            return fg._arg(args, kwargs, 2, "dim", -1 if base in ("topk", "kthvalue") else None)
        if base == "diff":  # torch.diff(input, n=1, dim=-1, ...)
            return fg._arg(args, kwargs, 2, "dim", -1)
        return fg._arg(args, kwargs, 1, "dim")

    def _f_trailing_norm(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        shape = fg._arg(args, kwargs, 1, "normalized_shape")
        if self._fold_of(x) is None or fold.dim >= x.dim() - (1 if isinstance(shape, int) else len(shape)):
            self._fold_fail(base, fold, "it normalises over the folded dim")
        return self._kept(func, args, kwargs, fold)

    def _f_linear(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        if self._fold_of(x) is None or fold.dim == x.dim() - 1:
            self._fold_fail(base, fold, "it contracts the folded dim")
        return self._kept(func, args, kwargs, fold)

    def _f_matmul(self, func, base, args, kwargs, stateful, fold):
        a, b = (args[1], args[0]) if base == "rmatmul" else (args[0], args[1])
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (a, b)):
            self._fold_fail(base, fold, "an operand is a vector")
        out = func(*args, **kwargs)
        self._set_fold(out, self._batched_fold(base, fold, out.dim(), (a, b)))
        return out

    def _batched_fold(self, base: str, fold: Fold, nd: int, tensors) -> Fold:
        """The fold of a call batched over the leading dims (matmul, attention): every folded
        operand folds the same batch dim (right-aligned to the output's ``nd`` dims); a plain
        operand is the same for every row of it."""
        at = None
        for t in tensors:
            f = self._fold_of(t)
            if f is None:
                continue
            if f.dim >= t.dim() - 2:
                self._fold_fail(base, fold, "it contracts or attends along the folded dim")
            shifted = f.at(f.dim + nd - t.dim())
            if at is not None and at != shifted:
                self._fold_fail(base, fold, "its operands are folded differently")
            at = shifted
        for t in tensors:
            i = at.dim - (nd - t.dim())
            if isinstance(t, torch.Tensor) and self._fold_of(t) is None and 0 <= i < t.dim() and t.shape[i] > 1:
                self._fold_fail(base, fold, f"a plain operand of shape {tuple(t.shape)} varies along the folded dim")
        return at

    def _f_sdpa(self, func, base, args, kwargs, stateful, fold):
        q, k, v = args[0], args[1], args[2]
        mask = fg._arg(args, kwargs, 3, "attn_mask")
        if any(self._fold_of(t) is None for t in (q, k, v)):
            self._fold_fail(base, fold, "its queries, keys and values are not all folded")
        at = self._batched_fold(base, fold, q.dim(), [q, k, v] + ([mask] if isinstance(mask, torch.Tensor) else []))
        if float(fg._arg(args, kwargs, 4, "dropout_p", 0.0)) > 0.0:
            out = self._draw(func, args, kwargs, fold.slab, q.device)
        else:
            out = func(*args, **kwargs)
        self._set_fold(out, at)
        return out

    # -- per-sample calls: the folded dim is the batch

    def _per_sample(self, base, args, kwargs, fold):
        """Refuse unless the folded dim is the batch dim of a call that computes every sample alone."""
        x = args[0]
        if self._fold_of(x) is None or fold.dim != 0:
            self._fold_fail(base, fold, "the folded dim is not its batch dim (dim 0)")
        found: list = []
        fg._walk((args[1:], kwargs), found)
        if any(fg._is_tagged(v) for v in found):
            self._fold_fail(base, fold, "its sizes are read from a slab")

    def _f_conv(self, func, base, args, kwargs, stateful, fold):
        self._per_sample(base, args, kwargs, fold)
        return self._kept(func, args, kwargs, fold)

    _f_pool = _f_conv
    _f_interpolate = _f_conv
    _f_pixel_shuffle = _f_conv
    _f_channel_op = _f_conv

    def _f_spatial_norm(self, func, base, args, kwargs, stateful, fold):
        if base == "instance_norm" and fg._arg(args, kwargs, 1, "running_mean") is not None:
            self._fold_fail(base, fold, "it updates running statistics from the batch")
        return self._f_conv(func, base, args, kwargs, stateful, fold)

    def _f_batch_norm(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        training = fg._arg(args, kwargs, 5, "training", False)
        if self._fold_of(x) is None or fold.dim == 1 or training or fg._arg(args, kwargs, 1, "running_mean") is None:
            self._fold_fail(base, fold, "it takes batch statistics (training mode) or its channels are folded")
        return self._kept(func, args, kwargs, fold)

    def _f_pad(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        pad = list(fg._arg(args, kwargs, 1, "pad"))
        if self._fold_of(x) is None or fold.dim >= x.dim() - len(pad) // 2 or any(fg._is_tagged(p) for p in pad):
            self._fold_fail(base, fold, "it pads the folded dim, or by sizes read from a slab")
        return self._kept(func, args, kwargs, fold)

    def _f_roll(self, func, base, args, kwargs, stateful, fold):
        x = args[0]
        dims = fg._arg(args, kwargs, 2, "dims")
        shifts = fg._arg(args, kwargs, 1, "shifts")
        dims = [] if dims is None else [dims] if isinstance(dims, int) else list(dims)
        shifts = [shifts] if not isinstance(shifts, (list, tuple)) else list(shifts)
        if not dims or any(d % x.dim() == fold.dim for d in dims) or any(fg._is_tagged(s) for s in shifts):
            self._fold_fail(base, fold, "it rolls along the folded dim (or the flattened tensor)")
        return self._kept(func, args, kwargs, fold)

    def _f_create(self, func, base, args, kwargs, stateful, fold):
        # (``x.new_zeros(sizes)``: the layout follows the sizes, not ``x``; a fold length among
        # them is refused by ``_sized_state``.)
        return self._h_create(func, base, args, kwargs, stateful)


_FOLD_HANDLERS = {name[3:]: fn for name, fn in vars(FoldCalls).items() if name.startswith("_f_") and callable(fn)}
for _kind in ("transpose", "permute", "movedim", "unsqueeze", "squeeze"):
    _FOLD_HANDLERS[_kind] = FoldCalls._f_dim_map
_FOLD_HANDLERS["view_as"] = FoldCalls._f_reshape
