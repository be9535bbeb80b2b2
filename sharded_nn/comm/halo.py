"""Halo exchange: thin boundary slabs swapped with the two neighbours along one mesh axis.

Only neighbours communicate (batched ``isend``/``irecv``); several sharded dims are exchanged one
after another on the already extended tensor, which covers the corners. With ``periodic=True``
the first and last rank are neighbours, which is what circular padding needs.

Widths are given for every rank (``HaloSpec``), so each rank knows what its neighbours expect
without asking them. ``HaloSpec.check`` tells whether every halo lies inside the direct
neighbour's slab: the common case, served by one exchange with the two neighbours
(``halo_cat``, ``halo_exchange``). Where it does not (a slab thinner than the halo: a deep stage
on many ranks; an empty slab; a halo clipped at the domain's edge), layers plan a
``HaloGather`` instead, which names every position by its global index; ``halo_gather`` fetches
each from the rank that owns it, still point-to-point (multi-hop), and ``halo_scatter`` is its
adjoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..errors import ShardingError
from .peers import AxisPeers

# gloo matches point-to-point messages by tag; NCCL matches them by issue order. Every rank
# issues [send right, recv from left, send left, recv from right] so that both agree even when
# the left and right neighbour are the same rank (two periodic ranks). One exchange uses two
# tags from a block reserved per call (``AxisPeers.next_tags``): ``tag`` for messages travelling
# rightward, ``tag + 1`` leftward. A halo operation reserves ``HALO_TAGS`` tags when it starts:
# the first two for its forward exchange, the next two for the exchange of its backward, so that
# exchanges of different layers may overlap (see peers.py). ``halo_cat``, ``halo_exchange`` and
# ``halo_add`` all reserve the same block with the same layout, and reserve it on every rank
# (also where a rank sends nothing), so neighbours may use different forms for one exchange (a
# layer that falls back from the overlapped form on one rank only) and the counters stay in step.
HALO_TAGS = 4


@dataclass(frozen=True)
class HaloSpec:
    """Halo widths along one tensor dim for every rank of one mesh axis.

    Attributes:
        dim: tensor dim that the axis shards.
        left: ``left[r]`` positions rank r receives from its left neighbour (its last ones).
        right: ``right[r]`` positions rank r receives from its right neighbour (its first ones).
        periodic: whether rank 0 and the last rank are neighbours.
    """

    dim: int
    left: tuple[int, ...]
    right: tuple[int, ...]
    periodic: bool = False

    def __post_init__(self) -> None:
        if not self.left:
            raise ValueError(f"HaloSpec: need widths for at least one rank, got left={self.left}, right={self.right}.")
        if len(self.left) != len(self.right) or min(self.left + self.right, default=0) < 0:
            raise ValueError(f"HaloSpec: need equal-length non-negative widths, got {self.left}, {self.right}.")
        if not self.periodic and (self.left[0] or self.right[-1]):
            raise ValueError(
                f"HaloSpec: without periodic wrap the first rank has no left neighbour and the last "
                f"no right one, got left={self.left}, right={self.right}."
            )

    def fits(self, sizes: tuple[int, ...]) -> bool:
        """Whether every halo lies inside the direct neighbour's slab (one exchange serves it)."""
        p = len(sizes)
        return all(
            not width or width <= sizes[src % p]
            for r in range(p)
            for width, src in ((self.left[r], r - 1), (self.right[r], r + 1))
        )

    def check(self, sizes: tuple[int, ...], what: str) -> None:
        """Raise (on every rank alike) when a halo is wider than the slab it is read from."""
        p = len(sizes)
        for r in range(p):
            for width, src, side in ((self.left[r], r - 1, "left"), (self.right[r], r + 1, "right")):
                if width and width > sizes[src % p]:
                    raise ShardingError(
                        f"{what}: rank {r} needs a {side} halo of {width} along dim {self.dim}, but its "
                        f"{side} neighbour (rank {src % p}) holds only {sizes[src % p]} positions "
                        f"(slab sizes {sizes}). A one-hop exchange reads direct neighbours only: plan a "
                        "HaloGather (halo_gather fetches from every rank the halo spans) or use fewer ranks."
                    )

    def send_widths(self, index: int) -> tuple[int, int]:
        """Positions this rank sends (to the left, to the right): what its neighbours receive."""
        p = len(self.left)
        to_left = self.right[index - 1] if (index > 0 or self.periodic) else 0
        to_right = self.left[(index + 1) % p] if (index < p - 1 or self.periodic) else 0
        return to_left, to_right


def _exchange(
    ring: AxisPeers,
    periodic: bool,
    send_left: torch.Tensor | None,
    send_right: torch.Tensor | None,
    recv_left: torch.Tensor | None,
    recv_right: torch.Tensor | None,
    tag: int,
) -> list[dist.Work]:
    """Issue the (at most four) point-to-point operations; returns the works to wait on."""
    left, right = ring.left(periodic), ring.right(periodic)
    if ring.size == 1:
        # A single periodic rank is its own neighbour: copy instead of messaging itself.
        if recv_left is not None:
            recv_left.copy_(send_right)
        if recv_right is not None:
            recv_right.copy_(send_left)
        return []
    ops = []
    for tensor, peer, send, t in (
        (send_right, right, True, tag),
        (recv_left, left, False, tag),
        (send_left, left, True, tag + 1),
        (recv_right, right, False, tag + 1),
    ):
        if tensor is not None and tensor.numel():
            ops.append((tensor, peer, send, t))
    return ring.start_p2p(ops)


def _edge(x: torch.Tensor, dim: int, width: int, head: bool) -> torch.Tensor | None:
    if width == 0:
        return None
    n = x.shape[dim]
    return x.narrow(dim, 0 if head else n - width, width).contiguous()


def _empty(x: torch.Tensor | _Like, dim: int, width: int) -> torch.Tensor | None:
    if width == 0:
        return None
    shape = list(x.shape)
    shape[dim] = width
    return torch.empty(shape, dtype=x.dtype, device=x.device)


class HaloHandle:
    """An exchange in flight, started by ``halo_exchange``.

    Attributes:
        x: an autograd alias of the slab. Compute on it (not on the original tensor) while the
            halos travel: its backward is where the halo gradients are returned to the
            neighbours, and it always runs on every rank, even on a rank whose halos are empty or
            unused, so that the neighbours' matching sends and receives are never left waiting.

    ``wait()`` returns the (left, right) halos (None where the width is zero).
    """

    def __init__(
        self, x: torch.Tensor, spec: HaloSpec, ring: AxisPeers, grad_inplace: bool = False, tag: int | None = None
    ) -> None:
        _check_ring(spec, ring)
        self.spec, self.ring, self.grad_inplace = spec, ring, grad_inplace
        self.tag = ring.next_tags(HALO_TAGS) if tag is None else tag
        self.grads: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
        # The halo-gradient exchange started early by ``_HaloWait.backward`` (see there).
        self.started: tuple | None = None
        to_left, to_right = spec.send_widths(ring.index)
        d = spec.dim
        xd = x.detach()
        # What the backward's receive buffers are shaped like (not ``x`` itself: holding the slab
        # until the backward would keep it alive where the caller's graph does not).
        self.like = _Like(tuple(xd.shape), xd.dtype, xd.device)
        self._sends = (_edge(xd, d, to_left, True), _edge(xd, d, to_right, False))
        self.recv_left = _empty(xd, d, spec.left[ring.index])
        self.recv_right = _empty(xd, d, spec.right[ring.index])
        self._works = _exchange(ring, spec.periodic, *self._sends, self.recv_left, self.recv_right, self.tag)
        # No graph to record (inference, frozen inputs): the slab itself, and ``wait`` skips its
        # Function too (two autograd Functions per exchange cost tens of microseconds per layer).
        self.tracked = x.requires_grad and torch.is_grad_enabled()
        self.x = _HaloStart.apply(x, self) if self.tracked else x

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # Drop the handle's reference to ``x``: ``x``'s autograd node holds this handle, so
        # keeping both would form a cycle through C++ that Python's gc cannot collect, leaking
        # one slab (and its halos) per call.
        x, self.x = self.x, None
        has_left, has_right = self.recv_left is not None, self.recv_right is not None
        if self.tracked:
            left, right = _HaloWait.apply(x, self)
        else:
            for w in self._works:
                w.wait()
            left, right = self.recv_left, self.recv_right
        # The backward needs none of the buffers; the handle lives until then (the autograd
        # nodes hold it), so drop them now: the halos live on only where the caller uses them.
        self.recv_left = self.recv_right = None
        self._sends, self._works = (None, None), []
        return (left if has_left else None, right if has_right else None)


class _HaloStart(torch.autograd.Function):
    """Identity on the slab; its backward returns the halo gradients to their owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: HaloHandle):  # noqa: D102
        ctx.handle = handle
        # An alias with x's own strides. ``view_as`` recomputes them, and for a batch of one in
        # channels-last memory it gives N the stride C instead of C*H*W: torch's convolutions
        # then no longer see channels-last strides, copy the slab to NCHW and run the NCHW
        # kernel (a ConvNeXt's 7x7 depthwise convolution 3.4x slower per call, issue 16).
        return x[...]

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        h = ctx.handle
        started, h.started = h.started, None
        if started is None:
            # Not started by ``_HaloWait.backward`` (a backend that matches by issue order, or a
            # rank whose halos no output used): start it now, as every rank must.
            g_left, g_right = h.grads if h.grads is not None else (None, None)
            started = _start_halo_grads(h.like, g_left, g_right, h.spec, h.ring, h.tag + 2)
        h.grads = None
        # Received halo gradients are added into the edges of this slab's gradient: in place
        # when the caller knows the incoming gradient is a fresh buffer nobody else holds (it
        # saves a slab-sized copy), else into a clone.
        grad = g.clone() if any(h.spec.send_widths(h.ring.index)) and not h.grad_inplace else g
        _finish_halo_grads(grad, *started, h.spec, h.ring)
        return grad, None


class _HaloWait(torch.autograd.Function):
    """Waits for the halos; its backward only hands their gradients to ``_HaloStart``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: HaloHandle):  # noqa: D102
        for w in handle._works:
            w.wait()
        ctx.handle = handle
        # Zero-width halos become empty tensors so that autograd sees a tensor output.
        left = handle.recv_left if handle.recv_left is not None else _zero_width(x, handle.spec.dim)
        right = handle.recv_right if handle.recv_right is not None else _zero_width(x, handle.spec.dim)
        return left, right

    @staticmethod
    def backward(ctx, g_left: torch.Tensor, g_right: torch.Tensor):  # noqa: D102
        h = ctx.handle
        if h.ring.matches_by_tag:
            # The halo gradients are complete here, before the backward of the work done on
            # ``handle.x`` (autograd runs later nodes first: the interior convolution's input and
            # weight gradients come after this): send them now, so that they travel during that
            # work and ``_HaloStart.backward`` only collects what arrived. Only where messages
            # match by tag (gloo): a rank whose halos no output used starts the same exchange
            # later, in ``_HaloStart.backward``, which issue-order matching (NCCL) could pair
            # with another exchange.
            h.started = _start_halo_grads(h.like, g_left, g_right, h.spec, h.ring, h.tag + 2)
        else:
            h.grads = (g_left, g_right)
        return None, None


@dataclass(frozen=True)
class _Like:
    """Shape, dtype and device of a slab: enough to allocate buffers shaped like it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def new_zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


def _zero_width(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = 0
    return x.new_empty(shape)


def _return_halo_grads(
    grad_x: torch.Tensor,
    g_left: torch.Tensor | None,
    g_right: torch.Tensor | None,
    spec: HaloSpec,
    ring: AxisPeers,
    tag: int,
) -> None:
    """Send halo gradients back to their owners; add the ones received into ``grad_x``'s edges."""
    _finish_halo_grads(grad_x, *_start_halo_grads(grad_x, g_left, g_right, spec, ring, tag), spec, ring)


def _start_halo_grads(like, g_left, g_right, spec: HaloSpec, ring: AxisPeers, tag: int):
    """Issue the exchange of ``_return_halo_grads``; returns ``(works, head, tail)`` for ``_finish_halo_grads``."""
    d = spec.dim
    to_left, to_right = spec.send_widths(ring.index)
    # What this rank sent to the left (its head) comes back from the left, and vice versa.
    head = _empty(like, d, to_left)
    tail = _empty(like, d, to_right)
    # A halo that no output used still has a neighbour waiting for its (zero) gradient.
    g_left = _grad_or_zeros(g_left, like, d, spec.left[ring.index])
    g_right = _grad_or_zeros(g_right, like, d, spec.right[ring.index])
    return _exchange(ring, spec.periodic, g_left, g_right, head, tail, tag), head, tail


def _finish_halo_grads(grad_x, works, head, tail, spec: HaloSpec, ring: AxisPeers) -> None:
    for w in works:
        w.wait()
    d = spec.dim
    to_left, to_right = spec.send_widths(ring.index)
    n = grad_x.shape[d]
    if head is not None:
        grad_x.narrow(d, 0, to_left).add_(head)
    if tail is not None:
        grad_x.narrow(d, n - to_right, to_right).add_(tail)


def _grad_or_zeros(g: torch.Tensor | None, like: torch.Tensor, dim: int, width: int) -> torch.Tensor | None:
    if width == 0:
        return None
    if g is None:
        shape = list(like.shape)
        shape[dim] = width
        return like.new_zeros(shape)
    return g.contiguous()


def _check_ring(spec: HaloSpec, ring: AxisPeers) -> None:
    # Same facts on every rank of the axis, so all of them raise together.
    if len(spec.left) != ring.size:
        raise ValueError(
            f"halo exchange: HaloSpec has widths for {len(spec.left)} ranks but the mesh axis has "
            f"{ring.size}. Build the spec from the layout of this axis."
        )


def halo_exchange(
    x: torch.Tensor, spec: HaloSpec, ring: AxisPeers, *, grad_inplace: bool = False, tag: int | None = None
) -> HaloHandle:
    """Start exchanging halos of ``x``; returns a handle.

    Compute on ``handle.x`` while the halos travel, then ``handle.wait()`` gives (left, right).
    ``grad_inplace=True`` adds the returned halo gradients into the incoming gradient of
    ``handle.x`` in place; only for callers whose use of ``handle.x`` produces a fresh gradient
    buffer (a convolution's input gradient).

    Args:
        x: this rank's slab.
        spec: widths for every rank along the axis (see ``HaloSpec``).
        ring: the axis, from ``axis_peers(mesh, axis)``.
        tag: first of ``HALO_TAGS`` message tags reserved with ``ring.next_tags`` (forward and
            backward exchange); ``None`` (the usual) reserves them now.
    """
    return HaloHandle(x, spec, ring, grad_inplace, tag)


def halo_cat(
    x: torch.Tensor,
    spec: HaloSpec,
    ring: AxisPeers,
    *,
    tag: int | None = None,
    pad: tuple[int, int] = (0, 0),
    value: float = 0.0,
) -> torch.Tensor:
    """``cat([left_halo, x, right_halo], spec.dim)``, exchanged synchronously, autograd-aware.

    One autograd node for the whole extension, so the backward allocates a single gradient the
    size of ``x`` (the halo gradients are added into its edges after being sent back). ``tag``:
    as ``halo_exchange``. ``pad``: positions of the constant ``value`` placed before and after
    (a domain edge's zero padding), written into the same buffer: padding the extended slab
    afterwards would copy all of it once more.
    """
    _check_ring(spec, ring)
    tag = ring.next_tags(HALO_TAGS) if tag is None else tag
    pad = (int(pad[0]), int(pad[1]))
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _cat_halos(x, spec, ring, tag, pad, value)  # no graph to record: skip the Function's per-call cost
    return _HaloCat.apply(x, spec, ring, tag, pad, value)


def _cat_halos(
    x: torch.Tensor, spec: HaloSpec, ring: AxisPeers, tag: int, pad: tuple[int, int] = (0, 0), value: float = 0.0
) -> torch.Tensor:
    """The forward of ``halo_cat`` (no autograd), with its exchange on tags ``tag, tag + 1``.

    The slab is copied into the extended tensor while the halos travel; the wait comes only
    where the halos are written (the copy ``torch.cat`` would make anyway, overlapped).
    """
    to_left, to_right = spec.send_widths(ring.index)
    d = spec.dim
    lw, rw = spec.left[ring.index], spec.right[ring.index]
    pl, pr = pad
    left, right = _empty(x, d, lw), _empty(x, d, rw)
    works = _exchange(ring, spec.periodic, _edge(x, d, to_left, True), _edge(x, d, to_right, False), left, right, tag)
    if not lw and not rw and not pl and not pr:
        for w in works:
            w.wait()
        return x.clone()
    shape = list(x.shape)
    n = shape[d]
    shape[d] = pl + lw + n + rw + pr
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format_of(x))
    out.narrow(d, pl + lw, n).copy_(x)
    if pl:
        out.narrow(d, 0, pl).fill_(value)
    if pr:
        out.narrow(d, pl + lw + n + rw, pr).fill_(value)
    for w in works:
        w.wait()
    if left is not None:
        out.narrow(d, pl, lw).copy_(left)
    if right is not None:
        out.narrow(d, pl + lw + n, rw).copy_(right)
    return out


def memory_format_of(x: torch.Tensor) -> torch.memory_format:
    """The memory format that layers keep for ``x``: channels-last (4-d or 5-d) when ``x`` is laid
    out so and not also contiguous, else contiguous (what ``torch.cat`` gives an extended slab,
    and what torch's own layers return for such an input)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


class _HaloCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: HaloSpec, ring: AxisPeers, tag: int, pad, value):  # noqa: D102
        ctx.spec, ctx.ring, ctx.tag, ctx.pad_left, ctx.n = spec, ring, tag, pad[0], x.shape[spec.dim]
        return _cat_halos(x, spec, ring, tag, pad, value)

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        spec, ring = ctx.spec, ctx.ring
        d = spec.dim
        lw, rw = spec.left[ring.index], spec.right[ring.index]
        # The constant padding (``pad_left`` before, the rest after) passes no gradient on.
        pl, n = ctx.pad_left, ctx.n
        g_left = g.narrow(d, pl, lw) if lw else None
        g_right = g.narrow(d, pl + lw + n, rw) if rw else None
        # The halo gradients travel while this slab's own gradient is copied out of ``g``.
        started = _start_halo_grads(g.narrow(d, pl + lw, n), g_left, g_right, spec, ring, ctx.tag + 2)
        grad_x = g.narrow(d, pl + lw, n).clone()
        _finish_halo_grads(grad_x, *started, spec, ring)
        return grad_x, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Multi-hop halos: positions read wherever they live (thin slabs, empty slabs, clipped domains)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HaloGather:
    """The positions every rank of one mesh axis reads along one dim, wherever they live.

    ``HaloSpec`` serves the common case (each halo lies inside the direct neighbour's slab: one
    exchange with the two neighbours). A slab thinner than the halo a layer needs (a deep stage on
    many ranks), an empty slab, or a halo clipped at the domain's edge needs positions from ranks
    further away: ``HaloGather`` names them by *global index*, and ``halo_gather`` fetches each
    one point-to-point from the rank that owns it (one message per pair of ranks that share
    positions, never a collective over the group).

    Rank r's extended slab is ``[left[r] | own slab[keep[r]] | right[r]]`` along ``dim``.

    Attributes:
        dim: tensor dim that the axis shards.
        sizes: slab size of every rank along ``dim`` (the layout; sizes may be zero).
        left: ``left[r]``: global index of each position rank r places before its kept slab, in
            order; ``-1`` for a position filled with the constant ``value`` (zero padding).
        keep: ``keep[r] = (offset, length)``: the part of rank r's own slab that it keeps.
        right: as ``left``, for the positions after the kept slab.
    """

    dim: int
    sizes: tuple[int, ...]
    left: tuple[tuple[int, ...], ...]
    keep: tuple[tuple[int, int], ...]
    right: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        p, n = len(self.sizes), sum(self.sizes)
        if not p or not (len(self.left) == len(self.keep) == len(self.right) == p):
            raise ValueError(f"HaloGather: need one entry per rank for {p} ranks, got {self}.")
        bad = [g for idx in self.left + self.right for g in idx if not -1 <= g < n]
        if bad or any(o < 0 or k < 0 or o + k > s for (o, k), s in zip(self.keep, self.sizes)):
            raise ValueError(
                f"HaloGather: indices must lie in [-1, {n}) and kept ranges inside the slabs {self.sizes}; got {self}."
            )

    @classmethod
    def of_blocks(cls, dim: int, sizes, blocks) -> HaloGather:
        """Every rank's extended slab = one block ``[lo, hi]`` of global positions (``hi < lo``:
        none): its own positions in the block kept, the others fetched before and after them
        (the rows a ``grid_sample`` reads, the mirror of a slab for ``flip``)."""
        left, keep, right = [], [], []
        start = 0
        for n, (lo, hi) in zip(sizes, blocks):
            a, b = max(lo, start), min(hi + 1, start + n)
            if a < b:
                left.append(tuple(range(lo, a)))
                keep.append((a - start, b - a))
                right.append(tuple(range(b, hi + 1)))
            else:
                left.append(tuple(range(lo, hi + 1)))
                keep.append((0, 0))
                right.append(())
            start += n
        return cls(dim, tuple(sizes), tuple(left), tuple(keep), tuple(right))

    def ext_size(self, index: int) -> int:
        """Length of rank ``index``'s extended slab along ``dim``."""
        return len(self.left[index]) + self.keep[index][1] + len(self.right[index])

    def routes(self, index: int) -> _Routes:
        """What rank ``index`` sends, receives and copies (pure arithmetic on the spec)."""
        starts = [0]
        for s in self.sizes:
            starts.append(starts[-1] + s)

        def owner(g: int) -> int:
            # The highest rank starting at or before g holds it (empty slabs share a start with
            # the next rank, which then wins).
            lo, hi = 0, len(self.sizes) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if starts[mid] <= g:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        def needs(dst: int) -> dict[int, list[int]]:
            out: dict[int, set[int]] = {}
            for g in self.left[dst] + self.right[dst]:
                if g >= 0:
                    o = owner(g)
                    out.setdefault(o, set()).add(g - starts[o])
            return {o: sorted(v) for o, v in out.items()}

        mine = needs(index)
        recvs = tuple((src, tuple(offs)) for src, offs in sorted(mine.items()) if src != index)
        own = tuple(mine.get(index, ()))
        sends = []
        for dst in range(len(self.sizes)):
            if dst != index:
                offs = needs(dst).get(index)
                if offs:
                    sends.append((dst, tuple(offs)))
        # Bank: the received rows (by source), then this rank's own rows, then one fill row.
        where: dict[int, int] = {}
        pos = 0
        for src, offs in recvs + ((index, own),):
            for o in offs:
                where[starts[src] + o] = pos
                pos += 1
        fill = pos
        index_of = tuple(where.get(g, fill) if g >= 0 else fill for g in self.left[index] + self.right[index])
        has_fill = any(i == fill for i in index_of)
        return _Routes(tuple(sends), recvs, own, index_of, fill + int(has_fill))


@dataclass(frozen=True)
class _Routes:
    """One rank's share of a ``HaloGather``: messages, its own rows, and where each halo position is found."""

    sends: tuple[tuple[int, tuple[int, ...]], ...]  # (destination, offsets in my slab)
    recvs: tuple[tuple[int, tuple[int, ...]], ...]  # (source, offsets in its slab)
    own: tuple[int, ...]  # offsets in my slab that my own halos read (reflect, circular on few ranks)
    index: tuple[int, ...]  # bank position of each halo position (left then right)
    bank: int  # bank length: received rows, own rows, and a fill row where needed


def _rows(x: torch.Tensor, dim: int, offsets: tuple[int, ...]) -> torch.Tensor:
    """``x``'s entries ``offsets`` along ``dim`` (sorted, unique), as a contiguous tensor."""
    if offsets == tuple(range(offsets[0], offsets[0] + len(offsets))):
        return x.narrow(dim, offsets[0], len(offsets)).contiguous()
    return x.index_select(dim, torch.tensor(offsets, device=x.device))


def _p2p(ring: AxisPeers, sends, recvs, tag: int) -> None:
    """Send ``(peer, tensor)`` pairs and receive into ``(peer, buffer)`` pairs; waits for all.

    At most one message per ordered pair of ranks, so a single tag tells them apart on gloo, and
    every rank issues its operations in peer order, which keeps NCCL's issue-order matching.
    """
    ops = [(t, peer, True, tag) for peer, t in sends if t.numel()]
    ops += [(t, peer, False, tag) for peer, t in recvs if t.numel()]
    for w in ring.start_p2p(ops):
        w.wait()


def _gather_fwd(x: torch.Tensor, spec: HaloGather, ring: AxisPeers, tag: int, value: float) -> torch.Tensor:
    d, me = spec.dim, ring.index
    rt = spec.routes(me)
    bufs = [(src, _empty(x, d, len(offs))) for src, offs in rt.recvs]
    _p2p(ring, [(dst, _rows(x, d, offs)) for dst, offs in rt.sends], bufs, tag)
    pieces = [b for _, b in bufs]
    if rt.own:
        pieces.append(_rows(x, d, rt.own))
    if rt.bank > sum(p.shape[d] for p in pieces):
        shape = list(x.shape)
        shape[d] = 1
        pieces.append(x.new_full(shape, value))
    nl = len(spec.left[me])
    off, n = spec.keep[me]
    parts = []
    if rt.index:
        bank = torch.cat(pieces, d) if len(pieces) > 1 else pieces[0]
        halo = bank.index_select(d, torch.tensor(rt.index, device=x.device))
        parts.append(halo.narrow(d, 0, nl))
    parts.append(x.narrow(d, off, n))
    if rt.index:
        parts.append(halo.narrow(d, nl, len(rt.index) - nl))
    return torch.cat(parts, d)


def _scatter_fwd(g: torch.Tensor, spec: HaloGather, ring: AxisPeers, tag: int) -> torch.Tensor:
    """The adjoint of ``_gather_fwd``: every position's value is added into the rank owning it."""
    d, me = spec.dim, ring.index
    rt = spec.routes(me)
    nl = len(spec.left[me])
    off, n = spec.keep[me]
    shape = list(g.shape)
    shape[d] = spec.sizes[me]
    out = g.new_zeros(shape)
    out.narrow(d, off, n).add_(g.narrow(d, nl, n))
    if rt.index:
        halo = torch.cat([g.narrow(d, 0, nl), g.narrow(d, nl + n, len(rt.index) - nl)], d)
        shape[d] = rt.bank
        bank = g.new_zeros(shape).index_add_(d, torch.tensor(rt.index, device=g.device), halo)
    else:
        bank = None
    # Rows this rank read from others go back to them; rows others read from it come back here.
    sends, pos = [], 0
    for src, offs in rt.recvs:
        sends.append((src, bank.narrow(d, pos, len(offs)).contiguous()))
        pos += len(offs)
    bufs = [(dst, _empty(g, d, len(offs))) for dst, offs in rt.sends]
    _p2p(ring, sends, bufs, tag)
    if rt.own:
        out.index_add_(d, torch.tensor(rt.own, device=g.device), bank.narrow(d, pos, len(rt.own)))
    for (_, offs), (_, b) in zip(rt.sends, bufs):
        out.index_add_(d, torch.tensor(offs, device=g.device), b)
    return out


def _check_gather_ring(spec: HaloGather, ring: AxisPeers) -> None:
    if len(spec.sizes) != ring.size:
        raise ValueError(
            f"halo gather: HaloGather has sizes for {len(spec.sizes)} ranks but the mesh axis has "
            f"{ring.size}. Build the spec from the layout of this axis."
        )


def halo_gather(
    x: torch.Tensor, spec: HaloGather, ring: AxisPeers, *, value: float = 0.0, tag: int | None = None
) -> torch.Tensor:
    """Rank r's extended slab ``[left | x[keep] | right]``, halos fetched from whichever ranks own them.

    The multi-hop form of ``halo_cat``: used where a halo spans several slabs (or a slab is
    empty); each rank exchanges one message with every rank it shares positions with, so the
    traffic is the halo itself, point-to-point. Autograd-aware: the backward adds each halo
    position's gradient into the rank that owns it (``halo_scatter``). ``tag``: as
    ``halo_exchange`` (``HALO_TAGS`` reserved on every rank).

    Args:
        x: this rank's slab (possibly empty along ``spec.dim``).
        spec: the positions every rank reads (see ``HaloGather``).
        ring: the axis, from ``axis_peers(mesh, axis)``.
        value: the fill of positions whose index is -1 (zero padding, ``-inf`` for max pooling).
    """
    _check_gather_ring(spec, ring)
    return _HaloGatherFn.apply(x, spec, ring, ring.next_tags(HALO_TAGS) if tag is None else tag, value)


def halo_scatter(y: torch.Tensor, spec: HaloGather, ring: AxisPeers, *, tag: int | None = None) -> torch.Tensor:
    """The adjoint of ``halo_gather``: add every position of ``y`` into the slab of the rank owning it.

    The multi-hop form of ``halo_add``: ``y`` is laid out as ``halo_gather``'s output
    (``[left | kept | right]``); returns this rank's slab (``spec.sizes[r]`` positions) with every
    rank's contributions added; positions with index -1 are dropped. The backward is
    ``halo_gather`` of the gradient.
    """
    _check_gather_ring(spec, ring)
    return _HaloScatterFn.apply(y, spec, ring, ring.next_tags(HALO_TAGS) if tag is None else tag)


class _HaloGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec: HaloGather, ring: AxisPeers, tag: int, value: float):  # noqa: D102
        ctx.spec, ctx.ring, ctx.tag = spec, ring, tag
        return _gather_fwd(x, spec, ring, tag, value)

    # Its communication is not recorded for a second derivative: double backward raises.
    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        return _scatter_fwd(g.contiguous(), ctx.spec, ctx.ring, ctx.tag + 2), None, None, None, None


class _HaloScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, spec: HaloGather, ring: AxisPeers, tag: int):  # noqa: D102
        ctx.spec, ctx.ring, ctx.tag = spec, ring, tag
        return _scatter_fwd(y.contiguous(), spec, ring, tag)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        return _gather_fwd(g.contiguous(), ctx.spec, ctx.ring, ctx.tag + 2, 0.0), None, None, None
