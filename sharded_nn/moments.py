"""The sharded norms' native kernels: a slab's per-channel mean and variance in one pass over
memory, and the group norm backward's input gradient in one pass.

Not part of the public API; ``layers/norm.py`` calls :func:`local_moments` (or
:func:`packed_local_moments`), which return None where the kernel does not apply, and
:func:`row_affine2` where :func:`row_affine2_applies`; elsewhere it keeps its torch-only forms.

Why. A sharded GroupNorm or BatchNorm takes its slab's statistics apart from the normalization:
they are merged across ranks before anything is normalized, while torch's fused CPU kernels
compute and apply their own statistics in one call. With torch's reductions the statistics read
the slab twice (a sum, then the squared deviations from the mean), which made a GroupNorm at P=2
cost as much as torch's whole ``group_norm`` at P=1 on twice the data. ``csrc/moments.cpp`` reads
the slab once: each row is cut into blocks that stay in the L1 cache, each block's deviations from
its own mean are squared while it is there, and blocks are merged in double precision with Chan's
formula (as stable as the two-pass form; deterministic).

The group norm's input gradient is a per-(sample, channel) affine map of two slabs,
``a * dy + b * x + c`` (``layers/norm.py``, ``_group_norm_backward_fused``); torch's elementwise
ops (a multiply, an ``addcmul_``, an ``add_``) read and write the slab three times where one
pass suffices. :func:`row_affine2` does it in one pass.

Where they apply: contiguous float32/float64 CPU tensors, one torch thread (the kernels are
single-threaded; with more threads torch's parallel ops are kept), outside ``torch.compile``
tracing and tensor subclasses (fake tensors have no data). The library is compiled on first use
(``sharded_nn.native``); without a C++ compiler, or with ``SHARDED_NN_NATIVE_MOMENTS=0``, the
torch path runs. Both give the same results to rounding.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from . import native
from .env import getenv

#: ``0`` keeps the torch-only statistics.
OPT_OUT_ENV = "SHARDED_NN_NATIVE_MOMENTS"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not: str | None = None
_FUNCS = {torch.float32: "snn_moments_f32", torch.float64: "snn_moments_f64"}
_AFFINE = {torch.float32: "snn_row_affine2_f32", torch.float64: "snn_row_affine2_f64"}
_MERGE = {torch.float32: "snn_merge_moments_f32", torch.float64: "snn_merge_moments_f64"}
_BN_SUMS = {torch.float32: "snn_bn_grad_sums_f32", torch.float64: "snn_bn_grad_sums_f64"}
_BN_DX = {torch.float32: "snn_bn_input_grad_f32", torch.float64: "snn_bn_input_grad_f64"}


def wanted() -> bool:
    """False when ``SHARDED_NN_NATIVE_MOMENTS=0`` asks for the torch-only statistics."""
    return getenv(OPT_OUT_ENV, "1") != "0"


def build() -> Path:
    """Compile the kernel once (``sharded_nn.native.build``) and return the library's path."""
    return native.build("moments", opt_out_hint=f", or set {OPT_OUT_ENV}=0")


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                lib = ctypes.CDLL(str(build()))
                args = (ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_void_p)
                for fn in _FUNCS.values():
                    getattr(lib, fn).argtypes = args
                    getattr(lib, fn).restype = None
                affine_args = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 4)
                for fn in _AFFINE.values():
                    getattr(lib, fn).argtypes = affine_args
                    getattr(lib, fn).restype = None
                i64, ptr, dbl = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
                for fn in _MERGE.values():
                    getattr(lib, fn).argtypes = (ptr, i64, i64, ptr, ptr, ptr, ptr, dbl)
                    getattr(lib, fn).restype = dbl
                for fn in _BN_SUMS.values():
                    getattr(lib, fn).argtypes = (ptr, ptr, i64, i64, i64, ptr, ptr, dbl, ptr, ptr, ptr)
                    getattr(lib, fn).restype = None
                for fn in _BN_DX.values():
                    getattr(lib, fn).argtypes = (ptr, ptr, i64, i64, i64, ptr, ptr, ptr, dbl, ptr, dbl, ptr)
                    getattr(lib, fn).restype = None
                _lib = lib
            except (RuntimeError, OSError) as exc:
                _why_not = str(exc)
            _tried = True
    return _lib


def why_not() -> str | None:
    """Why the native kernel could not be loaded (no compiler, a compile error), or None."""
    return _why_not


def available() -> bool:
    """Whether :func:`local_moments` can use the native kernel in this process (builds it once)."""
    return wanted() and _load() is not None


def _applies(x: torch.Tensor, ndim: int = 3) -> bool:
    """Whether the native kernels can read the ``ndim``-d ``x`` here (see the module docstring)."""
    return (
        not torch.compiler.is_compiling()  # (first: Dynamo breaks its graph at get_num_threads)
        and type(x) is torch.Tensor
        and x.device.type == "cpu"
        and x.dtype in _FUNCS
        and x.dim() == ndim
        and x.numel() > 0
        and x.is_contiguous()
        and torch.get_num_threads() == 1
        and available()
    )


def local_moments(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-``K`` mean and biased variance of an ``(A, K, B)`` tensor over ``A`` and ``B``, in its dtype.

    None where the native kernel does not apply (see the module docstring): the caller computes
    them with torch.
    """
    if not _applies(x3):
        return None
    a, k, b = x3.shape
    mean = torch.empty(k, dtype=torch.float64)
    m2 = torch.empty(k, dtype=torch.float64)
    getattr(_lib, _FUNCS[x3.dtype])(x3.data_ptr(), a, k, b, mean.data_ptr(), m2.data_ptr())
    return mean.to(x3.dtype), (m2 / (a * b)).to(x3.dtype)


def packed_local_moments(x3: torch.Tensor) -> torch.Tensor | None:
    """``[A * B, mean (K), M2 (K)]`` of an ``(A, K, B)`` tensor as one float64 ``(1 + 2K,)`` tensor.

    ``M2`` is the sum of squared deviations from each ``K``'s own mean. This is what the sharded
    norms send to the other ranks (``layers/norm.py``, ``merged_moments``): the kernel writes it
    in place, in the kernel's own double precision, so the message is ready with no further
    torch call (a deep CNN stage's statistics are a few hundred floats, where every tiny torch
    call costs more than the arithmetic). None where the native kernel does not apply.
    """
    if not _applies(x3):
        return None
    a, k, b = x3.shape
    out = torch.empty(1 + 2 * k, dtype=torch.float64)
    ptr = out.data_ptr()
    ctypes.c_double.from_address(ptr).value = float(a * b)
    getattr(_lib, _FUNCS[x3.dtype])(x3.data_ptr(), a, k, b, ptr + 8, ptr + 8 * (1 + k))
    return out



def _pair_applies(g: torch.Tensor, x: torch.Tensor, ndim: int) -> bool:
    """Whether the kernels can read ``x`` (``_applies``) and ``g``, a contiguous tensor like it."""
    return (
        _applies(x, ndim)
        and type(g) is torch.Tensor
        and g.dtype == x.dtype
        and g.shape == x.shape
        and g.is_contiguous()
    )


def row_affine2_applies(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`row_affine2` can take the ``(R, I)`` tensors ``g`` and ``x`` here."""
    return _pair_applies(g, x, 2)


def row_affine2(g: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a[r] * g[r] + b[r] * x[r] + c[r]`` for each row ``r`` of the ``(R, I)`` tensors ``g``, ``x``.

    ``a``, ``b``, ``c``: ``(R,)`` CPU tensors (cast to ``x``'s dtype). One pass over memory; a new
    tensor. Call only where :func:`row_affine2_applies` (the caller keeps a torch form otherwise).
    """
    if not row_affine2_applies(g, x):
        raise ValueError(
            f"row_affine2: expected contiguous CPU float32/float64 (R, I) tensors of one shape and dtype "
            f"under one torch thread, got {g.dtype} {tuple(g.shape)} and {x.dtype} {tuple(x.shape)}"
        )
    rows, inner = x.shape
    a, b, c = (v.to(x.dtype).contiguous() for v in (a, b, c))
    for v in (a, b, c):
        if v.shape != (rows,) or v.device.type != "cpu":
            raise ValueError(f"row_affine2: expected ({rows},) CPU coefficients, got {tuple(v.shape)} on {v.device}")
    out = torch.empty_like(x)
    getattr(_lib, _AFFINE[x.dtype])(
        g.data_ptr(), x.data_ptr(), rows, inner, a.data_ptr(), b.data_ptr(), c.data_ptr(), out.data_ptr()
    )
    return out


def _vector_of(t: torch.Tensor | None, dtype: torch.dtype, k: int) -> bool:
    """Whether ``t`` is a contiguous CPU ``(k,)`` tensor of ``dtype`` the kernels may read or write."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.dtype == dtype
        and t.shape == (k,)
        and t.is_contiguous()
    )


def merge_packed(
    rows: torch.Tensor,
    dtype: torch.dtype,
    running: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """Merge the ranks' ``packed_local_moments`` rows (``(ranks, 1 + 2K)`` float64) in rank order.

    Returns the merged per-``K`` mean and biased variance in ``dtype`` and the total count (a
    float), in one native call instead of a dozen tiny torch calls. ``running``:
    ``(running_mean, running_var, momentum)`` updated in place as torch's batch norm does
    (unbiased variance) when the count exceeds 1. None where the kernel does not apply (no native
    library, other dtypes or layouts, tracing): the caller merges with torch.
    """
    if (
        type(rows) is not torch.Tensor
        or rows.device.type != "cpu"
        or rows.dtype != torch.float64
        or rows.dim() != 2
        or not rows.is_contiguous()
        or dtype not in _MERGE
        or torch.compiler.is_compiling()
        or not available()
    ):
        return None
    ranks, width = rows.shape
    k = (width - 1) // 2
    rm = rv = None
    factor = 0.0
    if running is not None:
        rm, rv, factor = running
        if not (_vector_of(rm, dtype, k) and _vector_of(rv, dtype, k)):
            return None
    mean = torch.empty(k, dtype=dtype)
    var = torch.empty(k, dtype=dtype)
    count = getattr(_lib, _MERGE[dtype])(
        rows.data_ptr(), ranks, k, mean.data_ptr(), var.data_ptr(),
        None if rm is None else rm.data_ptr(), None if rv is None else rv.data_ptr(), float(factor),
    )  # fmt: skip
    return mean, var, count


def bn_backward_applies(
    g3: torch.Tensor, x3: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, var: torch.Tensor
) -> bool:
    """Whether :func:`bn_grad_sums` and :func:`bn_input_grad` both take these ``(A, K, B)`` tensors
    and per-``K`` statistics (checked before the sums are sent, so that a caller never starts an
    all-reduce it cannot finish on the same path)."""
    if not _pair_applies(g3, x3, 3):
        return False
    k = x3.shape[1]
    return (
        _vector_of(mean, x3.dtype, k)
        and _vector_of(var, x3.dtype, k)
        and (weight is None or _vector_of(weight, x3.dtype, k))
    )


def bn_grad_sums(
    g3: torch.Tensor,
    x3: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight_grad: bool = False,
    bias_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """A batch norm backward's sums over ``A`` and ``B`` of ``(A, K, B)`` tensors, in one pass.

    Returns ``(sums, dw, db)``: ``sums`` the float64 ``(2K,)`` ``[sum(g), sum(g * (x - mean))]``
    (the message a sharded batch norm's backward all-reduces), and where asked this slab's
    weight gradient ``sum(g * xhat)`` (``xhat = (x - mean) / sqrt(var + eps)``) and bias gradient
    ``sum(g)`` in ``x``'s dtype. None where the kernel does not apply.
    """
    if not bn_backward_applies(g3, x3, None, mean, var):
        return None
    a, k, b = x3.shape
    sums = torch.empty(2 * k, dtype=torch.float64)
    dw = torch.empty(k, dtype=x3.dtype) if weight_grad else None
    db = torch.empty(k, dtype=x3.dtype) if bias_grad else None
    getattr(_lib, _BN_SUMS[x3.dtype])(
        g3.data_ptr(), x3.data_ptr(), a, k, b, mean.data_ptr(), var.data_ptr(), float(eps), sums.data_ptr(),
        None if dw is None else dw.data_ptr(), None if db is None else db.data_ptr(),
    )  # fmt: skip
    return sums, dw, db


def bn_input_grad(
    g3: torch.Tensor,
    x3: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    sums: torch.Tensor,
    count: float,
) -> torch.Tensor | None:
    """A batch norm's input gradient ``w rstd g + a x + b`` per channel of ``(A, K, B)`` tensors from
    the global sums ``[S_g, S_gx]`` of :func:`bn_grad_sums` (coefficients in double), in one pass.
    None where the kernel does not apply."""
    if not (bn_backward_applies(g3, x3, weight, mean, var) and _vector_of(sums, torch.float64, 2 * x3.shape[1])):
        return None
    a, k, b = x3.shape
    out = torch.empty_like(x3)
    getattr(_lib, _BN_DX[x3.dtype])(
        g3.data_ptr(), x3.data_ptr(), a, k, b, None if weight is None else weight.data_ptr(), mean.data_ptr(),
        var.data_ptr(), float(eps), sums.data_ptr(), float(count), out.data_ptr(),
    )  # fmt: skip
    return out
