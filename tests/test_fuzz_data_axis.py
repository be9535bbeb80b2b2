"""Hypothesis fuzzing of the norms on a ("data", "domain") mesh: the global batch's statistics.

A mesh with a data axis splits the global batch over data replicas (``snn.batch_slice``) and
each sample's grid over the domain ranks. ``ShardedBatchNorm*d`` takes its statistics over both
(the global batch, as one device would on the whole batch), and running statistics must come
out identical on every rank; per-sample norms (group, instance, layer over the sample) must not
mix replicas. This file draws: the norm (batch norm in training or eval, with or without
running statistics, any momentum, affine or not; group norm; instance norm with and without
running statistics; layer norm over the channels and the grid), 1-3 spatial dims, 2 data
replicas of 1-2 samples each, 1-2 domain ranks sharding the first spatial dim in uneven slabs
(float64). The output, the input gradient, every parameter gradient (summed over all ranks: the
library's convention) and the buffers must equal the torch layer's on the whole global batch.
A ``ShardingError`` raised alike on every rank is a refusal, counted apart; any mismatch fails.

- ``test_fuzz_data_axis_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_data_axis_campaign`` (``pytest -m slow``): ``SNN_FUZZ_DATA_AXIS_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .fuzzing import fuzz_tests, randomize_norm_state_
from .harness import mesh, world_of
from .test_fuzz_fft_modes import _split

C = 4


def _layer(cfg: dict) -> nn.Module:
    nsp, kind = len(cfg["spatial"]), cfg["kind"]
    if kind == "batch":
        return getattr(nn, f"BatchNorm{nsp}d")(C, momentum=cfg["momentum"], affine=cfg["affine"],
                                               track_running_stats=cfg["track"])  # fmt: skip
    if kind == "instance":
        return getattr(nn, f"InstanceNorm{nsp}d")(C, affine=cfg["affine"], track_running_stats=cfg["track"])
    if kind == "group":
        return nn.GroupNorm(2, C, affine=cfg["affine"])
    return nn.LayerNorm([C, *cfg["spatial"]], elementwise_affine=cfg["affine"])


def _case(cfg: dict):
    m = mesh(cfg["domain"], data=2)
    r = m.get_local_rank("domain")
    torch.manual_seed(cfg["seed"])
    ref = randomize_norm_state_(_layer(cfg).double())
    if cfg["eval"]:
        ref.eval()
    batch = 2 * cfg["per_replica"]
    x = torch.randn(batch, C, *cfg["spatial"], dtype=torch.float64, requires_grad=True)
    model = snn.convert(copy.deepcopy(ref), m)  # before the reference's forward: the same starting buffers
    try:
        y_ref = ref(x)
    except (RuntimeError, ValueError) as e:  # torch's own rules (one value per channel in training)
        return ("invalid", str(e)[:100])
    g = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(cfg["seed"] + 1))
    (y_ref * g).sum().backward()
    sizes = cfg["sizes"]
    bs = snn.batch_slice(m, batch)

    def block(t):
        return t[bs].narrow(2, sum(sizes[:r]), sizes[r])

    x_l = block(x.detach()).clone().requires_grad_()
    try:
        y = model(x_l)
    except ShardingError as e:
        return ("refused", str(e)[:120])
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-10, rtol=1e-10, msg=lambda s: f"output: {s}")
    (y * block(g)).sum().backward()
    torch.testing.assert_close(x_l.grad, block(x.grad), atol=1e-10, rtol=1e-10, msg=lambda s: f"input grad: {s}")
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # every rank's part: domain slabs and data replicas
        torch.testing.assert_close(grad, p_ref.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    for (name, b), b_ref in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, b_ref, atol=1e-12, rtol=1e-12, msg=lambda s, n=name: f"buffer {n}: {s}")
    return "ok"


def _run(pools, cfg, timeout: float = 300.0):
    results = pools.run(world_of(cfg["domain"], 2), _case, cfg, timeout=timeout)
    assert all(x == results[0] for x in results), f"ranks ended differently on {cfg}: {results}"
    return results[0]


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2]))
    nsp = draw(st.integers(1, 3))
    n0 = draw(st.integers(domain, 7))
    spatial = [n0] + [draw(st.integers(1, 4)) for _ in range(nsp - 1)]
    return dict(
        domain=domain, kind=draw(st.sampled_from(["batch", "batch", "instance", "group", "layer"])),
        spatial=spatial, per_replica=draw(st.integers(1, 2)), eval=draw(st.booleans()),
        momentum=draw(st.sampled_from([0.1, 0.5, None])), affine=draw(st.booleans()), track=draw(st.booleans()),
        sizes=[s for s in _split(draw, n0, domain)] if domain > 1 else [n0], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


# Cases the fast run always includes: a training batch norm over 2 replicas of 1 sample and 2
# domain ranks of uneven slabs (cumulative running statistics); a layer norm over the grid; the
# two below.
EXAMPLES = [
    dict(domain=2, kind="batch", spatial=[5, 3], per_replica=1, eval=False, momentum=None, affine=True, track=True,
         sizes=[2, 3], seed=1),
    dict(domain=2, kind="layer", spatial=[4], per_replica=2, eval=False, momentum=0.1, affine=True, track=False,
         sizes=[3, 1], seed=2),
    # Session 59: instance norm's running statistics over the global batch (each data replica
    # kept its own before), on a domain of one rank (torch's layer there before) and of two.
    dict(domain=1, kind="instance", spatial=[3, 2], per_replica=2, eval=False, momentum=0.1, affine=False, track=True,
         sizes=[3], seed=3),
    dict(domain=2, kind="instance", spatial=[5], per_replica=1, eval=False, momentum=0.5, affine=True, track=True,
         sizes=[2, 3], seed=4),
]  # fmt: skip

test_fuzz_data_axis_fast, test_fuzz_data_axis_campaign = fuzz_tests(
    "data axis fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_DATA_AXIS_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_DATA_AXIS_EXAMPLES", 300), every=50,
)
