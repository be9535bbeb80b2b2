"""Training example: Transolver on a synthetic car surface with data x domain parallelism.

The car is an analytic closed surface: a superellipsoid body (length 4.4, width 1.8, height
1.4) with a smooth cabin bump on top whose height and position vary per sample. The target is
a smooth pressure-like coefficient: the potential-flow value on a body facing a head-on flow,
``Cp = 1 - 2.25 (1 - (n . e_x)^2)``, plus a small height-dependent term. Inputs per point: the
position as embedding and the unit normal as functional input.

Parallelism: ``mesh = init_mesh(domain=P, data=D)``. Each data replica trains on its own car
(sample index = its data coordinate); inside a replica, every rank generates one chunk of the
car (as if it read part of a file), ``PointCloudPartition.repartition`` gives it a spatially
coherent part, and ``snn.parallelize`` converts the model (sharded Physics-Attention) and
wraps it in DDP (gradients summed over the domain, averaged over data). The per-step loss is
the mean over the D cars of each car's MSE: the same number the single-device model gets on the
batch of D cars, step for step (checked with ``--check``; tests/test_transolver.py checks it at a
small size in float64).

Run from the repository root::

    python bench/car_surface.py --points 1000000 --data 2 --domain 2 --steps 3 --check
    python bench/car_surface.py --quick          # 20k points, 2 x 2 ranks, with --check
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from sharded_nn.zoo.transolver import Transolver

import sharded_nn as snn
from sharded_nn.points import PointCloudPartition


def car_surface(n: int, sample: int = 0, *, start: int = 0, stop: int | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Points ``start:stop`` of the ``n``-point car ``sample``: ``(pos, normals, cp)``, each ``(m, 3|1)``.

    Points lie on a golden-angle spiral in the (u, v) parameter plane, so any range of indices
    can be generated on its own and the cloud is the same however it is chunked.
    """
    stop = n if stop is None else stop
    i = torch.arange(start, stop, dtype=torch.float64)
    v = torch.asin(2 * (i + 0.5) / n - 1)  # latitude in (-pi/2, pi/2), area-uniform on a sphere
    u = torch.remainder(i * math.pi * (3 - math.sqrt(5)), 2 * math.pi)  # golden angle
    g = torch.Generator().manual_seed(1000 + sample)
    cabin_h = 0.35 + 0.1 * torch.rand((), generator=g, dtype=torch.float64)
    cabin_x = 0.4 * torch.rand((), generator=g, dtype=torch.float64) - 0.2

    def surface(u, v):
        e = 0.4  # superellipsoid exponent: boxy but smooth
        cu, su, cv, sv = torch.cos(u), torch.sin(u), torch.cos(v), torch.sin(v)

        def spow(t):
            return torch.sign(t) * t.abs().pow(e)

        x = 2.2 * spow(cv) * spow(cu)
        y = 0.9 * spow(cv) * spow(su)
        z = 0.5 * spow(sv)
        top = torch.clamp(z, min=0.0) / 0.5
        z = z + cabin_h * top * torch.exp(-(((x - cabin_x) / 0.9) ** 2))
        return torch.stack([x, y, z + 0.7], -1)

    pos = surface(u, v)
    h = 1e-5  # normals from central differences of the parametrisation
    du = surface(u + h, v) - surface(u - h, v)
    dv = surface(u, torch.clamp(v + h, max=math.pi / 2)) - surface(u, torch.clamp(v - h, min=-math.pi / 2))
    nrm = torch.cross(du, dv, dim=-1)
    nrm = nrm / nrm.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    cp = 1 - 2.25 * (1 - nrm[:, :1] ** 2) + 0.2 * torch.tanh(pos[:, 2:] - 0.7)
    return pos.to(dtype), nrm.to(dtype), cp.to(dtype)


def build_model(hidden: int, layers: int, heads: int, slices: int, dtype: torch.dtype) -> Transolver:
    torch.manual_seed(0)
    return Transolver(functional_dim=3, out_dim=1, embedding_dim=3, n_layers=layers, n_hidden=hidden, n_head=heads,
                      slice_num=slices, mlp_ratio=2).to(dtype)  # fmt: skip


def train(mesh, *, points: int, samples: int, steps: int, hidden: int = 32, layers: int = 2, heads: int = 4,
          slices: int = 16, lr: float = 1e-3, dtype: torch.dtype = torch.float32) -> list[float]:  # fmt: skip
    """Losses of ``steps`` Adam steps; ``mesh=None``: one device, the batch of all ``samples`` cars.

    With a mesh, ``samples`` must equal its data size (one car per data replica).
    """
    model = build_model(hidden, layers, heads, slices, dtype)
    if mesh is None:
        cars = [car_surface(points, s, dtype=dtype) for s in range(samples)]
        pos, nrm, cp = (torch.stack(t) for t in zip(*cars))
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(nrm, embedding=pos), cp)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    data = snn.data_axis(mesh)
    data_size = mesh.size(mesh._get_mesh_dim_by_name(data)) if data else 1
    if samples != data_size:
        raise ValueError(f"train: one car per data replica: samples={samples} but the mesh has {data_size} replicas.")
    sample = mesh.get_local_rank(data) if data else 0
    ring = snn.comm.domain_peers(mesh)
    # This rank's chunk of its car, as a data loader reading one slice of a file would give it.
    chunk = snn.Layout.balanced(points, ring.size).slice(ring.index)
    pos_c, nrm_c, cp_c = car_surface(points, sample, start=chunk.start, stop=chunk.stop, dtype=dtype)
    part = PointCloudPartition(mesh)
    pos_l, nrm_l, cp_l = part.repartition(pos_c, nrm_c, cp_c)
    pos_l, nrm_l, cp_l = pos_l[None], nrm_l[None], cp_l[None]
    ddp = snn.parallelize(model, mesh)
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = snn.losses.mse_loss(ddp(nrm_l, embedding=pos_l), cp_l, mesh)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if data:  # the global loss: the mean of the replicas' per-car losses
            value = snn.comm.all_reduce_sum(value, mesh.get_group(data)) / data_size
        losses.append(value.item())
    return losses


def _worker(args) -> dict:
    mesh = snn.init_mesh(domain=args.domain, data=args.data)
    dtype = torch.float64 if args.float64 else torch.float32
    kw = dict(points=args.points, samples=args.data, steps=args.steps, hidden=args.hidden, layers=args.layers,
              heads=args.heads, slices=args.slices, dtype=dtype)  # fmt: skip
    dist.barrier()
    t0 = time.perf_counter()
    losses = train(mesh, **kw)
    t = time.perf_counter() - t0
    ref = train(None, **kw) if args.check and dist.get_rank() == 0 else None
    return {"losses": losses, "time": t, "ref": ref}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=int, default=1_000_000)
    p.add_argument("--data", type=int, default=2)
    p.add_argument("--domain", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--slices", type=int, default=32)
    p.add_argument("--float64", action="store_true")
    p.add_argument("--check", action="store_true", help="also train the single-device model and compare the losses")
    p.add_argument("--quick", action="store_true", help="20k points, 2 steps, hidden 32, with --check")
    args = p.parse_args()
    if args.quick:
        args.points, args.steps, args.hidden, args.check = 20_000, 2, 32, True
    r0 = snn.launch(_worker, args.data * args.domain, args, threads=1, device_type="cpu", timeout=7200)
    print(f"car surface: {args.points} points, data {args.data} x domain {args.domain}, {args.steps} steps, "
          f"{r0['time']:.1f} s")  # fmt: skip
    for s, loss in enumerate(r0["losses"]):
        line = f"  step {s}: loss {loss:.6e}"
        if r0["ref"] is not None:
            ref = r0["ref"][s]
            line += f"  single-device {ref:.6e}  rel. diff {abs(loss - ref) / abs(ref):.1e}"
        print(line)


if __name__ == "__main__":
    main()
