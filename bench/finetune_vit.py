"""Fine-tune a pretrained timm ViT at high resolution with data x domain parallelism.

A checkpoint saved at 224^2 (a local file: ``--checkpoint``, or one this script writes from a
seeded timm model) is loaded at ``--img-size`` (default 1024^2) through
``sharded_nn.zoo.create_model``, which resamples the position embedding with timm's own filter.
The model is wrapped with ``snn.parallelize`` on a ``data x domain`` mesh: each data replica
holds its own samples, and each image is split over the domain ranks in patch-aligned slabs of
rows. A few SGD steps on synthetic data (seeded, the same for every layout) run, and the loss of
every step is compared with single-device training of the plain timm model on the whole batch.

Gradient bookkeeping (DESIGN.md section 3): the logits are replicated over the domain ranks, so
each rank back-propagates its share ``snn.losses.share(loss, mesh)``; ``parallelize``'s DDP hook
sums gradients over the domain axis and averages them over the data axis, which gives the
gradient of the mean loss over the global batch, as on one device.

Drop-path and dropout stay at timm's defaults (off) here: with them on, the sharded model draws
its masks from its own streams (see ``sharded_nn.zoo.vit``), so its loss would follow the same
distribution but not the same numbers as a single-device run.

    python bench/finetune_vit.py                            # 1024^2, data=1 x domain=2 (minutes)
    python bench/finetune_vit.py --img-size 128 --data 2 --domain 2 --steps 3   # quick
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sharded_nn as snn  # noqa: E402
from sharded_nn import zoo  # noqa: E402

NUM_CLASSES = 10


def write_checkpoint(path: str, name: str, model_kwargs: dict, seed: int = 0) -> str:
    """A stand-in "pretrained" checkpoint: a seeded timm model at 224^2, saved as safetensors."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    m = timm.create_model(name, img_size=224, **model_kwargs)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, path)
    return path


def batch(step: int, index: int, per_replica: int, img_size: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``index * per_replica ...`` of step ``step``: the same numbers for every layout."""
    xs, ys = [], []
    for i in range(index * per_replica, (index + 1) * per_replica):
        g = torch.Generator().manual_seed(10_000 * step + i)
        xs.append(torch.randn(1, 3, img_size, img_size, generator=g, dtype=dtype))
        ys.append(torch.randint(NUM_CLASSES, (1,), generator=g))
    return torch.cat(xs), torch.cat(ys)


def _build(name, img_size, checkpoint, model_kwargs, dtype, mesh=None):
    torch.manual_seed(1)  # the new classifier head: the same initial values everywhere
    model = zoo.create_model(
        name, mesh=None, img_size=img_size, pretrained_file=checkpoint, num_classes=NUM_CLASSES, **model_kwargs
    )
    return model.to(dtype)


def finetune_sharded(
    name: str,
    img_size: int,
    checkpoint: str,
    steps: int,
    per_replica: int,
    data: int,
    domain: int,
    model_kwargs: dict,
    lr: float = 0.01,
    dtype: torch.dtype = torch.float32,
    mesh=None,
) -> list[float]:
    """Per-step global losses of data x domain fine-tuning (call on every rank; ``mesh`` default:
    ``init_mesh(domain=domain, data=data)``)."""
    if mesh is None:
        mesh = snn.init_mesh(domain=domain, data=data, device_type="cpu")
    model = _build(name, img_size, checkpoint, model_kwargs, dtype)
    patch = model.patch_embed.patch_size[0]
    ddp = snn.parallelize(model, mesh)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    replica = mesh.get_local_rank("data") if data > 1 else 0
    losses = []
    for step in range(steps):
        x, y = batch(step, replica, per_replica, img_size, dtype)
        x_local = x[snn.local_slices(x.shape, mesh, dims=(2,), align=patch)]
        logits = ddp(x_local)  # replicated over the domain ranks
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        snn.losses.share(loss, mesh).backward()
        opt.step()
        # Log the global batch's loss: the mean of the replicas' losses.
        value = loss.detach().clone()
        if data > 1:
            dist.all_reduce(value, group=mesh.get_group("data"))
            value /= data
        losses.append(value.item())
    return losses


def finetune_single(
    name: str,
    img_size: int,
    checkpoint: str,
    steps: int,
    per_replica: int,
    data: int,
    model_kwargs: dict,
    lr: float = 0.01,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """The same steps on one device with the plain timm model and the whole global batch."""
    model = _build(name, img_size, checkpoint, model_kwargs, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        parts = [batch(step, r, per_replica, img_size, dtype) for r in range(data)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_tiny_patch16_224")
    parser.add_argument("--img-size", type=int, default=1024)
    parser.add_argument("--checkpoint", default=None, help="local pretrained file (default: write a seeded one)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-replica", type=int, default=1, help="samples per data replica per step")
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--depth", type=int, default=None, help="override the depth (e.g. 2 for a smoke run)")
    args = parser.parse_args()
    kwargs = {} if args.depth is None else {"depth": args.depth}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or write_checkpoint(os.path.join(tmp, "pretrained_224.safetensors"), args.model, kwargs)
        world = args.data * args.domain
        sharded = snn.launch(
            finetune_sharded, world, args.model, args.img_size, ckpt, args.steps, args.per_replica, args.data,
            args.domain, kwargs, threads=1, device_type="cpu", timeout=7200,
        )
        single = finetune_single(args.model, args.img_size, ckpt, args.steps, args.per_replica, args.data, kwargs)
    print(f"{args.model} fine-tuned at {args.img_size}^2, data={args.data} x domain={args.domain}, float32, SGD")
    print("| step | single device | sharded | abs diff |")
    print("| --- | --- | --- | --- |")
    for i, (a, b) in enumerate(zip(single, sharded)):
        print(f"| {i} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} |")


if __name__ == "__main__":
    main()
