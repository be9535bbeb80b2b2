"""Training on a data x domain mesh equals single-device training on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh, world_of


class Net(nn.Module):
    """Conv, BatchNorm, ReLU, Conv, GroupNorm, global average pool, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before a norm has a zero gradient,
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=False)  # which Adam turns into noise
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 2)
        self.mesh = None  # set on the sharded copy: the global pool then reduces over the slabs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gn(self.conv2(F.relu(self.bn(self.conv1(x)))))
        pooled = x.mean((2, 3)) if self.mesh is None else snn.reductions.mean(x, self.mesh, (2, 3))
        return self.fc(pooled)


def _train(domain, data, optimizer, steps, dims):
    m = mesh(domain, data)
    d = m.get_local_rank("data") if data > 1 else 0
    torch.manual_seed(0)
    ref = Net().double()
    model = copy.deepcopy(ref)
    model.mesh = m
    ddp = snn.parallelize(model, m, dims=dims)
    opt_ref = optimizer(ref.parameters())
    opt = optimizer(ddp.parameters())
    n_local = 2
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(n_local * data, 3, 12, 10, dtype=torch.float64, generator=gen)
        target = torch.randn(n_local * data, 2, dtype=torch.float64, generator=gen)
        opt_ref.zero_grad()
        F.mse_loss(ref(x), target).backward()

        batch = slice(d * n_local, (d + 1) * n_local)
        opt.zero_grad()
        out = ddp(snn.shard(x[batch], m, dims=dims, align=2))
        # The logits are replicated over the domain ranks: each contributes 1/P (share); the
        # DDP hook sums over the domain and averages over the data replicas.
        snn.losses.share(F.mse_loss(out, target[batch]), m).backward()
        for (name, p_ref), p in zip(ref.named_parameters(), ddp.module.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
        opt_ref.step()
        opt.step()
    for (name, a), b in zip(ref.state_dict().items(), ddp.module.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n} after {steps} steps: {s}")
    return True


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.parametrize(
    "domain,data,optimizer,dims",
    [
        (2, 2, sgd, (2,)),
        (2, 2, adam, (2,)),
        (3, 1, adam, (2,)),
        ((2, 2), 1, sgd, (2, 3)),
    ],
    ids=["data2xdomain2-sgd", "data2xdomain2-adam", "domain3-adam", "domain2x2-sgd"],
)
def test_parallelize_matches_single_device_training(run, domain, data, optimizer, dims):
    assert all(run(world_of(domain, data), _train, domain, data, optimizer, 3, dims))


def _train_fsdp2(domain, data, dtype, fsdp_modules, steps):
    """FSDP2 through ``parallelize(mode="fsdp")``: HSDP on a data x domain mesh (replicated over
    "data", sharded over "domain"), FSDP over all ranks on a 2-D domain. The gradient divide
    factor makes the per-rank losses of the convention give single-device gradients with no
    loss scaling."""
    m = mesh(domain, data)
    d = m.get_local_rank("data") if data > 1 else 0
    torch.manual_seed(0)
    ref = Net().to(dtype)
    model = copy.deepcopy(ref)
    model.mesh = m
    model = snn.parallelize(model, m, mode="fsdp", fsdp_modules=fsdp_modules)
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-4}
    opt_ref, opt = sgd(ref.parameters()), sgd(model.parameters())
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2 * data, 3, 12, 10, dtype=dtype, generator=gen)
        target = torch.randn(2 * data, 2, dtype=dtype, generator=gen)
        opt_ref.zero_grad()
        F.mse_loss(ref(x), target).backward()
        opt.zero_grad()
        out = model(snn.shard(x[2 * d : 2 * d + 2], m, align=2))
        snn.losses.share(F.mse_loss(out, target[2 * d : 2 * d + 2]), m).backward()
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            g = p.grad.full_tensor()
            torch.testing.assert_close(g, p_ref.grad, **tol, msg=lambda s, n=name: f"{n}: {s}")
        opt_ref.step()
        opt.step()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref, **tol, msg=lambda s, n=name: f"{n}: {s}")
    for (name, a), b in zip(ref.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, a, **tol, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize(
    "domain,data,dtype,fsdp_modules",
    [
        (2, 2, torch.float64, ()),
        ((2, 2), 1, torch.float64, ("conv*",)),
        (2, 1, torch.float32, ("bn", "fc")),
    ],
    ids=["hsdp-data2xdomain2", "fsdp-domain2x2-per-conv", "fsdp-domain2-float32"],
)
def test_fsdp2_matches_single_device_training(run, domain, data, dtype, fsdp_modules):
    assert all(run(world_of(domain, data), _train_fsdp2, domain, data, dtype, fsdp_modules, 3))
