"""Sliding windows over sharded dims: halo planning and extension for convolutions and pools.

For a window of span ``e = dilation * (kernel - 1) + 1``, stride ``s`` and global padding
``(pl, pr)`` along a sharded dim, output ``j`` reads inputs ``[j*s - pl, j*s - pl + e)``. A rank
whose slab is ``[a, b)`` computes the outputs whose window starts in its slab, ``j in [a/s, b/s)``;
this needs every slab start to be a multiple of ``s`` (the alignment), and then:

* left: ``pl`` positions, a halo from the left neighbour (global padding on the first rank);
* right: ``e - s - pl`` positions from the right neighbour (global padding ``pr`` on the last
  rank); when negative, the last ``s + pl - e`` positions of the slab are not read and are trimmed;
* outputs: ``(b - a) / s`` on every rank but the last, which also produces the outputs that the
  right padding adds, so the output slabs are again contiguous and aligned to ``align / s``.

All of this depends only on the layout, which every rank shares, so every rank validates the
same facts and raises the same error.

That is the one-hop plan (``WindowPlan.gather is None``): one exchange with the two neighbours,
overlapped with the interior work. When a slab is thinner than the halo (a deep stage on many
ranks), a slab is empty, or a halo reaches past the domain's edge (a dilated conv whose padding
exceeds the rows a rank has before it), the plan is *general* instead: rank r's outputs are the
global outputs ``j`` with ``j*s`` in its slab (none: an empty output slab), each extended
position is mapped to the global row it reads (or to the fill value) by the padding mode, and
``comm.halo_gather`` fetches every row from whichever rank owns it (multi-hop, point-to-point).
Only thin or edge-clipped stages pay for it; the common case keeps the one-hop exchange.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..comm import AxisPeers, HaloSpec, halo_cat, halo_exchange
from ..comm.halo import HaloGather, halo_gather, memory_format_of
from ..errors import ShardingError
from ..layout import Layout
from .base import BoundedCache

PAD_MODES = ("zeros", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class Window:
    """One dim of a sliding window: kernel, stride, dilation and global padding (left, right)."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_left: int = 0
    pad_right: int = 0

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1


@dataclass(frozen=True)
class WindowPlan:
    """How every rank extends its slab along one sharded dim before applying the window.

    Attributes:
        halo: halo widths (right halos clipped at zero).
        trim: positions each rank drops from its right end after the exchange.
        pad_left: global padding the first rank adds (0 when periodic).
        pad_right: global padding the last rank adds (0 when periodic).
        out: the output layout.
        gather: the general (multi-hop) plan, or None for the one-hop exchange of ``halo``. When
            set, ``extend`` returns exactly the positions this rank's outputs read, padding
            included (``trim``, ``pad_left`` and ``pad_right`` are then unused); a rank without
            outputs gets one window of fill, whose single output the layer crops
            (``crop_empty``).
    """

    halo: HaloSpec
    trim: tuple[int, ...]
    pad_left: int
    pad_right: int
    out: Layout
    gather: HaloGather | None = None


def source_index(q: int, n: int, mode: str) -> int:
    """The global position that padded position ``q`` reads along a dim of ``n``; -1: the fill value."""
    if 0 <= q < n:
        return q
    if mode in ("zeros", "constant"):
        return -1
    if mode == "replicate":
        return min(max(q, 0), n - 1)
    if mode == "reflect":
        return -q if q < 0 else 2 * (n - 1) - q
    if mode == "circular":
        return q % n
    raise ValueError(f"source_index: unknown padding mode {mode!r}; expected one of {PAD_MODES}.")


def gather_plan(dim: int, layout: Layout, ranges: Sequence[tuple[int, int]], mode: str) -> HaloGather:
    """The ``HaloGather`` giving rank r the padded global positions ``[lo, hi)`` of ``ranges[r]``.

    Positions outside ``[0, layout.size)`` are mapped by the padding ``mode`` (``source_index``):
    the fill value for zeros, else the row they mirror, repeat or wrap to. ``lo == hi``: nothing.
    """
    n = layout.size
    left, keep, right = [], [], []
    for (a, size), rng in zip(zip(layout.starts, layout.sizes), ranges):
        lo, hi = rng
        b = a + size
        k0, k1 = min(max(lo, a), b), max(min(hi, b), min(max(lo, a), b))
        left.append(tuple(source_index(q, n, mode) for q in range(lo, min(hi, a))))
        keep.append((k0 - a, k1 - k0))
        right.append(tuple(source_index(q, n, mode) for q in range(max(lo, b), hi)))
    return HaloGather(dim, layout.sizes, tuple(left), tuple(keep), tuple(right))


def plan_window(layout: Layout, w: Window, dim: int, *, mode: str, what: str) -> WindowPlan:
    """Plan the extension of ``layout`` along ``dim`` for window ``w``; validates on every rank.

    The one-hop plan where every halo lies inside the direct neighbour's slab and every rank has
    outputs; otherwise the general (multi-hop) plan, see the module docstring.

    Raises:
        ShardingError: misaligned slabs, padding that torch itself refuses on the full tensor
            (reflect wider than the dim, circular wider than the dim), or a window wider than
            the padded domain.
    """
    p = len(layout.sizes)
    periodic = mode == "circular"
    if not layout.is_aligned(w.stride):
        raise ShardingError(
            f"{what}: stride {w.stride} along dim {dim} needs every slab to start at a multiple of "
            f"{w.stride}, but the slabs start at {layout.starts} (sizes {layout.sizes}). Shard the "
            f"input with align a multiple of {w.stride} (the product of the strides of the model)."
        )
    inner_right = w.span - w.stride - w.pad_left
    left = tuple(w.pad_left if (r > 0 or periodic) else 0 for r in range(p))
    right = tuple(max(inner_right, 0) if r < p - 1 else (w.pad_right if periodic else 0) for r in range(p))
    trim = tuple(max(-inner_right, 0) if r < p - 1 else 0 for r in range(p))
    halo = HaloSpec(dim, left, right, periodic)
    out = []
    for r, n in enumerate(layout.sizes):
        reach = w.pad_left + n + (inner_right if r < p - 1 else w.pad_right)
        out.append((reach - w.span) // w.stride + 1)
    reflect_ok = mode != "reflect" or (w.pad_left < layout.sizes[0] and w.pad_right < layout.sizes[-1])
    # An empty slab takes the general plan even where its outputs' rows sit in one neighbour:
    # the one-hop paths convolve the slab itself (the overlapped interior), which torch refuses
    # for an empty dim, on that rank alone (found by tests/test_fuzz_thin.py).
    if halo.fits(layout.sizes) and reflect_ok and min(out) >= 1 and min(layout.sizes) >= 1:
        return WindowPlan(
            halo=halo,
            trim=trim,
            pad_left=0 if periodic else w.pad_left,
            pad_right=0 if periodic else w.pad_right,
            out=Layout(tuple(out), max(1, layout.align // w.stride)),
        )
    return _general_window_plan(layout, w, dim, mode, what, halo)


def _general_window_plan(layout: Layout, w: Window, dim: int, mode: str, what: str, halo: HaloSpec) -> WindowPlan:
    """The multi-hop plan: each rank reads exactly the rows of its outputs, wherever they live."""
    n, s = layout.size, w.stride
    limit = {"reflect": n - 1, "circular": n}.get(mode)
    if limit is not None and max(w.pad_left, w.pad_right) > limit:
        raise ShardingError(
            f"{what}: {mode} padding ({w.pad_left}, {w.pad_right}) along dim {dim} needs at most {limit} "
            f"for a global size of {n} (torch refuses it on one device too). Use a larger input or less padding."
        )
    total = (n + w.pad_left + w.pad_right - w.span) // s + 1
    if total < 1:
        raise ShardingError(
            f"{what}: along dim {dim} the window (kernel {w.kernel}, dilation {w.dilation}, padding "
            f"({w.pad_left}, {w.pad_right})) is wider than the padded global size {n}: no output at all. "
            "Use a larger input."
        )
    out, ranges = [], []
    for r, a in enumerate(layout.starts):
        # The global outputs whose windows start in this slab; the last rank also those that
        # right padding adds. None on a rank whose slab starts past the last output.
        hi = (a + layout.sizes[r]) // s if r < layout.parts - 1 else total
        k = max(min(hi, total) - a // s, 0)
        out.append(k)
        lo = a - w.pad_left
        # A rank without outputs reads one window of fill: its single output is cropped away.
        ranges.append((lo, lo + (k - 1) * s + w.span) if k else None)
    spec_ranges = [rg if rg is not None else (0, 0) for rg in ranges]
    spec = gather_plan(dim, layout, spec_ranges, mode)
    span_fill = tuple((-1,) * w.span for _ in ranges)
    spec = HaloGather(
        dim,
        spec.sizes,
        tuple(lf if rg is not None else span_fill[r] for r, (lf, rg) in enumerate(zip(spec.left, ranges))),
        spec.keep,
        spec.right,
    )
    starts = [sum(out[:r]) for r in range(len(out))]
    align = math.gcd(max(1, layout.align // s), *starts)
    return WindowPlan(
        halo=halo, trim=(0,) * len(out), pad_left=0, pad_right=0, out=Layout(tuple(out), align), gather=spec
    )


def crop_empty(y: torch.Tensor, plans: Sequence[WindowPlan], rings: Sequence[AxisPeers]) -> torch.Tensor:
    """Crop the placeholder output of a rank left without outputs (general plans) to size 0."""
    for plan, ring in zip(plans, rings):
        if plan.out.sizes[ring.index] == 0:
            y = y.narrow(plan.halo.dim, 0, 0)
    return y


def edge_pad(x: torch.Tensor, dim: int, width: int, left: bool, mode: str, value: float = 0.0) -> torch.Tensor:
    """``x`` with global padding of ``width`` on one side along ``dim`` (``mode`` as in torch)."""
    if width == 0:
        return x
    pad = edge_slab(x, dim, width, left, mode, value)
    return cat_like([pad, x] if left else [x, pad], dim, x)


def cat_like(pieces: Sequence[torch.Tensor], dim: int, like: torch.Tensor) -> torch.Tensor:
    """``torch.cat(pieces, dim)`` in the memory format of ``like`` (the slab the pieces extend).

    ``torch.cat`` of mixed formats gives NCHW: a channels-last slab beside a halo or padding
    piece would leave the next convolution an NCHW input where torch's own layer gets a
    channels-last one (a different, here several times slower, kernel). The small pieces are
    converted instead; slices of a channels-last slab already are channels-last.
    """
    fmt = memory_format_of(like)
    if fmt != torch.contiguous_format:
        pieces = [p.contiguous(memory_format=fmt) for p in pieces]
    return torch.cat(pieces, dim)


def edge_slab(x: torch.Tensor, dim: int, width: int, left: bool, mode: str, value: float = 0.0) -> torch.Tensor:
    """The padding slab itself (``width`` positions) that ``mode`` puts beside ``x``."""
    n = x.shape[dim]
    if mode == "zeros" or mode == "constant":
        shape = list(x.shape)
        shape[dim] = width
        pad = x.new_full(shape, value)
    elif mode == "replicate":
        idx = 0 if left else n - 1
        pad = x.narrow(dim, idx, 1).expand(*[width if i == dim else -1 for i in range(x.dim())])
    elif mode == "reflect":
        pad = x.narrow(dim, 1, width) if left else x.narrow(dim, n - 1 - width, width)
        pad = pad.flip(dim)
    else:
        raise ValueError(f"edge_pad: unknown padding mode {mode!r}; expected one of {PAD_MODES}.")
    return pad


def _communicates(plan: WindowPlan, ring: AxisPeers) -> bool:
    """Whether the one-hop ``plan`` moves any position along ``ring``.

    Not where no rank has a halo (a 1x1 convolution of stride 2, a pool whose window fits its
    stride): the exchange would only reserve tags and build empty buffers. Decided from the
    plan, which every rank shares, so every rank skips alike and the tag counters stay in step.
    """
    h = plan.halo
    return (ring.size > 1 or h.periodic) and (any(h.left) or any(h.right))


def extend(
    x: torch.Tensor,
    plan: WindowPlan,
    ring: AxisPeers,
    mode: str,
    value: float = 0.0,
) -> torch.Tensor:
    """Halo-exchange, trim and edge-pad ``x`` along ``plan.halo.dim``, as planned."""
    if plan.gather is not None:
        fill = value if mode in ("zeros", "constant") else 0.0
        return halo_gather(x, plan.gather, ring, value=fill)
    d = plan.halo.dim
    r = ring.index
    communicates = _communicates(plan, ring)
    if communicates and mode in ("zeros", "constant"):
        # The edge padding written with the halos, into one buffer (no second copy of the slab).
        # A trim comes only where there is no right halo and no right padding: it drops the
        # slab's own last positions, which the exchange has sent already.
        pad = (plan.pad_left if ring.is_first else 0, plan.pad_right if ring.is_last else 0)
        x = halo_cat(x, plan.halo, ring, pad=pad, value=value)
        return x.narrow(d, 0, x.shape[d] - plan.trim[r]) if plan.trim[r] else x
    x = halo_cat(x, plan.halo, ring) if communicates else x
    # Left padding before the trim: reflect padding reads positions that the trim may drop.
    if ring.is_first:
        x = edge_pad(x, d, plan.pad_left, True, mode, value)
    if plan.trim[r]:
        x = x.narrow(d, 0, x.shape[d] - plan.trim[r])
    if ring.is_last:
        x = edge_pad(x, d, plan.pad_right, False, mode, value)
    return x


def pad_unsharded(x: torch.Tensor, pads: dict[int, tuple[int, int]], mode: str, value: float = 0.0) -> torch.Tensor:
    """Apply global padding along dims that are not sharded (``pads[dim] = (left, right)``)."""
    if not any(a or b for a, b in pads.values()):
        return x
    flat: list[int] = []
    # Non-constant modes of F.pad want every spatial dim listed (zeros where nothing is padded).
    for d in range(x.dim() - 1, 1, -1):
        flat += list(pads.get(d, (0, 0)))
    if mode == "zeros":
        return F.pad(x, flat, "constant", value)
    return F.pad(x, flat, mode)


def apply_overlapped(
    x: torch.Tensor,
    plan: WindowPlan,
    ring: AxisPeers,
    mode: str,
    w: Window,
    fn,
    value: float = 0.0,
) -> torch.Tensor:
    """``fn(extend(x, plan, ...))`` with the halo exchange overlapped by the interior work.

    ``fn`` applies the window op (unpadded along ``plan.halo.dim``). The outputs whose windows lie
    inside the local slab are computed while the halos travel; the few outputs at each end are
    computed afterwards from small pieces, and the three parts are concatenated. Returns the same
    values as the synchronous path.
    """
    d, r, s, e = plan.halo.dim, ring.index, w.stride, w.span
    usable = x.shape[d] - plan.trim[r]
    lw = plan.halo.left[r] + (plan.pad_left if ring.is_first else 0)
    n_out = plan.out.sizes[r]
    # Output i reads x positions [i*s - lw, i*s - lw + e): interior when that lies in [0, usable).
    i0 = -(-lw // s)
    i1 = min((usable + lw - e) // s, n_out - 1)
    communicates = _communicates(plan, ring)
    if i1 < i0 or not communicates:
        return fn(extend(x, plan, ring, mode, value))
    handle = halo_exchange(x, plan.halo, ring)
    x = handle.x  # compute on the tracked alias so that halo gradients flow back
    interior = fn(x.narrow(d, i0 * s - lw, (i1 - i0) * s + e))
    left_halo, right_halo = handle.wait()
    parts = []
    if i0 > 0:
        # Outputs [0, i0) read extended positions [0, (i0 - 1) * s + e), which may end inside the
        # left halo itself when the padding is wider than the kernel.
        left = left_halo if left_halo is not None else edge_slab(x, d, plan.pad_left, True, mode, value)
        need = (i0 - 1) * s + e
        src = cat_like([left, x.narrow(d, 0, max(need - lw, 0))], d, x)
        parts.append(fn(src.narrow(d, 0, need)))
    parts.append(interior)
    if i1 < n_out - 1:
        start = (i1 + 1) * s - lw
        head = min(start, usable)
        pieces = [x.narrow(d, head, usable - head)]
        if right_halo is not None:
            pieces.append(right_halo)
        elif ring.is_last and plan.pad_right:
            pieces.append(edge_slab(x.narrow(d, 0, usable), d, plan.pad_right, False, mode, value))
        src = cat_like(pieces, d, x)
        parts.append(fn(src.narrow(d, start - head, src.shape[d] - (start - head))))
    return cat_like(parts, d, interior)


def apply_linear(
    x: torch.Tensor,
    plan: WindowPlan,
    ring: AxisPeers,
    mode: str,
    w: Window,
    conv_zero_padded,
    conv_taps,
    conv_band=None,
) -> torch.Tensor | None:
    """A *linear* window op (convolution) without copying the slab; None when not applicable.

    Linearity splits the extended input ``[L | x | R]`` into ``[0 | x | 0] + [L | 0 | R]``. The
    first term is one call on the slab itself with zero padding ``pad_left`` on both sides
    (``conv_zero_padded(x, pad)``, with bias): it overlaps the halo exchange, saves only a view
    of ``x`` for its backward and needs no extended copy. The second term touches only the first
    and last few output rows, and each of those rows reads only a few kernel taps of the halos:
    ``conv_taps(planes, taps)`` (no bias) computes one output row from the halo planes under the
    taps ``taps``, and the result is added in place. The corrections therefore read (and save for
    backward) nothing but the received halos. Applicable when the zero-padded call yields exactly
    this rank's output rows; the caller falls back to ``apply_overlapped`` otherwise (the halo
    traffic is the same either way).

    Where several output rows read one halo (kernels of 5 taps and more) and the caller gives
    ``conv_band`` (the window op with the layer's stride and dilation, no padding along the
    sharded dim, no bias), those rows are corrected by one call on a thin band instead of one
    call per row: the halo planes with zeros in place of the slab (``_halo_band``). Each call on
    a few planes costs tens of microseconds whatever its size, so one call for all rows is
    cheaper even though it multiplies zeros (measured, one thread, depthwise halos at 8-128
    columns: 80-120 us against 110-150 us for the two rows of a 5x5 kernel, 60 us against
    155-175 us for the three rows of a ConvNeXt's 7x7).
    """
    d, r, s, pl = plan.halo.dim, ring.index, w.stride, w.pad_left
    n = x.shape[d]
    n_out = plan.out.sizes[r]
    right = plan.halo.right[r] + (plan.pad_right if ring.is_last else 0) - plan.trim[r]
    if (n + 2 * pl - w.span) // s + 1 != n_out or right > pl:
        return None
    communicates = _communicates(plan, ring)
    handle = halo_exchange(x, plan.halo, ring, grad_inplace=True) if communicates else None
    if handle is not None:
        x = handle.x
    out = conv_zero_padded(x, pl)
    left_halo, right_halo = handle.wait() if handle is not None else (None, None)
    if left_halo is None and ring.is_first and plan.pad_left and mode != "zeros":
        left_halo = edge_slab(x, d, plan.pad_left, True, mode)
    if right_halo is None and ring.is_last and plan.pad_right and mode != "zeros":
        right_halo = edge_slab(x.narrow(d, 0, n - plan.trim[r]), d, plan.pad_right, False, mode)
    for halo, left in ((left_halo, True), (right_halo, False)):
        if halo is None or halo.shape[d] == 0:
            continue
        width = halo.shape[d]
        key = (w, n, n_out, width, left)
        rows = _HALO_TAPS.get(key, _halo_taps, *key)
        if conv_band is not None and len(rows) > 1:
            first = rows[0][0]
            band = _halo_band(halo, d, -width if left else n, first * s - pl, (rows[-1][0] - first) * s + w.span)
            rows = ((first, None, band),)
        for row, taps, idx in rows:
            corr = conv_band(idx) if taps is None else conv_taps(select_along(halo, d, idx), taps)
            # (Never traced by Dynamo: sharded layers run eagerly under torch.compile,
            # ``compile_boundary.py``; AOTAutograd had computed wrong input gradients through
            # the in-place ``_AddBand`` in some arrangements.)
            if out.requires_grad or corr.requires_grad:
                out = _AddBand.apply(out, corr, d, row)
            else:  # no graph to record: the Function's per-call cost buys nothing
                out.narrow(d, row, corr.shape[d]).add_(corr)
    return out


def _halo_band(halo: torch.Tensor, d: int, halo_start: int, start: int, length: int) -> torch.Tensor:
    """The slab positions ``[start, start + length)`` along ``d`` with zeros outside the halo.

    ``halo`` holds slab positions ``[halo_start, halo_start + halo.shape[d])`` (negative: the
    left halo, before the slab). The window op over this band, unpadded along ``d``, gives the
    halo's contribution to the outputs whose windows start at ``start``, ``start + stride``, ...:
    the slab's own positions are zeros here (the main call counted them).
    """
    lo, hi = max(halo_start, start), min(halo_start + halo.shape[d], start + length)
    piece = halo.narrow(d, lo - halo_start, max(hi - lo, 0))
    pad = [0, 0] * (halo.dim() - 1 - d) + [lo - start if hi > lo else length, start + length - hi if hi > lo else 0]
    return F.pad(piece, pad)


#: Tap corrections per geometry. The key is the window and this rank's slab, output and halo
#: sizes, all derived from the gathered layout; a miss is pure arithmetic (no collective), so a
#: hit on one rank and a miss on another cannot make the ranks diverge. Bounded: a long run over
#: many input sizes does not grow it without end.
_HALO_TAPS = BoundedCache(256)


def _halo_taps(w: Window, n: int, n_out: int, width: int, left: bool) -> tuple[tuple[int, tuple, tuple], ...]:
    """``(row, taps, halo_index)`` for each output row that reads the left (or right) halo.

    Output row ``j`` reads slab position ``j*s - pad_left + t*dilation`` under tap ``t``; the
    positions before 0 lie in the left halo (``width`` planes ending at 0), the ones from ``n``
    on in the right halo (``width`` planes starting at ``n``). Positions beyond a halo are
    zero padding of the main call and contribute nothing. Depends on the plan only, so it is
    worked out once per geometry (``_HALO_TAPS``).
    """
    if left:
        rows = range(0, min(-(-w.pad_left // w.stride), n_out))
    else:
        rows = range(max((n + w.pad_left - w.span) // w.stride + 1, 0), n_out)
    out = []
    for j in rows:
        taps, idx = [], []
        for t in range(w.kernel):
            p = j * w.stride - w.pad_left + t * w.dilation
            q = p + width if left else p - n
            if (p < 0 if left else p >= n) and 0 <= q < width:
                taps.append(t)
                idx.append(q)
        if taps:
            out.append((j, tuple(taps), tuple(idx)))
    return tuple(out)


def select_along(t: torch.Tensor, dim: int, idx: tuple[int, ...]) -> torch.Tensor:
    """``t``'s entries ``idx`` along ``dim``: a view when they are a unit-step run, else a copy."""
    if idx == tuple(range(idx[0], idx[0] + len(idx))):
        return t.narrow(dim, idx[0], len(idx))
    return t.index_select(dim, torch.tensor(idx, device=t.device))


class _AddBand(torch.autograd.Function):
    """``out[band] += corr`` in place, with a backward that copies nothing.

    Autograd's generic in-place-on-a-view path (CopySlices) clones the whole gradient of ``out``;
    here the gradient of ``out`` passes through as is and ``corr`` gets a view of its band.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, corr: torch.Tensor, dim: int, start: int):  # noqa: D102
        ctx.dim, ctx.start, ctx.width = dim, start, corr.shape[dim]
        out.narrow(dim, start, corr.shape[dim]).add_(corr)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        return g, g.narrow(ctx.dim, ctx.start, ctx.width), None, None
