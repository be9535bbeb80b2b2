"""Functional forms of the sharded layers: attention over a sequence sharded on the domain axis.

``ring_attention`` (key/value blocks travel around the ring, partial results merged by their
log-sum-exp) and ``ulysses_attention`` (all-to-all from sequence to head sharding and back) take
``(B, H, L_local, D)`` tensors like ``F.scaled_dot_product_attention`` whose sequence dim 2 is
sharded over the domain ranks, and return this rank's ``(B, H, L_local, D)`` slab of the exact
result. A domain of several mesh axes is flattened row-major into one sequence axis.

Token layouts (``layout=``): ``"contiguous"`` slabs (rank r holds one run of tokens, any lengths)
or ``"zigzag"``, the load-balanced layout for causal attention: the sequence is cut into 2P
balanced chunks and rank r holds chunks r and 2P-1-r, so that every rank does the same causal
work. ``zigzag_shard`` / ``zigzag_unshard`` move tokens into and out of it.

The grid functions ``conv`` (``F.conv*d`` on slabs), ``group_norm`` (``F.group_norm`` on slabs),
``interpolate`` (``F.interpolate`` on slabs) and ``pad`` (``F.pad`` on slabs) are served from
here too; they live beside their modules in ``sharded_nn.layers``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.autograd.function import once_differentiable

from .attention_kernels import BlockDropout, acc_dtype, block_backward, block_forward, merge
from .comm.all_to_all import heads_to_seq, seq_to_heads
from .comm.collectives import all_gather_uneven, all_reduce_max, all_reduce_sum
from .comm.peers import AxisPeers, domain_peers
from .comm.ring_pass import gather_ints, ring_pass
from .compile_boundary import eager_under_compile
from .errors import ShardingError
from .layout import Layout
from .mesh import device_code, device_name

__all__ = ["conv", "group_norm", "interpolate", "pad", "ring_attention", "ulysses_attention", "zigzag_shard", "zigzag_unshard"]


def __getattr__(name: str):
    # The functional forms of the grid layers live beside their modules (layers/conv.py,
    # layers/upsample.py, layers/padding.py), which import this module for attention; they are
    # served from here too, where a reader of ``F.conv2d`` / ``F.pad`` looks for them, without an
    # import cycle.
    if name == "conv":
        from .layers.conv import conv

        return conv
    if name == "group_norm":
        from .layers.norm import group_norm

        return group_norm
    if name == "interpolate":
        from .layers.upsample import interpolate

        return interpolate
    if name == "pad":
        from .layers.padding import pad

        return pad
    raise AttributeError(f"module 'sharded_nn.functional' has no attribute {name!r}")

_LAYOUTS = ("contiguous", "zigzag")
#: Pieces that the travelling K/V slab (and its dK/dV accumulator) is cut into, along batch and
#: KV heads: the ring's in-flight buffers are then about 1/_RING_CHUNKS of a slab each.
_RING_CHUNKS = 8
#: ... but no piece smaller than this many elements of K: each piece costs a kernel call, a
#: merge and a message per step (on CPU, vit_small at 1024^2 and P=2, six single-head pieces of
#: 2^17 elements cost about 7% more ring-forward time than three pieces of 2^18), while a piece
#: in flight costs memory only in proportion to its size.
_MIN_CHUNK_NUMEL = 1 << 18
# Message tags, a block of _RING_TAGS reserved per call (``AxisPeers.next_tags``, see
# comm/peers.py) at offsets: forward K/V/padding hops, backward K/V/padding hops, backward dK/dV
# hops. Key/value blocks and gradient accumulators are in flight at the same time, hence
# distinct tags; successive hops of one stream wait for the previous hop and reuse its tags.
_FWD_KV, _BWD_KV, _BWD_DKV = 0, 3, 6
#: Byte alignment of torch's CPU allocations: a chunk sent uncopied must start on it (``_travel``).
_ALIGN = 64
_RING_TAGS = 8


# --------------------------------------------------------------------------- zigzag layout


def _zigzag_chunks(length: int, parts: int) -> Layout:
    return Layout.balanced(length, 2 * parts)


def zigzag_shard(x: torch.Tensor, mesh: DeviceMesh, dim: int = 2) -> torch.Tensor:
    """This rank's zigzag slab of the full tensor ``x`` along ``dim``: chunks r and 2P-1-r.

    The global length is cut into 2P balanced chunks (``Layout.balanced``); every rank passes
    the full tensor.
    """
    ring = domain_peers(mesh)
    chunks = _zigzag_chunks(x.shape[dim], ring.size)
    r, p = ring.index, ring.size
    return torch.cat([x[_along(x, dim, chunks.slice(c))] for c in (r, 2 * p - 1 - r)], dim).clone()


def zigzag_unshard(x_local: torch.Tensor, mesh: DeviceMesh, dim: int = 2) -> torch.Tensor:
    """The full tensor in natural token order, on every rank, from zigzag slabs (no gradient)."""
    ring = domain_peers(mesh)
    dim = dim % x_local.dim()
    shapes = [tuple(s) for s in gather_ints(x_local.shape, ring)]
    parts = all_gather_uneven(x_local, ring.group, shapes) if ring.size > 1 else [x_local.detach()]
    p = ring.size
    chunks = _zigzag_chunks(sum(s[dim] for s in shapes), p)
    pieces: list[torch.Tensor | None] = [None] * (2 * p)
    for r, part in enumerate(parts):
        a = chunks.sizes[r]
        pieces[r] = part.narrow(dim, 0, a)
        pieces[2 * p - 1 - r] = part.narrow(dim, a, part.shape[dim] - a)
    return torch.cat(pieces, dim)


def _along(x: torch.Tensor, dim: int, s: slice) -> tuple[slice, ...]:
    idx = [slice(None)] * x.dim()
    idx[dim] = s
    return tuple(idx)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Segment:
    """A run of consecutive tokens: global start, offset in the local slab, length."""

    start: int
    offset: int
    length: int


@dataclass(frozen=True)
class _Chunk:
    """Batch items ``b0:b1`` and key/value heads ``h0:h1``: one piece of a travelling block."""

    b0: int
    b1: int
    h0: int
    h1: int


def _runs(n: int, parts: int) -> list[tuple[int, int]]:
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def _chunks(batch: int, kv_heads: int, target: int) -> tuple[_Chunk, ...]:
    """About ``target`` pieces of (B, Hkv), each one batch item or all heads of several.

    Pieces travel token-major (``_wire``): a piece of whole batch items of a token-major K/V
    goes as it is; a piece of some heads is copied to travel (received ones land in place).
    With fewer than ``target`` (batch, head) pairs, the pieces are single heads.
    """
    if target <= 1:
        return (_Chunk(0, batch, 0, kv_heads),)
    if batch >= target:
        return tuple(_Chunk(lo, hi, 0, kv_heads) for lo, hi in _runs(batch, target))
    per = min(kv_heads, -(-target // batch))
    return tuple(_Chunk(b, b + 1, lo, hi) for b in range(batch) for lo, hi in _runs(kv_heads, per))


@dataclass(frozen=True)
class _Plan:
    ring: AxisPeers
    scale: float
    causal: bool
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    q_segs: tuple[tuple[_Segment, ...], ...]  # per rank
    k_segs: tuple[tuple[_Segment, ...], ...]
    has_mask: bool
    groups: int  # query heads per key/value head
    chunks: tuple[_Chunk, ...]  # one when P == 1: nothing travels, so nothing is cut
    dropout_p: float = 0.0
    dropout_seed: int = 0
    rq_len: int = 0  # replicated queries (``replicated_q``) per rank; 0: none


def _segments(lens: tuple[int, ...], layout: str, what: str) -> tuple[tuple[_Segment, ...], ...]:
    p = len(lens)
    if layout == "contiguous":
        starts = Layout(lens).starts
        return tuple((_Segment(starts[r], 0, lens[r]),) for r in range(p))
    chunks = _zigzag_chunks(sum(lens), p)
    want = tuple(chunks.sizes[r] + chunks.sizes[2 * p - 1 - r] for r in range(p))
    if want != lens:
        raise ShardingError(
            f"{what}: layout='zigzag' expects per-rank lengths {want} (chunks r and 2P-1-r of "
            f"{chunks.sizes}) for a sequence of {sum(lens)} tokens, but the ranks hold {lens}. "
            "Put the tokens into the layout with sharded_nn.functional.zigzag_shard."
        )
    out = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        out.append((
            _Segment(chunks.starts[c0], 0, chunks.sizes[c0]),
            _Segment(chunks.starts[c1], chunks.sizes[c0], chunks.sizes[c1]),
        ))
    return tuple(out)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _dropout_facts(q, k, dropout_p, dropout_seed, q_positions, k_positions) -> tuple[int, ...]:
    """Dropout options as integers that must agree on every rank (the seed too: the mask law is
    global), plus whether this rank's position tensors are valid."""
    seed = 0 if dropout_seed is None else int(dropout_seed) % (1 << 63)

    def ok(pos, n):
        return pos is None or (
            isinstance(pos, torch.Tensor) and pos.dim() == 1 and pos.shape[0] == n and pos.dtype == torch.int64
        )

    valid = ok(q_positions, q.shape[2] if q.dim() == 4 else -1) and ok(k_positions, k.shape[2] if k.dim() == 4 else -1)
    return (
        _float_bits(dropout_p), int(dropout_seed is not None), seed,
        int(q_positions is not None), int(k_positions is not None), int(valid),
    )


def _rows_from_lengths(ring: AxisPeers, row: tuple[int, ...], seq_lens, what: str) -> list[tuple[int, ...]]:
    """Every rank's facts from this rank's and the caller's gathered lengths (no collective)."""
    q_lens, k_lens = (tuple(int(n) for n in lens) for lens in seq_lens)
    me = ring.index
    if len(q_lens) != ring.size or len(k_lens) != ring.size or (row[2], row[6], row[10]) != (
        q_lens[me], k_lens[me], k_lens[me]
    ):
        # Only a caller bug gets here, and only this rank can see it: the lengths are gathered facts.
        raise ShardingError(
            f"{what}: seq_lens={seq_lens} (per-rank query and key lengths of {ring.size} ranks) do not match "
            f"this rank's (rank {me}) q, k, v lengths {(row[2], row[6], row[10])}. Pass the lengths gathered "
            "from every rank, or seq_lens=None."
        )
    out = []
    for r in range(ring.size):
        other = list(row)
        other[2], other[6], other[10] = q_lens[r], k_lens[r], k_lens[r]
        out.append(tuple(other))
    return out


def _plan(
    q, k, v, mask, mesh, is_causal, scale, layout, what, dropout=(0.0, None, None, None), seq_lens=None, rq=None
) -> _Plan:
    ring = domain_peers(mesh)
    # The number of dims is a gathered fact too: a 3-d tensor on one rank alone must raise on
    # every rank, not on that rank while the others wait in the gather.
    ndims = tuple(t.dim() for t in (q, k, v))
    four = [(*tuple(t.shape)[:4], *(-1,) * max(0, 4 - t.dim())) for t in (q, k, v)]
    mask_shape = tuple(mask.shape) if mask is not None else None
    # A bad mask on one rank only must still raise on every rank: its validity is a gathered fact.
    mask_ok = mask is None or (
        ndims == (4, 4, 4) and mask_shape == (q.shape[0], k.shape[2]) and mask.dtype == torch.bool
    )
    facts = (*four[0], *four[1], *four[2], mask is not None, mask_ok)
    drop_facts = _dropout_facts(q, k, *dropout)
    # Options that change the result must agree too: a rank calling with another is_causal,
    # scale or layout would silently mix two different attentions. An invalid layout is a
    # gathered fact as well, so that every rank raises for it.
    rq_ok = rq is None or (
        isinstance(rq, torch.Tensor) and rq.dim() == 4 and q.dim() == 4 and v.dim() == 4
        and tuple(rq.shape[:2]) == tuple(q.shape[:2]) and rq.shape[3] == q.shape[3] and rq.dtype == q.dtype
    )
    call_facts = (
        int(bool(is_causal)), int(scale is not None), 0 if scale is None else _float_bits(scale),
        _LAYOUTS.index(layout) if layout in _LAYOUTS else -1,
        -1 if rq is None else (rq.shape[2] if isinstance(rq, torch.Tensor) and rq.dim() == 4 else -2), int(rq_ok),
    )  # fmt: skip
    # The device types too: with NCCL a CPU tensor on one rank would fail there alone, mid-ring.
    dev_facts = tuple(device_code(t.device) for t in (q, k, v))
    if seq_lens is None:
        rows = gather_ints((*facts, *drop_facts, *call_facts, *dev_facts, *ndims), ring)
    else:
        rows = _rows_from_lengths(ring, (*facts, *drop_facts, *call_facts, *dev_facts, *ndims), seq_lens, what)
    bad = [(r, tuple(row[-3:])) for r, row in enumerate(rows) if tuple(row[-3:]) != (4, 4, 4)]
    if bad:
        raise ShardingError(
            f"{what}: q, k and v must be 4-d (B, H, L_local, D) on every rank; (rank, (q, k, v) ndims) "
            f"of the ranks that differ: {bad}."
        )
    drop_rows = [tuple(row[len(facts) : len(facts) + len(drop_facts)]) for row in rows]
    n0 = len(facts) + len(drop_facts)
    call_rows = [tuple(row[n0 : n0 + len(call_facts)]) for row in rows]
    n1 = n0 + len(call_facts)
    dev_rows = [tuple(row[n1 : n1 + len(dev_facts)]) for row in rows]
    if len(set(dev_rows)) != 1:
        raise ShardingError(
            f"{what}: the ranks' q, k and v are on different device types: "
            f"{[tuple(device_name(c) for c in r) for r in dev_rows]} (by rank). Put every rank's tensors on "
            "its own device of the mesh's type."
        )
    if any(r[3] < 0 for r in call_rows):
        bad = [i for i, r in enumerate(call_rows) if r[3] < 0]
        raise ValueError(f"{what}: layout must be one of {_LAYOUTS}; ranks {bad} pass something else.")
    if len(set(call_rows)) != 1:
        raise ShardingError(
            f"{what}: ranks disagree on is_causal, scale or layout (or replicated_q); (is_causal, scale given, layout, "
            f"replicated queries (-1: none), replicated_q valid) per rank: "
            f"{[(bool(r[0]), bool(r[1]), _LAYOUTS[r[3]], r[4], bool(r[5])) for r in call_rows]}"
            f"{' (the scales differ)' if len({r[2] for r in call_rows}) > 1 else ''}. Every rank must call "
            "the attention alike: pass the same is_causal, scale and layout (and replicated_q length) on every rank."
        )
    if not call_rows[0][5]:
        raise ShardingError(
            f"{what}: replicated_q must be a (B, H, Lr, D) tensor with q's batch, heads, head size and dtype "
            f"(q: {tuple(q.shape)} {q.dtype}; replicated_q: "
            f"{tuple(rq.shape) if isinstance(rq, torch.Tensor) else type(rq).__name__}), on every rank."
        )
    if is_causal and rq is not None:
        raise ShardingError(
            f"{what}: replicated_q attends over all keys and has no causal position; call with is_causal=False "
            "or attend the replicated queries separately."
        )
    rows = [tuple(row[: len(facts)]) for row in rows]
    _check_dropout(what, drop_rows, dropout)
    # Unsharded facts must agree on every rank; all ranks see the same rows and raise together.
    keep = [i for i in range(len(facts) - 1) if i not in (2, 6, 10)]
    if len({tuple(r[i] for i in keep) for r in rows}) != 1:
        raise ShardingError(
            f"{what}: ranks disagree on batch, heads, head dims or mask presence. Local "
            f"(q, k, v) shapes per rank: {[(r[0:4], r[4:8], r[8:12]) for r in rows]}."
        )
    b, hq, _, d = q.shape
    bk, hk, _, dk = k.shape
    bv, hv, _, dv = v.shape
    if not (b == bk == bv and hk == hv and d == dk):
        raise ShardingError(
            f"{what}: expected q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if hq % hk:
        raise ShardingError(f"{what}: query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA.")
    q_lens = tuple(r[2] for r in rows)
    k_lens = tuple(r[6] for r in rows)
    if any(r[10] != r[6] for r in rows):
        raise ShardingError(
            f"{what}: k and v hold different lengths: {k_lens} vs {tuple(r[10] for r in rows)}. Pass k and v "
            "slabs of the same length (shard both alike)."
        )
    if sum(k_lens) == 0 and (sum(q_lens) > 0 or (rq is not None and rq.shape[2] > 0)):
        # (Empty slabs are taken since session 67: a rank without queries computes nothing, a
        # block without keys is skipped. With no key anywhere a query attends to nothing.)
        raise ShardingError(
            f"{what}: no rank holds a key (k lengths {k_lens}) for queries of lengths {q_lens}: attention "
            "over no keys is undefined. Pass at least one key token."
        )
    if not all(r[13] for r in rows):
        bad = [i for i, r in enumerate(rows) if not r[13]]
        mine = f"{mask.dtype} {mask_shape}" if mask is not None else "None"
        raise ShardingError(
            f"{what}: key_padding_mask must be a bool (B, Lk_local) tensor on every rank; ranks {bad} "
            f"pass something else (this rank: {mine}, expected {(b, k.shape[2])})."
        )
    if is_causal and q_lens != k_lens:
        raise ShardingError(
            f"{what}: causal attention needs queries and keys with the same layout, got q lengths "
            f"{q_lens} and k lengths {k_lens}."
        )
    q_segs = _segments(q_lens, layout, what)
    k_segs = _segments(k_lens, layout, what)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # From gathered facts only, so that every rank cuts its blocks the same way.
    target = min(_RING_CHUNKS, b * hk * max(k_lens) * d // max(_MIN_CHUNK_NUMEL, 1)) if ring.size > 1 else 1
    chunks = _chunks(b, hk, target)
    p, seed = float(dropout[0]), 0 if dropout[1] is None else int(dropout[1]) % (1 << 63)
    return _Plan(
        ring, scale, bool(is_causal), q_lens, k_lens, q_segs, k_segs, mask is not None, hq // hk, chunks, p, seed,
        0 if rq is None else rq.shape[2],
    )


def _check_dropout(what: str, drop_rows, dropout) -> None:
    """Dropout options must agree on every rank; raised on every rank alike (gathered facts)."""
    if len({r[:5] for r in drop_rows}) != 1:
        raise ShardingError(
            f"{what}: ranks disagree on the dropout options; (dropout_p bits, seed given, seed, q_positions "
            f"given, k_positions given) per rank: {[r[:5] for r in drop_rows]}. Pass the same dropout_p and "
            "dropout_seed on every rank (the mask law is keyed on global positions)."
        )
    bad = [r for r, row in enumerate(drop_rows) if not row[5]]
    if bad:
        raise ShardingError(
            f"{what}: q_positions / k_positions must be 1-d int64 tensors with one entry per local query / key "
            f"token; ranks {bad} pass something else."
        )
    p = struct.unpack("<d", struct.pack("<q", drop_rows[0][0]))[0]
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what}: dropout_p must be in [0, 1), got {p}.")
    if p > 0 and not drop_rows[0][1]:
        raise ValueError(
            f"{what}: dropout_p={p} needs dropout_seed (an int, the same on every rank): the mask is keyed on "
            "global positions and the seed, so that every rank draws its part of one mask."
        )


def _pairs(plan: _Plan, src: int):
    """(query segment, key segment, diagonal) pairs of this rank against the block of ``src``.

    Causal attention skips blocks wholly in the future and masks only the diagonal: in both
    layouts a key run that overlaps a query run is the same run of tokens, so it is causal
    top-left aligned.
    """
    me = plan.ring.index
    if not plan.causal:
        if plan.q_lens[me] and plan.k_lens[src]:  # (an empty slab on either side: nothing to attend)
            yield _Segment(0, 0, plan.q_lens[me]), _Segment(0, 0, plan.k_lens[src]), False
        return
    for qs in plan.q_segs[me]:
        for ks in plan.k_segs[src]:
            if not (qs.length and ks.length) or ks.start >= qs.start + qs.length:
                continue
            if ks.start + ks.length <= qs.start:
                yield qs, ks, False
            else:
                yield qs, ks, True


# --------------------------------------------------------------------------- dropout


@dataclass(frozen=True)
class _Drop:
    """Attention dropout of one call: law, this rank's query positions, every rank's key positions."""

    p: float
    seed: int
    q_pos: torch.Tensor
    k_pos: tuple[torch.Tensor, ...]  # by ring coordinate
    rq_pos: torch.Tensor | None = None  # positions of the replicated queries (the same on every rank)

    def block(self, c: _Chunk, groups: int, qs: _Segment, src: int, ks: _Segment, device) -> BlockDropout:
        return BlockDropout(
            self.p, self.seed,
            torch.arange(c.b0, c.b1, device=device),
            torch.arange(c.h0 * groups, c.h1 * groups, device=device),
            self.q_pos[qs.offset : qs.offset + qs.length],
            self.k_pos[src][ks.offset : ks.offset + ks.length],
        )

    def rq_block(self, c: _Chunk, groups: int, src: int, device) -> BlockDropout:
        """The replicated queries of chunk ``c`` against the whole key block of ``src``."""
        return BlockDropout(
            self.p, self.seed,
            torch.arange(c.b0, c.b1, device=device),
            torch.arange(c.h0 * groups, c.h1 * groups, device=device),
            self.rq_pos, self.k_pos[src],
        )


def _segment_positions(segs: tuple[_Segment, ...], device) -> torch.Tensor:
    return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segs])


def _dropout_setup(plan: _Plan, q, q_positions, k_positions, rq_positions=None) -> _Drop | None:
    """Global positions for the mask: given ones (keys gathered once), else the layout's."""
    if plan.dropout_p == 0.0:
        return None
    ring, dev = plan.ring, q.device
    q_pos = q_positions.to(dev) if q_positions is not None else _segment_positions(plan.q_segs[ring.index], dev)
    if k_positions is None:
        k_pos = tuple(_segment_positions(segs, dev) for segs in plan.k_segs)
    elif ring.size == 1:
        k_pos = (k_positions.to(dev),)
    else:
        k_pos = tuple(all_gather_uneven(k_positions.to(dev), ring.group, [(n,) for n in plan.k_lens]))
    rq_pos = None
    if plan.rq_len:
        if not (isinstance(rq_positions, torch.Tensor) and tuple(rq_positions.shape) == (plan.rq_len,)):
            # The same call on every rank (replicated), so every rank raises alike.
            raise ValueError(
                f"ring_attention: dropout with replicated_q needs replicated_positions, an int64 ({plan.rq_len},) "
                f"tensor of their global positions in the mask law; got {rq_positions!r}."
            )
        rq_pos = rq_positions.to(device=dev, dtype=torch.int64)
    return _Drop(plan.dropout_p, plan.dropout_seed, q_pos, k_pos, rq_pos)


# --------------------------------------------------------------------------- ring attention


def _whole(seg: _Segment, n: int) -> bool:
    return seg.offset == 0 and seg.length == n


def _accumulate(acc: torch.Tensor | None, seg: _Segment, val: torch.Tensor, shape, dtype) -> torch.Tensor:
    """``acc[:, :, seg] += val``; the first value of a whole-slab accumulator is taken as is.

    Taking the kernel's fresh result instead of adding it into zeros saves a buffer per
    accumulator.
    """
    if acc is None:
        if _whole(seg, shape[2]):
            return val.to(dtype)
        acc = _token_major_zeros(shape, dtype, val.device)
    _sl(acc, seg).add_(val)
    return acc


def _sl(t, seg: _Segment):
    """Tokens of ``seg`` along dim 2 of a (B, H, L, ...) tensor (a view)."""
    return t[:, :, seg.offset : seg.offset + seg.length]


def _sl_mask(m, seg: _Segment):
    return None if m is None else m[:, seg.offset : seg.offset + seg.length]


def _q_heads(t, c: _Chunk, groups: int):
    """The query-side rows of chunk ``c``: its batch items and the query heads of its KV heads."""
    return t[c.b0 : c.b1, c.h0 * groups : c.h1 * groups]


def _kv_heads(t, c: _Chunk):
    return t[c.b0 : c.b1, c.h0 : c.h1]


def _unit_shapes(plan: _Plan, src: int, c: _Chunk, k, v, with_pad: bool):
    """Wire shapes of chunk ``c`` of the key/value block of rank ``src`` (and of its padding
    flags): token-major, ``(B, L, H, D)`` (see ``_wire``)."""
    n, b, h = plan.k_lens[src], c.b1 - c.b0, c.h1 - c.h0
    shapes = [(b, n, h, k.shape[3]), (b, n, h, v.shape[3])]
    if with_pad:
        shapes.append((b, n))
    return shapes


def _unit(k, v, pad, c: _Chunk) -> list[torch.Tensor]:
    """Chunk ``c`` of this rank's block in wire form (K and V as token-major views)."""
    return [_wire(_kv_heads(k, c)), _wire(_kv_heads(v, c))] + ([pad[c.b0 : c.b1]] if pad is not None else [])


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A ``(B, H, L, D)`` key/value (gradient) view as the ``(B, L, H, D)`` tensor that travels.

    Why token-major: the kernels' key/value gradients come out stored that way (the CPU flash
    kernel's, the CUDA kernels'), and so do keys and values projected per token (one row of
    ``H * D`` values per token): as a contiguous ``(B, L, H, D)`` tensor they travel without a
    copy. The receiver computes on ``_wire(received)``, the same transpose back.
    """
    return t.transpose(1, 2)


def _token_major_zeros(shape, dtype, device) -> torch.Tensor:
    """Zeros of ``(B, H, L, D)`` ``shape`` stored token-major, so that they travel uncopied."""
    return _token_major_empty(shape, dtype, device).zero_()


def _token_major_empty(shape, dtype, device) -> torch.Tensor:
    b, h, n, d = shape
    return torch.empty((b, n, h, d), dtype=dtype, device=device).transpose(1, 2)


class _ChunkBuffers:
    """Free buffers for the travelling K/V chunks of one ring-attention call, reused by shape.

    Why: every hop otherwise receives into fresh chunk-sized tensors (and every chunk's first hop
    sends fresh contiguous copies). Chunks are sized around 1 MiB, where glibc maps and unmaps
    each allocation (``host_memory``'s threshold), so every fresh one was faulted in page by page:
    about 80k page faults per vit_small 1024^2 training step at P=2. Successive chunks and steps
    mostly have the same shapes (all of them when the slabs are even), so a chunk whose hop has
    completed serves the next one instead.

    Ownership is explicit: only ``_travel`` takes buffers, and it gives back a chunk once its hop
    has completed and the caller has resumed the iteration (no computation reads it any more).
    At most ``cap`` buffers are held (the oldest is dropped): two chunks' worth, the double
    buffer itself, so the pool adds at most that much to what the hops held before.
    """

    def __init__(self, cap: int = 6) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._order: list[tuple] = []  # keys of the held buffers, oldest first
        self._cap = cap

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, device)
        free = self._free.get(key)
        if free:
            self._order.remove(key)
            return free.pop()
        return torch.empty(key[0], dtype=dtype, device=device)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` (the same bits as ``t.contiguous()``) in a pooled buffer."""
        return self.take(t.shape, t.dtype, t.device).copy_(t)

    def give(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            key = (tuple(t.shape), t.dtype, t.device)
            self._free.setdefault(key, []).append(t)
            self._order.append(key)
            if len(self._order) > self._cap:
                self._free[self._order.pop(0)].pop(0)


def _travel(plan: _Plan, c: _Chunk, k, v, pad, tag: int, bufs: _ChunkBuffers, keep_first: bool = False):
    """Yield ``(step, src, k, v, pad)`` for chunk ``c`` of the blocks of every rank in turn.

    Step ``s`` holds the chunk of rank ``me - s``. Double buffering: the next chunk is already
    travelling from the left neighbour while the caller computes on the one yielded. The caller
    must not keep a yielded chunk past the iteration that yields it (its buffers go back to
    ``bufs`` when the iteration resumes), except the step-0 chunk with ``keep_first``.
    """
    ring, me, p = plan.ring, plan.ring.index, plan.ring.size
    unit = _unit(k, v, pad, c)
    pooled = [False] * len(unit)
    if p > 1:
        # What travels must be contiguous (in wire form); the owner computes on the same
        # layout as the receivers (a copy where its own is another, or is less aligned than an
        # allocation: BLAS may take another path), so that replicated queries get the same bits
        # on every rank. (Never traced: ring attention runs eagerly under torch.compile.)
        pooled = [not (t.is_contiguous() and t.data_ptr() % _ALIGN == 0) for t in unit]
        unit = [bufs.copy_of(t) if copy else t for t, copy in zip(unit, pooled)]
    # The last hop whose sends may still be in flight, and the pooled buffers it sent. Its sends
    # complete when the right neighbour has read them, which it does when it is ready for them:
    # waiting for that before computing on what arrived would make this rank idle for as long as
    # the neighbour is behind. It is completed before the next hop reuses its tags, and at the
    # end, after the computation on the last chunk.
    sending: tuple | None = None

    def sent() -> None:
        nonlocal sending
        if sending is not None:
            sending[0].wait()
            bufs.give(sending[1])
            sending = None

    for step in range(p):
        src = (me - step) % p
        hop = None
        if step < p - 1:
            sent()
            shapes = _unit_shapes(plan, (src - 1) % p, c, k, v, pad is not None)
            out = [bufs.take(s, t.dtype, t.device) for s, t in zip(shapes, unit)]
            hop = ring_pass(ring, unit, shapes, tag=tag, out=out)
        yield step, src, _wire(unit[0]), _wire(unit[1]), (unit[2] if pad is not None else None)
        received = hop.wait_received() if hop is not None else []
        # This step's chunk has been computed on (the caller resumed): its pooled buffers serve
        # a later chunk once its hop's sends are complete (not the caller's own k, v).
        mine = [] if p == 1 or (keep_first and step == 0) else [t for t, m in zip(unit, pooled) if m]
        if hop is not None:
            sending = (hop, mine)
        else:
            bufs.give(mine)
        unit, pooled = received, [True] * len(received)
    sent()


def _merge_whole(out, lse, o_b, l_b) -> None:
    """Merge block result ``(o_b, l_b)`` into ``(out, lse)`` in place when no lse is -inf.

    The new block's weight is ``sigmoid(l_b - lse)`` = e^l_b / (e^lse + e^l_b), so the output
    is one ``lerp`` pass (``merge`` scales both results and adds them: three passes, and six
    more small ops to guard rows without keys, which cannot occur here).
    """
    w = torch.sigmoid(l_b - lse).unsqueeze(-1)
    out.lerp_(o_b, w)
    torch.logaddexp(lse, l_b, out=lse)


def _rows_before(first: torch.Tensor, rest: torch.Tensor) -> torch.Tensor | None:
    """One ``(B, H, L1 + L2, D)`` view of two ``(B, H, L, D)`` tensors when ``first``'s tokens
    lie right before ``rest``'s in one storage with the same strides, else None.

    Why: a ViT's prefix and patch queries are two parts of one projection (``q.split``); seen as
    one tensor again, the replicated queries' backward joins the patch queries' kernel call.
    """
    if first.dtype != rest.dtype or first.device != rest.device or first.dim() != 4 or rest.dim() != 4:
        return None
    if first.shape[:2] != rest.shape[:2] or first.shape[3] != rest.shape[3]:
        return None
    if first.untyped_storage().data_ptr() != rest.untyped_storage().data_ptr():
        return None
    st = rest.stride()
    for d in (0, 1, 3):  # the stride of a dim of size 1 says nothing
        if rest.shape[d] > 1 and first.stride(d) != st[d]:
            return None
    if first.shape[2] > 1 and first.stride(2) != st[2]:
        return None
    if rest.storage_offset() != first.storage_offset() + first.shape[2] * st[2]:
        return None
    shape = (rest.shape[0], rest.shape[1], first.shape[2] + rest.shape[2], rest.shape[3])
    return rest.as_strided(shape, st, first.storage_offset())


def _block_grads(ctx, plan: _Plan, c: _Chunk, src: int, qc, lc, doc, oc, dqc, kb, vb, mb, rq_c, acc, joint=None):
    """Backward of chunk ``c`` of this rank's queries against the key/value block of ``src``.

    Returns ``(dqc, dkc, dvc)``: the query gradient accumulated into ``dqc`` (taken as is when
    None and whole) and this rank's share of the block's key/value gradients (fresh tensors).
    ``rq_c``: the replicated queries' (q, output gradient, output, lse, gradient share) of the
    chunk, or None; their share of the gradient is accumulated in place. ``joint``: the
    replicated and local queries' (q, output gradient, output, lse) as single tensors, the
    replicated rows first (only without causality and dropout: one whole block pair); one kernel
    call then serves both, instead of a second call whose key/value gradients are added.
    """
    if not kb.shape[2]:  # a block without keys (an empty slab): no share of anything
        return dqc, _token_major_zeros(kb.shape, acc, kb.device), _token_major_zeros(vb.shape, acc, kb.device)
    if joint is not None:
        drq = rq_c[4]
        lr = drq.shape[2]
        q_j, do_j, o_j, l_j = joint
        dq_j, dk_b, dv_b = block_backward(do_j, q_j, kb, vb, o_j, l_j, mb, plan.scale, False)
        drq.add_(dq_j[:, :, :lr])
        whole = _Segment(0, 0, qc.shape[2])
        dqc = _accumulate(dqc, whole, dq_j[:, :, lr:], qc.shape, acc)
        return dqc, dk_b.to(acc), dv_b.to(acc)
    dkc = dvc = None
    for qs, ks, diag in _pairs(plan, src):
        # The same block mask as in forward, regenerated from the seed and positions.
        bd = None if ctx.drop is None else ctx.drop.block(c, plan.groups, qs, src, ks, qc.device)
        dq_b, dk_b, dv_b = block_backward(
            _sl(doc, qs), _sl(qc, qs), _sl(kb, ks), _sl(vb, ks), _sl(oc, qs), _sl(lc, qs),
            _sl_mask(mb, ks), plan.scale, diag, bd,
        )
        dqc = _accumulate(dqc, qs, dq_b, qc.shape, acc)
        dkc = _accumulate(dkc, ks, dk_b, kb.shape, acc)
        dvc = _accumulate(dvc, ks, dv_b, vb.shape, acc)
        del dq_b, dk_b, dv_b
    if rq_c is not None:
        rq, drq_out, rq_out, rq_lse, drq = rq_c
        rbd = None if ctx.drop is None else ctx.drop.rq_block(c, plan.groups, src, qc.device)
        whole = _Segment(0, 0, kb.shape[2])
        drq_b, dk_b, dv_b = block_backward(drq_out, rq, kb, vb, rq_out, rq_lse, mb, plan.scale, False, rbd)
        drq.add_(drq_b)
        dkc = _accumulate(dkc, whole, dk_b, kb.shape, acc)
        dvc = _accumulate(dvc, whole, dv_b, vb.shape, acc)
    if dkc is None:  # a block wholly in this rank's causal future
        dkc = _token_major_zeros(kb.shape, acc, kb.device)
        dvc = _token_major_zeros(vb.shape, acc, kb.device)
    return dqc, dkc, dvc


class _RingAttention(torch.autograd.Function):
    """Ring attention on this rank's slabs; see ``ring_attention`` for the contract.

    Schedule: the K/V slab is cut into chunks along (batch, KV heads) (``_Plan.chunks``); for
    each chunk the ring runs its P steps (step s: the chunk of rank ``me - s``) before the next
    chunk starts. A rank therefore forwards each chunk to its right neighbour exactly when that
    neighbour needs it next, so only one chunk pair is in flight (double buffering at chunk
    granularity) instead of a whole block. In backward the owner keeps its own dK/dV share of a
    chunk; the accumulator of the other ranks' shares starts on the owner's right neighbour,
    follows the K/V one step behind and its last hop (P - 1 in all, the minimum) brings it home,
    where it is added to the owner's share.

    Replicated queries (``replicated_q``: the same tokens on every rank, e.g. a ViT's class
    token) attend over each K/V block as it passes; their per-block results are merged in rank
    order, so every rank gets the same bits without a collective. In backward each rank feeds
    its share of their output gradient into the travelling dK/dV accumulators.
    """

    @staticmethod
    def forward(ctx, q, k, v, pad, plan: _Plan, tag: int, drop: _Drop | None, rq: torch.Tensor | None):  # noqa: D102
        g, p = plan.groups, plan.ring.size
        acc = acc_dtype(q.dtype)
        n, lr = q.shape[2], plan.rq_len
        # The output is stored token-major, (B, Lr + Lq, H, Dv) with the replicated queries' rows
        # first: the caller's ``transpose(1, 2).reshape`` to tokens is then a view, and the one
        # tensor both this function (for backward) and the output projection keep is stored once.
        buf = torch.empty((q.shape[0], lr + n, q.shape[1], v.shape[3]), dtype=acc, device=q.device)
        out = buf[:, lr:].transpose(1, 2)
        lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
        rq_parts = None
        if rq is not None:
            # The replicated queries' partial result against each rank's block, merged in rank
            # order at the end, so that every rank computes the same bits.
            rq_parts = (
                torch.empty((p, *rq.shape[:3], v.shape[3]), dtype=acc, device=q.device),
                torch.empty((p, *rq.shape[:3]), dtype=acc, device=q.device),
            )
        # Replicated queries contiguous for the forward kernels, so that they see the same layout
        # on every rank (bit-identical results); backward takes the caller's view (``joint``).
        rqc = None if rq is None else rq.contiguous()
        bufs = _ChunkBuffers(2 * (3 if pad is not None else 2))
        # Without causality or padding no row's lse is ever -inf: blocks merge by weight in one
        # pass (``_merge_whole``). The first block is still copied into the output rather than
        # kept: keeping it would hold two block results at the last merge (+1.5 MiB per
        # vit_tiny layer at 1024^2, the forward's peak) to save one copy.
        whole_rows = not plan.causal and pad is None
        for c in plan.chunks:
            qc = _q_heads(q, c, g)
            oc, lc = _q_heads(out, c, g), _q_heads(lse, c, g)
            fresh = True  # nothing written to this chunk's output rows yet
            for _step, src, kb, vb, mb in _travel(plan, c, k, v, pad, tag + _FWD_KV, bufs):
                if rq is not None and not plan.k_lens[src]:
                    # A block without keys (an empty slab): nothing seen, merged as such.
                    _q_heads(rq_parts[0][src], c, g).zero_()
                    _q_heads(rq_parts[1][src], c, g).fill_(float("-inf"))
                elif rq is not None:
                    rbd = None if drop is None else drop.rq_block(c, g, src, q.device)
                    o_r, l_r = block_forward(_q_heads(rqc, c, g), kb, vb, mb, plan.scale, False, rbd)
                    _q_heads(rq_parts[0][src], c, g).copy_(o_r)
                    _q_heads(rq_parts[1][src], c, g).copy_(l_r)
                    del o_r, l_r
                for qs, ks, diag in _pairs(plan, src):
                    bd = None if drop is None else drop.block(c, g, qs, src, ks, q.device)
                    o_b, l_b = block_forward(
                        _sl(qc, qs), _sl(kb, ks), _sl(vb, ks), _sl_mask(mb, ks), plan.scale, diag, bd
                    )
                    if fresh and _whole(qs, n):
                        oc.copy_(o_b)
                        lc.copy_(l_b)
                    else:
                        if fresh:  # the first block covers part of the rows (zigzag causal)
                            oc.zero_()
                            lc.fill_(float("-inf"))
                        (_merge_whole if whole_rows else merge)(_sl(oc, qs), _sl(lc, qs), o_b, l_b)
                    fresh = False
                    del o_b, l_b
                # Drop this step's names so that a received chunk is freed once replaced.
                del kb, vb, mb
        rq_lse = None
        if rq is not None:
            rq_out = buf[:, :lr].transpose(1, 2)
            rq_out.copy_(rq_parts[0][0])
            rq_lse = rq_parts[1][0].clone()
            # Without padding or empty blocks no lse is -inf: merged by weight in one pass.
            rq_merge = _merge_whole if pad is None and min(plan.k_lens) else merge
            for src in range(1, p):
                rq_merge(rq_out, rq_lse, rq_parts[0][src], rq_parts[1][src])
            del rq_parts, rq_out
        buf = buf.to(q.dtype)  # float32 and float64 inputs: no copy
        ctx.plan, ctx.tag, ctx.drop = plan, tag, drop
        ctx.mark_non_differentiable(lse)
        empty = torch.empty(0)
        ctx.save_for_backward(
            q, k, v, pad if pad is not None else empty, buf, lse,
            rq if rq is not None else empty, rq_lse if rq_lse is not None else empty,
        )  # fmt: skip
        return buf, lse

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, dbuf, _dlse):  # noqa: D102
        plan = ctx.plan
        q, k, v, pad, buf, lse, rq, rq_lse = ctx.saved_tensors
        lr = plan.rq_len
        out, dout = buf[:, lr:].transpose(1, 2), dbuf[:, lr:].transpose(1, 2)
        rq_out = drq_out = None
        if lr:
            rq_out, drq_out = buf[:, :lr].transpose(1, 2), dbuf[:, :lr].transpose(1, 2)
        else:
            rq = rq_lse = None
        pad = pad if plan.has_mask else None
        ring, p, g = plan.ring, plan.ring.size, plan.groups
        acc = acc_dtype(q.dtype)
        if pad is not None:
            # A query with no visible key at all (lse = -inf, output 0) has zero gradients:
            # lse = +inf makes its probabilities exp(s - lse) 0 instead of NaN.
            lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
            if rq is not None:
                rq_lse = rq_lse.masked_fill(torch.isneginf(rq_lse), float("inf"))
        dq = dk = dv = drq = None
        if len(plan.chunks) > 1:
            # Token-major, as the kernels' gradients and a per-token projection's input
            # gradient are: no copy on either side.
            dq = _token_major_zeros(q.shape, acc, q.device)
        if rq is not None:
            # This rank's share of the replicated queries' gradient: its partial output
            # gradient against every key (the shares sum to the gradient, DESIGN.md section 3).
            drq = torch.zeros(rq.shape, dtype=acc, device=q.device)
        # Replicated queries stored right before the local ones (a ViT's split projection) share
        # the local queries' kernel calls (the output and its gradient are stored that way by
        # this function), where each block pair is one whole pair.
        q_joint = None
        if rq is not None and not plan.causal and ctx.drop is None:
            q_joint = _rows_before(rq, q)
        if q_joint is not None:
            o_joint, do_joint = buf.transpose(1, 2), dbuf.transpose(1, 2)
            l_joint = torch.cat([rq_lse, lse], 2)
        # The dK/dV accumulator of a block starts on the rank right of its owner and collects one
        # share per rank on its way round, P - 1 hops, the last one into the owner's hands
        # (``home``); the owner's own share never travels. ``travel``: the hop of the accumulator
        # this rank holds next, waited for at the next step. Hops are waited for after the next
        # block's computation, so that they travel while this rank computes.
        travel = home = None
        # The own block of the last chunk is computed last (``deferred``): its dK/dV share stays
        # here, so it can wait, and computing it after the last hop has left hides that hop, which
        # would otherwise be waited for with nothing left to compute.
        deferred = None

        def rq_args(c: _Chunk):
            if rq is None:
                return None
            return tuple(_q_heads(t, c, g) for t in (rq, drq_out, rq_out, rq_lse, drq))

        def joint_args(c: _Chunk):
            if q_joint is None:
                return None
            return tuple(_q_heads(t, c, g) for t in (q_joint, do_joint, o_joint, l_joint))

        def own_share(c: _Chunk, dkc: torch.Tensor, dvc: torch.Tensor) -> None:
            nonlocal dk, dv
            if p == 1 or len(plan.chunks) == 1:
                dk, dv = dkc, dvc  # fresh tensors of this call: the accumulator itself
                return
            if dk is None:
                # The other ranks' shares arrive with the last hop of each chunk and are added.
                dk = _token_major_empty(k.shape, acc, q.device)
                dv = _token_major_empty(v.shape, acc, q.device)
            _kv_heads(dk, c).copy_(dkc)
            _kv_heads(dv, c).copy_(dvc)

        def wait_home() -> None:
            nonlocal home
            if home is not None:
                # The other ranks' shares of one of this rank's chunks, back home.
                got = home[0].wait()
                _kv_heads(dk, home[1]).add_(_wire(got[0]))
                _kv_heads(dv, home[1]).add_(_wire(got[1]))
                home = None

        bufs = _ChunkBuffers(2 * (3 if pad is not None else 2))
        for ci, c in enumerate(plan.chunks):
            qc, lc = _q_heads(q, c, g), _q_heads(lse, c, g)
            # Views, no copies: the kernels take strided query-side tensors (the output and its
            # gradient are stored token-major); the CUDA kernel makes its own contiguous copies.
            doc, oc = _q_heads(dout, c, g), _q_heads(out, c, g)
            dqc = None if dq is None else _q_heads(dq, c, g)
            defer = p > 1 and ci == len(plan.chunks) - 1
            for step, src, kb, vb, mb in _travel(plan, c, k, v, pad, ctx.tag + _BWD_KV, bufs, keep_first=defer):
                if defer and step == 0:
                    deferred = (c, qc, lc, doc, oc, kb, vb, mb)
                    del kb, vb, mb
                    continue
                dqc, dkc, dvc = _block_grads(
                    ctx, plan, c, src, qc, lc, doc, oc, dqc, kb, vb, mb, rq_args(c), acc, joint_args(c)
                )
                if travel is not None:
                    # The shares of this block from the ranks that held it before (it travelled
                    # while this rank computed its own share).
                    got = travel.wait()
                    travel = None
                    dkc += _wire(got[0])
                    dvc += _wire(got[1])
                    del got
                wait_home()  # before its tags are reused by the next dK/dV hop
                if step == 0:
                    own_share(c, dkc, dvc)
                else:
                    # To the right neighbour, which holds block ``src`` next (or owns it, at the
                    # last step); from the left neighbour comes the accumulator of block src - 1.
                    shapes = _unit_shapes(plan, (src - 1) % p, c, k, v, False)
                    hop = ring_pass(ring, [_wire(dkc), _wire(dvc)], shapes, tag=ctx.tag + _BWD_DKV)
                    if step == p - 1:
                        home = (hop, c)
                    else:
                        travel = hop
                del kb, vb, mb, dkc, dvc
            if deferred is not None:
                c, qc, lc, doc, oc, kb, vb, mb = deferred
                deferred = None
                dqc, dkc, dvc = _block_grads(
                    ctx, plan, c, plan.ring.index, qc, lc, doc, oc, dqc, kb, vb, mb, rq_args(c), acc,
                    joint_args(c),
                )
                own_share(c, dkc, dvc)
                del kb, vb, mb, dkc, dvc
            if dq is None:
                dq = dqc
        if dq is None:  # no query here (an empty slab): nothing accumulated
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        wait_home()
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None)
        return (*grads, None if drq is None else drq.to(rq.dtype))


@eager_under_compile
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    seq_lens: tuple[Sequence[int], Sequence[int]] | None = None,
    replicated_q: torch.Tensor | None = None,
    replicated_positions: torch.Tensor | None = None,
    concat_replicated: bool = False,
):
    """Exact attention over a sequence sharded on the domain axis, by passing K/V around a ring.

    Sharding contract: q ``(B, H, Lq_local, D)``, k ``(B, Hkv, Lk_local, D)``, v
    ``(B, Hkv, Lk_local, Dv)`` hold this rank's tokens (dim 2 sharded, any lengths, ``layout``
    says which tokens); the result is this rank's ``(B, H, Lq_local, Dv)`` slab of
    ``F.scaled_dot_product_attention`` on the full sequence. Forward: one tiny all-gather of the
    local shapes, then P-1 point-to-point hops of each K/V piece (the slab is cut into up to
    ``_RING_CHUNKS`` pieces along batch and KV heads; each hop is double-buffered and overlapped
    with the block computation). Backward: K/V circulate again, each piece followed by its dK/dV
    accumulator, which ends on its owner. Per-rank memory is the O(L_local x D) slabs plus a few
    pieces in flight (about 1.1 slabs at 8 pieces); no rank ever holds the full K/V or an
    L x L matrix. Backward moves (P - 1) x (K/V + dK/dV), the minimum: each rank keeps its own
    dK/dV share and receives the sum of the others'. With one rank nothing is cut and nothing is copied. Partial results are merged
    in float32 (float64 for float64 inputs) by their log-sum-exp. Block kernels: see
    ``sharded_nn.attention_kernels`` (CPU flash kernel, CUDA memory-efficient kernel behind a
    one-time self-check, blocked math otherwise).

    Args:
        q, k, v: local slabs. ``H`` must be a multiple of ``Hkv`` (grouped-query attention).
        mesh: mesh with domain axes; several domain axes are flattened row-major.
        is_causal: causal mask on global token positions (needs identical q and k layouts).
        scale: score scale; default ``1 / sqrt(D)``.
        key_padding_mask: bool ``(B, Lk_local)``, True where a key is padding and must be
            ignored (``nn.MultiheadAttention``'s convention). A query whose keys are all padding
            gets zeros.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
        return_lse: also return the ``(B, H, Lq_local)`` log-sum-exp of the scores (of the
            undropped scores when dropout is on).
        dropout_p: attention dropout probability (apply it in training only, as torch's
            ``dropout_p``): each probability is dropped with probability p, kept ones are scaled
            by ``1 / (1 - p)``. The mask is position-keyed (``attention_kernels.dropout_keep``):
            entry (b, h, i, j) is a hash of ``dropout_seed`` and the global batch index, query
            head, query position i and key position j, so the ranks need not share random
            numbers and backward regenerates the mask. Same law as torch's dropout, not the same
            bits. Blocks with dropout run on the blocked math path.
        dropout_seed: the mask's seed, the same on every rank; draw a new one per step (and
            per layer). Required when ``dropout_p > 0``.
        q_positions, k_positions: int64 ``(Lq_local,)`` / ``(Lk_local,)`` global positions of
            this rank's query / key tokens in the mask law (default: their positions in the
            global sequence of ``layout``). The key positions are all-gathered once per call.
        seq_lens: ``(q_lens, k_lens)``, every rank's local query and key lengths, for a caller
            that has already gathered them (a model gathers its token layout once per forward):
            the call then skips its one small all-gather of the shapes, which is also a
            synchronisation of the ranks. The other facts (batch, heads, head dims, mask
            presence, dropout options) are then taken as agreed, not checked across ranks.
        replicated_q: ``(B, H, Lr, D)`` extra queries held identically by every rank (a ViT's
            class and register tokens), attending over the keys of all ranks (not causal). They
            ride along the ring: no extra collective. The call then also returns their
            ``(B, H, Lr, Dv)`` output, bit-identical on every rank (per-block results merged in
            rank order). Gradient convention of DESIGN.md section 3: their output gradient on
            each rank is a share, and so is the gradient returned for ``replicated_q``.
        replicated_positions: int64 ``(Lr,)`` global positions of the replicated queries in the
            dropout mask law; required with dropout and ``replicated_q``.
        concat_replicated: with ``replicated_q``, return one ``(B, H, Lr + Lq_local, Dv)``
            output, the replicated queries' rows first, instead of two.

    Returns:
        The ``(B, H, Lq_local, Dv)`` output, stored token-major (a ``(B, Lq_local, H, Dv)``
        tensor transposed, so that ``out.transpose(1, 2).reshape(B, Lq_local, H * Dv)`` is a
        view); with ``return_lse`` ``(out, lse)``; with ``replicated_q`` also the replicated
        output last: ``(out, out_r)`` or ``(out, lse, out_r)`` (or the concatenated output).

    Raises:
        ShardingError: inconsistent shapes or dropout options across ranks, a zigzag layout
            with the wrong lengths, or causal attention with different q and k layouts (on
            every rank alike).
        ValueError: ``dropout_p`` outside [0, 1), or without ``dropout_seed`` (every rank).
    """
    dropout = (dropout_p, dropout_seed, q_positions, k_positions)
    plan = _plan(
        q, k, v, key_padding_mask, mesh, is_causal, scale, layout, "ring_attention", dropout, seq_lens, replicated_q
    )
    pad = key_padding_mask.to(torch.uint8).contiguous() if key_padding_mask is not None else None
    drop = _dropout_setup(plan, q, q_positions, k_positions, replicated_positions)
    if plan.ring.size == 1 and drop is None and pad is None and not return_lse:
        return _one_rank_attention(q, k, v, plan, replicated_q, concat_replicated)
    # Reserved by every rank in program order, also for its backward (see comm/peers.py).
    tag = plan.ring.next_tags(_RING_TAGS)
    rq = replicated_q
    buf, lse = _RingAttention.apply(q, k, v, pad, plan, tag, drop, rq)
    lr = plan.rq_len
    if rq is not None and concat_replicated:
        both = buf.transpose(1, 2)
        return (both, lse) if return_lse else both
    out = buf[:, lr:].transpose(1, 2)
    if rq is None:
        return (out, lse) if return_lse else out
    out_r = buf[:, :lr].transpose(1, 2)
    return (out, lse, out_r) if return_lse else (out, out_r)


def _one_rank_attention(q, k, v, plan: _Plan, rq: torch.Tensor | None, concat_replicated: bool):
    """``ring_attention`` on a one-rank domain: torch's own fused attention on the whole sequence.

    Why: with nothing to pass around, the ring's bookkeeping (block plans, log-sum-exp merges, a
    separate small call for the replicated queries, a Python autograd function) is pure
    overhead, and on a GPU, where a ViT layer's attention takes about half a millisecond, it made a
    vit_small step at 1024^2 1.4x slower than timm's (H200, world size 1). Replicated queries
    join the others in one call (the same result as attending separately). Dropout (its mask law
    is ours, not torch's), key padding (a row whose keys are all padding gets zeros from the ring,
    NaN from torch) and ``return_lse`` keep the ring path.
    """
    n_r = 0 if rq is None else rq.shape[2]
    q_all = q if rq is None else torch.cat([rq, q], 2)
    out = F.scaled_dot_product_attention(
        q_all, k, v, is_causal=plan.causal, scale=plan.scale, enable_gqa=plan.groups > 1
    )
    if rq is None or concat_replicated:
        return out
    return out[:, :, n_r:], out[:, :, :n_r]


def _replicated_query_attention(q, k, v, peers: AxisPeers, scale: float | None = None) -> torch.Tensor:
    """Attention of queries held identically by every domain rank (a pooling latent, a class
    token) over keys/values sharded along their tokens: the replicated ``(B, H, Lr, Dv)`` output.

    Each rank attends over its own keys (blocked math: Lr is small), then the per-rank results
    are merged by their log-sum-exp with two sums over the ranks (max shift, no gradient through
    it). Autograd runs through the sums (gradient convention of DESIGN.md section 3: the output
    gradient on each rank is a share; the gradient reaching ``q`` on each rank is its part from
    this rank's keys, summed over the domain like any replicated parameter's). For the forward
    guard, whose states guarantee replicated queries and slabs of one layout.
    """
    acc = acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    lse = torch.logsumexp(scores, -1, keepdim=True)
    out = torch.softmax(scores, -1) @ v.to(acc)
    weight = torch.exp(lse - all_reduce_max(lse, peers.group))
    total = all_reduce_sum(weight * out, peers.group) / all_reduce_sum(weight, peers.group)
    return total.to(q.dtype)


# --------------------------------------------------------------------------- Ulysses


@eager_under_compile
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    layout: str = "contiguous",
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    seq_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """Exact attention over a sharded sequence by all-to-all to head sharding and back.

    Sharding contract: as ``ring_attention``. Forward: an all-to-all turns the local slabs of
    all heads into the full sequence of H/P heads, local ``F.scaled_dot_product_attention``
    runs on it, and a second all-to-all returns the sequence slabs; backward mirrors them. Memory
    per rank is O(L x H/P x D) plus what the local attention kernel needs. The key padding mask
    is all-gathered (B x L flags). Dropout options as ``ring_attention`` (the same mask law: a
    rank attends with whole heads over the full sequence and keys the mask on the global head
    index and positions; the positions are all-gathered once per call); with dropout the local
    attention runs on the blocked math kernel. ``seq_lens`` as ``ring_attention``.

    Raises:
        ShardingError: when the query or key/value heads are not divisible by the number of
            domain ranks (on every rank alike), or as ``ring_attention``.
    """
    dropout = (dropout_p, dropout_seed, q_positions, k_positions)
    plan = _plan(q, k, v, key_padding_mask, mesh, is_causal, scale, layout, "ulysses_attention", dropout, seq_lens)
    p = plan.ring.size
    hq, hk = q.shape[1], k.shape[1]
    if hq % p or hk % p:
        raise ShardingError(
            f"ulysses_attention: {hq} query heads and {hk} key/value heads must both be divisible by "
            f"the {p} domain ranks, because each rank attends over whole heads. Use ring_attention "
            "(attention='ring'), or a number of ranks that divides the heads."
        )
    ring = plan.ring
    qh = seq_to_heads(q, ring, plan.q_lens)
    kh = seq_to_heads(k, ring, plan.k_lens)
    vh = seq_to_heads(v, ring, plan.k_lens)
    mask = flags = None
    if key_padding_mask is not None:
        shapes = [(q.shape[0], n) for n in plan.k_lens]
        pads = all_gather_uneven(key_padding_mask.to(torch.uint8), ring.group, shapes) if p > 1 else [key_padding_mask]
        flags = torch.cat([t.to(torch.uint8) for t in pads], 1)
        mask = ~flags.bool()[:, None, None, :]
    drop = _ulysses_dropout(plan, q, q_positions, k_positions)
    order = None
    if is_causal and layout == "zigzag" and p > 1:
        # Tokens arrive in rank order; causal masking needs global order.
        order = torch.cat([
            torch.arange(s.start, s.start + s.length, device=q.device) for segs in plan.q_segs for s in segs
        ])
        natural = torch.argsort(order)
        qh, kh, vh = qh[:, :, natural], kh[:, :, natural], vh[:, :, natural]
        mask = mask[..., natural] if mask is not None else None
        flags = flags[:, natural] if flags is not None else None
        if drop is not None:
            drop = BlockDropout(drop.p, drop.seed, drop.batch, drop.heads, drop.q_pos[natural], drop.k_pos[natural])
    if drop is not None:
        oh = _LocalAttention.apply(qh, kh, vh, flags, plan.scale, bool(is_causal), drop)
        if order is not None:
            oh = oh[:, :, order]
        return heads_to_seq(oh.contiguous(), ring, plan.q_lens)
    causal_flag = is_causal
    if is_causal and mask is not None:
        # Padding and causality combined need an explicit (L, L) mask; without padding the
        # kernel's own causal path is used.
        n = qh.shape[2]
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        causal_flag = False
    oh = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal_flag, scale=scale, enable_gqa=hq != hk
    )
    if order is not None:
        oh = oh[:, :, order]
    return heads_to_seq(oh.contiguous(), ring, plan.q_lens)


def _ulysses_dropout(plan: _Plan, q, q_positions, k_positions) -> BlockDropout | None:
    """The dropout of this rank's head group over the full sequence (tokens in rank order)."""
    if plan.dropout_p == 0.0:
        return None
    ring, dev = plan.ring, q.device

    def every_rank(pos, lens, segs):
        if pos is None:
            return torch.cat([_segment_positions(sg, dev) for sg in segs])
        if ring.size == 1:
            return pos.to(dev)
        return torch.cat(all_gather_uneven(pos.to(dev), ring.group, [(n,) for n in lens]))

    hp = q.shape[1] // ring.size
    return BlockDropout(
        plan.dropout_p, plan.dropout_seed,
        torch.arange(q.shape[0], device=dev),
        torch.arange(ring.index * hp, (ring.index + 1) * hp, device=dev),
        every_rank(q_positions, plan.q_lens, plan.q_segs),
        every_rank(k_positions, plan.k_lens, plan.k_segs),
    )


class _LocalAttention(torch.autograd.Function):
    """Attention with position-keyed dropout on one rank's full sequence (Ulysses' local step):
    the blocked math kernel forward, its mask regenerated in backward."""

    @staticmethod
    def forward(ctx, q, k, v, pad, scale: float, causal: bool, drop: BlockDropout):  # noqa: D102
        out, lse = block_forward(q, k, v, pad, scale, causal, drop)
        out = out.to(q.dtype)
        ctx.scale, ctx.causal, ctx.drop, ctx.has_pad = scale, causal, drop, pad is not None
        ctx.save_for_backward(q, k, v, pad if pad is not None else torch.empty(0), out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):  # noqa: D102
        q, k, v, pad, out, lse = ctx.saved_tensors
        pad = pad if ctx.has_pad else None
        if pad is not None:
            # A query with no visible key (lse = -inf, output 0) gets zero gradients.
            lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, pad, ctx.scale, ctx.causal, ctx.drop)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
