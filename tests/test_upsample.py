"""ShardedUpsample / interpolate against torch on the full tensor, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh
from .reference import check_against_reference

SHAPE = {1: (2, 3, 13), 2: (2, 3, 11, 6), 3: (1, 2, 9, 5, 4)}
MODES = [("area", 2), ("area", 1), ("nearest", 2), ("nearest-exact", 2), ("linear", 1), ("bilinear", 2), ("trilinear", 3), ("bicubic", 2),
         ("nearest", 3), ("nearest", 1)]
SIZES = [dict(scale_factor=2), dict(scale_factor=3), dict(scale_factor=1.5), dict(scale_factor=0.5), dict(size=17)]


def _cases():
    for mode, nd in MODES:
        for ac in [None] if mode.startswith("nearest") or mode == "area" else [False, True]:
            for kw in SIZES:
                # Area halving of 11 positions over 4 ranks leaves one rank without a bin (an error).
                if not (mode == "area" and kw == dict(scale_factor=0.5)):
                    yield mode, nd, ac, kw


def _check_many(domain, dims, sizes=None, every=1):
    m = mesh(domain)
    n_checked = 0
    for mode, nd, ac, kw in list(_cases())[::every]:
        if len(dims) > nd or (sizes is not None and sum(sizes) != SHAPE[nd][2]):
            continue
        ref = nn.Upsample(mode=mode, align_corners=ac, **kw)
        torch.manual_seed(1)
        x = torch.randn(SHAPE[nd], dtype=torch.float64)
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
        try:
            check_against_reference(ref, x, m, dims=dims, sharded=sharded, sizes=sizes)
        except AssertionError as e:
            raise AssertionError(f"mode={mode} align_corners={ac} {kw}: {e}") from None
        n_checked += 1
    return n_checked


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
def test_upsample_matches_torch_1d_mesh(run, domain):
    # Every case on 2 and 4 ranks; every other one on 1 and 3 (the suite stays fast).
    every = 2 if domain in (1, 3) else 1
    assert all(n > 50 // every for n in run(domain, _check_many, domain, (2,), None, every))


def test_upsample_2x2_mesh(run):
    assert all(n > 30 for n in run(4, _check_many, (2, 2), (2, 3)))


def test_upsample_explicit_uneven_slabs(run):
    assert all(n > 20 for n in run(3, _check_many, 3, (2,), (2, 6, 3)))


def _functional_and_aliases():
    m = mesh(2)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 10, 7, dtype=torch.float64)
    x_loc = snn.shard(x, m, dims=(2,))
    y = snn.interpolate(x_loc, m, size=(15, 9), mode="bicubic", align_corners=False)
    torch.testing.assert_close(snn.gather(y, m, dims=(2,)), F.interpolate(x, size=(15, 9), mode="bicubic"))
    for ref in (nn.UpsamplingNearest2d(scale_factor=2), nn.UpsamplingBilinear2d(scale_factor=2)):
        sharded = snn.convert(copy.deepcopy(ref), m)
        assert type(sharded).__name__ == f"Sharded{type(ref).__name__}"
        check_against_reference(ref, x, m, sharded=sharded)
    # Integer factors keep the output slabs aligned: rank r's outputs start at 2 * its input start.
    assert y.shape[2] in (8, 7)
    with pytest.raises(snn.ShardingNotImplementedError, match="antialias"):
        snn.interpolate(x_loc, m, scale_factor=2, mode="bilinear", antialias=True)
    # Fewer output rows than ranks: rank 1 carries an empty slab (it used to raise).
    for mode in ("nearest", "bilinear"):
        y = snn.interpolate(x_loc, m, size=(1, 7), mode=mode)
        rank = m.get_local_rank("domain")
        assert y.shape[2] == (1 if rank == 0 else 0)
        if rank == 0:
            torch.testing.assert_close(y, F.interpolate(x, size=(1, 7), mode=mode))
    return True


def test_functional_form_aliases_and_errors(run):
    assert all(run(2, _functional_and_aliases))


def _float32():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear"),
                        nn.Conv2d(4, 2, 3, padding=1))
    return check_against_reference(ref, torch.randn(1, 3, 10, 6), mesh(3), atol=1e-5, rtol=1e-4)


def test_float32_stack(run):
    run(3, _float32)
