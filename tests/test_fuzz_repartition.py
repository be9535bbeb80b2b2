"""Hypothesis fuzzing of ``PointCloudPartition.repartition``: parts built from per-rank chunks.

``repartition`` finds the parts of a cloud whose chunks are spread over the ranks (each rank read
part of a file) by a distributed bisection, and must give exactly the parts ``part(full_cloud)``
makes on one rank's copy of the whole cloud. ``tests/test_points.py`` checks distinct random
points; this file draws clouds where ties are the rule: points on a small integer lattice of
1-3 dims (equal coordinates, exact duplicates) or random, 1-60 points in chunks of random sizes
(empty ones included), both partition methods, 1-4 ranks, a batch of fields or none. This rank's
part (positions, fields, ``part.index``) must equal ``part(full)``'s, the gradients must travel
back to the chunks, ``to_chunks`` must give back the chunk layout and ``restore`` the whole cloud.
Any mismatch fails.

- ``test_fuzz_repartition_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_repartition_campaign`` (``pytest -m slow``): ``SNN_FUZZ_REPARTITION_EXAMPLES``
  examples (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from sharded_nn.points import PointCloudPartition

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .test_fuzz_fft_modes import _split


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    r = m.get_local_rank("domain")
    chunks = cfg["chunks"]
    n = sum(chunks)
    g = torch.Generator().manual_seed(cfg["seed"])
    if cfg["lattice"]:
        pos = torch.randint(0, cfg["lattice"], (n, cfg["dim"]), generator=g).double()
    else:
        pos = torch.rand(n, cfg["dim"], generator=g, dtype=torch.float64)
    f = torch.randn(*([2] if cfg["batch"] else []), n, 3, generator=g, dtype=torch.float64)
    c0 = sum(chunks[:r])
    pos_c = pos[c0 : c0 + chunks[r]].clone()
    f_c = f[..., c0 : c0 + chunks[r], :].clone().requires_grad_()

    part = PointCloudPartition(m, method=cfg["method"])
    pos_l, f_l = part.repartition(pos_c, f_c)
    ref = PointCloudPartition(m, method=cfg["method"])
    ref_pos_l, ref_f_l = ref(pos, f)
    assert torch.equal(part.index, ref.index), f"index {part.index.tolist()} against {ref.index.tolist()}"
    assert torch.equal(pos_l, ref_pos_l) and torch.equal(f_l, ref_f_l), "positions or fields differ"
    w = torch.randn(f.shape, generator=g, dtype=torch.float64)
    (f_l * w[..., part.index, :]).sum().backward()
    assert torch.equal(f_c.grad, w[..., c0 : c0 + chunks[r], :]), "the gradient did not reach its chunk rows"
    y_l = f_l.detach() * 2.0
    assert torch.equal(part.to_chunks(y_l), f[..., c0 : c0 + chunks[r], :] * 2.0), "to_chunks"
    assert torch.equal(part.restore(y_l), f * 2.0), "restore"
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4]))
    n = draw(st.integers(domain, 60))
    return dict(
        domain=domain, chunks=_split(draw, n, domain), dim=draw(st.integers(1, 3)),
        lattice=draw(st.sampled_from([0, 2, 3, 4])), method=draw(st.sampled_from(["rcb", "morton"])),
        batch=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a 2-point lattice full of duplicates in uneven chunks with
# an empty one at 3 ranks (both methods).
EXAMPLES = [
    dict(domain=3, chunks=[9, 0, 14], dim=2, lattice=2, method="rcb", batch=True, seed=1),
    dict(domain=4, chunks=[1, 12, 0, 6], dim=3, lattice=2, method="morton", batch=False, seed=2),
]  # fmt: skip

test_fuzz_repartition_fast, test_fuzz_repartition_campaign = fuzz_tests(
    "repartition fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_REPARTITION_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_REPARTITION_EXAMPLES", 300), every=50,
)
