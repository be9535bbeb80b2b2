"""The scratch memory of CPU convolution kernels: what ``plan_memory``'s trace cannot see.

The planner follows the tensors that operators return. A convolution kernel on CPU also
allocates buffers of its own while it runs, freed before it returns, and some are large:

- torch's native ("slow") kernels unfold their input into a column matrix (``im2col``) and
  multiply it with the weight: ``C_in / groups * prod(kernel)`` rows by ``prod(output)`` columns,
  27 times the input of a 3x3x3 convolution (the first layer of the demo's 3-D CNN at 64^3: 108
  MiB, above the whole traced peak of 69 MiB). Their backward unfolds again, one matrix at a time
  (the input's gradient, then the weight's); a 1x1 convolution of stride 1 without padding needs
  none in 2-D, and in 3-D only for the input's gradient. The transposed ones unfold
  ``C_out / groups * prod(kernel)`` rows by the *input's* positions, one sample at a time, as do
  the dilated ones;
- oneDNN (``mkldnn``) reorders its operands into blocked layouts: measured on this build, about
  ``max(input, output)`` bytes during a forward (twice the output for a transposed one), and
  during the backward ``max(input, output)`` (one input more with a stride) for the input's
  gradient, ``input + output`` for the weight's, one after the other.

The sharded layers choose differently in one case: a float32 3-D convolution that torch would run
on its native kernel goes to oneDNN (``layers/conv.py``, ``_conv3d_on_onednn``: 3-14x faster),
in training by cutting the one sample into a batch of two halves (a copy of the input, which the
convolution keeps for its backward in place of the input itself). ``scratch_bytes`` gives
both figures per call: torch's (the plain model, P=1) and the sharded layers' (P >= 2).

The backend is the one ATen picks for the call's shapes (``torch._C._select_conv_backend``, which
works on fake tensors). Measured with the profiler's allocation events on CPU, float32, one
thread (``tests/test_planner.py`` checks the plan against them); other devices get 0 (CUDA:
cuDNN's workspace comes from the caching allocator and varies by algorithm), and the oneDNN
figures are approximate (channel counts below its block size are padded to it, which the rule
does not model).
"""

from __future__ import annotations

import math

import torch

__all__ = ["scratch_bytes", "workspace_bytes"]

_B = torch._C._ConvBackend
_SLOW = {int(_B.Slow2d), int(_B.Slow3d)}
_DILATED = {int(_B.SlowDilated2d), int(_B.SlowDilated3d)}
_TRANSPOSED = {int(_B.SlowTranspose2d), int(_B.SlowTranspose3d)}
_MKLDNN = int(_B.Mkldnn)
_MKLDNN_T = 9  # MkldnnTranspose (the enum's member without a name in this build)
_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default


class _Call:
    """One convolution call's geometry, forward or backward, from its ATen arguments."""

    def __init__(self, func, args):
        if func is _CONV:
            self.x, self.w, _, stride, padding, dilation, transposed, output_padding, groups = args[:9]
            self.mask = None
        else:
            _, self.x, self.w, _, stride, padding, dilation, transposed, output_padding, groups, self.mask = args[:11]
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.transposed, self.output_padding, self.groups = bool(transposed), list(output_padding), int(groups)
        x, w = self.x, self.w
        self.out = [
            (i - 1) * s - 2 * p + d * (k - 1) + o + 1 if self.transposed else (i + 2 * p - d * (k - 1) - 1) // s + 1
            for i, s, p, d, k, o in zip(x.shape[2:], stride, padding, dilation, w.shape[2:], output_padding)
        ]  # fmt: skip
        self.c_out = w.shape[1] * self.groups if self.transposed else w.shape[0]
        self.item = x.element_size()

    @property
    def backward(self) -> bool:
        return self.mask is not None

    def backend(self) -> int | None:
        try:
            return int(torch._C._select_conv_backend(
                self.x, self.w, None, self.stride, self.padding, self.dilation, self.transposed, self.output_padding,
                self.groups, None,
            ))  # fmt: skip
        except Exception:  # a call ATen itself would refuse; the call reports it when it runs
            return None

    def y_bytes(self) -> int:
        return self.x.shape[0] * self.c_out * math.prod(self.out) * self.item


def _scratch(c: _Call, backend: int | None, x_bytes: int, y_bytes: int) -> int:
    """The bytes ``backend`` allocates for itself on call ``c`` (operands of ``x_bytes`` and ``y_bytes``)."""
    n, kernel, spatial = c.x.shape[0], c.w.shape[2:], c.x.shape[2:]
    grad_input = c.backward and bool(c.mask[0])
    grad_weight = c.backward and bool(c.mask[1])
    if backend in _SLOW:
        pointwise = all(k == 1 for k in kernel) and all(s == 1 for s in c.stride) and all(p == 0 for p in c.padding)
        if pointwise and not (grad_input and c.x.dim() == 5):
            return 0
        return n * (c.x.shape[1] // c.groups) * math.prod(kernel) * math.prod(c.out) * c.item
    if backend in _DILATED:
        return (c.x.shape[1] // c.groups) * math.prod(kernel) * math.prod(c.out) * c.item
    if backend in _TRANSPOSED:
        return (c.c_out // c.groups) * math.prod(kernel) * math.prod(spatial) * c.item
    if backend in (_MKLDNN, _MKLDNN_T):
        if not c.backward:
            return 2 * y_bytes if backend == _MKLDNN_T else max(x_bytes, y_bytes)
        strided = backend == _MKLDNN and any(s != 1 for s in c.stride)
        gi = (y_bytes if backend == _MKLDNN_T else max(x_bytes, y_bytes) + strided * x_bytes) if grad_input else 0
        gw = x_bytes + y_bytes if grad_weight else 0
        return max(gi, gw)
    return 0


def _sharded_to_onednn(c: _Call, backend: int | None) -> bool:
    """Whether the sharded layers send this call to oneDNN where torch uses its native 3-D kernel
    (the conditions of ``layers/conv.py``'s ``_on_reference_kernel``)."""
    return (
        backend == int(_B.Slow3d)
        and not c.transposed
        and c.x.dtype == torch.float32
        and torch.backends.mkldnn.enabled
        and torch.backends.mkldnn.is_available()
        and not all(k == 1 for k in c.w.shape[2:])
    )


def _cuts(c: _Call) -> bool:
    """Whether the sharded layer cuts a training call's one sample into a batch of two halves
    (``_conv3d_on_onednn``); it keeps torch's kernel for several samples, one channel, or no dim
    with two outputs."""
    return c.x.shape[0] == 1 and c.x.shape[1] > 1 and max(c.out) >= 2


def scratch_bytes(func, args) -> tuple[int, int]:
    """``(torch's kernel, the sharded layers' kernel)``: the bytes a CPU convolution
    (``aten.convolution`` or ``aten.convolution_backward``) allocates for itself while it runs,
    from its arguments (real or fake tensors); ``(0, 0)`` for any other call or device."""
    if func is not _CONV and func is not _CONV_BACKWARD:
        return 0, 0
    c = _Call(func, args)
    if c.x.device.type != "cpu" or c.x.dim() not in (4, 5) or c.x.numel() == 0:
        return 0, 0
    backend = c.backend()
    x_bytes, y_bytes = c.x.numel() * c.item, c.y_bytes()
    plain = _scratch(c, backend, x_bytes, y_bytes)
    if not _sharded_to_onednn(c, backend):
        return plain, plain
    if not c.backward and torch.is_grad_enabled() and (c.x.requires_grad or c.w.requires_grad) and not _cuts(c):
        return plain, plain  # the layer keeps torch's kernel
    # The copy of the input that a cut keeps for the backward takes the place of the input the
    # convolution would have kept: no net change to count. (A backward whose forward the layer
    # left on torch's kernel cannot be told apart here: it is charged as oneDNN's.)
    return plain, _scratch(c, _MKLDNN, x_bytes, y_bytes)


def workspace_bytes(func, args) -> int:
    """Bytes torch's own CPU convolution kernel allocates for itself on this call (see
    ``scratch_bytes``)."""
    return scratch_bytes(func, args)[0]
