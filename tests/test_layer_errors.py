"""Every public sharded layer raises the same error on every rank, never a hang.

Each case feeds a bad input on ONE rank (a different number of dims, dtype, channel count,
``requires_grad``, argument or mask) or on every rank, catches the exception in the worker and
returns ``(type name, message)``; the test asserts that every rank raised, with the same type
and the same message. Before the checks were decided on gathered facts, a bad input on one rank
made that rank raise while its peers waited in a collective (the harness then times out).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import sharded_nn as snn

from .harness import mesh

D = torch.float64


def _grid(n: int, seed: int = 0) -> torch.Tensor:
    """A full (N, C, S...) input: 4 channels, an odd length along the sharded dim (uneven slabs)."""
    shape = {1: (2, 4, 9), 2: (2, 4, 9, 6), 3: (1, 4, 9, 5, 4)}[n]
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _one_rank(r: int, bad: Callable, good: Callable):
    """``bad()`` on rank 1 only, ``good()`` elsewhere."""
    return bad() if r == 1 else good()


# --- grid layers: the module, its input dimensionality, and which bad inputs apply -------------


def _grid_variants(n: int, channels: bool, grad: bool) -> dict[str, Callable]:
    """Bad inputs for a layer on (N, C, S...) slabs; each returns the layer's input on rank r."""

    def variants(x: torch.Tensor, r: int):
        v = {
            "ndim on one rank": _one_rank(r, lambda: x.unsqueeze(0), lambda: x),
            "dtype on one rank": _one_rank(r, lambda: x.float(), lambda: x),
            # (With NCCL, a CPU slab among GPU ones; "meta" stands in for the other device here.)
            "device on one rank": _one_rank(r, lambda: x.to("meta"), lambda: x),
            "ndim on every rank": x.reshape(1, 1, *x.shape),
        }
        if channels:
            v["channels on one rank"] = _one_rank(r, lambda: x[:, :3], lambda: x)
            v["channels on every rank"] = x[:, :3]
        if grad:
            v["requires_grad on one rank"] = _one_rank(r, lambda: x.detach().requires_grad_(), lambda: x.detach())
        return v

    return variants


def _pads():
    out = {}
    for n in (1, 2, 3):
        out[f"ZeroPad{n}d"] = (lambda n=n: getattr(nn, f"ZeroPad{n}d")(1), n, False, True)
        out[f"ConstantPad{n}d"] = (lambda n=n: getattr(nn, f"ConstantPad{n}d")(1, 0.5), n, False, True)
        out[f"ReflectionPad{n}d"] = (lambda n=n: getattr(nn, f"ReflectionPad{n}d")(1), n, False, True)
        out[f"ReplicationPad{n}d"] = (lambda n=n: getattr(nn, f"ReplicationPad{n}d")(1), n, False, True)
        out[f"CircularPad{n}d"] = (lambda n=n: getattr(nn, f"CircularPad{n}d")(1), n, False, True)
    return out


#: torch layer name -> (factory, spatial dims, has channel checks, communicates on x's backward)
GRID = {
    **{f"Conv{n}d": (lambda n=n: getattr(nn, f"Conv{n}d")(4, 3, 3, padding=1), n, True, True) for n in (1, 2, 3)},
    **{
        f"ConvTranspose{n}d": (
            lambda n=n: getattr(nn, f"ConvTranspose{n}d")(4, 3, 3, stride=2, padding=1), n, True, False
        )
        for n in (1, 2, 3)
    },
    **{f"MaxPool{n}d": (lambda n=n: getattr(nn, f"MaxPool{n}d")(3, 1, 1), n, False, True) for n in (1, 2, 3)},
    **{f"AvgPool{n}d": (lambda n=n: getattr(nn, f"AvgPool{n}d")(3, 1, 1), n, False, True) for n in (1, 2, 3)},
    **{f"AdaptiveAvgPool{n}d": (lambda n=n: getattr(nn, f"AdaptiveAvgPool{n}d")(3), n, False, True) for n in (1, 2, 3)},
    **{f"AdaptiveMaxPool{n}d": (lambda n=n: getattr(nn, f"AdaptiveMaxPool{n}d")(1), n, False, True) for n in (1, 2, 3)},
    **{f"BatchNorm{n}d": (lambda n=n: getattr(nn, f"BatchNorm{n}d")(4), n, True, True) for n in (1, 2, 3)},
    **{
        f"InstanceNorm{n}d": (lambda n=n: getattr(nn, f"InstanceNorm{n}d")(4, affine=True), n, True, True)
        for n in (1, 2, 3)
    },
    "SyncBatchNorm": (lambda: nn.SyncBatchNorm(4), 3, True, True),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), 2, True, True),
    "LayerNorm": (lambda: nn.LayerNorm([4, 9, 6]), 2, True, True),
    **_pads(),
    "Upsample": (lambda: nn.Upsample(scale_factor=2, mode="linear"), 1, False, True),
    "UpsamplingNearest2d": (lambda: nn.UpsamplingNearest2d(scale_factor=2), 2, False, True),
    "UpsamplingBilinear2d": (lambda: nn.UpsamplingBilinear2d(scale_factor=2), 2, False, True),
    "Unfold": (lambda: nn.Unfold(3, padding=1), 2, False, True),
}


def _catch(fn: Callable) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the point is to report whatever was raised
        return type(e).__name__, str(e)
    return None


def _grid_errors(world: int, name: str) -> dict[str, tuple[str, str] | None]:
    m = mesh(world)
    r = m.get_local_rank("domain")
    factory, n, channels, grad = GRID[name]
    torch.manual_seed(0)
    layer = snn.convert(factory().double(), m)
    assert type(layer).__name__ == f"Sharded{name}", type(layer)
    x = snn.shard(_grid(n), m, dims=(2,))
    variants = _grid_variants(n, channels, grad)(x, r)
    return {what: _catch(lambda t=t: layer(t)) for what, t in variants.items()}


def _assert_same_everywhere(results: list[dict], allowed: tuple[str, ...] = ("ShardingError",)) -> None:
    for what in results[0]:
        got = [res[what] for res in results]
        assert got[0] is not None, f"{what}: rank 0 did not raise"
        assert all(g == got[0] for g in got), f"{what}: ranks raised differently: {got}"
        assert got[0][0] in allowed, f"{what}: {got[0]}"


@pytest.mark.parametrize("name", list(GRID))
def test_grid_layer_raises_alike_on_every_rank(run, name):
    _assert_same_everywhere(run(2, _grid_errors, 2, name))


@pytest.mark.parametrize("name", ["Conv2d", "GroupNorm", "CircularPad2d"])
def test_grid_layer_raises_alike_at_three_ranks(run, name):
    _assert_same_everywhere(run(3, _grid_errors, 3, name))


# --- transposed convolution: output_size is a call argument every rank must pass alike ---------


def _conv_transpose_output_size():
    m = mesh(2)
    r = m.get_local_rank("domain")
    layer = snn.ShardedConvTranspose2d(4, 3, 3, stride=2, padding=1, mesh=m).double()
    x = snn.shard(_grid(2), m, dims=(2,))
    return {
        # e.g. output_size=skip.shape taken from a local slab: differs by rank
        "output_size on one rank": _catch(lambda: layer(x, output_size=(17 + r, 11))),
        "output_size out of range everywhere": _catch(lambda: layer(x, output_size=(30, 11))),
    }


def test_conv_transpose_output_size_raises_alike(run):
    _assert_same_everywhere(run(2, _conv_transpose_output_size), ("ShardingError", "ValueError"))


# --- max unpooling ------------------------------------------------------------------------


def _unpool_errors(world: int, n: int):
    m = mesh(world)
    r = m.get_local_rank("domain")
    pool = snn.convert(getattr(nn, f"MaxPool{n}d")(2, return_indices=True), m)
    unpool = snn.convert(getattr(nn, f"MaxUnpool{n}d")(2), m)
    full = _grid(n)
    full = full.narrow(2, 0, 8)  # even length: aligned slabs for the stride-2 pool
    y, idx = pool(snn.shard(full, m, dims=(2,), align=2))
    total = idx.new_tensor(full.shape[2:]).prod()
    return {
        "indices out of range on one rank": _catch(lambda: unpool(y, _one_rank(r, lambda: idx + total, lambda: idx))),
        "negative indices on every rank": _catch(lambda: unpool(y, idx - total)),
        "indices dtype on one rank": _catch(lambda: unpool(y, _one_rank(r, lambda: idx.int(), lambda: idx))),
        "indices shape on one rank": _catch(lambda: unpool(y, _one_rank(r, lambda: idx[:1], lambda: idx))),
        "ndim on one rank": _catch(lambda: unpool(*_one_rank(r, lambda: (y[None], idx[None]), lambda: (y, idx)))),
        "dtype on one rank": _catch(lambda: unpool(_one_rank(r, lambda: y.float(), lambda: y), idx)),
        "output_size on one rank": _catch(lambda: unpool(y, idx, output_size=(8 + r, *full.shape[3:]))),
        "output_size length on every rank": _catch(lambda: unpool(y, idx, output_size=(8,) * (n + 1))),
    }


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_unpool_raises_alike_on_every_rank(run, n):
    _assert_same_everywhere(run(2, _unpool_errors, 2, n), ("ShardingError", "ValueError"))


def test_max_unpool_raises_alike_at_three_ranks(run):
    _assert_same_everywhere(run(3, _unpool_errors, 3, 1), ("ShardingError", "ValueError"))


# --- functional forms ------------------------------------------------------------------------


def _functional_errors():
    m = mesh(2)
    r = m.get_local_rank("domain")
    x = snn.shard(_grid(2), m, dims=(2,))
    bad = _one_rank(r, lambda: x.unsqueeze(0), lambda: x)
    return {
        "pad: ndim on one rank": _catch(lambda: snn.layers.padding.pad(bad, (1, 1, 1, 1), m, "reflect")),
        "pad: dtype on one rank": _catch(lambda: snn.layers.padding.pad(_one_rank(r, x.float, lambda: x), (1, 1), m)),
        "interpolate: ndim on one rank": _catch(lambda: snn.interpolate(bad, m, scale_factor=2, mode="bilinear")),
        "interpolate: wrong ndim for the mode": _catch(lambda: snn.interpolate(x, m, scale_factor=2, mode="linear")),
    }


def test_functional_forms_raise_alike(run):
    _assert_same_everywhere(run(2, _functional_errors))


# --- attention ---------------------------------------------------------------------------------


def _tokens(m, b=2, length=9, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return snn.shard(torch.randn(b, length, e, generator=g, dtype=D), m, dims=(1,))


def _mha_errors(world: int, batch_first: bool):
    m = mesh(world)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    mha = snn.convert(nn.MultiheadAttention(8, 2, batch_first=batch_first).double(), m)
    x = _tokens(m)
    if not batch_first:
        x = x.transpose(0, 1)
    b, lk = 2, x.shape[1 if batch_first else 0]
    mask = torch.zeros(b, lk, dtype=torch.bool)

    def call(q, **kw):
        kw.setdefault("need_weights", False)
        return mha(q, x, x, **kw)

    return {
        "float mask on one rank": _catch(lambda: call(x, key_padding_mask=_one_rank(r, mask.float, lambda: mask))),
        "mask shape on one rank": _catch(
            lambda: call(x, key_padding_mask=_one_rank(r, lambda: mask[:, :1], lambda: mask))
        ),
        "need_weights on one rank": _catch(lambda: call(x, need_weights=r == 1)),
        "need_weights with a mask of local size": _catch(
            lambda: call(x, need_weights=True, attn_mask=torch.zeros(x.shape[1 if batch_first else 0], lk))
        ),
        "embed dim on one rank": _catch(lambda: call(_one_rank(r, lambda: x[..., :7], lambda: x))),
        "ndim on one rank": _catch(lambda: call(_one_rank(r, lambda: x[None], lambda: x))),
        "dtype on one rank": _catch(lambda: call(_one_rank(r, x.float, lambda: x))),
        "attn_mask on one rank": _catch(lambda: call(x, attn_mask=torch.ones(1, 1) if r == 1 else None)),
    }


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_raises_alike(run, batch_first):
    _assert_same_everywhere(
        run(2, _mha_errors, 2, batch_first), ("ShardingError", "ShardingNotImplementedError")
    )


def test_multihead_attention_raises_alike_at_three_ranks(run):
    _assert_same_everywhere(run(3, _mha_errors, 3, True), ("ShardingError", "ShardingNotImplementedError"))


def _core_errors(cls_name: str):
    m = mesh(2)
    r = m.get_local_rank("domain")
    attn = getattr(snn, cls_name)(m)
    g = torch.Generator().manual_seed(0)
    q = snn.shard(torch.randn(2, 2, 9, 4, generator=g, dtype=D), m, dims=(2,))
    mask = torch.zeros(2, q.shape[2], dtype=torch.bool)
    out = {
        "float mask on one rank": _catch(
            lambda: attn(q, q, q, key_padding_mask=_one_rank(r, mask.float, lambda: mask))
        ),
        "head dim on one rank": _catch(lambda: attn(*(_one_rank(r, lambda: q[..., :3], lambda: q),) * 3)),
        "heads on one rank": _catch(lambda: attn(*(_one_rank(r, lambda: q[:, :1], lambda: q),) * 3)),
        "3-d q, k, v on one rank": _catch(lambda: attn(*(_one_rank(r, lambda: q[0], lambda: q),) * 3)),
        "device on one rank": _catch(lambda: attn(*(_one_rank(r, lambda: q.to("meta"), lambda: q),) * 3)),
    }
    if cls_name == "UlyssesAttention":
        q3 = snn.shard(torch.randn(2, 3, 9, 4, generator=g, dtype=D), m, dims=(2,))
        out["heads not divisible on every rank"] = _catch(lambda: attn(q3, q3, q3))
    return out


@pytest.mark.parametrize("cls_name", ["RingAttention", "UlyssesAttention"])
def test_attention_cores_raise_alike(run, cls_name):
    results = run(2, _core_errors, cls_name)
    # functional.ring_attention's mask message ends with a clause about the raising rank's own
    # mask ("(this rank: ...)"); every rank raises the same error, and the rest of the message
    # is the same everywhere.
    for res in results:
        for what, got in res.items():
            if got is not None:
                res[what] = (got[0], re.sub(r" \(this rank: .*\)\.$", ".", got[1]))
    _assert_same_everywhere(results)


def _timm_errors():
    from timm.models.vision_transformer import Attention

    m = mesh(2)
    r = m.get_local_rank("domain")
    torch.manual_seed(0)
    attn = snn.convert(Attention(8, num_heads=2).double(), m)
    assert type(attn).__name__ == "ShardedTimmAttention"
    x = _tokens(m)
    return {
        "channels on one rank": _catch(lambda: attn(_one_rank(r, lambda: x[..., :7], lambda: x))),
        "ndim on one rank": _catch(lambda: attn(_one_rank(r, lambda: x[None], lambda: x))),
        "attn_mask on one rank": _catch(lambda: attn(x, attn_mask=torch.ones(1, 1) if r == 1 else None)),
        "attn_mask on every rank": _catch(lambda: attn(x, attn_mask=torch.ones(1, 1))),
    }


def test_timm_attention_raises_alike(run):
    _assert_same_everywhere(run(2, _timm_errors), ("ShardingError", "ShardingNotImplementedError"))


def test_every_public_layer_is_covered():
    """The cases above name every public sharded layer class."""
    covered = {f"Sharded{n}" for n in GRID} | {f"ShardedMaxUnpool{n}d" for n in (1, 2, 3)}
    covered |= {"ShardedMultiheadAttention", "RingAttention", "UlyssesAttention", "ShardedTimmAttention"}
    covered |= {"ShardedFold"}  # test_unfold.py: test_fold_of_blocks_not_in_whole_rows_raises_on_every_rank
    # Their error cases live with their other tests: test_transformer_fastpath.py
    # (test_container_errors_on_every_rank), test_timm_norm_act.py (test_errors_raise_alike) and
    # test_timm_conv.py (test_errors_raise_alike_on_every_rank).
    covered |= {"ShardedTransformerEncoder", "ShardedTransformerEncoderLayer", "ShardedConv2dSame",
                "ShardedStdConv2dSame", "ShardedScaledStdConv2dSame", "ShardedBlurPool2d"}
    covered |= {"ShardedBatchNormAct2d", "ShardedGroupNormAct", "ShardedGroupNorm1Act", "ShardedTimmGroupNorm",
                "ShardedTimmGroupNorm1"}  # fmt: skip
    public = {n for n in snn.layers.__all__ if isinstance(getattr(snn.layers, n), type)}
    assert public <= covered, sorted(public - covered)
