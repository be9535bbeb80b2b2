"""Hypothesis fuzzing of ``sharded_nn.fft_modes``: the kept Fourier modes of random slabs.

``tests/test_fft_modes.py`` checks chosen cases; this file draws them: tensors with 1-2 leading
dims and 1-3 grid dims of lengths 1-11 (odd and even, lengths below the world size), 1-3
transformed dims in any order (the last of them halved), random kept modes up to the limits
(``2m <= n``, ``m <= n // 2 + 1`` on the halved dim: the Nyquist frequency and every frequency of
a dim included), sharded dims among the grid dims, transformed or not, and slabs of random
uneven lengths, empty ones included, on 1-4 ranks or a 2x2 mesh. ``rfftn_modes`` must equal
``torch.fft.rfftn`` of the whole tensor, cropped (a dim that is sharded but not transformed stays
sharded); ``irfftn_modes`` of the modes times a weight must equal this slab of ``torch.fft.irfftn``
of the zero-filled spectrum; the input's gradient and the weight's (each rank's part summed) must
equal the single device's (float64, 1e-10).

- ``test_fuzz_fft_modes_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_fft_modes_campaign`` (``pytest -m slow``): ``SNN_FUZZ_FFT_MODES_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from sharded_nn.fft_modes import irfftn_modes, rfftn_modes

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .test_fft_modes import _compact, _full


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    shape, dims, modes, splits = cfg["shape"], cfg["dims"], cfg["modes"], cfg["splits"]
    sharded = [d for d, _ in splits]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    gen = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    z_ref = _compact(torch.fft.rfftn(x, dim=dims), dims, modes)
    w_ref = torch.randn(z_ref.shape, generator=gen, dtype=torch.complex128, requires_grad=True)
    y_ref = torch.fft.irfftn(_full(z_ref * w_ref, shape, dims, modes), s=[shape[d] for d in dims], dim=dims)
    g = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    (y_ref * g).sum().backward()

    def block(t, only_untransformed=False):
        """This rank's slab of a whole tensor (of the modes: along untransformed sharded dims only)."""
        for (d, split), c in zip(splits, coords):
            if not (only_untransformed and d in dims):
                t = t.narrow(d, sum(split[:c]), split[c])
        return t

    x_l = block(x.detach()).clone().requires_grad_()
    w = block(w_ref.detach(), True).clone().requires_grad_()
    z = rfftn_modes(x_l, m, modes, dims, sharded_dims=sharded)
    torch.testing.assert_close(z, block(z_ref.detach(), True), atol=1e-10, rtol=1e-10, msg=lambda s: f"modes: {s}")
    y = irfftn_modes(z * w, x_l, m, dims, sharded_dims=sharded)
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-10, rtol=1e-10, msg=lambda s: f"inverse: {s}")
    (y * block(g)).sum().backward()
    torch.testing.assert_close(x_l.grad, block(x.grad), atol=1e-10, rtol=1e-10, msg=lambda s: f"input grad: {s}")
    # The weight's gradient: each rank's part placed in the whole and summed over every rank
    # (ranks that share a block of the modes hold partial sums of its gradient).
    whole = torch.zeros_like(w_ref)
    block(whole, True).copy_(w.grad)
    torch.distributed.all_reduce(whole)
    torch.testing.assert_close(whole, w_ref.grad, atol=1e-10, rtol=1e-10, msg=lambda s: f"weight grad: {s}")
    return "ok"


def _split(draw, n: int, parts: int) -> list[int]:
    """``n`` rows in ``parts`` slabs of random lengths (zeros allowed), in rank order."""
    cuts = sorted(draw(st.integers(0, n)) for _ in range(parts - 1))
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    lead = draw(st.integers(1, 2))
    ngrid = draw(st.integers(len(axes), 3))
    grid = list(range(lead, lead + ngrid))
    shape = [draw(st.integers(1, 3)) for _ in range(lead)] + [draw(st.integers(1, 11)) for _ in grid]
    dims = draw(st.permutations(grid))[: draw(st.integers(1, ngrid))]
    for d in dims[:-1]:  # a dim that keeps both ends needs two rows
        shape[d] = max(shape[d], 2)
    modes = [draw(st.integers(1, shape[d] // 2)) for d in dims[:-1]]
    modes.append(draw(st.integers(1, shape[dims[-1]] // 2 + 1)))
    sharded = draw(st.permutations(grid))[: len(axes)]
    return dict(
        domain=domain, shape=shape, dims=dims, modes=modes,
        splits=[(d, _split(draw, shape[d], p)) for d, p in zip(sharded, axes)], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: the halved dim sharded with an empty slab at 3 ranks; a 2x2
# mesh sharding one transformed and one untransformed dim, every frequency of the halved dim kept.
EXAMPLES = [
    dict(domain=3, shape=[2, 3, 7, 6], dims=[2, 3], modes=[3, 4], splits=[(3, [4, 0, 2])], seed=1),
    dict(domain=(2, 2), shape=[1, 2, 5, 8, 4], dims=[4, 2], modes=[2, 3], splits=[(2, [1, 4]), (3, [8, 0])], seed=2),
]  # fmt: skip

test_fuzz_fft_modes_fast, test_fuzz_fft_modes_campaign = fuzz_tests(
    "fft_modes fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_FFT_MODES_FAST_EXAMPLES", 6), campaign=("SNN_FUZZ_FFT_MODES_EXAMPLES", 300), every=50,
)
