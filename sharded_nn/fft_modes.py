"""The lowest Fourier modes of a sharded tensor, and back: spectral layers without all-to-alls.

A Fourier neural operator's spectral convolution keeps a few modes per dim (16 of 1024) and sets
the rest to zero. Transforming the whole spectrum on slabs (``sharded_nn.fft``) moves the whole
activation through two all-to-alls per sharded dim and direction, to keep a sliver of it. Here
only the kept modes are made, as the single device's ``rfftn`` would give them:

- **Forward** (``kept_spectrum``): every rank transforms its own rows. Along the last dim (halved
  by the real transform) a whole dim is ``torch.fft.rfft`` then cropped; along the other dims,
  and along a sharded last dim, the kept frequencies are a small matrix product with the
  discrete Fourier transform's rows for those frequencies and the slab's positions. Each rank's
  result is its slab's part of a sum over positions; one all-reduce of the small mode tensor
  (``comm.all_reduce_sum``) completes it, the same on every rank.
- **Inverse** (``from_kept_spectrum``): every rank holds all kept modes, so each makes its own
  rows of ``irfftn`` with no communication: the inverse transform's columns for its positions,
  then ``torch.fft.irfft`` along a whole last dim (or the real part's product, along a sharded
  one).

Cost per call: one all-reduce of ``N * C * prod(kept modes)`` complex numbers, instead of four
all-to-alls of the activation; the slabs' own transforms are the single device's work divided by
the number of ranks, less (the dims but the last are transformed for the kept columns only). Any
grid dims may be sharded, the last one included (there the whole-spectrum route is refused).

The kept modes of a dim of length ``n`` with ``m`` modes: frequencies ``0..m-1`` and ``n-m..n-1``
(``x_ft[:m]`` and ``x_ft[-m:]``: both ends, low positive and low negative) for every dim but the
last, which keeps ``0..m-1``; the compact spectrum lays them out as ``[low, high]`` (``2m`` rows)
along each dim. That needs ``2m <= n`` (the ends must not overlap; a spectral layer that keeps
more modes uses the whole-spectrum route) and ``m <= n // 2 + 1`` on the last dim. ``norm`` is
torch's default (``"backward"``: the inverse divides by the number of positions).

Public: ``rfftn_modes(x, mesh, modes, dim)`` and ``irfftn_modes(z, like, mesh, dim)`` for a
spectral layer of a user's own (the zoo FNO's ``ShardedSpectralConv`` calls the internals with
its agreed layout).

Arithmetic: float64 phases (each ``f * h`` reduced modulo ``n`` in integers first), then the
input's precision. The matrix products give the same modes as torch's FFT to rounding (float64:
~1e-15 relative; float32: ~1e-6), and their gradients are the exact adjoints, as torch's are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_sum, gather_layouts
from .errors import ShardingError
from .fft import _local
from .mesh import domain_axes, group_over
from .sharding import default_dims

__all__ = ["check_modes", "fits", "from_kept_spectrum", "irfftn_modes", "kept_spectrum", "rfftn_modes"]


def rfftn_modes(
    x: torch.Tensor, mesh: DeviceMesh, modes: int | Sequence[int], dim: Sequence[int] | None = None, *,
    sharded_dims=None,
) -> torch.Tensor:
    """The lowest ``modes`` of ``torch.fft.rfftn(whole, dim=dim)``, from this rank's slab ``x``.

    Args:
        x: this rank's slab (real), sharded along ``sharded_dims`` (default: the first spatial
            dims), uneven slabs allowed.
        modes: kept modes per dim of ``dim`` (an int for all): frequencies ``[:m]`` and ``[-m:]``
            of each dim but the last, ``[:m]`` of the last (the halved one); ``2m <= n`` on every
            dim but the last, ``m <= n // 2 + 1`` on the last.
        dim: the transformed dims (default: the last ``len(modes)`` dims; required for an int
            ``modes``); any of them may be sharded.

    Returns the compact spectrum, the same on every rank of the axes that shard the transformed
    dims (a sharded dim that is not transformed stays sharded): ``x``'s global shape with each
    transformed dim replaced by ``2m`` (the ``[:m]`` frequencies, then the ``[-m:]`` ones) and the
    last by ``m``. One all-reduce of it; the backward sums its gradient over the ranks.
    """
    dims, modes = _dims_and_modes(x, modes, dim, "rfftn_modes")
    rows, group = _rows(x, mesh, dims, sharded_dims, "sharded_nn.fft_modes.rfftn_modes")
    sizes = [rows[d][2] for d in dims]
    check_modes(sizes, modes, dims, "sharded_nn.fft_modes.rfftn_modes")
    _check_fits(sizes, modes, "sharded_nn.fft_modes.rfftn_modes")
    return kept_spectrum(x, rows, dims, modes, group)


def irfftn_modes(
    z: torch.Tensor, like: torch.Tensor, mesh: DeviceMesh, dim: Sequence[int], *, sharded_dims=None
) -> torch.Tensor:
    """This rank's slab of ``torch.fft.irfftn(full, s=whole.shape[dim], dim=dim)``, in ``like``'s layout.

    Args:
        z: a compact spectrum as ``rfftn_modes`` returns it (the same on every rank; the kept
            modes are read from its shape: ``2m`` rows per dim but the last, ``m`` on the last);
            ``full`` is the spectrum holding it, zeros elsewhere.
        like: a slab with the output's layout (the input of ``rfftn_modes``, say): its global
            lengths along ``dim`` are the output's sizes ``s``, its slabs the output's.
        dim: the transformed dims, as ``rfftn_modes`` transformed them (the last one halved).

    No communication; the backward gives each rank the part of ``z``'s gradient from its rows
    (summed over the ranks by ``rfftn_modes``' backward).
    """
    what = "sharded_nn.fft_modes.irfftn_modes"
    if z.dim() != like.dim():
        raise ShardingError(f"{what}: z has {z.dim()} dims and like {like.dim()}; they must match.")
    dims = [int(d) % like.dim() for d in dim]
    if any(z.shape[d] % 2 for d in dims[:-1]):
        raise ShardingError(
            f"{what}: z's length along each transformed dim but the last must be 2 * modes (both ends), got "
            f"{[z.shape[d] for d in dims[:-1]]} along {dims[:-1]}."
        )
    modes = [z.shape[d] // 2 for d in dims[:-1]] + [z.shape[dims[-1]]]
    rows, _ = _rows(like, mesh, dims, sharded_dims, what)
    sizes = [rows[d][2] for d in dims]
    check_modes(sizes, modes, dims, what)
    _check_fits(sizes, modes, what)
    return from_kept_spectrum(z, rows, dims, modes)


def _dims_and_modes(x, modes, dim, what) -> tuple[list[int], list[int]]:
    if dim is None:
        if isinstance(modes, int):
            raise ShardingError(f"sharded_nn.fft_modes.{what}: give dim with an int modes (which dims to transform).")
        dim = range(x.dim() - len(modes), x.dim())
    dims = [int(d) % x.dim() for d in dim]
    modes = [modes] * len(dims) if isinstance(modes, int) else [int(m) for m in modes]
    if len(modes) != len(dims) or len(set(dims)) != len(dims) or any(m < 1 for m in modes):
        raise ShardingError(
            f"sharded_nn.fft_modes.{what}: modes {modes} must be positive, one per transformed dim {dims} "
            "(distinct dims)."
        )
    return dims, modes


def _rows(x, mesh, dims, sharded_dims, what):
    """Every transformed dim's (slab start, length, global length), and the group over the axes
    that shard them (``None`` where none does), from one agreement of the layouts."""
    if sharded_dims is None:
        sharded_dims = default_dims(mesh)
    sharded_dims = [d % x.dim() for d in ((sharded_dims,) if isinstance(sharded_dims, int) else sharded_dims)]
    axes = domain_axes(mesh)[: len(sharded_dims)]
    layouts = gather_layouts(x.shape, mesh, sharded_dims, what=what, allow_empty=True)
    rows = {d: (0, x.shape[d], x.shape[d]) for d in dims}
    used = []
    for d, a, lay in zip(sharded_dims, axes, layouts):
        r = mesh.get_local_rank(a)
        if d in rows:
            rows[d] = (lay.starts[r], lay.sizes[r], lay.size)
            used.append(a)
    return rows, (group_over(mesh, used) if used else None)


def _check_fits(sizes, modes, what) -> None:
    if not fits(sizes, modes):
        raise ShardingError(
            f"{what}: modes {list(modes)} overlap at the two ends of a dim of lengths {list(sizes)} (2 * modes > "
            "length); keep at most half of each dim's length, or use sharded_nn.fft.rfftn and crop."
        )

#: Per transformed dim: (this slab's global start, its length, the dim's global length).
Rows = Mapping[int, "tuple[int, int, int]"]


def fits(sizes: Sequence[int], modes: Sequence[int]) -> bool:
    """Whether ``modes`` (per transformed dim, last one halved) can be kept as two separate ends:
    ``2m <= n`` on every dim but the last, ``m <= n // 2 + 1`` on the last."""
    *rest, last = zip(sizes, modes)
    return all(2 * m <= n for n, m in rest) and last[1] <= last[0] // 2 + 1


def kept_spectrum(
    x: torch.Tensor, rows: Rows, dims: Sequence[int], modes: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The kept modes of ``torch.fft.rfftn(whole, dim=dims)``, from this rank's slab ``x``.

    Args:
        x: this rank's slab (real).
        rows: every transformed dim's (slab start, slab length, global length); a whole dim is
            ``(0, n, n)``.
        dims: the transformed dims, distinct and non-negative, in any order; the last is the
            halved one (as ``torch.fft.rfftn`` halves the last of its ``dim``).
        modes: kept modes per dim of ``dims``; ``fits`` must hold.
        group: the ranks whose slabs make up the whole (``None``: this rank holds all of it).

    Returns the compact spectrum, the same on every rank of ``group``: ``x``'s shape with each
    transformed dim replaced by ``2m`` (``[low, high]`` frequencies) or, for the last, ``m``.
    Autograd: the backward sums the modes' gradients over ``group`` (``all_reduce_sum``).
    """
    last = dims[-1]
    start, n, total = rows[last]
    if n == total:  # whole: the FFT, cropped (one copy of the kept columns, so the full
        # half-spectrum is freed now and nothing large is saved for the backward)
        z = _local("rfft", x, last, None, None)[(slice(None),) * last + (slice(0, modes[-1]),)].contiguous()
    else:
        z = _real_rows_to_modes(x, last, start, n, total, modes[-1])
    for d, m in zip(dims[:-1], modes[:-1]):
        z = _contract(z, d, _forward_matrix(*rows[d], m, z.dtype, z.device))
    if group is not None and group.size() > 1:
        z = torch.view_as_complex(all_reduce_sum(torch.view_as_real(z), group, owned=True))
    return z


def from_kept_spectrum(z: torch.Tensor, rows: Rows, dims: Sequence[int], modes: Sequence[int]) -> torch.Tensor:
    """This rank's slab of ``torch.fft.irfftn(full, s=totals, dim=dims)``, where ``full`` is the
    spectrum that holds the compact ``z`` (``kept_spectrum``'s layout) and zeros elsewhere.

    ``z`` must be the same on every rank (as ``kept_spectrum`` returns it); no communication.
    Autograd: each rank's gradient of ``z`` is the part from its own rows (a partial sum, as the
    gradient convention has it for a replicated value).
    """
    for d, m in zip(dims[:-1], modes[:-1]):
        z = _contract(z, d, _inverse_matrix(*rows[d], m, z.dtype, z.device))
    last = dims[-1]
    start, n, total = rows[last]
    if n == total:
        pad = total // 2 + 1 - z.shape[last]
        z = torch.nn.functional.pad(z, (0, 0) * (z.dim() - 1 - last) + (0, pad)) if pad else z
        return _local("irfft", z, last, total, None)
    return _modes_to_real_rows(z, last, start, n, total)


# ------------------------------------------------------------------------------ the matrices


def _phases(start: int, n: int, total: int, freqs: torch.Tensor) -> torch.Tensor:
    """``2 pi f h / total`` for h in ``[start, start + n)`` (rows) and f in ``freqs`` (columns),
    float64, with ``f * h`` reduced modulo ``total`` in integers (exact for any length)."""
    h = torch.arange(start, start + n, dtype=torch.int64)
    return (h[:, None] * freqs[None, :] % total).to(torch.float64) * (2 * math.pi / total)


def _both_ends(total: int, m: int) -> torch.Tensor:
    return torch.cat([torch.arange(m), torch.arange(total - m, total)])


def _forward_matrix(start, n, total, m, dtype, device) -> torch.Tensor:
    """(n, 2m): ``exp(-2 pi i f h / total)``, the kept frequencies' rows of the DFT for these positions."""
    ph = _phases(start, n, total, _both_ends(total, m))
    return torch.polar(torch.ones_like(ph), -ph).to(dtype=dtype, device=device)


def _inverse_matrix(start, n, total, m, dtype, device) -> torch.Tensor:
    """(2m, n): ``exp(2 pi i f h / total) / total``: the inverse DFT from the kept frequencies to these positions."""
    ph = _phases(start, n, total, _both_ends(total, m))
    return torch.polar(torch.full_like(ph, 1.0 / total), ph).t().to(dtype=dtype, device=device)


def _contract(z: torch.Tensor, d: int, matrix: torch.Tensor) -> torch.Tensor:
    """``z`` with dim ``d`` (length ``matrix.shape[0]``) replaced by ``z``'s product with ``matrix``."""
    return (z.movedim(d, -1) @ matrix).movedim(-1, d)


def _real_rows_to_modes(x, d, start, n, total, m) -> torch.Tensor:
    """The r2c transform's first ``m`` frequencies of this slab's rows of dim ``d`` (a partial sum
    over positions): one real product with the (cos, -sin) columns interleaved, read as complex."""
    ph = _phases(start, n, total, torch.arange(m))
    e = torch.stack([ph.cos(), -ph.sin()], -1).reshape(n, 2 * m).to(dtype=x.dtype, device=x.device)
    y = x.movedim(d, -1) @ e
    return torch.view_as_complex(y.unflatten(-1, (m, 2))).movedim(-1, d)


def _modes_to_real_rows(z, d, start, n, total) -> torch.Tensor:
    """The c2r inverse along dim ``d`` for this slab's positions, from its first ``m`` frequencies
    (the rest zero): ``sum_k c_k Re(z_k exp(2 pi i k h / total)) / total``, with ``c_k = 1`` at
    frequency 0 and at ``total / 2`` and 2 elsewhere (as torch's ``irfft`` counts the half
    spectrum; the imaginary parts at those two are ignored, as torch ignores them)."""
    m = z.shape[d]
    ph = _phases(start, n, total, torch.arange(m))
    c = torch.full((m,), 2.0 / total, dtype=torch.float64)
    c[0] = 1.0 / total
    if total % 2 == 0 and m > total // 2:
        c[total // 2] = 1.0 / total
    g = torch.stack([(c * ph.cos()).t(), (-c * ph.sin()).t()], 1).reshape(2 * m, n)
    zr = torch.view_as_real(z.movedim(d, -1).resolve_conj().contiguous()).flatten(-2)  # z may be a conjugate view
    return (zr @ g.to(dtype=zr.dtype, device=zr.device)).movedim(-1, d)


def check_modes(sizes: Sequence[int], modes: Sequence[int], dims: Sequence[int], what: str) -> None:
    """Raise where the single device's crops would not hold ``modes`` (there: its einsum's size
    error): more modes than positions along a dim, or than ``n // 2 + 1`` along the last."""
    for k, (n, m, d) in enumerate(zip(sizes, modes, dims)):
        last = k == len(sizes) - 1
        have = n // 2 + 1 if last else n
        if m > have:
            kind = f"a half spectrum of {have} frequencies (a grid of {n})" if last else f"a grid of {n} positions"
            raise ShardingError(
                f"{what}: {m} modes along dim {d} need a grid of at least that many frequencies, got {kind}; use "
                "fewer modes or a larger grid."
            )
