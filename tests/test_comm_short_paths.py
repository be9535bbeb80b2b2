"""Per-call cost of the comm wrappers: what they skip, and that skipping changes no value.

* a one-rank group makes no collective call (gloo still hands every call to a worker thread:
  about 0.16 ms for a 1-int all-reduce at P=1);
* without a graph to record (no grad required, or grad mode off) ``all_reduce_sum``,
  ``halo_cat`` and ``halo_exchange`` skip their autograd Functions, and return what the
  Functions return;
* with a graph, the result and its gradient are unchanged (float64, P = 1, 2 and 3).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import sharded_nn as snn
from sharded_nn.comm import HaloSpec, all_reduce_max, all_reduce_sum, axis_peers, halo_cat
from sharded_nn.comm.halo import halo_exchange
from sharded_nn.comm.collectives import all_gather_stacked
from sharded_nn.comm.traffic import count_traffic

from .harness import mesh

D = torch.float64


def _one_rank_is_silent():
    m = mesh(1)
    group = snn.domain_group(m)
    x = torch.arange(6, dtype=D).reshape(2, 3)
    with count_traffic() as t:
        a = all_reduce_sum(x, group)
        b = all_reduce_max(x, group)
        c = all_gather_stacked(x, group)
    assert torch.equal(a, x) and torch.equal(b, x) and torch.equal(c, x.unsqueeze(0))
    assert a.data_ptr() != x.data_ptr() and c.data_ptr() != x.data_ptr()  # fresh tensors, as before
    return dict(t.calls)


def test_one_rank_group_makes_no_collective(run):
    (calls,) = run(1, _one_rank_is_silent)
    assert calls == {}, calls


def _same_with_and_without_graph(domain: int):
    m = mesh(domain)
    group = snn.domain_group(m)
    ring = axis_peers(m, "domain")
    r = ring.index
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r), dtype=D)
    with torch.no_grad():
        plain = all_reduce_sum(x.requires_grad_(), group)
    assert plain.grad_fn is None and not plain.requires_grad
    xg = x.detach().clone().requires_grad_()
    tracked = all_reduce_sum(xg, group)
    assert tracked.grad_fn is not None
    torch.testing.assert_close(plain, tracked, atol=0, rtol=0)
    tracked.sum().backward()
    # Sum over ranks of the per-rank loss sum(y): each rank's x gets the summed ones.
    torch.testing.assert_close(xg.grad, torch.full_like(x, float(domain)), atol=0, rtol=0)

    sizes = (3, 1, 2)[:domain]
    spec = HaloSpec(0, (0,) + (1,) * (domain - 1), (1,) * (domain - 1) + (0,))
    s = torch.randn(sizes[r], 2, generator=torch.Generator().manual_seed(10 + r), dtype=D)
    with torch.no_grad():
        h0 = halo_cat(s.requires_grad_(), spec, ring)
    h1 = halo_cat(s.detach(), spec, ring)  # no grad required
    sg = s.detach().clone().requires_grad_()
    h2 = halo_cat(sg, spec, ring)
    assert h0.grad_fn is None and h1.grad_fn is None and h2.grad_fn is not None
    torch.testing.assert_close(h0, h2, atol=0, rtol=0)
    torch.testing.assert_close(h1, h2, atol=0, rtol=0)
    full = torch.cat([torch.randn(n, 2, generator=torch.Generator().manual_seed(10 + k), dtype=D)
                      for k, n in enumerate(sizes)])
    start = sum(sizes[:r])
    lo, hi = max(start - spec.left[r], 0), start + sizes[r] + spec.right[r]
    torch.testing.assert_close(h2, full[lo:hi], atol=0, rtol=0)
    h2.sum().backward()
    # Each position's gradient counts the extended slabs that hold it (own slab + neighbours' halos).
    counts = torch.zeros(sum(sizes), 2, dtype=D)
    for k, n in enumerate(sizes):
        a = sum(sizes[:k])
        counts[max(a - spec.left[k], 0): a + n + spec.right[k]] += 1
    torch.testing.assert_close(sg.grad, counts[start: start + sizes[r]], atol=0, rtol=0)
    dist.barrier()
    return True


@pytest.mark.parametrize("domain", [2, 3])
def test_no_graph_paths_match_the_function(run, domain):
    assert run(domain, _same_with_and_without_graph, domain) == [True] * domain


def _exchange_with_and_without_graph(domain: int):
    m = mesh(domain)
    ring = axis_peers(m, "domain")
    r = ring.index
    sizes = (3, 2, 4)[:domain]
    spec = HaloSpec(0, (0,) + (2,) * (domain - 1), (1,) * (domain - 1) + (0,))
    s = torch.randn(sizes[r], 2, generator=torch.Generator().manual_seed(20 + r), dtype=D)
    with torch.no_grad():
        plain = halo_exchange(s.requires_grad_(), spec, ring)
    assert plain.x is s  # no alias Function: the slab itself
    plain_halos = plain.wait()
    free = halo_exchange(s.detach(), spec, ring)  # grad mode on, nothing requires grad
    free_halos = free.wait()
    sg = s.detach().clone().requires_grad_()
    tracked = halo_exchange(sg, spec, ring)
    assert tracked.x is not sg and tracked.x.grad_fn is not None
    x_alias = tracked.x
    tracked_halos = tracked.wait()
    for a, b, c in zip(plain_halos, free_halos, tracked_halos):
        assert (a is None) == (b is None) == (c is None)
        if a is not None:
            assert not a.requires_grad and not b.requires_grad and c.requires_grad
            torch.testing.assert_close(a, c.detach(), atol=0, rtol=0)
            torch.testing.assert_close(b, c.detach(), atol=0, rtol=0)
    # The tracked exchange still returns its halo gradients to their owners.
    loss = x_alias.sum() + sum(h.sum() for h in tracked_halos if h is not None)
    loss.backward()
    counts = torch.ones(sizes[r], 2, dtype=D)
    if r > 0:  # this rank's first rows are the left neighbour's right halo (1 row)
        counts[:1] += 1
    if r < domain - 1:  # its last rows are the right neighbour's left halo (2 rows)
        counts[-2:] += 1
    torch.testing.assert_close(sg.grad, counts, atol=0, rtol=0)
    dist.barrier()
    return True


@pytest.mark.parametrize("domain", [2, 3])
def test_halo_exchange_without_graph_skips_its_functions(run, domain):
    assert run(domain, _exchange_with_and_without_graph, domain) == [True] * domain
