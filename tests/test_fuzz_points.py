"""Hypothesis fuzzing of the point-cloud tools: ``knn``, ``radius``, ``within_radius``,
``gather_neighbours`` and ``PointCloudPartition`` (partition, restore, ghosts).

``tests/test_points.py`` checks them on clouds of distinct random points; this file draws clouds
where ties are the rule: points on a small integer lattice of 1-3 dims (many equal distances,
exact duplicates) or random points, parts of random uneven sizes with empty ones, 0-6 queries per
rank, ``k`` up to every candidate, radii that fall exactly on lattice distances, and 1-4 ranks.
The references are brute force on all points in float64 with the documented order (by distance,
ties by global index): each rank's ``knn`` and ``radius`` results must equal them exactly,
``within_radius`` the exact set, ``gather_neighbours`` the indexed features and their
gradients; the partition must be balanced, keep every point once, restore the cloud's order
(forward and backward) and find exactly the ghosts brute force finds.

- ``test_fuzz_points_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_points_campaign`` (``pytest -m slow``): ``SNN_FUZZ_POINTS_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.points import PointCloudPartition, gather_neighbours, knn, radius, within_radius
from sharded_nn.points.partition import _assign_local, balanced_sizes

from .fuzzing import fuzz_tests, outcome
from .harness import mesh


def _cloud(cfg: dict, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if cfg["lattice"]:
        return torch.randint(0, cfg["lattice"], (n, cfg["dim"]), generator=g).double()
    return torch.rand(n, cfg["dim"], generator=g, dtype=torch.float64)


def _dist(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.cdist(q, p, compute_mode="donot_use_mm_for_euclid_dist")


def _canonical(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every candidate per query, by distance then global index (the documented order)."""
    idx = torch.arange(d.shape[1]).expand_as(d)
    o = torch.argsort(d, dim=1, stable=True)  # stable: equal distances keep index order
    return d.gather(1, o), idx.gather(1, o)


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    r = snn.domain_group(m).rank()
    sizes = cfg["sizes"]
    n = sum(sizes)
    pos = _cloud(cfg, n, cfg["seed"])
    start = sum(sizes[:r])
    pos_l = pos[start : start + sizes[r]]
    query = _cloud(cfg, cfg["queries"][r], cfg["seed"] + 10 + r)

    # knn and radius: exactly the brute-force canonical order.
    k = min(cfg["k"], n)
    d, i = knn(query, pos_l, k, mesh=m)
    full = _dist(query, pos)
    ref_d, ref_i = _canonical(full)
    assert torch.equal(i, ref_i[:, :k]), f"knn indices: {i} vs {ref_i[:, :k]}"
    torch.testing.assert_close(d, ref_d[:, :k], rtol=0, atol=0)
    rad, mx = cfg["radius"], min(cfg["max_nn"], n)
    dr, ir = radius(query, pos_l, rad, mesh=m, max_num_neighbors=cfg["max_nn"])
    far = ref_d[:, :mx] > rad
    assert torch.equal(ir, ref_i[:, :mx].masked_fill(far, -1)), "radius indices"
    assert torch.isinf(dr[ir < 0]).all() and torch.equal(dr[ir >= 0], ref_d[:, :mx][~far])
    near = within_radius(query, pos_l, rad, mesh=m)
    assert torch.equal(near, torch.nonzero((full <= rad).any(0)).squeeze(1)), "within_radius"

    # gather_neighbours: features at global indices (with -1 holes) and their gradients.
    x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(cfg["seed"] + 1), dtype=torch.float64)
    x_l = x[:, start : start + sizes[r]].clone().requires_grad_()
    got = gather_neighbours(x_l, ir, mesh=m)
    expect = x[:, ir.clamp(min=0)] * (ir >= 0).unsqueeze(-1)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(cfg["seed"] + 20 + r), dtype=torch.float64)
    (got * w).sum().backward()
    ref_grad = torch.zeros_like(x)
    ref_grad.index_add_(1, ir[ir >= 0], w[:, ir >= 0])
    dist.all_reduce(ref_grad, group=snn.domain_group(m))
    torch.testing.assert_close(x_l.grad, ref_grad[:, start : start + sizes[r]], rtol=1e-12, atol=1e-12)

    # PointCloudPartition of the whole cloud: balanced, every point once, restore, ghosts
    # (every part needs a point: fewer points than ranks is a documented error).
    if n < cfg["domain"]:
        return "ok"
    f = torch.randn(n, 2, generator=torch.Generator().manual_seed(cfg["seed"] + 2), dtype=torch.float64,
                    requires_grad=True)  # fmt: skip
    part = PointCloudPartition(m, method=cfg["method"])
    p_l, f_l = part(pos, f)
    counts = part.sizes
    assert sum(counts) == n and max(counts) - min(counts) <= 1, counts
    every = torch.zeros(n, dtype=torch.int64)
    every[part.index] = 1
    dist.all_reduce(every, group=snn.domain_group(m))
    assert torch.equal(every, torch.ones(n, dtype=torch.int64)), "each point in exactly one part"
    torch.testing.assert_close(p_l, pos[part.index], rtol=0, atol=0)
    y = part.restore(f_l * 2.0)
    torch.testing.assert_close(y, f.detach() * 2.0, rtol=0, atol=0)
    # Ghosts (collective: every rank calls): the k nearest follow the knn tie rule over the
    # partitioned order (parts concatenated by rank), so the reference ranks candidates so too.
    kk = min(cfg["k"], n)
    gh = part.ghosts(p_l, f_l, k=kk if cfg["ghost_knn"] else None, radius=None if cfg["ghost_knn"] else rad)
    assign = _assign_local(pos, balanced_sizes(n, cfg["domain"]), cfg["method"])
    order = torch.cat([torch.nonzero(assign == q).squeeze(1) for q in range(cfg["domain"])])
    mine = torch.zeros(n, dtype=torch.bool)
    mine[part.index] = True
    dm = _dist(pos[part.index], pos[order])
    nb = torch.zeros(n, dtype=torch.bool)
    if cfg["ghost_knn"]:
        nb[order[_canonical(dm)[1][:, :kk].flatten()]] = True
    else:
        nb[order[(dm <= rad).any(0)]] = True
    expect_idx = torch.nonzero(nb & ~mine).squeeze(1)
    assert torch.equal(torch.sort(gh.index).values, expect_idx), f"ghosts: {gh.index} vs {expect_idx}"
    torch.testing.assert_close(gh.fields[0], f.detach()[gh.index], rtol=0, atol=0)
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.integers(1, 4))
    sizes = [draw(st.integers(0, 12)) for _ in range(domain)]
    if sum(sizes) == 0:
        sizes[0] = 1
    lattice = draw(st.sampled_from([0, 2, 3, 4]))
    return dict(
        domain=domain, sizes=sizes, dim=draw(st.integers(1, 3)), lattice=lattice,
        queries=[draw(st.integers(0, 6)) for _ in range(domain)], k=draw(st.integers(1, 10)),
        radius=draw(st.sampled_from([0.0, 1.0, 2**0.5, 1.5, 2.0, 0.3])), max_nn=draw(st.integers(1, 8)),
        method=draw(st.sampled_from(["rcb", "morton"])), ghost_knn=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a lattice full of ties with an empty part, random points.
EXAMPLES = [
    dict(domain=3, sizes=[7, 0, 9], dim=2, lattice=3, queries=[4, 2, 0], k=6, radius=1.0, max_nn=5, method="rcb",
         ghost_knn=True, seed=1),
    dict(domain=4, sizes=[3, 5, 1, 6], dim=3, lattice=0, queries=[2, 2, 3, 1], k=10, radius=0.3, max_nn=8,
         method="morton", ghost_knn=False, seed=2),
]  # fmt: skip

test_fuzz_points_fast, test_fuzz_points_campaign = fuzz_tests(
    "points fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_POINTS_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_POINTS_EXAMPLES", 300), every=50,
)
