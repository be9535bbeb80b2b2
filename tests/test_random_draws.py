"""Random draws in a converted model's own forward (training): the single-device law on slabs.

A replicated random value (a drop-path decision per sample, a channel-dropout mask, dropout of
pooled features) must be the same on every rank, and the random values of a slab must be
independent across ranks. Before the forward guard routed random calls, every rank drew its own
drop-path decisions (a sample dropped on one slab and kept on the next: a model no single device
computes) and ranks seeded alike drew the same element mask on every slab.

Each test recovers the draws from the output and checks them against the law, then checks the
forward and the gradients against the single-device model under the same draws (float64, uneven
slabs, P = 2, 3 and a 2 x 2 mesh).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh, world_of

_SIZES = {2: (6, 4), 3: (6, 4, 4), (2, 2): (6, 4)}


def _local(x: torch.Tensor, m, domain, sizes, width_sizes=(4, 2)) -> torch.Tensor:
    """This rank's uneven slab of ``x`` (H sharded; with a 2-D mesh, W too)."""
    if isinstance(domain, tuple):
        r0, r1 = m.get_local_rank("domain0"), m.get_local_rank("domain1")
        x = x.narrow(2, sum(sizes[:r0]), sizes[r0])
        return x.narrow(3, sum(width_sizes[:r1]), width_sizes[r1]).clone()
    r = m.get_local_rank("domain")
    return x.narrow(2, sum(sizes[:r]), sizes[r]).clone()


def _dims(domain):
    return (2, 3) if isinstance(domain, tuple) else (2,)


def _domain_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


class Residual(nn.Module):
    """``x + drop(tanh(conv(x)))`` with one of the stochastic-depth modules or calls."""

    def __init__(self, kind: str, p: float) -> None:
        super().__init__()
        self.kind, self.p = kind, p
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        if kind == "timm":
            from timm.layers import DropPath

            self.drop = DropPath(p)
        elif kind == "torchvision":
            from torchvision.ops import StochasticDepth

            self.drop = StochasticDepth(p, "row")
        elif kind == "monai":
            from monai.networks.layers import DropPath

            self.drop = DropPath(p)

    def branch(self, x):
        return torch.tanh(self.conv(x))

    def forward(self, x):
        if self.kind == "functional":
            from timm.layers import drop_path

            return x + drop_path(self.branch(x), self.p, self.training)
        return x + self.drop(self.branch(x))


def _drop_path(domain, kind, seed):
    m = mesh(domain)
    sizes = _SIZES[domain]
    torch.manual_seed(0)
    ref = Residual(kind, 0.5).double()
    n = 40
    x = torch.randn(n, 3, sum(sizes), 6, dtype=torch.float64)
    w = torch.randn(n, 3, sum(sizes), 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict: no hazard left to warn about
        model = snn.convert(copy.deepcopy(ref), m, strict=True).train()
    torch.manual_seed(seed + dist.get_rank())  # ranks seeded differently: the guard must agree
    xl = _local(x, m, domain, sizes).requires_grad_()
    y = model(xl)
    (y * _local(w, m, domain, sizes)).sum().backward()
    yf = snn.gather(y.detach(), m, dims=_dims(domain))
    # Recover each sample's decision from the output: kept (branch / keep) or dropped (0).
    f = ref.branch(x).detach()
    kept = torch.stack([(yf[b] - x[b] - f[b] / 0.5).abs().max() < 1e-12 for b in range(n)])
    dropped = torch.stack([(yf[b] - x[b]).abs().max() < 1e-12 for b in range(n)])
    assert bool((kept ^ dropped).all()), "a sample is neither wholly kept nor wholly dropped"
    # The single-device model under the same decisions: output, input and weight gradients.
    r = copy.deepcopy(ref)
    xr = x.clone().requires_grad_()
    yr = xr + r.branch(xr) * (kept.double() / 0.5)[:, None, None, None]
    (yr * w).sum().backward()
    assert (yf - yr.detach()).abs().max() < 1e-12
    assert (xl.grad - _local(xr.grad, m, domain, sizes)).abs().max() < 1e-12
    assert (_domain_sum(model.conv.weight.grad) - r.conv.weight.grad).abs().max() < 1e-12
    return kept.tolist()


@pytest.mark.parametrize("kind", ["timm", "torchvision", "monai", "functional"])
@pytest.mark.parametrize("domain", [2, 3, (2, 2)])
def test_drop_path_decides_once_per_sample(run, domain, kind):
    out = run(world_of(domain), _drop_path, domain, kind, 0)
    assert all(o == out[0] for o in out)  # every rank saw the same decisions
    frac = sum(out[0]) / len(out[0])
    assert 0.2 < frac < 0.8, frac  # keep probability 0.5 over 40 samples (a 4-sigma band)


def test_drop_path_follows_the_seed(run):
    a = run(2, _drop_path, 2, "timm", 0)[0]
    b = run(2, _drop_path, 2, "timm", 0)[0]
    c = run(2, _drop_path, 2, "timm", 1)[0]
    assert a == b  # torch.manual_seed on domain rank 0 makes the draws repeatable
    assert a != c


class Channels(nn.Module):
    """Channel dropout of a slab, then element dropout of the pooled features."""

    def __init__(self, p_channel: float, p_pooled: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.drop2d = nn.Dropout2d(p_channel)
        self.drop = nn.Dropout(p_pooled)
        self.fc = nn.Linear(8, 5)

    def features(self, x):
        return torch.tanh(self.conv(x)) + 2.0  # never zero: a zero output means dropped

    def forward(self, x):
        h = self.drop2d(self.features(x))
        return self.fc(self.drop(h.mean((2, 3))))


def _channels(domain, functional_3d):
    m = mesh(domain)
    sizes = _SIZES[domain]
    torch.manual_seed(0)
    ref = Channels(0.5, 0.5).double()
    x = torch.randn(6, 3, sum(sizes), 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (fc acts on pooled features; convert cannot tell from the layers alone on a 2-D mesh)
        model = snn.convert(copy.deepcopy(ref), m, strict=True, plan={"fc": None}).train()
    torch.manual_seed(1 + dist.get_rank())
    xl = _local(x, m, domain, sizes).requires_grad_()
    feats = {}
    model.drop2d.register_forward_hook(lambda mod, i, o: feats.__setitem__("h", o))
    model.drop.register_forward_hook(lambda mod, i, o: feats.update(pooled_in=i[0].detach(), pooled_out=o.detach()))
    logits = model(xl)
    snn.losses.share(logits.sum(), m).backward()  # a loss of replicated logits: shared by the ranks
    h = snn.gather(feats["h"].detach(), m, dims=_dims(domain))
    f = ref.features(x).detach()
    zero = (h == 0).flatten(2)
    channel_kept = ~zero.all(-1)
    assert bool((zero.any(-1) == ~channel_kept).all()), "a channel is dropped on some slabs only"
    assert (h - f * channel_kept[..., None, None] / 0.5).abs().max() < 1e-12
    # Pooled-feature dropout: the logits are replicated, so every rank drew the same mask.
    gathered = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, logits.detach())
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    pooled = (f * channel_kept[..., None, None] / 0.5).mean((2, 3))
    assert (feats["pooled_in"] - pooled).abs().max() < 1e-12
    mask = (feats["pooled_out"] != 0).double()
    assert (feats["pooled_out"] - pooled * mask / 0.5).abs().max() < 1e-12
    r = copy.deepcopy(ref)
    xr = x.clone().requires_grad_()
    hr = r.features(xr) * channel_kept[..., None, None] / 0.5
    yr = r.fc(hr.mean((2, 3)) * mask / 0.5)
    yr.sum().backward()
    assert (logits.detach() - yr.detach()).abs().max() < 1e-10
    assert (xl.grad - _local(xr.grad, m, domain, sizes)).abs().max() < 1e-12
    assert (_domain_sum(model.conv.weight.grad) - r.conv.weight.grad).abs().max() < 1e-12
    # The replicated head's gradients are shares: they sum to the reference.
    assert (_domain_sum(model.fc.weight.grad) - r.fc.weight.grad).abs().max() < 1e-12
    return channel_kept.float().mean().item(), mask.mean().item()


@pytest.mark.parametrize("domain", [2, 3, (2, 2)])
def test_channel_and_replicated_dropout_are_drawn_alike(run, domain):
    out = run(world_of(domain), _channels, domain, False)
    assert all(o == out[0] for o in out)
    for frac in out[0]:
        assert 0.15 < frac < 0.85, out[0]


class Elements(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.tanh(self.conv(x)) + 2.0)


def _elements(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Elements().double(), m, strict=True).train()
    x = torch.randn(4, 2, 8 * m.size(), 8, dtype=torch.float64)  # equal slabs
    torch.manual_seed(0)  # every rank seeded alike, as data-parallel scripts do
    y = model(snn.shard(x, m))
    kept = (y != 0).flatten()
    gathered = [torch.empty_like(kept) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, kept)
    return kept.float().mean().item(), [(g == gathered[0]).float().mean().item() for g in gathered[1:]]


@pytest.mark.parametrize("domain", [2, 3])
def test_slab_dropout_is_independent_across_ranks(run, domain):
    for frac, agreement in run(domain, _elements, domain):
        assert 0.4 < frac < 0.6, frac  # 2048 elements per slab, keep 0.5
        # Independent masks agree on about half the elements; identical ones on all.
        assert all(0.4 < a < 0.6 for a in agreement), agreement


def _random_tensors(domain, same_seed):
    """Random tensors the model builds itself: replicated ones alike, slab ones independent."""

    class Noise(nn.Module):
        def forward(self, x):
            n, c, h, w = x.shape
            plain = torch.rand(n, c, 1, 1, dtype=x.dtype) + torch.randn(1, dtype=x.dtype).abs()  # replicated
            slab = torch.rand(n, c, h, w, dtype=x.dtype)  # sized by the local slab: a slab of noise
            like = torch.randn_like(x)
            self.draws = (plain, slab, like)
            return x * plain + slab + like

    m = mesh(domain)
    torch.manual_seed(0 if same_seed else dist.get_rank())
    model = snn.convert(Noise(), m)
    x = torch.ones(2, 3, 4 * m.size(), 4, dtype=torch.float64)
    y = model(snn.shard(x, m))
    plain, slab, like = model.draws
    assert torch.equal(y, plain + slab + like)
    first = plain.clone()
    model(snn.shard(x, m))
    out = []
    for t in (plain, slab, like, model.draws[0]):
        g = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(g, t.contiguous())
        out.append(all(torch.equal(a, g[0]) for a in g))
    return out + [torch.equal(first, model.draws[0])]


@pytest.mark.parametrize("same_seed", [True, False])
def test_model_built_random_tensors(run, same_seed):
    for plain_alike, slab_alike, like_alike, second_alike, repeated in run(2, _random_tensors, 2, same_seed):
        assert plain_alike and second_alike  # replicated noise: the same on every rank
        assert not slab_alike and not like_alike  # slab noise: independent across ranks
        assert not repeated  # every forward draws afresh


def test_convert_reports_drop_path_only_without_the_guard(run):
    out = run(2, _strict_without_guard, 2)
    assert all("drop (DropPath)" in o for o in out), out


def _strict_without_guard(domain):
    m = mesh(domain)
    try:
        snn.convert(Residual("timm", 0.2), m, strict=True, guard=False)
    except snn.ShardingNotImplementedError as e:
        return str(e)
    return "no error"
