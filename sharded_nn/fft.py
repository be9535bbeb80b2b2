"""Discrete Fourier transforms over sharded dims: ``torch.fft`` for slabs.

Spectral models (Fourier neural operators, FourCastNet's AFNO, spectral filters in weather and
CFD codes) transform the whole domain, so every output position depends on every input position.
On slabs, ``fftn``/``ifftn``/``rfftn``/``irfftn`` and their 1-D and 2-D forms here give the
single device's transform, in the input's layout: the spectrum of a tensor sharded along a dim is
sharded along the same dim, with the same slab lengths (frequency rows ``[a, b)`` where the input
held positions ``[a, b)``), so a model's own code after it (crops of the low modes, a pointwise
or ``einsum`` filter, the inverse transform, a residual add) lines up as on one device. The
forward guard routes a converted model's own ``torch.fft`` calls here.

How: a multi-dim transform is the composition of 1-D transforms along its dims. The dims that
are whole on every rank are transformed in place; for a sharded dim, an all-to-all
(``comm.transpose_shards``) makes it whole and splits a partner dim instead (the largest other
dim, so the work stays balanced), the 1-D transform runs, and a second all-to-all restores the
layout. Cost per sharded dim: two all-to-alls of the tensor (each rank sends ``(P - 1) / P`` of
its slab). ``rfft*`` halves its last transformed dim and ``irfft*`` rebuilds it: that dim must not
be sharded (the halved lengths would not match any slab layout of the input); list the dims so
that a whole one is last, or shard another dim. A size ``s``/``n`` along a sharded dim must be
its global length (a padded or cropped transform along it is not supported). ``hfft``/``ihfft``
are not routed. Autograd: every step is differentiable (torch's transforms, the transposes'
inverse as backward); gradients match the single device's.

Every rank decides from the same facts (the dims, the sizes, the layouts gathered on every rank),
so bad input raises the same ``ShardingError`` everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import axis_peers, gather_layouts
from .comm.all_to_all import transpose_shards
from .comm.peers import AxisPeers
from .errors import ShardingError
from .mesh import domain_axes
from .sharding import default_dims

__all__ = ["fft", "fft2", "fftn", "ifft", "ifft2", "ifftn", "irfft", "irfft2", "irfftn", "rfft", "rfft2", "rfftn"]

#: (ring over the ranks that share this dim's other coordinates, every rank's length along it)
Sharded = Mapping[int, "tuple[AxisPeers, tuple[int, ...]]"]

_ONE_D = {"fft": torch.fft.fft, "ifft": torch.fft.ifft, "rfft": torch.fft.rfft, "irfft": torch.fft.irfft}


def transform(
    kind: str,
    x: torch.Tensor,
    sharded: Sharded,
    dims: Sequence[int],
    sizes: Sequence[int | None],
    norm: str | None,
    what: str,
) -> torch.Tensor:
    """The n-dim transform ``kind`` (``fft``, ``ifft``, ``rfft``, ``irfft``) of slab ``x`` over ``dims``.

    Args:
        kind: ``fft``/``ifft``: complex transforms over every dim of ``dims``; ``rfft``: real to
            complex along ``dims[-1]``, then ``fft`` along the rest (``torch.fft.rfftn``);
            ``irfft``: ``ifft`` along ``dims[:-1]``, then complex to real along ``dims[-1]``.
        sharded: every sharded dim of ``x`` (transformed or not), with its ring and lengths.
        dims: the transformed dims (distinct, non-negative), in torch's order.
        sizes: per dim of ``dims``, the transform length (``None``: torch's default).
        norm: torch's ``norm`` (``None``, ``"backward"``, ``"ortho"``, ``"forward"``).
        what: the caller's name for error messages.
    """
    dims = [d % x.dim() for d in dims]
    refused = refusal(kind, dims, sizes, {d: lengths for d, (_, lengths) in sharded.items()})
    if refused is not None:
        why, todo = refused
        raise ShardingError(f"{what}: {why}. {todo[:1].upper()}{todo[1:]}.")
    half = dims[-1] if kind in ("rfft", "irfft") else None
    steps = list(zip(dims, sizes))
    if kind == "rfft":  # r2c first, then the complex transforms (torch.fft.rfftn's order)
        steps = [steps[-1], *steps[:-1]]
    one = {"rfft": "fft", "irfft": "ifft"}.get(kind, kind)
    ops = [kind if kind in ("rfft", "irfft") and d == half else one for d, _ in steps]
    # Whole dims first (no communication), then the sharded ones; r2c stays first and c2r last.
    order = sorted(range(len(steps)), key=lambda i: (ops[i] == "irfft", ops[i] != "rfft", steps[i][0] in sharded))
    for i in order:
        (d, n), op = steps[i], ops[i]
        if d in sharded:
            ring, lengths = sharded[d]
            x = _along_sharded(x, op, d, n, norm, ring, lengths)
        else:
            x = _local(op, x, d, n, norm)
    return x


def refusal(kind: str, dims: Sequence[int], sizes: Sequence, lengths: Mapping[int, Sequence[int]]):
    """(why, what to do) where the transform cannot be computed on these slabs, else ``None``.

    ``dims``: non-negative transformed dims; ``lengths``: every sharded dim's lengths on its ring.
    """
    if len(set(dims)) != len(dims):
        return f"the transformed dims {tuple(dims)} repeat a dim", "name each dim once"
    for d, n in zip(dims, sizes):
        if d in lengths and n is not None and int(n) != sum(lengths[d]):
            return (
                f"the transform length {n} along sharded dim {d} differs from its global length {sum(lengths[d])} "
                "(a padded or cropped transform along a sharded dim is not supported)",
                "pad or crop that dim before sharding, or transform along whole dims only",
            )
    if kind in ("rfft", "irfft") and dims and dims[-1] in lengths:
        return (
            f"torch.fft.{kind}n halves (or rebuilds) its last transformed dim, dim {dims[-1]}, and that dim is "
            "sharded: the halved spectrum has no slab layout matching the input's",
            "list the transformed dims so that a whole (unsharded) dim is last, or shard another dim",
        )
    return None


def _local(op: str, x: torch.Tensor, d: int, n: int | None, norm: str | None) -> torch.Tensor:
    """``torch.fft.<op>`` along whole dim ``d``; an empty slab (no rows here) gives its empty
    result still connected to ``x`` (its backward then runs the same collectives as the others')."""
    if x.numel():
        return _ONE_D[op](x, n=None if n is None else int(n), dim=d, norm=norm)
    m = x.shape[d]
    length = {"rfft": (int(n) if n is not None else m) // 2 + 1, "irfft": int(n) if n is not None else 2 * (m - 1)}
    shape = list(x.shape)
    shape[d] = length.get(op, int(n) if n is not None else m)
    real = op == "irfft"
    dtype = (x.real if x.is_complex() else x).dtype if real else torch.promote_types(x.dtype, torch.complex64)
    anchor = x.sum()
    anchor = (anchor.real if anchor.is_complex() and real else anchor) * 0
    return torch.zeros(shape, dtype=dtype, device=x.device) + anchor


def _along_sharded(x, op: str, d: int, n, norm, ring: AxisPeers, lengths: tuple[int, ...]):
    """``op`` (a complex transform) along sharded dim ``d``: whole after an all-to-all with a
    partner dim, then back."""
    if ring.size == 1:
        return _local(op, x, d, n, norm)
    # The partner: the largest other dim (its length is the same on every rank of this ring: a dim
    # sharded by another mesh axis has this rank's length on all of them); ties go to the first.
    others = [t for t in range(x.dim()) if t != d]
    added = not others or max(x.shape[t] for t in others) == 0
    if added:  # nothing to split: a dim of one, held by the ring's first rank
        x, d, others = x.unsqueeze(0), d + 1, [0]
    t = min(others, key=lambda i: (-x.shape[i], i))
    m, p = x.shape[t], ring.size
    parts = tuple(m // p + (r < m % p) for r in range(p))
    # The transformed dim goes last first: the exchange packs every piece contiguous anyway, and
    # that copy then lays the dim out contiguous, where torch's FFT runs several times faster
    # than along a strided dim (the result is a view with the dims back in place).
    last = x.dim() - 1
    tm = t - (t > d)
    y = transpose_shards(x.movedim(d, last), ring, last, tm, lengths, parts)
    y = _local(op, y, last, n, norm)
    y = transpose_shards(y, ring, tm, last, parts, lengths).movedim(last, d)
    return y.squeeze(0) if added else y


# ------------------------------------------------------------------------------ public functions


def _plan(x: torch.Tensor, mesh: DeviceMesh, sharded_dims, what: str) -> dict:
    """{sharded dim: (ring, lengths)} from one agreement of the layouts (same on every rank)."""
    if sharded_dims is None:
        sharded_dims = default_dims(mesh)
    sharded_dims = (sharded_dims,) if isinstance(sharded_dims, int) else tuple(sharded_dims)
    axes = domain_axes(mesh)
    if len(sharded_dims) > len(axes):
        raise ShardingError(
            f"{what}: sharded_dims {sharded_dims} name more dims than the mesh has domain axes {tuple(axes)}."
        )
    layouts = gather_layouts(x.shape, mesh, sharded_dims, what=what, allow_empty=True)
    return {
        d % x.dim(): (axis_peers(mesh, a), tuple(lay.sizes)) for d, a, lay in zip(sharded_dims, axes, layouts)
    }


def transform_dims(x: torch.Tensor, s, dim) -> tuple[list[int], list]:
    """torch.fft's rules for ``s`` and ``dim``: the transformed dims (non-negative) and their
    lengths (``None``: torch's default); for the 1-D forms pass ``[n]`` (or ``None``) and the dim."""
    if dim is None:
        dims = list(range(x.dim() - len(s), x.dim())) if s is not None else list(range(x.dim()))
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
    if s is not None and len(s) != len(dims):
        raise ShardingError(f"torch.fft: s {tuple(s)} and dim {tuple(dims)} must have the same length.")
    sizes = list(s) if s is not None else [None] * len(dims)
    return [d % x.dim() for d in dims], sizes


def _call(kind: str, x, mesh, s, dim, norm, sharded_dims, name: str) -> torch.Tensor:
    what = f"sharded_nn.fft.{name}"
    dims, sizes = transform_dims(x, s, dim)
    return transform(kind, x, _plan(x, mesh, sharded_dims, what), dims, sizes, norm, what)


def fftn(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=None, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.fftn`` of the tensor whose slab is ``x`` (sharded along ``sharded_dims``,
    default: the first spatial dims); returns this rank's slab of the spectrum, in ``x``'s layout."""
    return _call("fft", x, mesh, s, dim, norm, sharded_dims, "fftn")


def ifftn(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=None, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.ifftn`` of a sharded tensor (see ``fftn``)."""
    return _call("ifft", x, mesh, s, dim, norm, sharded_dims, "ifftn")


def rfftn(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=None, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.rfftn`` of a sharded real tensor; the last transformed dim must be whole."""
    return _call("rfft", x, mesh, s, dim, norm, sharded_dims, "rfftn")


def irfftn(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=None, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.irfftn`` of a sharded half spectrum; the last transformed dim must be whole."""
    return _call("irfft", x, mesh, s, dim, norm, sharded_dims, "irfftn")


def fft2(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=(-2, -1), norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.fft2`` of a sharded tensor (see ``fftn``)."""
    return _call("fft", x, mesh, s, dim, norm, sharded_dims, "fft2")


def ifft2(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=(-2, -1), norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.ifft2`` of a sharded tensor (see ``fftn``)."""
    return _call("ifft", x, mesh, s, dim, norm, sharded_dims, "ifft2")


def rfft2(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=(-2, -1), norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.rfft2`` of a sharded real tensor; the last transformed dim must be whole."""
    return _call("rfft", x, mesh, s, dim, norm, sharded_dims, "rfft2")


def irfft2(x: torch.Tensor, mesh: DeviceMesh, s=None, dim=(-2, -1), norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.irfft2`` of a sharded half spectrum; the last transformed dim must be whole."""
    return _call("irfft", x, mesh, s, dim, norm, sharded_dims, "irfft2")


def fft(x: torch.Tensor, mesh: DeviceMesh, n=None, dim: int = -1, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.fft`` along one dim of a sharded tensor (see ``fftn``)."""
    return _call("fft", x, mesh, None if n is None else [n], dim, norm, sharded_dims, "fft")


def ifft(x: torch.Tensor, mesh: DeviceMesh, n=None, dim: int = -1, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.ifft`` along one dim of a sharded tensor (see ``fftn``)."""
    return _call("ifft", x, mesh, None if n is None else [n], dim, norm, sharded_dims, "ifft")


def rfft(x: torch.Tensor, mesh: DeviceMesh, n=None, dim: int = -1, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.rfft`` along a whole dim of a sharded real tensor (see ``fftn``)."""
    return _call("rfft", x, mesh, None if n is None else [n], dim, norm, sharded_dims, "rfft")


def irfft(x: torch.Tensor, mesh: DeviceMesh, n=None, dim: int = -1, norm: str | None = None, *, sharded_dims=None):
    """``torch.fft.irfft`` along a whole dim of a sharded half spectrum (see ``fftn``)."""
    return _call("irfft", x, mesh, None if n is None else [n], dim, norm, sharded_dims, "irfft")
