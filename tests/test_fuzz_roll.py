"""Hypothesis fuzzing of ``torch.roll`` in a converted model's own ``forward`` (the guard's
periodic shifts, ``comm/shift.py``).

Swin's cyclic shifts, periodic boundary conditions (longitude in weather grids) and centred
spectra written by hand roll a tensor along sharded dims. This file draws models that do:
1-3 spatial dims of lengths 1-9 after a 1x1 convolution, one or two ``torch.roll`` calls each
over one or more dims (sharded or not), shifts of any sign and size (past the whole length, and
shifts computed from the tensor's own sizes, ``h.shape[d] // 2``: the single device's number),
any spatial dims sharded, slabs of random uneven lengths (thin ones, from which a shift reads
rows of several ranks; sometimes empty ones: taken since session 67), on 1-4 ranks or a 2x2
mesh. The output, the input's gradient and the
convolution's parameter gradients (summed over the ranks) must be the single device's (float64,
1e-12). A ``ShardingError`` raised alike on every rank counts as a refusal (a roll of the
flattened tensor, ``dims=None``, is one); any mismatch fails.

- ``test_fuzz_roll_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_roll_campaign`` (``pytest -m slow``): ``SNN_FUZZ_ROLL_EXAMPLES`` examples (default
  300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .fuzzing import fuzz_tests, outcome, slab_of
from .harness import mesh
from .reference import assert_param_grads
from .test_fuzz_reductions import _split_rows


class Rolls(nn.Module):
    """A 1x1 convolution, then the rolls ``[(shifts, dims), ...]``; a shift ``("half", d)`` is
    ``h.shape[d] // 2`` and ``("minus", d, k)`` is ``k - h.shape[d]``, read from the tensor."""

    def __init__(self, nsp: int, rolls: list) -> None:
        super().__init__()
        self.conv = getattr(nn, f"Conv{nsp}d")(2, 2, 1)
        self.rolls = rolls

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.conv(x)
        for shifts, dims in self.rolls:
            if dims is None:
                h = torch.roll(h, shifts[0])
                continue
            values = []
            for s in shifts:
                if isinstance(s, (list, tuple)) and s[0] == "half":
                    values.append(h.shape[s[1]] // 2)
                elif isinstance(s, (list, tuple)):
                    values.append(s[2] - h.shape[s[1]])
                else:
                    values.append(s)
            h = torch.roll(h, tuple(values), tuple(dims)) if len(dims) > 1 else torch.roll(h, values[0], dims[0])
        return h * 1.5


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    nsp = len(cfg["shape"]) - 2
    torch.manual_seed(cfg["seed"])
    ref = Rolls(nsp, cfg["rolls"]).double()
    x = torch.randn(cfg["shape"], dtype=torch.float64).requires_grad_()
    y_ref = ref(x)

    def block(t):
        return slab_of(t, splits, coords)

    model = snn.convert(copy.deepcopy(ref), m, dims=tuple(d for d, _ in splits), strict=True)
    x_l = block(x.detach()).clone().requires_grad_()
    try:
        y = model(x_l)
    except ShardingError as e:
        return ("refused", str(e)[:120])
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-12, rtol=1e-12, msg=lambda s: f"output: {s}")
    g = torch.randn(y_ref.shape, dtype=torch.float64)
    (y_ref * g).sum().backward()
    (y * block(g)).sum().backward()
    torch.testing.assert_close(x_l.grad, block(x.grad), atol=1e-12, rtol=1e-12, msg=lambda s: f"input grad: {s}")
    assert_param_grads(ref, model, m, atol=1e-10, rtol=1e-10)  # the partial sums, summed over the ranks
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    nsp = draw(st.integers(len(axes), 3))
    shape = [draw(st.integers(1, 2)), 2] + [draw(st.integers(1, 9)) for _ in range(nsp)]
    sharded = draw(st.permutations(range(2, 2 + nsp)))[: len(axes)]
    for d, parts in zip(sharded, axes):
        if draw(st.integers(0, 3)):  # mostly a row per rank at least (empty slabs: since session 67 taken)
            shape[d] = max(shape[d], parts)
    rolls = []
    for _ in range(draw(st.integers(1, 2))):
        if not draw(st.integers(0, 19)):
            rolls.append(([draw(st.integers(-5, 5))], None))  # the flattened tensor: refused
            continue
        dims = draw(st.permutations(range(2, 2 + nsp)))[: draw(st.integers(1, nsp))]
        shifts = []
        for d in dims:
            how = draw(st.integers(0, 5))
            if how == 0:
                shifts.append(("half", d))
            elif how == 1:
                shifts.append(("minus", d, draw(st.integers(-3, 3))))
            else:
                shifts.append(draw(st.integers(-12, 12)))
        rolls.append((shifts, [d - len(shape) if draw(st.booleans()) else d for d in dims]))
    return dict(
        domain=domain, shape=shape, rolls=rolls,
        splits=[(d, _split_rows(draw, shape[d], p)) for d, p in zip(sharded, axes)],
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a shift longer than the whole length over thin slabs at 4
# ranks; a centred shift read from the sizes on both sharded dims of a 2x2 mesh.
EXAMPLES = [
    dict(domain=4, shape=[1, 2, 7], rolls=[([-9], [2])], splits=[(2, [1, 1, 2, 3])], seed=1),
    dict(domain=(2, 2), shape=[1, 2, 5, 6], rolls=[([("half", 2), ("minus", 3, 1)], [2, -1])],
         splits=[(3, [2, 4]), (2, [3, 2])], seed=2),
    # Session 67: empty slabs (a deep stage on many ranks), first and in the middle of the ring.
    dict(domain=3, shape=[1, 2, 5, 4], rolls=[([1, ("half", 3)], [2, 3])], splits=[(2, [2, 0, 3])], seed=3),
    dict(domain=4, shape=[2, 2, 6], rolls=[([-2], [2]), ([7], [-1])], splits=[(2, [0, 1, 0, 5])], seed=4),
]  # fmt: skip

test_fuzz_roll_fast, test_fuzz_roll_campaign = fuzz_tests(
    "roll fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_ROLL_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_ROLL_EXAMPLES", 300), every=50,
)
