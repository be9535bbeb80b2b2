"""Global reductions over sharded dims: ``sum``, ``mean``, ``max``, ``argmax``, ``norm``, ``var``, ``std``,
and ``softmax`` / ``log_softmax`` / ``cumsum`` along a sharded dim.

For heads (global pooling, then a Linear on the replicated features) and for losses. ``x`` is
this rank's slab of a tensor sharded along ``sharded_dims`` (default: ``default_dims(mesh)``,
the first spatial dims, one per domain axis, as for every grid layer); ``dims`` are the dims to
reduce. Reducing a sharded
dim all-reduces over the domain axis that shards it, so the result is *replicated* over those
ranks; dims that are sharded but not reduced stay sharded.

Autograd follows the gradient convention (DESIGN.md section 3): the global loss is the sum of the
per-rank losses. The result is a *value* replicated over the reducing ranks, not a loss: its
gradient on each rank is taken as partial, and the backward of ``comm.all_reduce_sum`` sums those
partial gradients, so every rank's input gradient is exact. A loss computed from a replicated
value is therefore counted once per rank unless it is shared: write
``losses.share(loss, mesh).backward()`` (or use ``losses.global_mean`` / ``losses.mse_loss``,
which share for you). ``reductions.mean(err, mesh).backward()`` on every rank gives P times the
gradient, exactly as summing P identical per-rank losses would; called from a script (not inside
a converted model's forward, whose own outputs are checked), a small replicated result behind
``losses.check_seeded`` warns where a rank's backward starts on it with ones (that mistake).

Precision: sums and counts accumulate in float32 for fp16/bf16 inputs (in the input dtype
otherwise), as torch's own reductions do, and the result has the input dtype. ``max`` splits the gradient evenly among all
elements equal to the maximum, on every rank that holds one, like ``torch.amax``. ``argmax``
and ``argmin`` return *global* indices (the first extreme position, like ``torch.argmax``; with
``dim=None`` the flat index into the whole tensor); they have no gradient.
``norm`` is ``torch.linalg.vector_norm`` (sum of ``|x|^p`` over the ranks, then the root; ``inf``
through ``max``), with torch's zero gradient where the norm is zero. ``var`` and ``std`` take two
passes (the global mean, then the global sum of squared deviations), as stable as torch's own,
and their gradient does not travel back through the mean (its contribution is exactly zero).

Every rank first agrees on the layout (``gather_layouts``), so bad input raises the same error
on every rank.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_max, all_reduce_sum, gather_layouts
from .comm.collectives import all_gather_stacked
from .comm.sizes import check_cut, scope_declare, scope_forget
from .errors import ShardingError
from .layout import Layout
from .mesh import axis_index, axis_size, domain_axes, group_over
from .sharding import default_dims

__all__ = [
    "argmax", "argmin", "cumsum", "log_softmax", "logsumexp", "max", "max_dim", "mean", "norm", "softmax", "std",
    "std_mean", "sum", "var", "var_mean",
]


def _plan(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None,
    sharded_dims: int | Sequence[int] | None,
    what: str,
    keepdim: bool = False,
    needs_data: bool = False,
) -> tuple[tuple[int, ...], list[str], dict[int, tuple[str, Layout]]]:
    """(reduced dims, mesh axes to reduce over, {sharded dim: (axis, layout)}).

    ``sharded_dims``: one dim per domain axis in order, ``None`` for an axis that shards none
    (the tensor is replicated over it: the columns of a 2x2 mesh after a reduction over the rows).
    Empty slabs (a rank left without rows by a deep stage on many ranks, a crop) take part:
    each reduction gives its identity there (a sum's zeros, a maximum's lowest value). Refused
    alike on every rank where ``needs_data`` and a reduced sharded dim is empty on every rank
    (torch's ``amax`` and ``argmax`` of nothing raise too).
    """
    all_axes = domain_axes(mesh)
    if sharded_dims is None:
        sharded_dims = default_dims(mesh)
    sharded_dims = (sharded_dims,) if isinstance(sharded_dims, int) else tuple(sharded_dims)
    check_cut(x, sharded_dims, what)
    pairs = [(d, a) for d, a in zip(sharded_dims, all_axes) if d is not None]
    sharded_dims, axes = tuple(d for d, _ in pairs), tuple(a for _, a in pairs)
    # Inside a converted model's layout scope the input's layout is usually known (no collective).
    layouts = gather_layouts(x.shape, mesh, sharded_dims, what=what, scoped=True, axes=axes, allow_empty=True)
    nd = x.dim()
    if dims is None:
        dims = tuple(range(nd))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if any(not -nd <= d < nd for d in dims) or len({d % nd for d in dims}) != len(dims):
        raise ShardingError(f"{what}: dims {dims} must be distinct dims of a {nd}-d tensor (shape {tuple(x.shape)}).")
    dims = tuple(sorted(d % nd for d in dims))
    sharded = {d % nd: (a, lay) for d, a, lay in zip(sharded_dims, axes, layouts)}
    reduce_axes = [a for a in axes if any(sharded.get(d, (None,))[0] == a for d in dims)]
    if needs_data:
        for d in dims:
            if d in sharded and sharded[d][1].size == 0:
                raise ShardingError(f"{what}: dim {d} is empty on every rank (sizes {sharded[d][1].sizes}); "
                                    "the extreme of nothing is undefined (torch raises too). Reduce a non-empty tensor.")
    if axes == all_axes[: len(axes)]:
        _declare_output(mesh, nd, dims, tuple(d % nd for d in sharded_dims), layouts, keepdim)
    else:
        scope_forget()  # (the scope describes tensors sharded by the leading axes only)
    _PLANNED.axes = reduce_axes
    return dims, reduce_axes, sharded


#: The mesh axes the last ``_plan`` of this thread reduces over (read by ``_seed_checked``).
_PLANNED = threading.local()
#: Results up to this many elements are checked (losses, per-sample values): the check reads the gradient.
SEED_CHECKED_NUMEL = 4096


def _seed_checked(fn):
    """``fn``'s replicated result behind ``losses.check_seeded`` where a script calls it.

    ``reductions.mean(err, mesh).backward()`` without ``share`` counts the loss once per rank:
    P times the gradient, silently (the README's gradient convention). A converted model checks
    its own small replicated outputs; a reduction called after the model, on its slab output, was
    not checked. Now a small result that needs a gradient warns where a rank's backward starts on
    it with ones. Not inside a guarded forward (the model's outputs are checked there, and the
    guard's own routes call these) nor under ``torch.compile``.
    """
    what = f"the result of sharded_nn.reductions.{fn.__name__}"

    @functools.wraps(fn)
    def checked(x, mesh, *args, **kwargs):
        _PLANNED.axes = None
        out = fn(x, mesh, *args, **kwargs)
        axes = _PLANNED.axes
        if not axes or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return out
        from .forward_guard import guard_active

        if guard_active():
            return out
        from .losses import check_seeded

        ranks = math.prod(axis_size(mesh, a) for a in axes)
        if ranks == 1:
            return out

        def one(t):
            if not (isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()):
                return t
            if t.numel() > SEED_CHECKED_NUMEL:
                return t
            return check_seeded(t, group_over(mesh, axes), ranks, what)

        return tuple(one(t) for t in out) if isinstance(out, tuple) else one(out)

    return checked


def _declare_output(mesh, nd: int, dims: tuple[int, ...], sharded_dims: tuple[int, ...], layouts, keepdim: bool) -> None:
    """Tell the layout scope the output's layout (the scope's rule: declare it or forget).

    All sharded dims reduced: the output is replicated, no sharded layout is made. None reduced:
    the output keeps the input's layouts, at shifted dims when reduced dims before them are
    dropped. Some reduced: a tensor sharded along fewer dims than the mesh has axes, which the
    scope does not describe, so it forgets. Every rank decides from the same agreed facts.
    """
    reduced = [d for d in sharded_dims if d in dims]
    if len(reduced) == len(sharded_dims):
        return
    if reduced:
        scope_forget()
        return
    if keepdim:
        return  # same dims, same ndim: the input's layout, already known to the scope
    out_dims = tuple(d - len([r for r in dims if r < d]) for d in sharded_dims)  # (this module shadows sum)
    scope_declare(mesh, out_dims, nd - len(dims), layouts)


def _reduce_sum(t: torch.Tensor, mesh: DeviceMesh, axes: list[str]) -> torch.Tensor:
    # ``t`` is always a partial sum made here for the purpose (owned: reduced in place without grad).
    return all_reduce_sum(t, group_over(mesh, axes), owned=True) if axes else t


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp16/bf16 (what torch's reductions accumulate in), else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@_seed_checked
def sum(  # noqa: A001 - mirrors torch.sum
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.sum(x_full, dims, keepdim)`` from slabs; replicated over the reducing ranks.

    Args:
        x: this rank's slab.
        mesh: mesh with domain axes.
        dims: dims to reduce (default: all).
        keepdim: keep reduced dims with size 1.
        sharded_dims: dims of ``x`` sharded by the domain axes, one per axis in order, ``None``
            for an axis that shards none (default: the first spatial dims).
    """
    dims, axes, _ = _plan(x, mesh, dims, sharded_dims, "reductions.sum", keepdim)
    if not x.is_floating_point():
        return _reduce_sum(x.sum(dims, keepdim=keepdim), mesh, axes)
    # Partial sums cross ranks in the accumulation dtype: rounding each rank's partial sum to
    # bf16 before adding them would round P times where torch rounds once.
    total = _reduce_sum(x.sum(dims, keepdim=keepdim, dtype=accumulation_dtype(x.dtype)), mesh, axes)
    return total.to(x.dtype)


@_seed_checked
def mean(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.mean(x_full, dims, keepdim)`` from slabs (exact on uneven slabs); see ``sum``."""
    dims, axes, sharded = _plan(x, mesh, dims, sharded_dims, "reductions.mean", keepdim)
    # The count comes from the agreed global layout: an exact Python int on every rank.
    count = math.prod(sharded[d][1].size if d in sharded else x.shape[d] for d in dims)
    total = _reduce_sum(x.sum(dims, keepdim=keepdim, dtype=accumulation_dtype(x.dtype)), mesh, axes)
    if total.requires_grad:
        return (total / count).to(x.dtype)
    # No graph (``no_grad``, or an input that needs no gradient): ``total`` is this call's own
    # buffer, divided in place (the same rounding as the division above).
    total.div_(count)
    return total if total.dtype == x.dtype else total.to(x.dtype)


@_seed_checked
def max(  # noqa: A001 - mirrors torch.amax
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.amax(x_full, dims, keepdim)`` from slabs; see ``sum``.

    The gradient is split evenly among all elements equal to the maximum (on every rank that
    holds one), exactly like ``torch.amax``. NaNs are not supported.
    """
    dims, axes, _ = _plan(x, mesh, dims, sharded_dims, "reductions.max", keepdim, needs_data=True)
    return _amax(x, mesh, dims, axes, keepdim)


def _amax(x: torch.Tensor, mesh: DeviceMesh, dims: tuple[int, ...], axes: list[str], keepdim: bool) -> torch.Tensor:
    """``max``'s body once the plan is agreed."""
    if not axes:
        return x.amax(dims, keepdim=keepdim)
    group = group_over(mesh, axes)
    top = all_reduce_max(_local_top(x.detach(), dims), group)
    if not x.is_floating_point():  # no gradient to route
        return top if keepdim else top.squeeze(dims)
    hit = x.detach() == top
    acc = accumulation_dtype(x.dtype)
    # Tie counts in the accumulation dtype: bf16 cannot count past 256 exactly.
    ties = all_reduce_sum(hit.sum(dims, keepdim=True, dtype=acc), group)
    # The value is ``top`` plus an exact zero whose gradient is hit / ties, summed over the ranks
    # by all_reduce_sum's backward. (Written as ``x - top`` where x is maximal, the zero was
    # NaN where the maximum is infinite: a line of -inf gave NaN where torch gives -inf.)
    zero = all_reduce_sum(_ZeroRoutedToTies.apply(x, (hit / ties).to(x.dtype), top.shape), group)
    out = top + zero
    return out if keepdim else out.squeeze(dims)


class _ZeroRoutedToTies(torch.autograd.Function):
    """Zeros of the reduced shape whose gradient reaches ``x`` with the weights ``share`` (each
    maximal element's share of the ties)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, share: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        ctx.save_for_backward(share)
        return x.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (share,) = ctx.saved_tensors
        return grad * share, None, None


def argmax(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.argmax(x_full, dim, keepdim)`` from slabs: *global* indices along ``dim``, or
    (``dim=None``, since session 60) the global flat index into the whole tensor.

    Ties resolve to the first (lowest global index) maximum, like ``torch.argmax``. No gradient.
    NaNs are not supported.
    """
    return _arg_extreme(x, mesh, dim, keepdim, sharded_dims, "reductions.argmax", largest=True)


def argmin(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.argmin(x_full, dim, keepdim)`` from slabs; see ``argmax``."""
    return _arg_extreme(x, mesh, dim, keepdim, sharded_dims, "reductions.argmin", largest=False)


def _arg_extreme(x, mesh, dim, keepdim: bool, sharded_dims, what: str, largest: bool) -> torch.Tensor:
    if dim is not None and not isinstance(dim, int):
        raise ShardingError(f"{what}: dim must be one int or None, got {dim!r}.")
    plan = _plan(x, mesh, dim, sharded_dims, what, keepdim, needs_data=True)
    return _arg_extreme_planned(x, mesh, dim, keepdim, plan, largest)


def _arg_extreme_planned(x, mesh, dim, keepdim: bool, plan, largest: bool) -> torch.Tensor:
    """``_arg_extreme``'s body once the plan (``_plan``'s result) is agreed."""
    dims, axes, sharded = plan
    x = x.detach()
    if not largest:
        # Order-reversing and exact: the bitwise complement for integers, negation for floats.
        x = -x if x.is_floating_point() else ~x
    if dim is None:
        return _flat_argmax(x, mesh, axes, sharded, keepdim)
    (d,) = dims
    if x.shape[d]:
        idx = x.argmax(d, keepdim=True)
    else:  # an empty slab: a candidate that never wins
        idx = torch.zeros((*x.shape[:d], 1, *x.shape[d + 1 :]), dtype=torch.int64, device=x.device)
    if not axes:
        return idx if keepdim else idx.squeeze(d)
    axis, layout = sharded[d]
    idx = idx + layout.starts[axis_index(mesh, axis)]
    group = group_over(mesh, axes)
    local_top = _local_top(x, (d,))
    top = all_reduce_max(local_top, group)
    # Lowest global index among the ranks that hold the extreme: max of -index. (An empty slab
    # never wins: its candidate, the identity, ties with a line of -inf on the others.)
    big = layout.size
    cand = torch.where(local_top == top, -idx, -big) if x.shape[d] else torch.full_like(idx, -big)
    out = -all_reduce_max(cand, group)
    return out if keepdim else out.squeeze(d)


@_seed_checked
def max_dim(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
    largest: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(x_full, dim, keepdim)`` (``largest=False``: ``torch.min``) from slabs: the
    values and their *global* indices (the first extreme, like torch), replicated over the
    reducing ranks. The values' gradient reaches the one element each index names, on the rank
    that holds it, as torch's does (``max``, like ``torch.amax``, splits it among ties)."""
    what = "reductions.max_dim" if largest else "reductions.min_dim"
    if not isinstance(dim, int):
        raise ShardingError(f"{what}: dim must be one int, got {dim!r}.")
    plan = _plan(x, mesh, dim, sharded_dims, what, keepdim, needs_data=True)  # one agreement for both parts
    idx = _arg_extreme_planned(x, mesh, dim, True, plan, largest)
    dims, axes, sharded = plan
    (d,) = dims
    if not axes:
        values = x.gather(d, idx)
    else:
        axis, layout = sharded[d]
        a = layout.starts[axis_index(mesh, axis)]
        mine = (idx >= a) & (idx < a + x.shape[d])
        if x.shape[d]:
            local = x.gather(d, (idx - a).clamp(0, x.shape[d] - 1))
            local = torch.where(mine, local, torch.zeros((), dtype=x.dtype, device=x.device))
        else:
            local = x.sum(d, keepdim=True)  # an empty slab: zeros, still part of the graph
        # The owner's value plus the others' zeros: the gradient goes to the owner's element.
        values = all_reduce_sum(local, group_over(mesh, axes))
    if not keepdim:
        values, idx = values.squeeze(d), idx.squeeze(d)
    return values, idx


def _lowest(dtype: torch.dtype):
    """The identity of a maximum in ``dtype`` (an empty slab's candidate): -inf for floats."""
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _local_top(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``t.amax(dims, keepdim=True)``, or the identity where a reduced dim is empty here (an
    empty slab: torch's amax refuses it, which would leave this rank alone with an error)."""
    if all(t.shape[d] for d in dims):
        return t.amax(dims, keepdim=True)
    shape = [1 if d in dims else n for d, n in enumerate(t.shape)]
    return torch.full(shape, _lowest(t.dtype), dtype=t.dtype, device=t.device)


def _flat_argmax(x: torch.Tensor, mesh: DeviceMesh, axes: list[str], sharded, keepdim: bool) -> torch.Tensor:
    """The global flat index of the first maximum of the whole tensor (``argmax(dim=None)``)."""
    shape = list(x.shape)
    starts = [0] * x.dim()
    for d, (axis, layout) in sharded.items():
        shape[d] = layout.size
        starts[d] = layout.starts[axis_index(mesh, axis)]
    if x.numel():
        flat = x.reshape(-1)
        i = flat.argmax()
        local_top = flat[i].reshape(1)
        # The slab's row-major order is the whole tensor's restricted to the slab: the slab's
        # first maximum has the lowest global index among its maxima.
        coords = torch.stack(torch.unravel_index(i, x.shape)) + torch.tensor(starts, device=x.device)
        strides = torch.tensor([math.prod(shape[k + 1 :]) for k in range(x.dim())], device=x.device)
        gidx = (coords * strides).sum().reshape(1)
    else:
        local_top = torch.full((1,), _lowest(x.dtype), dtype=x.dtype, device=x.device)
        gidx = torch.full((1,), math.prod(shape), dtype=torch.int64, device=x.device)
    if axes:
        group = group_over(mesh, axes)
        top = all_reduce_max(local_top, group)
        gidx = -all_reduce_max(torch.where(local_top == top, -gidx, -math.prod(shape)), group)
    out = gidx.reshape(())
    return out.reshape([1] * x.dim()) if keepdim else out


def _safe_root(s: torch.Tensor, p: float) -> torch.Tensor:
    """``s ** (1 / p)`` with torch's norm convention at ``s == 0``: value 0, gradient 0 (not NaN).
    A NaN (a variance with no degrees of freedom) stays NaN, as torch's ``std`` gives it."""
    zero = s == 0
    base = torch.where(zero, torch.ones_like(s), s)  # the gradient reaches ``s`` only where s != 0
    root = base.sqrt() if p == 2 else base.pow(1.0 / p)
    return torch.where(zero, torch.zeros_like(root), root)


@_seed_checked
def norm(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    p: float | str = 2,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.linalg.vector_norm(x_full, p, dims, keepdim)`` from slabs; see ``sum``.

    ``p``: any float, ``inf``, ``-inf``, ``0`` (the count of non-zeros: no gradient, as torch's
    is zero) or ``"fro"`` (2). The p-th powers are summed over the ranks in the accumulation dtype
    (float32 for fp16/bf16, as torch does), then the root is taken once: the result equals
    torch's up to the order of summation. Where the norm is zero the gradient is zero, as torch's.
    """
    if p == "fro":
        p = 2
    if isinstance(p, str) or isinstance(p, bool):
        raise ShardingError(f"reductions.norm: p must be a number, inf, -inf or 'fro'; got {p!r}. A matrix norm "
                            "('nuc', spectral) over sharded dims is not supported: gather the tensor first.")
    dims, axes, _ = _plan(x, mesh, dims, sharded_dims, "reductions.norm", keepdim, needs_data=math.isinf(float(p)))
    if not axes:
        return torch.linalg.vector_norm(x, p, dims, keepdim)
    if not (x.is_floating_point() or x.is_complex()):
        raise ShardingError(f"reductions.norm: expected a floating point tensor, got {x.dtype}.")
    if x.is_complex():
        raise ShardingError("reductions.norm: complex tensors over sharded dims are not supported; "
                            "take the norm of x.abs().")
    p = float(p)
    if math.isinf(p):
        a = x.abs()
        return _amax(a, mesh, dims, axes, keepdim) if p > 0 else -_amax(-a, mesh, dims, axes, keepdim)
    acc = accumulation_dtype(x.dtype)
    if p == 0:
        count = _reduce_sum((x.detach() != 0).sum(dims, keepdim=keepdim, dtype=acc), mesh, axes)
        return count.to(x.dtype)
    if p == 1:
        powered = x.abs()
    elif p == 2:
        powered = x * x
    elif p > 1:
        powered = x.abs().pow(p)
    else:
        # |x|^p for p < 1 has an infinite slope at 0 (a NaN gradient there); torch's norm
        # backward gives zeros the gradient 0, and so does this (their value stays |0|^p).
        a = x.abs()
        zero = a == 0
        powered = torch.where(zero, a.detach().pow(p), torch.where(zero, torch.ones_like(a), a).pow(p))
    total = _reduce_sum(powered.sum(dims, keepdim=keepdim, dtype=acc), mesh, axes)
    out = total if p == 1 else _safe_root(total, p)
    return out.to(x.dtype)


def _moments(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None,
    correction: float,
    keepdim: bool,
    sharded_dims: int | Sequence[int] | None,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(variance, mean) over ``dims``, or None where no sharded dim is reduced (torch's own then)."""
    dims, axes, sharded = _plan(x, mesh, dims, sharded_dims, what, keepdim)
    if not axes:
        return None
    if not x.is_floating_point():
        raise ShardingError(f"{what}: expected a floating point tensor, got {x.dtype}.")
    count = math.prod(sharded[d][1].size if d in sharded else x.shape[d] for d in dims)
    acc = accumulation_dtype(x.dtype)
    mean = _reduce_sum(x.sum(dims, keepdim=True, dtype=acc), mesh, axes) / count
    dev = _Deviation.apply(x.to(acc), mean, dims)
    total = _reduce_sum((dev * dev).sum(dims, keepdim=keepdim), mesh, axes)
    dof = count - correction
    if dof >= 0:
        var = total / dof  # no degrees of freedom: inf, or NaN for a zero sum, as torch's
    else:
        # torch's value divides by max(0, dof) (never a negative variance), its gradient by dof.
        var = total / dof + (total / 0 - total / dof).detach()
    if not keepdim:
        mean = mean.squeeze(dims)
    return var.to(x.dtype), mean.to(x.dtype)


class _Deviation(torch.autograd.Function):
    """``x - mean`` (``mean`` the mean of ``x`` over ``dims``, kept), for a variance.

    The mean's own gradient path is zero in a first derivative (the deviations sum to zero, and
    the variance's gradient is ``2 * dev`` times a factor constant over ``dims``), so the
    backward skips it, and the all-reduce behind the mean, there (torch's var backward has no
    such term either). A second derivative (``create_graph``) differentiates ``2 * dev`` itself,
    where the mean's path is not zero: the backward then gives the mean its gradient (recorded,
    through the mean's all-reduce). Every rank builds the same kind of backward, so the
    collectives match.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, mean: torch.Tensor, dims: tuple[int, ...]):  # noqa: D102
        ctx.dims = dims
        return x - mean

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        if not torch.is_grad_enabled():  # a first derivative only
            return g, None, None
        return g, -g.sum(ctx.dims, keepdim=True), None


@_seed_checked
def var(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    correction: float = 1,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.var(x_full, dims, correction=correction, keepdim=keepdim)`` from slabs; see ``sum``."""
    got = _moments(x, mesh, dims, correction, keepdim, sharded_dims, "reductions.var")
    if got is None:
        return torch.var(x, _torch_dims(dims, x), correction=correction, keepdim=keepdim)
    return got[0]


@_seed_checked
def std(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    correction: float = 1,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.std(x_full, dims, correction=correction, keepdim=keepdim)`` from slabs; see ``sum``.

    Where the deviation is zero the gradient is zero, as torch's.
    """
    got = _moments(x, mesh, dims, correction, keepdim, sharded_dims, "reductions.std")
    if got is None:
        return torch.std(x, _torch_dims(dims, x), correction=correction, keepdim=keepdim)
    return _safe_root(got[0], 2)


@_seed_checked
def var_mean(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    correction: float = 1,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.var_mean`` from slabs: (variance, mean); see ``var``."""
    got = _moments(x, mesh, dims, correction, keepdim, sharded_dims, "reductions.var_mean")
    if got is None:
        return torch.var_mean(x, _torch_dims(dims, x), correction=correction, keepdim=keepdim)
    return got


@_seed_checked
def std_mean(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    correction: float = 1,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.std_mean`` from slabs: (standard deviation, mean); see ``std``."""
    got = _moments(x, mesh, dims, correction, keepdim, sharded_dims, "reductions.std_mean")
    if got is None:
        return torch.std_mean(x, _torch_dims(dims, x), correction=correction, keepdim=keepdim)
    return _safe_root(got[0], 2), got[1]


def _torch_dims(dims, x: torch.Tensor):
    return tuple(range(x.dim())) if dims is None else dims


def _log_partition(
    x: torch.Tensor, mesh: DeviceMesh, dim, sharded_dims, what: str, with_shift: bool = False, keepdim: bool = True
):
    """(shifted x, log of the global sum of exp(shifted x)) along sharded ``dim`` (an int or a
    tuple), or None where no dim of them is sharded; ``with_shift``: the shift too. The shift is
    the global max (no gradient: the result does not depend on it)."""
    dims, axes, _ = _plan(x, mesh, dim, sharded_dims, what, keepdim)
    if not axes:
        return None
    acc = accumulation_dtype(x.dtype)
    xs = x.to(acc)
    top = all_reduce_max(_local_top(xs.detach(), dims), group_over(mesh, axes))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of -inf stays NaN-free
    shifted = xs - top
    log_total = _reduce_sum(shifted.exp().sum(dims, keepdim=True), mesh, axes).log()
    return (shifted, log_total, top) if with_shift else (shifted, log_total)


@_seed_checked
def logsumexp(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int | Sequence[int],
    keepdim: bool = False,
    *,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.logsumexp(x_full, dim, keepdim)`` from slabs, along sharded dims too: replicated
    along the reduced sharded dims (the library's gradient convention), computed in the
    accumulation dtype from the global max and one all-reduce of the shifted sums."""
    got = _log_partition(x, mesh, dim, sharded_dims, "reductions.logsumexp", with_shift=True, keepdim=keepdim)
    if got is None:
        return torch.logsumexp(x, dim, keepdim)
    _shifted, log_total, top = got
    out = log_total + top
    if not keepdim:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        out = out.squeeze(tuple(d % x.dim() for d in dims))
    return out.to(x.dtype)


def softmax(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int,
    *,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.softmax(x_full, dim)`` from slabs, along a sharded ``dim`` too; the result keeps
    ``x``'s layout (this rank's slab of the full softmax). Computed in the accumulation dtype."""
    got = _log_partition(x, mesh, dim, sharded_dims, "reductions.softmax")
    if got is None:
        return torch.softmax(x, dim)
    shifted, log_total = got
    return (shifted - log_total).exp().to(x.dtype)


def log_softmax(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int,
    *,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.log_softmax(x_full, dim)`` from slabs; see ``softmax``."""
    got = _log_partition(x, mesh, dim, sharded_dims, "reductions.log_softmax")
    if got is None:
        return torch.log_softmax(x, dim)
    shifted, log_total = got
    return (shifted - log_total).to(x.dtype)


def cumsum(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int,
    *,
    dtype: torch.dtype | None = None,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.cumsum(x_full, dim, dtype=dtype)`` from slabs, along a sharded ``dim`` too; the
    result keeps ``x``'s layout (this rank's slab of the full running sum).

    Each rank adds to its own running sum the totals of the slabs before it (one all-gather of
    one slice per slab); backward is the reversed running sum plus the gradient totals of the
    slabs after it (one all-gather), itself differentiable (second derivatives, ``create_graph``).
    Exact for integers and integer-valued floats (a count of mask positions, as in EdgeNeXt's
    position encoding); other floats are summed in another order than one device's (rounding
    differences only). Sums accumulate in float32 for fp16/bf16 inputs.
    """
    dims, axes, _ = _plan(x, mesh, dim, sharded_dims, "reductions.cumsum", keepdim=True)
    out_dtype = dtype or (torch.int64 if not (x.is_floating_point() or x.is_complex()) else x.dtype)
    if not axes:
        return torch.cumsum(x, dims[0], dtype=dtype)
    acc = accumulation_dtype(out_dtype)
    (axis,) = axes
    return _CumSum.apply(x, dims[0], group_over(mesh, [axis]), axis_index(mesh, axis), acc, out_dtype)


class _CumSum(torch.autograd.Function):
    """The running sum along a dim sharded over ``group`` (this rank at ``rank`` along it), from
    the first position on, or from the last one backwards (``reverse``: the adjoint)."""

    @staticmethod
    def forward(ctx, x, dim, group, rank, acc, out_dtype, reverse=False):  # noqa: D102
        ctx.args, ctx.in_dtype, ctx.reverse = (dim, group, rank, acc), x.dtype, reverse
        xa = x.to(acc)
        if reverse:
            local = xa.flip(dim).cumsum(dim).flip(dim)
            total = local.narrow(dim, 0, 1) if xa.shape[dim] else None
        else:
            local = torch.cumsum(xa, dim)
            total = local.narrow(dim, local.shape[dim] - 1, 1) if xa.shape[dim] else None
        if total is None:  # an empty slab adds nothing to the running sums of the others
            total = xa.new_zeros([1 if d == dim else n for d, n in enumerate(xa.shape)])
        return (local + _earlier_totals(total, group, rank, before=not reverse)).to(out_dtype)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        # The adjoint runs the other way (the reversed running sum plus the gradient totals of
        # the slabs after this one). Applying the Function records its all-gather, so that a
        # second derivative is exact; computed here by plain ops, it would be a constant.
        dim, group, rank, acc = ctx.args
        dx = _CumSum.apply(g, dim, group, rank, acc, ctx.in_dtype, not ctx.reverse)
        return dx, None, None, None, None, None, None


def _earlier_totals(t: torch.Tensor, group, rank: int, *, before: bool) -> torch.Tensor:
    """The sum of ``t`` over the ranks of ``group`` before this one (``before``) or after it."""
    every = all_gather_stacked(t.detach(), group)
    part = every[:rank] if before else every[rank + 1 :]
    return part.sum(0) if part.shape[0] else torch.zeros_like(t)
