"""Global reductions over sharded dims against torch on the full tensor, forward and backward."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import sharded_nn as snn

from .harness import mesh

REDUCE_DIMS = [(2, 3), (3,), (-1, -2), None, (2,), (1, 2)]
# On a 2x2 mesh, reducing only dim 2 leaves a tensor sharded by the second axis alone, which
# ``gather`` cannot assemble (its k-th dim is always sharded by the k-th axis): those are
# checked on 1-D meshes.
REDUCE_DIMS_2D = REDUCE_DIMS[:4]


def _reference(op, x, dims, keepdim):
    if op == "sum":
        return x.sum(dims if dims is not None else tuple(range(x.dim())), keepdim=keepdim)
    if op == "mean":
        return x.mean(dims if dims is not None else tuple(range(x.dim())), keepdim=keepdim)
    return x.amax(dims if dims is not None else tuple(range(x.dim())), keepdim=keepdim)


def _check(domain, sharded_dims, reduce_dims=REDUCE_DIMS, argmax_dims=(1, 2, 3)):
    m = mesh(domain)
    torch.manual_seed(0)
    smooth = torch.randn(2, 3, 11, 7, dtype=torch.float64)
    # Few distinct values: many ties, also across ranks, for max's gradient split.
    ties = torch.randint(0, 3, (2, 3, 11, 7)).double()
    for x_full, keepdims in ((smooth, (False,)), (ties, (False, True))):
        for op in ("sum", "mean", "max"):
            for dims in reduce_dims:
                for keepdim in keepdims:
                    x = x_full.clone().requires_grad_()
                    y = _reference(op, x, dims, keepdim)
                    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
                    (y * g).sum().backward()

                    x_local = snn.shard(x_full, m, dims=sharded_dims).requires_grad_()
                    y_local = getattr(snn.reductions, op)(x_local, m, dims, keepdim=keepdim, sharded_dims=sharded_dims)
                    # Dims that were sharded and not reduced stay sharded: gather them.
                    left = _still_sharded(sharded_dims, dims, x.dim(), keepdim)
                    y_full = snn.gather(y_local, m, dims=left) if left else y_local
                    torch.testing.assert_close(y_full, y.detach(), atol=1e-12, rtol=1e-12)
                    loss = (y_full * g).sum()
                    # A replicated loss: each rank contributes 1/P (the gradient convention),
                    # also where y_local was replicated over one axis only and gathered over the
                    # other (gather's backward sums over the gathered axes only).
                    snn.losses.share(loss, m).backward()
                    gx = snn.gather(x_local.grad, m, dims=sharded_dims)
                    torch.testing.assert_close(gx, x.grad, atol=1e-12, rtol=1e-12, msg=lambda s: f"{op} {dims}: {s}")
        for dim in argmax_dims:
            want = x_full.argmax(dim, keepdim=True)
            x_local = snn.shard(x_full, m, dims=sharded_dims)
            got = snn.reductions.argmax(x_local, m, dim, keepdim=True, sharded_dims=sharded_dims)
            left = _still_sharded(sharded_dims, (dim,), 4, True)
            got = snn.gather(got, m, dims=left) if left else got
            assert torch.equal(got, want), (dim, got, want)
            assert snn.reductions.argmax(x_local, m, dim, sharded_dims=sharded_dims).dim() == 3
    return True


def _still_sharded(sharded_dims, dims, ndim, keepdim):
    reduced = set(range(ndim)) if dims is None else {d % ndim for d in dims}
    out = []
    for d in sharded_dims:
        if d not in reduced:
            out.append(d if keepdim else d - sum(1 for r in reduced if r < d))
    return tuple(out)


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
def test_reductions_1d_mesh(run, domain):
    assert all(run(domain, _check, domain, (2,)))


def test_reductions_2x2_mesh(run):
    assert all(run(4, _check, (2, 2), (2, 3), REDUCE_DIMS_2D, (1, 3)))


def test_reductions_shard_a_later_dim(run):
    assert all(run(3, _check, 3, (3,)))


def _pool_then_linear():
    # A classification head: global average pool over the sharded grid, then a Linear.
    m = mesh(2)
    torch.manual_seed(0)
    head = torch.nn.Linear(3, 4).double()
    x = torch.randn(2, 3, 9, 5, dtype=torch.float64, requires_grad=True)
    ref = head(x.mean((2, 3)))
    ref.square().sum().backward()
    ref_w = head.weight.grad.clone()
    head.weight.grad = None
    x_local = snn.shard(x.detach(), m).requires_grad_()
    out = head(snn.reductions.mean(x_local, m, (2, 3)))
    torch.testing.assert_close(out, ref.detach())
    snn.losses.share(out.square().sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), x.grad)
    torch.testing.assert_close(snn.losses.domain_sum(head.weight.grad, m), ref_w)
    return True


def test_global_pool_then_linear(run):
    assert all(run(2, _pool_then_linear))


def _errors():
    m = mesh(2)
    r = m.get_local_rank("domain")
    x = torch.randn(1, 2, 4, 3 + r)  # the unsharded W differs on rank 1 only
    with pytest.raises(snn.ShardingError, match="differs across ranks"):
        snn.reductions.sum(x, m, (2,))
    y = torch.randn(1, 2, 4, 3)
    with pytest.raises(snn.ShardingError, match="must be distinct dims"):
        snn.reductions.mean(y, m, (2, 2))
    with pytest.raises(snn.ShardingError, match="one int"):
        snn.reductions.argmax(y, m, (2, 3))
    return True


def test_bad_input_raises_on_every_rank(run):
    assert all(run(2, _errors))



# --------------------------------------------------------------------------------------------
# Vector norms, variances, standard deviations

STAT_DIMS = [(2, 3), (2,), (1, 2), None, (3,)]


def _stat_cases():
    for p in (2, 1, 3.5, 0.5, float("inf"), float("-inf"), 0, "fro"):  # 0.5: NaN gradients at zeros before session 59
        yield f"norm p={p}", (lambda x, d, k, p=p: torch.linalg.vector_norm(x, 2 if p == "fro" else p, d, k)), (
            lambda x, m, d, k, sd, p=p: snn.reductions.norm(x, m, d, p, keepdim=k, sharded_dims=sd))
    for c in (1, 0, 2):
        for op in ("var", "std"):
            yield f"{op} correction={c}", (lambda x, d, k, op=op, c=c: getattr(torch, op)(x, d, correction=c, keepdim=k)), (
                lambda x, m, d, k, sd, op=op, c=c: getattr(snn.reductions, op)(x, m, d, correction=c, keepdim=k, sharded_dims=sd))
        for op in ("var_mean", "std_mean"):
            yield f"{op} correction={c}", (lambda x, d, k, op=op, c=c: torch.stack(getattr(torch, op)(x, d, correction=c, keepdim=k))), (
                lambda x, m, d, k, sd, op=op, c=c: torch.stack(getattr(snn.reductions, op)(x, m, d, correction=c, keepdim=k, sharded_dims=sd)))


def _check_stats(domain, sharded_dims, reduce_dims=STAT_DIMS):
    m = mesh(domain)
    torch.manual_seed(0)
    x_full = torch.randn(2, 3, 11, 7, dtype=torch.float64)
    x_full[1, 2] = 0  # a zero channel: torch's zero gradient where a norm or a deviation is zero
    x_full[0, 1, :, 3] = 0.5  # a constant column: std over dim 2 is zero there
    for name, ref_fn, ours in _stat_cases():
        for dims in reduce_dims:
            for keepdim in (False, True):
                x = x_full.clone().requires_grad_()
                y = ref_fn(x, dims, keepdim)
                g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
                (y * g).sum().backward()
                x_local = snn.shard(x_full, m, dims=sharded_dims).requires_grad_()
                y_local = ours(x_local, m, dims, keepdim, sharded_dims)
                left = _still_sharded(sharded_dims, dims, x.dim(), keepdim)
                if "_mean" in name and left:
                    left = tuple(d + 1 for d in left)  # the stacked pair adds a leading dim
                y_full = snn.gather(y_local, m, dims=left) if left else y_local
                what = f"{name} dims={dims} keepdim={keepdim}"
                torch.testing.assert_close(y_full, y.detach(), atol=1e-12, rtol=1e-12, msg=lambda s: f"{what}: {s}")
                if name == "norm p=0":  # a count: no gradient (torch's is zero or none)
                    assert x.grad is None or not x.grad.any(), what
                    continue
                snn.losses.share((y_full * g).sum(), m).backward()
                gx = snn.gather(x_local.grad, m, dims=sharded_dims)
                assert torch.isfinite(gx).all(), what
                torch.testing.assert_close(gx, x.grad, atol=1e-11, rtol=1e-11, msg=lambda s: f"{what}: {s}")
    return True


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
def test_norm_var_std_1d_mesh(run, domain):
    assert all(run(domain, _check_stats, domain, (2,)))


def test_norm_var_std_2x2_mesh(run):
    assert all(run(4, _check_stats, (2, 2), (2, 3), [(2, 3), None]))


def _no_degrees_of_freedom():
    """``var``/``std`` with ``correction`` at or above the count: torch divides by
    ``max(0, count - correction)`` (inf, or NaN for a zero sum); found by the reductions fuzzer,
    the sharded ``var`` divided by a negative count (a negative variance) and ``std`` turned
    the NaN into 0."""
    m = mesh(2)
    torch.manual_seed(0)
    x_full = torch.randn(2, 3, 5, dtype=torch.float64)
    x_full[1, :, :] = 0.25  # constant rows: a zero sum of squares
    for c in (5, 6, 7.5):
        for op in ("var", "std", "var_mean", "std_mean"):
            ref = getattr(torch, op)(x_full, (2,), correction=c)
            x_local = snn.shard(x_full, m, dims=(2,))
            ours = getattr(snn.reductions, op)(x_local, m, (2,), correction=c, sharded_dims=(2,))
            for a, b in zip(ours if isinstance(ours, tuple) else (ours,), ref if isinstance(ref, tuple) else (ref,)):
                torch.testing.assert_close(a, b, equal_nan=True, msg=lambda s, op=op, c=c: f"{op} correction={c}: {s}")
    return True


def test_var_std_without_degrees_of_freedom_match_torch(run):
    assert all(run(2, _no_degrees_of_freedom))


def _infinite_maxima():
    """``max`` over a sharded dim where a line's maximum is -inf or inf (masked scores): torch's
    value, and the gradient split among the ties (found by the reductions fuzzer: NaN before)."""
    m = mesh(2)
    torch.manual_seed(0)
    x_full = torch.randn(2, 3, 5, dtype=torch.float64)
    x_full[0, 1] = -math.inf
    x_full[1, 2, 1:4] = math.inf
    x = x_full.clone().requires_grad_()
    y = torch.amax(x, (2,))
    g = torch.randn(y.shape, dtype=torch.float64)
    (y * g).sum().backward()
    x_local = snn.shard(x_full, m, dims=(2,)).requires_grad_()
    y_local = snn.reductions.max(x_local, m, (2,), sharded_dims=(2,))
    torch.testing.assert_close(y_local, y.detach())
    snn.losses.share((y_local * g).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m, dims=(2,)), x.grad)
    return True


def test_max_of_infinite_lines_matches_torch(run):
    assert all(run(2, _infinite_maxima))


def _stat_errors():
    m = mesh(2)
    y = torch.randn(1, 2, 4, 3)
    with pytest.raises(snn.ShardingError, match="p must be a number"):
        snn.reductions.norm(y, m, (2, 3), "nuc")
    with pytest.raises(snn.ShardingError, match="floating point"):
        snn.reductions.var(torch.ones(1, 2, 4, 3, dtype=torch.int64), m, (2,))
    return True


def test_stat_bad_input_raises_on_every_rank(run):
    assert all(run(2, _stat_errors))


def _assert_keeps_layout(m, x_full, sharded_dims, torch_fn, sharded_fn, what: str) -> None:
    """``sharded_fn`` (slab -> slab of the same layout) against ``torch_fn`` on the whole tensor:
    the gathered output, and the input gradient of a loss whose output gradient is a slab's."""
    x = x_full.clone().requires_grad_()
    y = torch_fn(x)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    x_local = snn.shard(x_full, m, dims=sharded_dims).requires_grad_()
    y_local = sharded_fn(x_local)
    torch.testing.assert_close(snn.gather(y_local, m, dims=sharded_dims), y.detach(), atol=1e-12, rtol=1e-12)
    # The output keeps the input's layout: its gradient is a slab's, nothing shared.
    (y_local * snn.shard(g, m, dims=sharded_dims)).sum().backward()
    gx = snn.gather(x_local.grad, m, dims=sharded_dims)
    torch.testing.assert_close(gx, x.grad, atol=1e-12, rtol=1e-12, msg=lambda s: f"{what}: {s}")


def _check_softmax(domain, sharded_dims):
    m = mesh(domain)
    torch.manual_seed(0)
    x_full = torch.randn(2, 3, 11, 7, dtype=torch.float64) * 3
    for op in ("softmax", "log_softmax"):
        for dim in (2, 3, 1, -1):
            _assert_keeps_layout(
                m, x_full, sharded_dims, lambda x: getattr(torch, op)(x, dim),
                lambda xl: getattr(snn.reductions, op)(xl, m, dim, sharded_dims=sharded_dims), f"{op} {dim}",
            )
    return True


@pytest.mark.parametrize("domain", [1, 2, 3])
def test_softmax_along_sharded_dim(run, domain):
    assert all(run(domain, _check_softmax, domain, (2,)))


def test_softmax_along_sharded_dim_2x2(run):
    assert all(run(4, _check_softmax, (2, 2), (2, 3)))


def _check_logsumexp(domain, sharded_dims, cases):
    """``reductions.logsumexp`` over sharded dims (one, both, with an unsharded one, keepdim or
    not) against torch on the whole tensor; the result is replicated along the reduced sharded
    dims, so each rank back-propagates its share of the loss (DESIGN.md section 3)."""
    m = mesh(domain)
    torch.manual_seed(0)
    x_full = torch.randn(2, 3, 11, 7, dtype=torch.float64) * 3
    x_full[0, 0, 4, 2] = float("-inf")  # an exp of 0 among the terms
    for dims in cases:
        for keepdim in (False, True):
            x = x_full.clone().requires_grad_()
            y = torch.logsumexp(x, dims, keepdim)
            g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            (y * g).sum().backward()
            x_local = snn.shard(x_full, m, dims=sharded_dims).requires_grad_()
            y_local = snn.reductions.logsumexp(x_local, m, dims, keepdim, sharded_dims=sharded_dims)
            replicated = all(d in dims for d in sharded_dims)
            got = y_local if replicated else snn.gather(y_local, m, dims=sharded_dims)
            torch.testing.assert_close(got, y.detach(), atol=1e-12, rtol=1e-12, msg=lambda s: f"{dims}: {s}")
            if replicated:
                snn.losses.share((y_local * g).sum(), m).backward()
            else:
                (y_local * snn.shard(g, m, dims=sharded_dims)).sum().backward()
            gx = snn.gather(x_local.grad, m, dims=sharded_dims)
            torch.testing.assert_close(gx, x.grad, atol=1e-12, rtol=1e-12, msg=lambda s: f"grad {dims}: {s}")
    return True


@pytest.mark.parametrize("domain", [1, 2, 3])
def test_logsumexp_along_sharded_dims(run, domain):
    assert all(run(domain, _check_logsumexp, domain, (2,), ((2,), (2, 3), (1, 2), (3,))))


def test_logsumexp_along_sharded_dims_2x2(run):
    assert all(run(4, _check_logsumexp, (2, 2), (2, 3), ((2, 3), (1, 2, 3))))


def _check_cumsum(domain, sharded_dims):
    """``reductions.cumsum`` along sharded and unsharded dims (float64, an integer input, a
    float32 input summed in float64) against torch on the whole tensor; the output keeps the
    input's layout, so its gradient is a slab's."""
    m = mesh(domain)
    torch.manual_seed(0)
    x_full = torch.randn(2, 3, 11, 7, dtype=torch.float64)
    for dim in (2, 3, 1, -2):
        _assert_keeps_layout(
            m, x_full, sharded_dims, lambda x: torch.cumsum(x, dim),
            lambda xl: snn.reductions.cumsum(xl, m, dim, sharded_dims=sharded_dims), f"cumsum {dim}",
        )
        ints = (x_full * 3).round().long()
        got = snn.reductions.cumsum(snn.shard(ints, m, dims=sharded_dims), m, dim, sharded_dims=sharded_dims)
        assert got.dtype == torch.int64
        assert torch.equal(snn.gather(got, m, dims=sharded_dims), torch.cumsum(ints, dim))
        got = snn.reductions.cumsum(snn.shard(x_full.float(), m, dims=sharded_dims), m, dim, dtype=torch.float64,
                                    sharded_dims=sharded_dims)
        assert got.dtype == torch.float64
        want = torch.cumsum(x_full.float(), dim, dtype=torch.float64)
        torch.testing.assert_close(snn.gather(got, m, dims=sharded_dims), want, atol=1e-12, rtol=1e-12)
    return True


@pytest.mark.parametrize("domain", [1, 2, 3])
def test_cumsum_along_sharded_dim(run, domain):
    assert all(run(domain, _check_cumsum, domain, (2,)))


def test_cumsum_along_sharded_dim_2x2(run):
    assert all(run(4, _check_cumsum, (2, 2), (2, 3)))


def _cumsum_uneven_slabs(sizes):
    m = mesh(len(sizes))
    r = m.get_local_rank("domain")
    x_full = torch.randn(2, 3, sum(sizes), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = x_full.clone().requires_grad_()
    y = torch.cumsum(x, 2)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    a, n = sum(sizes[:r]), sizes[r]
    x_local = x_full.narrow(2, a, n).clone().requires_grad_()
    y_local = snn.reductions.cumsum(x_local, m, 2)
    (y_local * g.narrow(2, a, n)).sum().backward()
    torch.testing.assert_close(y_local, y.detach().narrow(2, a, n), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(x_local.grad, x.grad.narrow(2, a, n), atol=1e-12, rtol=1e-12)
    return True


def test_cumsum_on_uneven_slabs(run):
    assert all(run(3, _cumsum_uneven_slabs, (5, 1, 6)))


class _DeepMean(torch.nn.Module):
    """A stride-4 conv (a deep stage: 2 output rows over 3 ranks, one rank empty), then a
    squeeze-excite gate from the mean over the rows and a loss of the map: routed sums and means."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Conv2d(3, 4, 4, stride=4)

    def forward(self, x, target):
        y = self.down(x)
        y = y * torch.sigmoid(y.mean((2, 3), keepdim=True))
        return torch.nn.functional.mse_loss(y, target)


def _empty_slabs(domain):
    m = mesh(domain)
    rank = m.get_local_rank("domain")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    sizes = (3, 0, 6)[:domain] if domain == 3 else (0, 9)
    local = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
    xr = x.clone().requires_grad_()
    out = []
    for op in ("sum", "mean"):
        for dims in ((2,), (2, 3), None):
            y = getattr(snn.reductions, op)(local, m, dims)
            ref = _reference(op, xr, dims, False)
            torch.testing.assert_close(y, ref, atol=1e-12, rtol=1e-12)
            g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
            local.grad = xr.grad = None
            snn.losses.share((y * g).sum(), m).backward()
            (ref * g).sum().backward()
            torch.testing.assert_close(local.grad, xr.grad.narrow(2, sum(sizes[:rank]), sizes[rank]))
            out.append(float(y.sum()))
    # In a converted model: a deep stage leaves a rank without rows; the guard's routed mean
    # and the loss still compute (aligned slabs of 4 rows: 4 and 4 and 0 of 8).
    model = _DeepMean().double()
    ref_model = copy.deepcopy(model)
    x8 = torch.randn(1, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    target = torch.randn(1, 4, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    expected = ref_model(x8, target)
    split = (4, 4, 0)[:domain] if domain == 3 else (8, 0)
    conv = snn.convert(model, m)
    part = x8.narrow(2, sum(split[:rank]), split[rank]).clone()
    t_split = [s // 4 for s in split]
    got = conv(part, target.narrow(2, sum(t_split[:rank]), t_split[rank]).clone())
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    return out


@pytest.mark.parametrize("domain", [2, 3])
def test_sum_and_mean_take_empty_slabs(run, domain):
    """Before session 61 every reduction refused a rank without rows; a sum is defined there."""
    out = run(domain, _empty_slabs, domain)
    assert all(o == out[0] for o in out)


# Every reduction on slabs with an empty one: (name, sharded call, torch call); ``d`` the
# reduced dims. Rows 2 of ``x`` hold -inf lines (a masked score) so that an empty slab's
# candidate (the identity of a maximum) meets a line whose maximum is -inf.
_EMPTY_CASES = [
    ("max", lambda x, m, d: snn.reductions.max(x, m, d), lambda x, d: x.amax(d)),
    ("norm2", lambda x, m, d: snn.reductions.norm(x.nan_to_num(neginf=0), m, d),
     lambda x, d: torch.linalg.vector_norm(x.nan_to_num(neginf=0), 2, d)),
    ("norm1", lambda x, m, d: snn.reductions.norm(x.nan_to_num(neginf=0), m, d, 1),
     lambda x, d: torch.linalg.vector_norm(x.nan_to_num(neginf=0), 1, d)),
    ("norm_inf", lambda x, m, d: snn.reductions.norm(x.nan_to_num(neginf=0), m, d, math.inf),
     lambda x, d: torch.linalg.vector_norm(x.nan_to_num(neginf=0), math.inf, d)),
    ("var", lambda x, m, d: snn.reductions.var(x.nan_to_num(neginf=0), m, d),
     lambda x, d: x.nan_to_num(neginf=0).var(d)),
    ("std_mean", lambda x, m, d: torch.cat(snn.reductions.std_mean(x.nan_to_num(neginf=0), m, d)),
     lambda x, d: torch.cat(torch.std_mean(x.nan_to_num(neginf=0), d))),
    ("logsumexp", lambda x, m, d: snn.reductions.logsumexp(x, m, d), lambda x, d: x.logsumexp(d)),
    ("argmax", lambda x, m, d: snn.reductions.argmax(x, m, d[0]).double(), lambda x, d: x.argmax(d[0]).double()),
    ("argmin", lambda x, m, d: snn.reductions.argmin(x.nan_to_num(neginf=0), m, d[0]).double(),
     lambda x, d: x.nan_to_num(neginf=0).argmin(d[0]).double()),
    ("max_dim", lambda x, m, d: torch.cat(snn.reductions.max_dim(x, m, d[0])[:1]),
     lambda x, d: torch.cat(x.max(d[0])[:1])),
]
# Calls whose result keeps the slab's layout (along the sharded dim): compared slab by slab.
_EMPTY_KEEPING = [
    ("softmax", lambda x, m: snn.reductions.softmax(x, m, 2), lambda x: x.softmax(2)),
    ("log_softmax", lambda x, m: snn.reductions.log_softmax(x, m, 2), lambda x: x.log_softmax(2)),
    ("cumsum", lambda x, m: snn.reductions.cumsum(x.nan_to_num(neginf=0), m, 2),
     lambda x: x.nan_to_num(neginf=0).cumsum(2)),
]


def _every_reduction_on_empty_slabs(sizes):
    """Each reduction with one rank's slab empty: torch's value and gradient on every rank
    (session 67: all but ``sum`` and ``mean`` refused there; in a converted model that rank
    alone refused, a hang)."""
    m = mesh(len(sizes))
    rank = m.get_local_rank("domain")
    a, n = sum(sizes[:rank]), sizes[rank]
    x = torch.randn(2, 3, sum(sizes), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    x[1, 2, :, 1] = -math.inf
    failures = []

    def compare(name, got, ref, grad, ref_grad):
        # (Compared after both backwards ran: a rank that stopped at a mismatch would skip the
        # others' collectives.)
        for what, u, v in (("value", got, ref), ("gradient", grad, ref_grad)):
            try:
                torch.testing.assert_close(u, v, atol=1e-12, rtol=1e-12, equal_nan=True)
            except AssertionError as e:
                failures.append(f"{name} {what}: {str(e)[:300]}")

    for name, ours, theirs in _EMPTY_CASES:
        for dims in ((2,), (2, 3), (3, 2)) if not name.startswith("arg") and name != "max_dim" else ((2,),):
            xr = x.clone().requires_grad_()
            local = x.narrow(2, a, n).clone().requires_grad_()
            ref, got = theirs(xr, dims), ours(local, m, dims)
            if ref.requires_grad:
                g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
                (ref * g).sum().backward()
                snn.losses.share((got * g).sum(), m).backward()
            grads = (local.grad, xr.grad.narrow(2, a, n)) if ref.requires_grad else (None, None)
            compare(f"{name} {dims}", got, ref, *grads)
    for name, ours, theirs in _EMPTY_KEEPING:
        xr = x.clone().requires_grad_()
        local = x.narrow(2, a, n).clone().requires_grad_()
        ref, got = theirs(xr), ours(local, m)
        g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        (ref * g).nan_to_num().sum().backward()
        (got * g.narrow(2, a, n)).nan_to_num().sum().backward()
        compare(name, got, ref.detach().narrow(2, a, n), local.grad, xr.grad.narrow(2, a, n))
    # Nothing on any rank: the extremes refuse alike (torch raises too); a sum is zeros.
    nothing = x.narrow(2, 0, 0).clone()
    for call in (lambda: snn.reductions.max(nothing, m, 2), lambda: snn.reductions.argmax(nothing, m, 2)):
        try:
            call()
            failures.append("an extreme of nothing did not raise")
        except snn.ShardingError as e:
            assert "empty on every rank" in str(e), e
    torch.testing.assert_close(snn.reductions.sum(nothing, m, 2), torch.zeros(2, 3, 4, dtype=torch.float64))
    return failures


@pytest.mark.parametrize("sizes", [(3, 0), (0, 2, 3), (2, 3, 0), (2, 0, 0, 1)])
def test_every_reduction_takes_empty_slabs(run, sizes):
    out = run(len(sizes), _every_reduction_on_empty_slabs, sizes)
    assert out[0] == [] and all(o == out[0] for o in out), out
