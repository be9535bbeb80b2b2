"""``parallelize(model, mesh)``: convert, then reduce gradients with torch's DDP or FSDP2.

Parameters are replicated over the domain ranks and every rank's parameter gradient is a
partial sum (DESIGN.md section 3). The single-device gradient of one sample is the *sum* over
the domain ranks; over data-parallel replicas the usual *mean* applies. Both engines average
over all their ranks by default, so:

- DDP (``mode="ddp"``): a communication hook divides by the data size only and then sums over
  the whole mesh; DDP still buckets and overlaps the reduction with backward.
- FSDP2 (``mode="fsdp"``): ``fully_shard`` on the data x domain mesh, with every FSDP module's
  gradient divide factor set to the data size (``set_gradient_divide_factor``): its reduction
  then sums over all ranks and divides by the data size only. No loss scaling is needed.
"""

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from .convert import convert
from .mesh import DATA_AXIS, axis_size, data_axis, domain_axes, group_over
from .weights import sync_weights


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


def _data_size(mesh: DeviceMesh) -> int:
    return axis_size(mesh, DATA_AXIS) if data_axis(mesh) else 1


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, Mapping[str, Any] | None] | None = None,
    dims: int | Sequence[int] | None = None,
    strict: bool = False,
    mode: str = "ddp",
    fsdp_modules: Sequence[str] = (),
    input_dims: Mapping[str | int, int | Sequence[int] | None] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Convert ``model`` for ``mesh`` and reduce its gradients like one device would.

    After ``loss.backward()`` on every rank (with the per-rank losses of ``sharded_nn.losses``,
    or a loss passed through ``losses.share``), every parameter's ``.grad`` (its full tensor
    under FSDP2) equals the single-device gradient of the global batch's loss.

    Args:
        model: the single-device model (converted in place).
        mesh: a mesh with domain axes and optionally a ``"data"`` axis.
        plan, dims, strict, input_dims: passed to ``convert`` (a model converted before with
            ``input_dims`` keeps them).
        mode: ``"ddp"``: wrap in ``DistributedDataParallel`` with the domain-sum / data-mean
            hook. ``"fsdp"``: apply FSDP2's ``fully_shard`` (HSDP on a data x domain mesh:
            parameters replicated over ``"data"``, sharded over ``"domain"``; a mesh with
            several domain axes shards them over all its ranks) and set the gradient divide
            factor (``set_gradient_divide_factor``).
        fsdp_modules: with ``mode="fsdp"``, globs of submodule names (``named_modules``) that
            get their own ``fully_shard`` before the root (e.g. ``("blocks.*",)``), so that
            their parameters are gathered and their gradients reduced one block at a time.
        **kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``) or to every
            ``fully_shard`` call (e.g. ``mp_policy``, ``reshard_after_forward``).

    Returns:
        The DDP wrapper, or the model itself (now an ``FSDPModule``) with ``mode="fsdp"``.
    """
    if mode not in ("ddp", "fsdp"):
        raise ValueError(f"parallelize: mode must be 'ddp' or 'fsdp', got {mode!r}.")
    if fsdp_modules and mode != "fsdp":
        raise ValueError(f"parallelize: fsdp_modules={tuple(fsdp_modules)!r} needs mode='fsdp', got mode={mode!r}.")
    model = convert(model, mesh, plan=plan, dims=dims, strict=strict, input_dims=input_dims)
    check_model_mesh(model, mesh, "parallelize")
    if mode == "fsdp":
        # FSDP2 keeps each rank's own values (DDP broadcasts the first rank's at construction):
        # copy them first, or every shard and data replica would start from other weights.
        sync_weights(model, mesh)
        return _fully_shard(model, mesh, fsdp_modules, kwargs)
    if mesh.device_type == "cuda":
        kwargs.setdefault("device_ids", [torch.cuda.current_device()])
    group = group_over(mesh, mesh.mesh_dim_names)
    ddp = DDP(model, process_group=group, **kwargs)
    ddp.register_comm_hook(_HookState(group, 1.0 / _data_size(mesh)), _sum_domain_mean_data_hook)
    return ddp


def check_model_mesh(model: nn.Module, mesh: DeviceMesh, what: str = "check_model_mesh") -> None:
    """Raise if a sharded layer of ``model`` was converted for another mesh than ``mesh``.

    ``convert`` leaves layers that are already sharded as they are, so a model converted for one
    mesh and then used with another keeps exchanging halos over the first mesh's groups: with a
    ``"data"`` axis added or the domain reshaped, the result is silently wrong. Meshes compare as
    torch's ``DeviceMesh`` does (device type, rank layout and axis names), facts every rank
    shares, so every rank raises alike.
    """
    other = [
        (f"{name or '<root>'} ({type(m).__name__})", m.mesh)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "mesh", None), DeviceMesh) and m.mesh != mesh
    ]
    if other:
        shown = ", ".join(label for label, _ in other[:4])
        theirs = other[0][1]
        raise ValueError(
            f"{what}: {len(other)} layer(s) were converted for another mesh (axes {theirs.mesh_dim_names}, "
            f"shape {tuple(theirs.shape)}) than the one given (axes {mesh.mesh_dim_names}, shape "
            f"{tuple(mesh.shape)}): {shown}{', ...' if len(other) > 4 else ''}. Convert the single-device model "
            "once, with the mesh you train on (keep an unconverted copy, or reload its state_dict into a fresh "
            "model: the keys are the same)."
        )


def _fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh for ``fully_shard``: (data, domain) for HSDP, else all ranks flattened to 1-D."""
    names = tuple(mesh.mesh_dim_names)
    axes = domain_axes(mesh)
    if len(axes) == 1 and names in ((axes[0],), (DATA_AXIS, axes[0])):
        return mesh  # 1-D: FSDP over the domain; 2-D: HSDP, replicate over dim 0, shard over dim 1
    # Several domain axes: FSDP2 takes one shard dim, so shard over every rank of the mesh. The
    # divide factor is the same: the sum over all ranks, divided by the data size.
    return mesh._flatten("_".join(names) + "_flat")  # the name mesh.group_over gives it too


def _fully_shard(model: nn.Module, mesh: DeviceMesh, fsdp_modules: Sequence[str], kwargs: dict) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fsdp_mesh = _fsdp_mesh(mesh)
    units = [m for name, m in model.named_modules() if name and any(fnmatch.fnmatchcase(name, g) for g in fsdp_modules)]
    missing = [g for g in fsdp_modules if not any(fnmatch.fnmatchcase(n, g) for n, _ in model.named_modules() if n)]
    if missing:
        raise ValueError(
            f"parallelize: fsdp_modules globs {missing} match no submodule; names look like "
            f"{[n for n, _ in model.named_modules() if n][:6]}."
        )
    # Innermost first: a parent's fully_shard must not take over its children's parameters.
    for m in reversed(units):
        fully_shard(m, mesh=fsdp_mesh, **kwargs)
    fully_shard(model, mesh=fsdp_mesh, **kwargs)
    set_gradient_divide_factor(model, mesh)
    return model


def set_gradient_divide_factor(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make FSDP2's gradient reduction give the single-device gradient under the convention.

    Call it after your own ``fully_shard`` calls (``parallelize(mode="fsdp")`` does it for
    you). It sets, on every ``FSDPModule`` in ``model``, the divide factor to the data size:
    FSDP2 then sums the gradients over all ranks (the domain ranks' partial sums add up to the
    sample's gradient) and divides by the number of data replicas (the batch mean). On backends
    without averaging reductions (gloo) the reduction is forced to plain sums.
    """
    from torch.distributed.fsdp import FSDPModule

    factor = float(_data_size(mesh))
    sum_only = dist.get_backend(group_over(mesh, mesh.mesh_dim_names)) != "nccl"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(factor)
            if sum_only:
                m.set_force_sum_reduction_for_comms(True)
