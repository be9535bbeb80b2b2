"""Hypothesis fuzzing of max pooling with indices and max unpooling (SegNet-style encoders and
decoders): ``nn.MaxPool*d(return_indices=True)`` then ``nn.MaxUnpool*d``, converted.

``tests/test_pool.py`` checks chosen geometries; this file draws them: 1-3 spatial dims, kernel
1-3, stride 1-3, padding up to half the kernel, dilation 1-2, ``ceil_mode``, the unpooling's own
kernel/stride/padding taken from the pool (as models write it), ``output_size`` from the pooled
tensor's own shape (``x.shape[2:]``, as SegNet writes it) or not given, random values (no ties),
slabs of random uneven aligned lengths (1-3 blocks of the stride, the last one cut short) on 1-4
ranks, or a 2x2 mesh. The output, the input gradient and the parameter gradients (summed over
the ranks) must equal the single-device model's (``tests/reference.py``, float64). A
``ShardingError`` raised alike on every rank counts as a refusal, a geometry torch itself
rejects as invalid; any mismatch fails.

- ``test_fuzz_unpool_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_unpool_campaign`` (``pytest -m slow``): ``SNN_FUZZ_UNPOOL_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .reference import check_against_reference


class PoolUnpool(nn.Module):
    """A 1x1 convolution, a max pool with indices, the unpooling back (sized by the input's own
    shape or not), and a residual."""

    def __init__(self, nsp: int, k: int, s: int, p: int, d: int, ceil: bool, sized: bool) -> None:
        super().__init__()
        self.conv = getattr(nn, f"Conv{nsp}d")(2, 2, 1)
        self.pool = getattr(nn, f"MaxPool{nsp}d")(k, s, p, dilation=d, ceil_mode=ceil, return_indices=True)
        self.unpool = getattr(nn, f"MaxUnpool{nsp}d")(k, s, p)
        self.sized = sized

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.conv(x)
        y, idx = self.pool(h)
        z = self.unpool(y, idx, output_size=h.shape[2:]) if self.sized else self.unpool(y, idx)
        return z + (0.1 * h if z.shape == h.shape else 0)


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    torch.manual_seed(cfg["seed"])
    nsp = len(cfg["spatial"])
    ref = PoolUnpool(nsp, cfg["k"], cfg["s"], cfg["p"], cfg["d"], cfg["ceil"], cfg["sized"]).double()
    x = torch.randn(cfg["batch"], 2, *cfg["spatial"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(cfg["seed"] + 1))  # fmt: skip
    try:  # torch's own rules, forward and backward (indices past an unpooling's default size)
        ref(x.clone().requires_grad_()).sum().backward()
        ref.zero_grad(set_to_none=True)
    except (RuntimeError, ValueError) as e:
        return ("invalid", str(e)[:100])
    dims = (2,) if isinstance(cfg["domain"], int) else (2, 3)
    try:
        check_against_reference(ref, x, m, dims=dims, align=cfg["s"], sizes=cfg["sizes"], atol=1e-10, rtol=1e-10)
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", str(e)[:120])
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    two = isinstance(domain, tuple)
    nsp = draw(st.integers(2 if two else 1, 3))
    k, s, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    p = draw(st.integers(0, k // 2))

    def slabs(parts):
        sizes = [draw(st.integers(1, 3)) * s for _ in range(parts)]
        sizes[-1] = max(1, sizes[-1] - draw(st.integers(0, s - 1)))
        return tuple(sizes)

    if two:
        sizes = (slabs(2), slabs(2))
        spatial = [sum(sizes[0]), sum(sizes[1])] + [draw(st.integers(2, 5)) for _ in range(nsp - 2)]
    else:
        sizes = slabs(domain)
        spatial = [sum(sizes)] + [draw(st.integers(2, 5)) for _ in range(nsp - 1)]
    return dict(domain=domain, spatial=spatial, sizes=sizes if (two or domain > 1) else None, k=k, s=s, p=p, d=d,
                ceil=draw(st.booleans()), sized=draw(st.booleans()), batch=draw(st.integers(1, 2)),
                seed=draw(st.integers(0, 2**16)))  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a ceil-mode pool with padding at 3 uneven ranks, unpooled
# to the input's own size; a 2x2 mesh without output_size.
EXAMPLES = [
    dict(domain=3, spatial=[9, 4], sizes=(4, 2, 3), k=3, s=2, p=1, d=1, ceil=True, sized=True, batch=1, seed=1),
    dict(domain=(2, 2), spatial=[6, 8], sizes=((4, 2), (4, 4)), k=2, s=2, p=0, d=1, ceil=False, sized=False,
         batch=2, seed=2),
]  # fmt: skip

test_fuzz_unpool_fast, test_fuzz_unpool_campaign = fuzz_tests(
    "unpool fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_UNPOOL_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_UNPOOL_EXAMPLES", 300), every=50,
)
