"""Slab layouts: which rank holds which contiguous slab of a sharded dim.

A ``Layout`` describes one sharded dim: the per-rank sizes along it and the alignment that every
slab start honours. Layouts are immutable and identical on every rank, so any validation based on
them raises the same error on every rank (DESIGN.md section 4).

The balanced rule: the dim is cut into ``ceil(size / align)`` blocks of ``align`` positions (the
last block may be short); blocks are dealt out as evenly as possible, the extra blocks going to
the first ranks, so every slab starts at a multiple of ``align`` and the last slab is the one
that may be short.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .errors import ShardingError


@dataclass(frozen=True)
class Layout:
    """Per-rank slab sizes along one tensor dim.

    Attributes:
        sizes: slab size of each rank along the dim, indexed by the mesh-axis coordinate.
        align: every slab starts at a multiple of this (1: no constraint).
    """

    sizes: tuple[int, ...]
    align: int = 1

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 0 for s in self.sizes):
            raise ShardingError(f"Layout: slab sizes must be non-negative and non-empty, got {self.sizes}.")
        if self.align < 1:
            raise ShardingError(f"Layout: align must be >= 1, got {self.align}.")
        bad = [(r, a) for r, a in enumerate(self.starts) if a % self.align]
        if bad:
            raise ShardingError(
                f"Layout: slab starts {self.starts} are not multiples of align={self.align} "
                f"(rank, start) {bad}. Use sharded_nn.shard(..., align={self.align}) or balanced()."
            )

    @classmethod
    def balanced(cls, size: int, parts: int, align: int = 1) -> Layout:
        """The balanced aligned split of ``size`` positions over ``parts`` ranks.

        Raises:
            ShardingError: when some rank would receive an empty slab.
        """
        if parts < 1 or align < 1:
            raise ShardingError(f"Layout.balanced: parts and align must be >= 1, got {parts}, {align}.")
        blocks = -(-size // align)
        if blocks < parts:
            raise ShardingError(
                f"Layout.balanced: a dim of size {size} cut into blocks of align={align} has {blocks} "
                f"block(s), fewer than the {parts} ranks; every rank needs a non-empty slab. "
                "Use fewer ranks, a larger input or a smaller alignment."
            )
        base, extra = divmod(blocks, parts)
        sizes = [(base + (r < extra)) * align for r in range(parts)]
        # Only the last block may be short; the last rank holds at least one block, so its slab
        # stays non-empty.
        sizes[-1] -= blocks * align - size
        return cls(tuple(sizes), align)

    @property
    def parts(self) -> int:
        return len(self.sizes)

    @property
    def size(self) -> int:
        """Global size along the dim."""
        return sum(self.sizes)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.sizes, initial=0))[:-1]

    @property
    def max_size(self) -> int:
        return max(self.sizes)

    def slice(self, rank: int) -> slice:
        """Global index range of ``rank``'s slab."""
        a = self.starts[rank]
        return slice(a, a + self.sizes[rank])

    def is_aligned(self, align: int) -> bool:
        """Whether every slab starts at a multiple of ``align``."""
        return all(a % align == 0 for a in self.starts)

    def require_nonempty(self, what: str) -> None:
        """Raise when a rank holds an empty slab."""
        empty = [r for r, s in enumerate(self.sizes) if s == 0]
        if empty:
            raise ShardingError(
                f"{what}: ranks {empty} hold empty slabs (sizes {self.sizes}); every rank needs data. "
                "Use fewer ranks or a larger input, and cut slabs with sharded_nn.shard / local_slices."
            )


def slab_overlap(a: int, b: int, start: int, n: int) -> tuple[int, int]:
    """The part of the global range ``[a, b)`` that the slab ``[start, start + n)`` holds, as
    offsets ``(lo, hi)`` into the slab (``lo == hi`` where it holds none): a crop or an index
    assignment by global positions, on one rank."""
    lo = min(max(a - start, 0), n)
    return lo, max(min(b - start, n), lo)


def overlap_lengths(a: int, b: int, sizes) -> tuple[int, ...]:
    """Every rank's number of positions of the global range ``[a, b)``, for slabs of ``sizes``."""
    out, start = [], 0
    for n in sizes:
        lo, hi = slab_overlap(a, b, start, n)
        out.append(hi - lo)
        start += n
    return tuple(out)
