"""``comm.traffic.count_traffic``: the bytes each rank sends, by kind, equal what the algorithm moves."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.comm.traffic import count_traffic

from .harness import mesh


def _conv_traffic(k: int, h: int, w: int, channels: int):
    m = mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = snn.convert(nn.Sequential(nn.Conv2d(channels, channels, k, padding=k // 2)), m)
    shape = (1, channels, h, w)
    x = torch.randn(shape)[snn.local_slices(shape, m, dims=(2,))].clone().requires_grad_()
    model(x).sum().backward()  # warm-up
    with count_traffic() as t:
        model(x).sum().backward()
    assert dist.batch_isend_irecv.__name__ == "batch_isend_irecv"  # restored after the block
    return dict(t.sent)


@pytest.mark.parametrize("world", [2, 3])
def test_conv_halo_bytes_are_the_halo(run, world):
    k, h, w, c = 5, 23, 6, 3
    res = run(world, _conv_traffic, k, h, w, c)
    row = (k // 2) * c * w * 4  # halo rows of one side, float32
    for rank, sent in enumerate(res):
        neighbours = (rank > 0) + (rank < world - 1)
        # Forward: the halo rows to each neighbour; backward: their gradients back.
        assert sent["halo"] == 2 * neighbours * row
        assert set(sent) <= {"halo", "metadata"}


def _ring_traffic(length: int):
    m = mesh(dist.get_world_size())
    p = dist.get_world_size()
    local = len(range(length)[snn.local_slices((length,), m, dims=(0,))[0]])
    assert local == ([9, 8] if p == 2 else [6, 6, 5])[dist.get_rank()]  # the sizes the test assumes
    q = torch.randn(1, 2, local, 8)
    snn.functional.ring_attention(q, q, q, m)
    with count_traffic() as t:
        snn.functional.ring_attention(q, q, q, m)
    return dict(t.sent)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_forward_moves_each_kv_block_p_minus_1_hops(run, world):
    length = 17
    sizes = [9, 8] if world == 2 else [6, 6, 5]  # local_slices of 17 tokens (checked on the ranks)
    for rank, sent in enumerate(run(world, _ring_traffic, length)):
        # Hop h forwards the block that started h ranks to the left: its K and V, float32.
        forwarded = sum(sizes[(rank - h) % world] for h in range(world - 1))
        assert sent["ring"] == forwarded * 2 * (2 * 8 * 4)


def _reduction_traffic():
    m = mesh(dist.get_world_size())
    x = torch.randn(4, 3)
    with count_traffic() as t:
        snn.comm.all_reduce_sum(x, snn.domain_group(m))
    return dict(t.sent), dict(t.calls)


def test_reduction_counts_payload_once(run):
    for sent, calls in run(2, _reduction_traffic):
        assert sent == {"reduction": 4 * 3 * 4} and calls == {"reduction": 1}


def _ring_backward_traffic(length: int, heads: int):
    m = mesh(dist.get_world_size())
    local = len(range(length)[snn.local_slices((length,), m, dims=(0,))[0]])
    q, k, v = (torch.randn(1, heads, local, 8, requires_grad=True) for _ in range(3))
    snn.functional.ring_attention(q, k, v, m).sum().backward()  # warm-up
    with count_traffic() as t:
        snn.functional.ring_attention(q, k, v, m).sum().backward()
    return dict(t.sent)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_backward_moves_the_minimum(run, world):
    # The minimum: every K/V block visits the P-1 other ranks in forward and again in backward,
    # and each rank's dK/dV shares reach the owner in P-1 hops in all (the owner keeps its own).
    length, heads = 17, 2
    sizes = [9, 8] if world == 2 else [6, 6, 5]
    block = 2 * heads * 8 * 4  # K and V (or dK and dV) of one token, float32
    for rank, sent in enumerate(run(world, _ring_backward_traffic, length, heads)):
        kv = sum(sizes[(rank - h) % world] for h in range(world - 1))  # forward hops 0..P-2
        dkv = sum(sizes[(rank - s) % world] for s in range(1, world))  # accumulators of blocks me-1..me-(P-1)
        assert sent["ring"] == (2 * kv + dkv) * block
