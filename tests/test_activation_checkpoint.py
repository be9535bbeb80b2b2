"""Activation checkpointing of regions of a converted model.

``torch.utils.checkpoint`` recomputes a region in backward, where the forward guard does not run:
a squeeze-excite mean, an interpolation or a roll of the model's own would be recomputed on the slab alone
and the gradients would be silently wrong (they were, before the guard refused it). So:

- ``snn.activation_checkpoint`` regions recompute under the guard: forward, input and parameter
  gradients equal the single-device model's (float64, uneven slabs, P = 2, 3, 2 x 2), and with
  random draws in training they equal the same sharded model run without checkpointing;
- inside ``torch.utils.checkpoint`` (reentrant or not, and timm's ``set_grad_checkpointing``) a
  routed call is refused on every rank with the fix named; regions of sharded layers and
  pointwise calls only, and inference under ``no_grad``, still run.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import sharded_nn as snn

from .harness import mesh, world_of

_SIZES = {2: (6, 4), 3: (6, 4, 4), (2, 2): (6, 4)}
_WIDTHS = (4, 2)


def _local(x, m, domain):
    sizes = _SIZES[domain]
    if isinstance(domain, tuple):
        r0, r1 = m.get_local_rank("domain0"), m.get_local_rank("domain1")
        return x.narrow(2, sum(sizes[:r0]), sizes[r0]).narrow(3, sum(_WIDTHS[:r1]), _WIDTHS[r1]).clone()
    r = m.get_local_rank("domain")
    return x.narrow(2, sum(sizes[:r]), sizes[r]).clone()


class Block(nn.Module):
    """A residual block whose own forward mixes positions: squeeze-excite, interpolate, roll, drop-path."""

    def __init__(self, drop: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.drop = drop

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h = h * torch.sigmoid(h.mean((2, 3), keepdim=True))
        h = h + F.interpolate(F.avg_pool2d(h, 2, ceil_mode=True), size=h.shape[2:], mode="bilinear")
        h = torch.roll(h, 1, 2)
        if self.drop:
            from timm.layers import drop_path

            h = F.dropout(drop_path(h, self.drop, self.training), 0.2, self.training)
        return x + h


class Net(nn.Module):
    def __init__(self, how: str, drop: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.blocks = nn.ModuleList([Block(drop), Block(drop)])
        self.how = how

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            if self.how == "snn":
                x = snn.activation_checkpoint(b, x)
            elif self.how == "torch":
                x = checkpoint(b, x, use_reentrant=False)
            elif self.how == "torch_reentrant":
                x = checkpoint(b, x, use_reentrant=True)
            else:
                x = b(x)
        return x


def _exact(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Net("none").double()
    x = torch.randn(2, 2, sum(_SIZES[domain]), 6, dtype=torch.float64)
    w = torch.randn(2, 4, sum(_SIZES[domain]), 6, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    model.how = "snn"
    xl = _local(x, m, domain).requires_grad_()
    y = model(xl)
    (y * _local(w, m, domain)).sum().backward()
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * w).sum().backward()
    errs = [(y - _local(yr, m, domain)).abs().max(), (xl.grad - _local(xr.grad, m, domain)).abs().max()]
    for p, pr in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        errs.append((g - pr.grad).abs().max())
    return max(e.item() for e in errs)


@pytest.mark.parametrize("domain", [2, 3, (2, 2)])
def test_activation_checkpoint_is_exact(run, domain):
    assert max(run(world_of(domain), _exact, domain)) < 1e-12


class TorchRegion(nn.Module):
    """A region made of torch's own modules only (``nn.Sequential``: no frame of the model's code
    between the checkpoint and the calls), with a softmax over the rows that the guard routes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU(), nn.Softmax(dim=2), nn.Conv2d(4, 4, 1))
        self.checkpointed = True

    def forward(self, x):
        x = self.stem(x)
        return x + (snn.activation_checkpoint(self.body, x) if self.checkpointed else self.body(x))


def _torch_region(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = TorchRegion().double()
    ref.checkpointed = False
    x = torch.randn(2, 2, sum(_SIZES[domain]), 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, sum(_SIZES[domain]), 6, dtype=torch.float64)
    (ref(x) * w).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", snn.ShardingWarning)  # the Softmax over rows, which the guard routes
        model = snn.convert(copy.deepcopy(ref), m)
    model.checkpointed = True
    xl = _local(x.detach(), m, domain).requires_grad_()
    y = model(xl)
    (y * _local(w, m, domain)).sum().backward()
    errs = [(y - _local(ref(x).detach(), m, domain)).abs().max(), (xl.grad - _local(x.grad, m, domain)).abs().max()]
    for p, pr in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        errs.append((g - pr.grad).abs().max())
    return max(e.item() for e in errs)


@pytest.mark.parametrize("domain", [2, (2, 2)])
def test_activation_checkpoint_of_torch_modules_is_exact(run, domain):
    """Refused before (the calls of ``nn.Sequential``'s modules were taken for the library's own,
    passed through unfollowed, and the next sharded layer got an untracked tensor)."""
    assert max(run(world_of(domain), _torch_region, domain)) < 1e-12


def _random(domain):
    """With drop-path and dropout in training: checkpointed = not checkpointed, same seed."""
    m = mesh(domain)
    torch.manual_seed(0)
    base = Net("none", drop=0.5).double()
    x = torch.randn(8, 2, sum(_SIZES[domain]), 6, dtype=torch.float64)
    w = torch.randn(8, 4, sum(_SIZES[domain]), 6, dtype=torch.float64)
    out = []
    for how in ("none", "snn"):
        model = snn.convert(copy.deepcopy(base), m, strict=True).train()
        model.how = how
        torch.manual_seed(7)
        xl = _local(x, m, domain).requires_grad_()
        y = model(xl)
        (y * _local(w, m, domain)).sum().backward()
        out.append([y.detach(), xl.grad, *[p.grad for p in model.parameters()]])
    return max((a - b).abs().max().item() for a, b in zip(*out))


@pytest.mark.parametrize("domain", [2, 3])
def test_activation_checkpoint_recomputes_the_same_draws(run, domain):
    assert max(run(world_of(domain), _random, domain)) == 0.0


def _torch_checkpoint(domain, how, grad):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Net(how).double(), m, strict=True)
    xl = _local(torch.randn(2, 2, sum(_SIZES[domain]), 6, dtype=torch.float64), m, domain)
    try:
        if grad:
            model(xl.requires_grad_()).sum().backward()
        else:
            with torch.no_grad():
                model(xl)
    except snn.ShardingError as e:
        return str(e)
    return "ran"


@pytest.mark.parametrize("how", ["torch", "torch_reentrant"])
def test_torch_checkpoint_of_routed_calls_is_refused(run, how):
    out = run(2, _torch_checkpoint, 2, how, True)
    assert len(set(out)) == 1, out
    assert "inside torch.utils.checkpoint" in out[0] and "sharded_nn.activation_checkpoint" in out[0], out[0]
    assert "`mean`" in out[0], out[0]  # the first routed call of the region is named


def test_torch_checkpoint_without_grad_runs(run):
    assert run(2, _torch_checkpoint, 2, "torch", False) == ["ran", "ran"]


class Plain(nn.Module):
    """Sharded layers and pointwise calls only: torch's checkpoint recomputes them correctly."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return checkpoint(lambda t: torch.tanh(self.b(torch.relu(self.a(t)))), x, use_reentrant=False)


def _plain(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Plain().double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(1, 2, sum(_SIZES[domain]), 6, dtype=torch.float64)
    xl = _local(x, m, domain).requires_grad_()
    model(xl).sum().backward()
    xr = x.clone().requires_grad_()
    ref(xr).sum().backward()
    return (xl.grad - _local(xr.grad, m, domain)).abs().max().item()


def test_torch_checkpoint_of_sharded_layers_still_runs(run):
    assert max(run(2, _plain, 2)) < 1e-12


def _timm(domain):
    import timm

    m = mesh(domain)
    model = timm.create_model("mobilenetv3_small_050", num_classes=3).double()
    model.set_grad_checkpointing(True)
    model = snn.convert(model, m)
    x = torch.randn(1, 3, 64 * domain, 32, dtype=torch.float64)
    try:
        model(snn.shard(x, m).requires_grad_()).sum().backward()
    except snn.ShardingError as e:
        return str(e)
    return "ran"


def test_timm_grad_checkpointing_with_routed_calls_is_refused(run):
    out = run(2, _timm, 2)
    assert len(set(out)) == 1 and "inside torch.utils.checkpoint" in out[0], out


def _bad_options(domain):
    m = mesh(domain)
    model = snn.convert(Net("none").double(), m)
    errors = []
    for kw in ({"use_reentrant": True}, {"context_fn": None}):
        try:
            snn.activation_checkpoint(model.blocks[0], torch.zeros(1, 4, 4, 4, dtype=torch.float64), **kw)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_activation_checkpoint_bad_options(run):
    errors = run(2, _bad_options, 2)[0]
    assert len(errors) == 2 and "use_reentrant=True is not supported" in errors[0] and "context_fn" in errors[1]
