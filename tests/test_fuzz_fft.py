"""Hypothesis fuzzing of ``sharded_nn.fft``: whole-spectrum transforms of random slabs.

``tests/test_fft.py`` checks twelve chosen calls; this file draws them: each of the twelve
functions (``fft``, ``ifft``, ``rfft``, ``irfft``, their ``2`` and ``n`` forms), tensors with
1-2 leading dims and 1-3 grid dims of lengths 1-9 (odd and even, shorter than the ring), real or
complex input where torch takes either, the transformed dims in any order (negative or not, or
torch's defaults), sizes ``s``/``n`` that pad or crop whole dims (and the global length, given
explicitly, along sharded ones), every ``norm``, any dims sharded (transformed or not, a leading
dim included), slabs of random uneven lengths with empty ones, on 1-4 ranks or a 2x2 mesh. The
spectrum must be this rank's slab of ``torch.fft`` on the whole tensor (the input's layout), and
the input's gradient the single device's slab (float64 / complex128, 1e-10). The documented
refusals (the halved last dim of ``rfft*``/``irfft*`` sharded; a length along a sharded dim other
than its global one) must come alike on every rank exactly where predicted; any other outcome fails.

- ``test_fuzz_fft_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_fft_campaign`` (``pytest -m slow``): ``SNN_FUZZ_FFT_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .fuzzing import fuzz_tests, outcome, slab_of
from .harness import mesh
from .test_fuzz_fft_modes import _split

#: name -> (kind, number of transformed dims: 1, 2 or None for n-dim)
FUNCTIONS = {
    "fft": ("fft", 1), "ifft": ("ifft", 1), "rfft": ("rfft", 1), "irfft": ("irfft", 1),
    "fft2": ("fft", 2), "ifft2": ("ifft", 2), "rfft2": ("rfft", 2), "irfft2": ("irfft", 2),
    "fftn": ("fft", None), "ifftn": ("ifft", None), "rfftn": ("rfft", None), "irfftn": ("irfft", None),
}  # fmt: skip


def _call(fn, x, cfg, **kw):
    """``fn`` (torch.fft's or ours) with the example's size and dim arguments, as a user writes them."""
    one = FUNCTIONS[cfg["name"]][1] == 1
    args = {}
    if cfg["s"] is not None:
        args["n" if one else "s"] = cfg["s"][0] if one else tuple(cfg["s"])
    if cfg["dim"] is not None:
        args["dim"] = cfg["dim"][0] if one else tuple(cfg["dim"])
    if cfg["norm"] != "default":
        args["norm"] = cfg["norm"]
    return fn(x, **args, **kw)


def _expected_refusal(cfg) -> bool:
    """Whether the documented rules refuse this call (computed here, apart from the library's)."""
    name, shape = cfg["name"], cfg["shape"]
    nd = len(shape)
    kind, count = FUNCTIONS[name]
    if cfg["dim"] is not None:
        dims = [d % nd for d in cfg["dim"]]
    elif cfg["s"] is not None:
        dims = list(range(nd - len(cfg["s"]), nd))
    else:
        dims = [nd - 1] if count == 1 else list(range(nd - 2, nd)) if count == 2 else list(range(nd))
    sharded = {d for d, _ in cfg["splits"]}
    sizes = cfg["s"] if cfg["s"] is not None else [None] * len(dims)
    if any(d in sharded and n is not None and n != shape[d] for d, n in zip(dims, sizes)):
        return True
    return kind in ("rfft", "irfft") and dims[-1] in sharded


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    gen = torch.Generator().manual_seed(cfg["seed"])
    dtype = torch.complex128 if cfg["complex"] else torch.float64
    x = torch.randn(cfg["shape"], generator=gen, dtype=dtype).requires_grad_()

    def block(t):
        return slab_of(t, splits, coords)

    try:
        y_ref = _call(getattr(torch.fft, cfg["name"]), x, cfg)
    except RuntimeError as e:  # torch's own rules (e.g. an output length it cannot make)
        return ("invalid", str(e)[:120])
    x_l = block(x.detach()).clone().requires_grad_()
    ours = getattr(snn.fft, cfg["name"])
    try:
        y = _call(ours, x_l, cfg, mesh=m, sharded_dims=[d for d, _ in splits])
    except ShardingError as e:
        assert _expected_refusal(cfg), f"refused where the documented rules do not: {e}"
        return ("refused", str(e).split(":")[0] + ": " + str(e)[-80:])
    assert not _expected_refusal(cfg), "ran where the documented rules refuse"
    assert y.dtype == y_ref.dtype, f"dtype {y.dtype}, torch's {y_ref.dtype}"
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-10, rtol=1e-10, msg=lambda s: f"spectrum: {s}")
    g = torch.randn(y_ref.shape, generator=gen, dtype=y_ref.dtype)

    def loss(out, grad):  # real-valued, the same for real and complex outputs (torch.fft.ifft of a
        # real input returns a conjugate view, which view_as_real refuses: resolved first)
        if out.is_complex():
            return (torch.view_as_real(out.resolve_conj()) * torch.view_as_real(grad)).sum()
        return (out * grad).sum()

    loss(y_ref, g).backward()
    loss(y, block(g)).backward()
    torch.testing.assert_close(x_l.grad, block(x.grad), atol=1e-10, rtol=1e-10, msg=lambda s: f"input grad: {s}")
    return "ok"


@st.composite
def configs(draw):
    name = draw(st.sampled_from(sorted(FUNCTIONS)))
    kind, count = FUNCTIONS[name]
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    lead = draw(st.integers(1, 2))
    ngrid = draw(st.integers(max(1, (count or 1) - lead, len(axes) - lead), 3))
    nd = lead + ngrid
    shape = [draw(st.integers(1, 3)) for _ in range(lead)] + [draw(st.integers(1, 9)) for _ in range(ngrid)]
    # The transformed dims: torch's default, or given (any order, negative or not); for the
    # n-dim forms sometimes only s, which then names the last len(s) dims.
    how = draw(st.sampled_from(["default", "dim", "s"]))
    k = count or draw(st.integers(1, min(3, nd)))
    if how == "dim" or (how == "s" and count is None and draw(st.booleans())):
        dims = draw(st.permutations(range(nd)))[:k]
        dim = [d - nd if draw(st.booleans()) else d for d in dims]
    else:
        dims = [nd - 1] if count == 1 else list(range(nd - 2, nd)) if count == 2 else list(range(nd - k, nd))
        if count is None and how == "default":
            dims = list(range(nd))  # fftn without s or dim transforms every dim
        dim = None
    # The input: complex for the inverse real transform (its half spectrum), real or complex for
    # the complex ones, real for rfft*.
    cplx = kind == "irfft" or (kind in ("fft", "ifft") and draw(st.booleans()))
    if kind == "irfft" and shape[dims[-1]] < 1:
        shape[dims[-1]] = 1
    sharded = draw(st.permutations(range(nd)))[: len(axes)]
    s = None
    if how == "s" or (how == "dim" and draw(st.booleans())):
        s = []
        for i, d in enumerate(dims):
            if d in sharded and draw(st.integers(0, 9)):  # usually the global length, sometimes not
                s.append(shape[d])
            elif kind == "irfft" and i == len(dims) - 1:
                s.append(draw(st.integers(1, 2 * shape[d])))  # the rebuilt length: any
            else:
                s.append(draw(st.integers(1, 12)))
    if kind == "irfft" and s is None and shape[dims[-1]] < 2:
        shape[dims[-1]] = 2  # torch's default output length 2 (n - 1) must be positive
    norm = draw(st.sampled_from(["default", "backward", "ortho", "forward"]))
    return dict(
        domain=domain, name=name, shape=shape, dim=dim, s=s, norm=norm, complex=cplx,
        splits=[(d, _split(draw, shape[d], p)) for d, p in zip(sharded, axes)], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a 2x2 mesh transforming both sharded dims with an empty slab
# and a padded whole dim; irfftn at 3 ranks with its halved dim whole and a leading dim sharded.
EXAMPLES = [
    dict(domain=(2, 2), name="fftn", shape=[2, 5, 3, 4], dim=[1, -2, 3], s=[5, 3, 6], norm="ortho", complex=True,
         splits=[(1, [5, 0]), (2, [1, 2])], seed=1),
    dict(domain=3, name="irfftn", shape=[3, 4, 5], dim=[-2, 2], s=None, norm="forward", complex=True,
         splits=[(0, [1, 0, 2])], seed=2),
]  # fmt: skip

test_fuzz_fft_fast, test_fuzz_fft_campaign = fuzz_tests(
    "fft fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_FFT_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_FFT_EXAMPLES", 300), every=50,
)
