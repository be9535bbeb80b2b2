"""``torch.fft`` inside a converted model's own forward: the forward guard's spectral calls.

A Fourier layer written for one device (an FNO spectral convolution, FourCastNet's AFNO filter)
calls ``torch.fft.rfft2``/``irfft2``/``fftn``/... on the whole domain. On a slab the local call
runs and is silently wrong: every frequency depends on every position. The guard routes such
calls to ``sharded_nn.fft``, which computes the single device's transform and returns it in the
input's layout (the spectrum sharded along the same dims with the same slab lengths), so the
model's code after it lines up as on one device; ``fftshift``/``ifftshift`` along a sharded dim
become the periodic shift of ``torch.roll``. Transforms along whole dims only run locally.
Refused alike on every rank: the halved dim of ``rfft*``/``irfft*`` sharded, a transform length
along a sharded dim other than its global length, ``hfft``/``ihfft`` along a sharded dim, an
``out=`` tensor. Sizes read from slabs (``s=(x.size(-2), x.size(-1))``) stand for the global
ones, as everywhere in the guard.
"""

from __future__ import annotations

import torch

from . import forward_guard as fg
from .fft import refusal, transform, transform_dims

__all__ = ["FftCalls"]

#: torch.fft name -> (kind for ``sharded_nn.fft.transform``, dims when none are given: ``None``
#: all dims, or a tuple; True for the 1-D forms (``n`` and one ``dim``, default -1)).
_ROUTED = {
    "fft": ("fft", True), "ifft": ("ifft", True), "rfft": ("rfft", True), "irfft": ("irfft", True),
    "fft2": ("fft", (-2, -1)), "ifft2": ("ifft", (-2, -1)), "rfft2": ("rfft", (-2, -1)), "irfft2": ("irfft", (-2, -1)),
    "fftn": ("fft", None), "ifftn": ("ifft", None), "rfftn": ("rfft", None), "irfftn": ("irfft", None),
}  # fmt: skip
#: The Hermitian forms, not routed: computed locally where they do not touch a sharded dim.
_LOCAL_ONLY = {
    "hfft": True, "ihfft": True, "hfft2": (-2, -1), "ihfft2": (-2, -1), "hfftn": None, "ihfftn": None,
}  # fmt: skip


def _empty_transform(func, args, kwargs, x: torch.Tensor) -> torch.Tensor:
    """``func(*args, **kwargs)`` (a transform along whole dims) of an empty slab (a deep stage
    with fewer rows than ranks): torch's CPU transforms raise on any empty tensor (MKL), which
    left that rank alone with an error (session 67). The shape and dtype come from the same call
    on a meta tensor; the zeros stay connected to ``x`` (its backward runs as the others')."""
    meta = x.to("meta")
    args = tuple(meta if a is x else a for a in args)
    kwargs = {k: meta if v is x else v for k, v in kwargs.items()}
    like = func(*args, **kwargs)
    anchor = x.sum() * 0
    if anchor.is_complex() and not like.is_complex():
        anchor = anchor.real
    return torch.zeros(like.shape, dtype=like.dtype, device=x.device) + anchor


class FftCalls:
    """The forward guard's ``torch.fft`` handler (mixed into ``_GuardMode``)."""

    def _h_fft(self, func, base, args, kwargs, stateful):
        name = base[len("fft_"):]
        call = f"`torch.fft.{name}`"
        if name in ("fftfreq", "rfftfreq"):
            # ``fftfreq(x.shape[2])``: the frequencies of the whole domain (a plain tensor, as one
            # device makes it; a slab's rows of it are taken where it meets one).
            args, kwargs = self._globalise(call, args, kwargs)
            return func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        st = self._st(x) if x is not None else None
        if st is None:
            if stateful:
                return self._plain_or_fail(func, base, args, kwargs, stateful)
            # A plain (replicated, whole) tensor: sizes read from slabs stand for the global ones
            # (``irfft2(modes, s=(x.shape[2], x.shape[3]))``: a kernel of the whole grid).
            args, kwargs = self._globalise(call, args, kwargs)
            return func(*args, **kwargs)
        self._require_known(call, [x])
        if kwargs.get("out") is not None:
            self.fail(call, "it writes into an `out=` tensor", "assign the result instead")
        sharded = {d: k for k, d in enumerate(st) if d is not None}
        if name in ("fftshift", "ifftshift"):
            return self._fft_shift(name, x, st, args, kwargs, stateful)
        spec = _ROUTED.get(name, (None, _LOCAL_ONLY.get(name, False)))
        kind, default = spec
        if default is False:  # a torch.fft function that is not a transform over dims
            self.fail(call, f"the guard does not know this call, and it receives {self._what(stateful, False)}", "")
        if default is True:
            n = fg._arg(args, kwargs, 1, "n")
            dims, sizes = transform_dims(x, None if n is None else [n], fg._arg(args, kwargs, 2, "dim", -1))
        else:
            dims, sizes = transform_dims(x, fg._arg(args, kwargs, 1, "s"), fg._arg(args, kwargs, 2, "dim", default))
        if not any(d in sharded for d in dims):
            # Along whole dims only: the slab's own transform is exact (a length read from a slab
            # is the global one there too, as on one device).
            args, kwargs = self._globalise(call, args, kwargs)
            out = func(*args, **kwargs) if x.numel() else _empty_transform(func, args, kwargs, x)
            self._set(out, st)
            return out
        if kind is None:
            self.fail(call, f"it transforms along sharded dim {[d for d in dims if d in sharded][0]}, and the "
                      "Hermitian transforms are not routed", "use rfftn/irfftn (or fftn/ifftn) along sharded dims")
        tagged = [v for v in sizes if fg._is_tagged(v)]
        if tagged:  # a size read from a slab stands for the global one
            glob = self._global_values(tagged, call)
            sizes = [glob[id(v)] if fg._is_tagged(v) else v for v in sizes]
        self._routing(call)
        local = [(k, int(x.shape[d])) for d, k in sharded.items()]
        every = self._lengths(local, f"forward guard: {call}")
        lengths = {d: tuple(lens) for d, lens in zip(sharded, every)}
        refused = refusal(kind, dims, sizes, lengths)
        if refused is not None:
            self.fail(call, *refused)
        from .comm import axis_peers

        mesh, axes = self.guard.mesh, self.guard.axes
        rings = {d: (axis_peers(mesh, axes[k]), lengths[d]) for d, k in sharded.items()}
        out = transform(kind, x, rings, dims, sizes, fg._arg(args, kwargs, 3, "norm"), call)
        self._set(out, st)
        return out

    def _fft_shift(self, name, x, st, args, kwargs, stateful):
        """``fftshift``/``ifftshift``: ``torch.roll`` by half the global length along each dim."""
        nd = x.dim()
        dim = fg._arg(args, kwargs, 1, "dim")
        dims = list(range(nd)) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
        dims = [int(d) % nd for d in dims]
        sharded = [(k, d) for k, d in enumerate(st) if d is not None and d in dims]
        total = dict(zip([d for _, d in sharded], (
            sum(lens) for lens in self._lengths([(k, int(x.shape[d])) for k, d in sharded], "forward guard: fftshift")
        ))) if sharded else {}
        shifts = []
        for d in dims:
            n = total.get(d, int(x.shape[d]))
            shifts.append(n // 2 if name == "fftshift" else -(n // 2))
        return self._h_roll(torch.roll, "roll", (x, shifts, dims), {}, stateful)
