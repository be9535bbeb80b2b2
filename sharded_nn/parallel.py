"""``parallelize(model, mesh)``: convert, then reduce gradients with torch's DDP.

Parameters are replicated over the domain ranks and every rank's parameter gradient is a
partial sum (DESIGN.md section 3). The single-device gradient of one sample is the *sum* over
the domain ranks; over data-parallel replicas the usual *mean* applies. DDP's default hook
averages over all ranks, so we install a communication hook that divides by the data size only
and then sums over the whole mesh: DDP still buckets and overlaps the reduction with backward.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from .convert import convert
from .mesh import DATA_AXIS, axis_size, data_axis, group_over


@dataclass
class _HookState:
    group: dist.ProcessGroup
    scale: float


# No `from __future__ import annotations` here: DDP inspects the hook's annotations at runtime.
def _sum_domain_mean_data_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if state.scale != 1.0:
        buf.mul_(state.scale)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, Mapping[str, Any] | None] | None = None,
    strict: bool = False,
    **ddp_kwargs: Any,
) -> DDP:
    """Convert ``model`` for ``mesh`` and wrap it in DDP with the domain-sum / data-mean hook.

    After ``loss.backward()`` on every rank (with the per-rank losses of ``sharded_nn.losses``),
    every parameter's ``.grad`` equals the single-device gradient of the global batch's loss.

    Args:
        model: the single-device model (converted in place).
        mesh: a mesh with domain axes and optionally a ``"data"`` axis.
        plan, strict: passed to ``convert``.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``).
    """
    model = convert(model, mesh, plan=plan, strict=strict)
    if mesh.device_type == "cuda":
        ddp_kwargs.setdefault("device_ids", [torch.cuda.current_device()])
    ddp = DDP(model, process_group=group_over(mesh, mesh.mesh_dim_names), **ddp_kwargs)
    data = axis_size(mesh, DATA_AXIS) if data_axis(mesh) else 1
    ddp.register_comm_hook(_HookState(group_over(mesh, mesh.mesh_dim_names), 1.0 / data), _sum_domain_mean_data_hook)
    return ddp
