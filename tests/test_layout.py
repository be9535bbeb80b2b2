"""Layouts: the balanced aligned rule, Layout validation, and layouts agreed from local shapes.

Pure functions, no processes: property tests can afford many examples here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_nn import Layout, ShardingError
from sharded_nn.comm import layouts_from_shapes

# ---------------------------------------------------------------------------------------------
# Layout.balanced
# ---------------------------------------------------------------------------------------------


@st.composite
def feasible(draw):
    """(size, parts, align) with at least one block per rank."""
    parts = draw(st.integers(1, 9))
    align = draw(st.integers(1, 17))
    blocks = draw(st.integers(parts, parts * 6))
    # The last block may be short by 0 .. align-1 positions.
    short = draw(st.integers(0, align - 1))
    return blocks * align - short, parts, align


@settings(max_examples=400, deadline=None)
@given(feasible())
def test_balanced_properties(case):
    size, parts, align = case
    lay = Layout.balanced(size, parts, align)
    sizes = lay.sizes
    assert lay.align == align
    assert lay.parts == len(sizes) == parts
    assert lay.size == sum(sizes) == size
    # Every rank holds data.
    assert min(sizes) >= 1
    # Every slab starts at a multiple of align; equivalently every slab but the last is whole blocks.
    assert all(a % align == 0 for a in lay.starts)
    assert lay.is_aligned(align)
    assert all(s % align == 0 for s in sizes[:-1])
    # Blocks (the last one possibly short) are dealt as evenly as possible, extras to the first
    # ranks: block counts are non-increasing and differ by at most one.
    blocks = [math.ceil(s / align) for s in sizes]
    assert sum(blocks) == math.ceil(size / align)
    assert max(blocks) - min(blocks) <= 1
    assert blocks == sorted(blocks, reverse=True)
    # Hence: sizes of all slabs but the last differ by at most align, and the last slab is the
    # only one that may be short: no larger than any other, and short by less than 2*align.
    if parts > 1:
        head = sizes[:-1]
        assert max(head) - min(head) <= align
        assert sizes[-1] <= min(head)
        assert max(head) - sizes[-1] < 2 * align
    # Last slab short by less than one block relative to a whole number of blocks.
    assert blocks[-1] * align - sizes[-1] < align
    # Slices tile [0, size) in order.
    covered = []
    for r in range(parts):
        sl = lay.slice(r)
        assert sl.stop - sl.start == sizes[r]
        covered.extend(range(sl.start, sl.stop))
    assert covered == list(range(size))
    assert lay.max_size == max(sizes)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(1, 12))
def test_balanced_align1_matches_tensor_split(size, parts):
    if size < parts:
        with pytest.raises(ShardingError, match="fewer than the"):
            Layout.balanced(size, parts)
        return
    expected = tuple(len(c) for c in torch.arange(size).tensor_split(parts))
    assert Layout.balanced(size, parts).sizes == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 16))
def test_balanced_divisible_is_blockwise_tensor_split(blocks, parts, align):
    # When align divides the size, the split is the block-level tensor_split scaled by align.
    if blocks < parts:
        return
    expected = tuple(align * len(c) for c in torch.arange(blocks).tensor_split(parts))
    assert Layout.balanced(blocks * align, parts, align).sizes == expected


@pytest.mark.parametrize(
    ("size", "parts", "align", "sizes"),
    [
        (10, 1, 1, (10,)),
        (10, 1, 4, (10,)),
        (7, 3, 1, (3, 2, 2)),
        (10, 3, 4, (4, 4, 2)),
        (5, 2, 2, (4, 1)),
        (33, 2, 16, (32, 1)),
        (64, 4, 16, (16, 16, 16, 16)),
        (65, 4, 16, (32, 16, 16, 1)),
        (1, 1, 16, (1,)),
    ],
)
def test_balanced_examples(size, parts, align, sizes):
    assert Layout.balanced(size, parts, align).sizes == sizes


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 17), st.data())
def test_balanced_too_few_blocks(parts, align, data):
    # Fewer blocks than ranks: some rank would be empty.
    blocks = data.draw(st.integers(0, parts - 1))
    size = data.draw(st.integers(max(0, (blocks - 1) * align + 1), blocks * align)) if blocks else 0
    assert math.ceil(size / align) == blocks
    with pytest.raises(ShardingError, match=rf"size {size}.*align={align}.*{blocks} block\(s\).*{parts} ranks"):
        Layout.balanced(size, parts, align)


def test_sharding_error_is_value_error():
    assert issubclass(ShardingError, ValueError)
    with pytest.raises(ValueError):
        Layout.balanced(1, 2)


@pytest.mark.parametrize(("parts", "align"), [(0, 1), (-1, 1), (2, 0), (2, -3)])
def test_balanced_bad_arguments(parts, align):
    with pytest.raises(ShardingError, match="parts and align must be >= 1"):
        Layout.balanced(10, parts, align)


# ---------------------------------------------------------------------------------------------
# Layout validation
# ---------------------------------------------------------------------------------------------


def test_layout_valid():
    lay = Layout((4, 4, 3), align=2)
    assert lay.starts == (0, 4, 8)
    assert lay.size == 11
    assert lay.slice(1) == slice(4, 8)
    assert lay.slice(2) == slice(8, 11)
    assert lay.is_aligned(4)
    assert not Layout((4, 2, 3), align=2).is_aligned(4)
    # Zero sizes are a valid layout (e.g. a gathered description), rejected only on request.
    assert Layout((0, 5)).starts == (0, 0)


@pytest.mark.parametrize("sizes", [(), (3, -1), (-2,)])
def test_layout_rejects_bad_sizes(sizes):
    with pytest.raises(ShardingError, match="non-negative and non-empty"):
        Layout(sizes)


@pytest.mark.parametrize("align", [0, -4])
def test_layout_rejects_bad_align(align):
    with pytest.raises(ShardingError, match="align must be >= 1"):
        Layout((4, 4), align=align)


@pytest.mark.parametrize(
    ("sizes", "align", "bad"),
    [
        ((3, 4), 2, r"\(1, 3\)"),
        ((4, 3, 4), 2, r"\(2, 7\)"),
        ((16, 15, 16, 16), 16, r"\(2, 31\), \(3, 47\)"),
    ],
)
def test_layout_rejects_misaligned_starts(sizes, align, bad):
    with pytest.raises(ShardingError, match=rf"not multiples of align={align}.*{bad}"):
        Layout(sizes, align=align)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 8))
def test_layout_accepts_exactly_aligned_starts(sizes, align):
    sizes = tuple(sizes)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    if all(a % align == 0 for a in starts):
        lay = Layout(sizes, align)
        assert lay.starts == tuple(starts)
    else:
        with pytest.raises(ShardingError, match="not multiples of align"):
            Layout(sizes, align)


def test_require_nonempty():
    Layout((1, 2)).require_nonempty("ok")
    with pytest.raises(ShardingError, match=r"MyLayer: ranks \[0, 2\] hold empty slabs \(sizes \(0, 3, 0\)\)"):
        Layout((0, 3, 0)).require_nonempty("MyLayer")


def test_layout_is_frozen_and_hashable():
    lay = Layout.balanced(10, 3, 2)
    assert lay == Layout(lay.sizes, 2)
    assert hash(lay) == hash(Layout(lay.sizes, 2))
    with pytest.raises(AttributeError):
        lay.sizes = (10,)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# comm.layouts_from_shapes (pure half of gather_layouts)
# ---------------------------------------------------------------------------------------------


def test_layouts_from_shapes_1d():
    shapes = [(2, 3, 5, 7), (2, 3, 4, 7), (2, 3, 4, 7)]
    coords = [(0,), (1,), (2,)]
    (lay,) = layouts_from_shapes(shapes, coords, [3], (2,))
    assert lay.sizes == (5, 4, 4)


def test_layouts_from_shapes_negative_dim_and_coord_order():
    # Ranks may arrive in any order; coordinates decide the position.
    shapes = [(6, 8), (2, 8), (4, 8)]
    coords = [(2,), (0,), (1,)]
    (lay,) = layouts_from_shapes(shapes, coords, [3], (-2,))
    assert lay.sizes == (2, 4, 6)


def test_layouts_from_shapes_2d():
    # A 2x2 tensor product: dim 2 split (3, 2) by axis 0, dim 3 split (4, 1) by axis 1.
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    shapes = [(1, 2, 3, 4), (1, 2, 3, 1), (1, 2, 2, 4), (1, 2, 2, 1)]
    lay0, lay1 = layouts_from_shapes(shapes, coords, [2, 2], (2, 3))
    assert lay0.sizes == (3, 2)
    assert lay1.sizes == (4, 1)


def test_layouts_from_shapes_unsharded_dim_disagrees():
    shapes = [(2, 3, 5), (2, 4, 5)]
    match = r"gather: dim 1 is not sharded but its size differs across ranks: \[3, 4\]"
    with pytest.raises(ShardingError, match=match):
        layouts_from_shapes(shapes, [(0,), (1,)], [2], (2,), what="gather")


def test_layouts_from_shapes_ndim_disagrees():
    with pytest.raises(ShardingError, match=r"different ranks \(ndims\)"):
        layouts_from_shapes([(2, 3, 5), (2, 3, 5, 1)], [(0,), (1,)], [2], (2,))


def test_layouts_from_shapes_not_a_tensor_product():
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Ranks (0, 0) and (0, 1) share row 0 of the decomposition but disagree on its size.
    shapes = [(1, 1, 3, 4), (1, 1, 2, 4), (1, 1, 2, 4), (1, 1, 2, 4)]
    with pytest.raises(ShardingError, match=r"coordinate 0 of domain axis 0 .*along dim 2.*tensor product"):
        layouts_from_shapes(shapes, coords, [2, 2], (2, 3))
    shapes = [(1, 1, 3, 4), (1, 1, 3, 4), (1, 1, 2, 5), (1, 1, 2, 4)]
    with pytest.raises(ShardingError, match=r"coordinate 0 of domain axis 1 .*along dim 3.*tensor product"):
        layouts_from_shapes(shapes, coords, [2, 2], (2, 3))


def test_layouts_from_shapes_empty_slab():
    shapes = [(2, 3, 4), (2, 3, 0)]
    with pytest.raises(ShardingError, match=r"conv along dim 2: ranks \[1\] hold empty slabs"):
        layouts_from_shapes(shapes, [(0,), (1,)], [2], (2,), what="conv")
