"""The sharded norms' native kernels (sharded_nn/moments.py, csrc/moments.cpp): the one-pass slab
statistics against float64 references, and the group norm backward's one-pass affine map.

The sharded norms' tests (test_norm.py, test_norm_precision.py) run their ranks with one thread,
so they go through this kernel too; these tests pin the kernel itself: every tail length of its
16 lanes and 1024-element blocks, large offsets, several outer rows, and where it must not apply.
"""

from __future__ import annotations

import sys

import pytest
import torch

from sharded_nn import moments, native
from sharded_nn.layers.norm import _blocked_moments

needs_native = pytest.mark.skipif(
    not sys.platform.startswith("linux") or native.compiler() is None,
    reason="the native moments kernel is compiled with a C++ compiler on Linux",
)


@pytest.fixture()
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _reference(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xd = x3.double().transpose(0, 1).reshape(x3.shape[1], -1)
    mean = xd.mean(1)
    # Deviations from the exact-enough float64 mean: a reference for float32 and float64 alike.
    return mean, (xd - mean[:, None]).square().mean(1)


@needs_native
@pytest.mark.parametrize("inner", [1, 7, 15, 16, 17, 1023, 1024, 1025, 3000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_float64_reference_for_every_tail(one_thread, inner, dtype) -> None:
    g = torch.Generator().manual_seed(inner)
    x3 = (torch.randn(3, 4, inner, generator=g, dtype=torch.float64) * 2.5 + 0.7).to(dtype)
    got = moments.local_moments(x3)
    assert got is not None, moments.why_not()
    mean, var = got
    assert mean.dtype == var.dtype == dtype and mean.shape == var.shape == (4,)
    want_mean, want_var = _reference(x3)
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(mean.double(), want_mean, atol=tol * 3, rtol=tol)
    torch.testing.assert_close(var.double(), want_var, atol=0, rtol=tol * 5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stable_when_the_mean_dwarfs_the_spread(one_thread, dtype) -> None:
    # E[x^2] - E[x]^2 would lose every digit here; deviations from each block's mean do not.
    g = torch.Generator().manual_seed(0)
    offset = 1e4 if dtype == torch.float32 else 1e8
    noise = torch.randn(1, 2, 5000, generator=g, dtype=torch.float64)
    x3 = (noise + offset).to(dtype)
    mean, var = moments.local_moments(x3)
    want_mean, want_var = _reference(x3)
    torch.testing.assert_close(var.double(), want_var, atol=0, rtol=1e-5 if dtype == torch.float32 else 1e-7)
    torch.testing.assert_close(mean.double(), want_mean, atol=0, rtol=1e-7 if dtype == torch.float32 else 1e-15)


@needs_native
def test_smooth_rows_with_drifting_block_means(one_thread) -> None:
    # A field that drifts along the row (a temperature gradient): block means differ by many
    # within-block deviations, the case where a running shift would cancel.
    t = torch.linspace(0, 1, 50_000, dtype=torch.float64)
    x3 = (300.0 + 40.0 * t + 1e-3 * torch.sin(977.0 * t)).reshape(1, 1, -1).float()
    mean, var = moments.local_moments(x3)
    want_mean, want_var = _reference(x3)
    torch.testing.assert_close(var.double(), want_var, atol=0, rtol=1e-5)
    torch.testing.assert_close(mean.double(), want_mean, atol=0, rtol=1e-7)


@needs_native
def test_agrees_with_the_torch_path(one_thread, monkeypatch) -> None:
    x3 = torch.randn(2, 8, 300_000, dtype=torch.float64)
    native = _blocked_moments(x3)
    monkeypatch.setenv(moments.OPT_OUT_ENV, "0")
    assert moments.local_moments(x3) is None  # opted out: the torch path runs
    torch_path = _blocked_moments(x3)
    for a, b in zip(native, torch_path):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-13)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_message_holds_count_mean_and_squared_deviations(one_thread, dtype) -> None:
    # What the sharded norms send to the other ranks: [A*B, mean (K), M2 (K)] in float64.
    g = torch.Generator().manual_seed(3)
    x3 = (torch.randn(2, 5, 1500, generator=g, dtype=torch.float64) * 3.0 - 1.25).to(dtype)
    packed = moments.packed_local_moments(x3)
    assert packed is not None and packed.dtype == torch.float64 and packed.shape == (11,)
    want_mean, want_var = _reference(x3)
    assert packed[0].item() == 3000
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(packed[1:6], want_mean, atol=tol, rtol=tol)
    torch.testing.assert_close(packed[6:] / 3000, want_var, atol=tol, rtol=tol)
    assert moments.packed_local_moments(x3.transpose(0, 1)) is None  # not contiguous: the torch path


def test_does_not_apply_where_it_cannot_read_the_data(one_thread) -> None:
    x = torch.randn(2, 3, 40)
    assert moments.local_moments(x.transpose(0, 1)) is None  # not contiguous
    assert moments.local_moments(x.half()) is None  # no half kernel: torch accumulates in float32
    assert moments.local_moments(torch.empty(2, 3, 0)) is None
    assert moments.local_moments(x.to("meta")) is None
    torch.set_num_threads(2)
    assert moments.local_moments(x) is None  # torch's parallel reductions keep the threads busy



@needs_native
@pytest.mark.parametrize("inner", [1, 7, 33, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_affine2_matches_torch(one_thread, inner, dtype) -> None:
    # The group norm backward's dx = a * dy + b * x + c per (sample, channel) row, in one pass.
    gen = torch.Generator().manual_seed(inner)
    g, x = (torch.randn(5, inner, generator=gen, dtype=dtype) for _ in range(2))
    a, b, c = (torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(3))
    assert moments.row_affine2_applies(g, x)
    got = moments.row_affine2(g, x, a, b, c)
    want = (a[:, None] * g.double() + b[:, None] * x.double()) + c[:, None]
    assert got.dtype == dtype and got.shape == x.shape and got.data_ptr() not in (g.data_ptr(), x.data_ptr())
    tol = 1e-14 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), want, atol=tol * 10, rtol=tol)


def test_row_affine2_refuses_what_it_cannot_read(one_thread) -> None:
    g, x = torch.randn(4, 10), torch.randn(4, 10)
    coef = torch.ones(4)
    assert not moments.row_affine2_applies(g.t().contiguous().t(), x)  # not contiguous
    assert not moments.row_affine2_applies(g.double(), x)  # dtypes differ
    assert not moments.row_affine2_applies(g[:3], x)  # shapes differ
    assert not moments.row_affine2_applies(g.half(), x.half())
    with pytest.raises(ValueError, match="expected contiguous CPU float32/float64"):
        moments.row_affine2(g.half(), x.half(), coef, coef, coef)
    if moments.available():
        with pytest.raises(ValueError, match=r"expected \(4,\) CPU coefficients"):
            moments.row_affine2(g, x, torch.ones(3), coef, coef)
    torch.set_num_threads(2)
    assert not moments.row_affine2_applies(g, x)  # torch's parallel elementwise ops run instead


def test_the_source_ships_with_the_package() -> None:
    # Compiled from the installed package's csrc/ (pyproject package-data "csrc/*.cpp").
    assert native.source("moments").is_file()


def _torch_merge(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Chan's merge of ``[count, mean (K), M2 (K)]`` rows written with torch ops, in float64."""
    k = (rows.shape[1] - 1) // 2
    counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + k], rows[:, 1 + k :]
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    return mean, (m2s + counts * (means - mean) ** 2).sum(0) / n, n.item()


@needs_native
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_of_the_ranks_messages_matches_torch(one_thread, ranks, dtype) -> None:
    # The ranks' packed statistics of one tensor cut into uneven slabs (one of them empty when
    # there are several ranks) merge to the whole tensor's mean and biased variance.
    gen = torch.Generator().manual_seed(ranks)
    sizes = [7, 0, 130, 1, 64][:ranks] if ranks > 1 else [90]
    whole = torch.randn(2, 6, sum(sizes), generator=gen, dtype=torch.float64) * 1.5 + 4.0
    parts = whole.split(sizes, dim=2)
    rows = []
    for part in parts:
        packed = moments.packed_local_moments(part.contiguous()) if part.shape[2] else None
        rows.append(packed if packed is not None else torch.zeros(13, dtype=torch.float64))
    rows = torch.stack(rows)
    got = moments.merge_packed(rows, dtype)
    assert got is not None, moments.why_not()
    mean, var, count = got
    assert mean.dtype == var.dtype == dtype and mean.shape == var.shape == (6,) and count == 2 * sum(sizes)
    want_mean, want_var = _reference(whole)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(mean.double(), want_mean, atol=tol, rtol=tol)
    torch.testing.assert_close(var.double(), want_var, atol=tol, rtol=tol)
    t_mean, t_var, t_n = _torch_merge(rows)
    torch.testing.assert_close(mean.double(), t_mean.to(dtype).double(), atol=tol, rtol=tol)
    assert t_n == count


@needs_native
@pytest.mark.parametrize("momentum", [0.1, 1.0 / 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_updates_running_statistics_as_torch_batch_norm(one_thread, momentum, dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 50, generator=gen, dtype=dtype) * 2 - 1
    bn = torch.nn.BatchNorm1d(4, momentum=momentum).to(dtype)
    bn.running_mean.uniform_(-1, 1, generator=gen)
    bn.running_var.uniform_(0.5, 2, generator=gen)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    bn.train()(x)  # torch's update
    rows = torch.stack([moments.packed_local_moments(x[:, :, :20].contiguous()),
                        moments.packed_local_moments(x[:, :, 20:].contiguous())])  # fmt: skip
    assert moments.merge_packed(rows, dtype, (rm, rv, momentum)) is not None
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(rm, bn.running_mean, atol=tol, rtol=tol)
    torch.testing.assert_close(rv, bn.running_var, atol=tol, rtol=tol)
    # One value per channel: torch raises before updating, so the merge leaves them alone.
    single = torch.stack([moments.packed_local_moments(x[:1, :, :1].contiguous())])
    before = rm.clone()
    assert moments.merge_packed(single, dtype, (rm, rv, momentum))[2] == 1
    assert torch.equal(rm, before)


def test_merge_refuses_what_it_cannot_write(one_thread) -> None:
    rows = torch.zeros(2, 7, dtype=torch.float64)
    rows[:, 0] = 4
    assert moments.merge_packed(rows.float(), torch.float32) is None  # the message is float64
    assert moments.merge_packed(rows, torch.float16) is None  # no half kernel
    stats = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), 0.1
    assert moments.merge_packed(rows, torch.float32, stats) is None  # running stats of another dtype
    assert moments.merge_packed(rows, torch.float32, (torch.zeros(6)[::2], torch.ones(3), 0.1)) is None


@needs_native
@pytest.mark.parametrize("inner", [1, 9, 16, 1000, 2051])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_norm_backward_kernels_match_torch(one_thread, inner, dtype) -> None:
    # The sums a sharded batch norm all-reduces, its slab's weight and bias gradients, and the
    # input gradient from global sums, against torch's own batch norm backward in float64.
    gen = torch.Generator().manual_seed(inner)
    x = torch.randn(2, 5, inner, generator=gen, dtype=torch.float64) * 1.7 + 0.3
    g = torch.randn(2, 5, inner, generator=gen, dtype=torch.float64)
    w = torch.randn(5, generator=gen, dtype=torch.float64)
    eps = 1e-5
    var, mean = torch.var_mean(x, (0, 2), correction=0)
    got = moments.bn_grad_sums(g.to(dtype), x.to(dtype), mean.to(dtype), var.to(dtype), eps, True, True)
    assert got is not None, moments.why_not()
    sums, dw, db = got
    assert sums.dtype == torch.float64 and sums.shape == (10,) and dw.dtype == db.dtype == dtype
    xs, gs, ms, vs = x.to(dtype).double(), g.to(dtype).double(), mean.to(dtype).double(), var.to(dtype).double()
    want_g = gs.sum((0, 2))
    want_gx = (gs * (xs - ms[:, None])).sum((0, 2))
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    scale = gs.abs().sum((0, 2)).max().item()
    torch.testing.assert_close(sums[:5], want_g, atol=tol * scale, rtol=tol)
    torch.testing.assert_close(sums[5:], want_gx, atol=tol * scale * 4, rtol=tol)
    torch.testing.assert_close(db.double(), want_g, atol=tol * scale, rtol=tol)
    torch.testing.assert_close(dw.double(), want_gx / (vs + eps).sqrt(), atol=tol * scale * 4, rtol=tol)
    # dx with the batch statistics equals torch's training-mode batch norm backward.
    xr = xs.clone().requires_grad_()
    torch.nn.functional.batch_norm(xr, None, None, w, None, True, 0.0, eps).backward(gs)
    dx = moments.bn_input_grad(g.to(dtype), x.to(dtype), w.to(dtype), mean.to(dtype), var.to(dtype), eps, sums,
                               2.0 * inner)  # fmt: skip
    assert dx is not None and dx.dtype == dtype and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), xr.grad, atol=1e-10 if dtype == torch.float64 else 2e-4, rtol=1e-4)
    no_weight = moments.bn_input_grad(g, x, None, mean, var, eps, sums.new_tensor(sums.tolist()), 2.0 * inner)
    xr.grad = None
    torch.nn.functional.batch_norm(xr, None, None, None, None, True, 0.0, eps).backward(gs)
    if dtype == torch.float64:
        torch.testing.assert_close(no_weight, xr.grad, atol=1e-10, rtol=1e-8)


def test_batch_norm_backward_kernels_refuse_what_they_cannot_read(one_thread) -> None:
    x, g = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    m, v, sums = torch.zeros(3), torch.ones(3), torch.zeros(6, dtype=torch.float64)
    assert moments.bn_grad_sums(g.transpose(1, 2).contiguous().transpose(1, 2), x, m, v, 1e-5) is None
    assert moments.bn_grad_sums(g, x, m.double(), v, 1e-5) is None
    assert moments.bn_input_grad(g, x, torch.ones(3, dtype=torch.float64), m, v, 1e-5, sums, 8.0) is None
    assert moments.bn_input_grad(g, x, None, m, v, 1e-5, sums.float(), 8.0) is None
    torch.set_num_threads(2)
    assert moments.bn_grad_sums(g, x, m, v, 1e-5) is None
