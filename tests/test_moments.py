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
