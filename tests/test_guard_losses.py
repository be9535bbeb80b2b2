"""Loss functions inside a converted model's forward, and the check of unshared replicated outputs.

A model that returns its loss (``forward(x, target)`` ending in ``F.cross_entropy``) ran the
loss on the slab before session 61: refused by the guard. Now the guard computes torch's loss
with ``reduction="none"`` on the slabs and reduces over the whole sample (``guard_losses``):
each case is compared with the single-device model (value, input gradient, summed parameter
gradients) on uneven slabs of 2 and 3 ranks and a 2x2 mesh. The routed loss is a replicated
value (the library's gradient convention, as ``x.mean()``): ``share`` it before ``backward``.
Calling ``backward()`` on it directly gave P times the gradient, silently; it now warns on
every rank (``losses.check_seeded``; with ``convert(..., strict=True)`` every rank raises), as
does ``logits.sum().backward()`` on a ViT head's replicated logits, while a shared loss and a
loss seeded on one rank only stay exact and quiet.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.mesh import domain_axes

from .harness import mesh
from .reference import reduce_param_grads

TOL = {"atol": 1e-10, "rtol": 1e-10}
IGNORE = 255


class LossModel(nn.Module):
    """A convolution whose forward returns a loss of its output against ``target`` (``kind``)."""

    def __init__(self, kind: str, reduction: str = "mean", ndim: int = 2, classes: int = 4):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        self.conv = conv(3, classes, 3, padding=1)
        self.kind, self.reduction = kind, reduction
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, classes))
        self.register_buffer("pos_weight", torch.linspace(0.5, 1.5, classes).view(classes, *[1] * ndim))

    def forward(self, x, target, weight=None):
        y, r, k = self.conv(x), self.reduction, self.kind
        if k == "mse":
            return F.mse_loss(y, target, reduction=r)
        if k == "mse_weight":
            return F.mse_loss(y, target, reduction=r, weight=weight)
        if k == "l1_weight":
            return F.l1_loss(y, target, reduction=r, weight=weight)
        if k == "huber_weight":
            return F.huber_loss(y, target, reduction=r, delta=0.5, weight=weight)
        if k == "smooth_l1":
            return nn.SmoothL1Loss(reduction=r, beta=0.3)(y, target)  # (the module calls F)
        if k == "bce_logits":
            return F.binary_cross_entropy_with_logits(y, target.sigmoid(), weight=weight, pos_weight=self.pos_weight,
                                                      reduction=r)
        if k == "bce":
            return F.binary_cross_entropy(y.sigmoid(), target.sigmoid(), reduction=r)
        if k == "soft_margin":
            return F.soft_margin_loss(y, target.sign(), reduction=r)
        if k == "poisson":
            return F.poisson_nll_loss(y, target.abs(), reduction=r)
        if k == "gaussian":
            return F.gaussian_nll_loss(y, target, weight.abs() + 0.1, reduction=r)
        if k == "kl_div":
            return F.kl_div(y.log_softmax(1), target.log_softmax(1), reduction=r, log_target=True)
        if k == "ce":
            return F.cross_entropy(y, target, reduction=r)
        if k == "ce_weighted":  # class weights, ignored positions, label smoothing
            return F.cross_entropy(y, target, weight=self.class_weight, ignore_index=IGNORE, reduction=r,
                                   label_smoothing=0.1)
        if k == "ce_probs":
            return F.cross_entropy(y, target.softmax(1), reduction=r)
        if k == "nll":
            return nn.NLLLoss(weight=self.class_weight, ignore_index=IGNORE, reduction=r)(y.log_softmax(1), target)
        raise ValueError(k)


ELEMENTWISE = ["mse", "mse_weight", "l1_weight", "huber_weight", "smooth_l1", "bce_logits", "bce", "soft_margin",
               "poisson", "gaussian", "kl_div", "ce_probs"]
BY_CLASS = ["ce", "ce_weighted", "nll"]


def _inputs(kind: str, shape, classes: int):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape[0], 3, *shape[1:], dtype=torch.float64, generator=gen)
    weight = torch.rand(shape[0], classes, *shape[1:], dtype=torch.float64, generator=gen)
    if kind in BY_CLASS:
        target = torch.randint(0, classes, (shape[0], *shape[1:]), generator=gen)
        target[torch.rand(target.shape, generator=gen) < 0.2] = IGNORE if kind != "ce" else 0
    else:
        target = torch.randn(shape[0], classes, *shape[1:], dtype=torch.float64, generator=gen)
    return x, target, weight


def _slab(t: torch.Tensor, m, sizes, first: int) -> torch.Tensor:
    """This rank's slab of ``t`` along its dims ``first, first + 1, ...`` (one per domain axis)."""
    for k, axis in enumerate(domain_axes(m)):
        split = sizes[k]
        r = m.get_local_rank(axis)
        t = t.narrow(first + k, sum(split[:r]), split[r])
    return t.contiguous()


def _case(domain, kind: str, reduction: str, sizes, seed_with: str = "share"):
    m = mesh(domain)
    ndim = 2
    torch.manual_seed(0)
    ref = LossModel(kind, reduction, ndim).double()
    shape = (2, *[sum(s) for s in sizes], *([5] * (ndim - len(sizes))))
    x, target, weight = _inputs(kind, shape, 4)
    x.requires_grad_()
    out = ref(x, target, weight)
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    (out * g).sum().backward()

    # Class indices (N, H, W) are sharded along dims 1.. where the scores are along 2..: say so.
    by_class = {"input_dims": {"target": tuple(range(1, 1 + len(sizes)))}} if kind in BY_CLASS else {}
    model = snn.convert(copy.deepcopy(ref), m, **by_class)
    xl = _slab(x.detach(), m, sizes, 2).requires_grad_()
    tl = _slab(target, m, sizes, 1 if kind in BY_CLASS else 2)
    per_position = 1 if kind in BY_CLASS or kind == "ce_probs" else 2  # the first sharded dim of the losses
    wl = _slab(weight, m, sizes, 2)
    got = model(xl, tl, wl)
    if reduction == "none":
        gl = _slab(g, m, sizes, per_position)
        (got * gl).sum().backward()
        full = snn.gather(got.detach(), m, dims=[per_position + d for d in range(len(sizes))])
        torch.testing.assert_close(full, out.detach(), **TOL)
        got = full
    else:
        if seed_with == "share":
            (snn.losses.share(got, m) * g).backward()
        else:  # only the first rank seeds the loss (counted once): no share needed, no error
            first = all(m.get_local_rank(a) == 0 for a in domain_axes(m))
            (got * g * float(first)).backward()
        torch.testing.assert_close(got.detach(), out.detach(), **TOL)
    gx = snn.gather(xl.grad, m, dims=[2 + d for d in range(len(sizes))])
    torch.testing.assert_close(gx, x.grad, **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, **TOL, msg=lambda s, n=name: f"{n}: {s}")
    return float(got.detach().sum())



@pytest.mark.parametrize("kind", ELEMENTWISE + BY_CLASS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_in_forward_is_exact(run, kind, reduction):
    if kind == "kl_div" and reduction == "mean":
        reduction = "batchmean"  # (kl_div's mean is torch's deprecated form; batchmean is the loss)
    out = run(2, _case, 2, kind, reduction, ((7, 4),))
    assert len(set(out)) == 1  # the same value on every rank


@pytest.mark.parametrize("kind", ["mse_weight", "ce_weighted", "kl_div"])
def test_loss_in_forward_three_ranks_and_one_rank_seeding(run, kind):
    reduction = "batchmean" if kind == "kl_div" else "mean"
    run(3, _case, 3, kind, reduction, ((5, 2, 6),))
    run(3, _case, 3, kind, reduction, ((5, 2, 6),), "first rank")


@pytest.mark.parametrize("kind", ["ce_weighted", "mse", "gaussian"])
def test_loss_in_forward_on_a_2x2_mesh(run, kind):
    run(4, _case, (2, 2), kind, "mean", ((5, 3), (2, 4)))


class TokenLoss(nn.Module):
    """Scores of tokens (L, C) sharded along dim 0 (the batch dim of torch's losses)."""

    def __init__(self, kind: str):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.kind = kind

    def forward(self, x, target):
        y = self.proj(x)
        if self.kind == "kl_div":
            return F.kl_div(y.log_softmax(-1), target.log_softmax(-1), reduction="batchmean", log_target=True)
        if self.kind == "ce":
            return F.cross_entropy(y, target, ignore_index=IGNORE, label_smoothing=0.2)
        return F.mse_loss(y, target)


def _tokens(domain, kind: str, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = TokenLoss(kind).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(sizes), 3, dtype=torch.float64, generator=gen, requires_grad=True)
    if kind == "ce":
        target = torch.randint(0, 4, (sum(sizes),), generator=gen)
        target[::3] = IGNORE
    else:
        target = torch.randn(sum(sizes), 4, dtype=torch.float64, generator=gen)
    out = ref(x, target)
    out.backward()
    model = snn.convert(copy.deepcopy(ref), m, dims=[0])
    xl = _slab(x.detach(), m, (sizes,), 0).requires_grad_()
    got = model(xl, _slab(target, m, (sizes,), 0))
    snn.losses.share(got, m).backward()
    torch.testing.assert_close(got.detach(), out.detach(), **TOL)
    torch.testing.assert_close(snn.gather(xl.grad, m, dims=[0]), x.grad, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, **TOL)
    return float(got)


@pytest.mark.parametrize("kind", ["kl_div", "ce", "mse"])
def test_loss_of_tokens_sharded_along_the_batch_dim(run, kind):
    """kl_div's batchmean divides by the global token count; cross_entropy's class dim is dim 1."""
    out = run(3, _tokens, 3, kind, (4, 1, 6))
    assert len(set(out)) == 1


def _all_ignored(domain):
    """Every position ignored: torch's mean is 0/0 = nan; so is the routed one, on every rank."""
    m = mesh(domain)
    torch.manual_seed(0)
    ref = LossModel("ce_weighted").double()
    x = torch.randn(1, 3, 6, 4, dtype=torch.float64)
    t = torch.full((1, 6, 4), IGNORE)
    expected = ref(x, t)
    got = snn.convert(copy.deepcopy(ref), m, input_dims={"target": 1})(snn.shard(x, m), snn.shard(t, m, dims=[1]))
    return bool(expected.isnan()), bool(got.isnan())


def test_every_position_ignored_gives_nan_like_torch(run):
    assert run(2, _all_ignored, 2) == [(True, True)] * 2


class Classifier(nn.Module):
    """A conv, a global average pool and a head: replicated logits leave the model."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x, target=None):
        logits = self.head(self.conv(x).mean((2, 3)))
        return logits if target is None else F.cross_entropy(logits, target)


def _unshared(domain, what: str, strict: bool):
    import warnings

    m = mesh(domain)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 6)
    target = torch.randint(0, 4, (2, 7, 6))
    if what == "loss":
        model = snn.convert(LossModel("ce"), m, input_dims={"target": 1}, strict=strict)
        run = lambda: model(snn.shard(x, m), snn.shard(target, m, dims=[1]))  # noqa: E731
    elif what == "logits_sum":
        model = snn.convert(Classifier(), m, strict=strict)
        run = lambda: model(snn.shard(x, m)).add_(1.0).sum()  # noqa: E731  (in place: the output is no view)
    else:  # a loss of replicated logits computed inside the forward (one device's code)
        model = snn.convert(Classifier(), m, strict=strict)
        run = lambda: model(snn.shard(x, m), torch.tensor([1, 3]))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run().backward()
        except snn.ShardingError as e:
            first = "raised: " + str(e)
        else:
            first = "; ".join(str(w.message) for w in caught if issubclass(w.category, snn.ShardingWarning))
        # The check does not stay armed: the same forward, shared, then backs up without a word.
        model.zero_grad()
        n = len(caught)
        snn.losses.share(run(), m).backward()
        quiet = len(caught) == n
    return first, quiet and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("what", ["loss", "logits_sum", "loss_of_logits"])
def test_backward_of_an_unshared_replicated_output_warns_or_raises(run, domain, what):
    # By default a ShardingWarning on every rank (a timing run may back up out.sum() on purpose).
    out = run(domain, _unshared, domain, what, False)
    msg, ok = out[0]
    assert all(o == out[0] for o in out), out
    assert "this rank seeded its backward with ones" in msg and f"{domain} times" in msg, msg
    assert "sharded_nn.losses.share" in msg and ok
    # convert(..., strict=True): the same ShardingError on every rank.
    out = run(domain, _unshared, domain, what, True)
    assert len(set(out)) == 1, out
    msg, ok = out[0]
    assert msg.startswith("raised: ") and "every rank seeded its backward with ones" in msg, msg
    assert ok


def _script_reduction(domain, name: str):
    """A loss a script builds from a converted model's slab output with a public reduction."""
    import warnings

    m = mesh(domain)
    torch.manual_seed(0)
    ref = nn.Conv2d(3, 4, 3, padding=1).double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    reduce = {
        "mean": lambda y: snn.reductions.mean(y.square(), m),
        "sum_per_sample": lambda y: snn.reductions.sum(y.square(), m, dims=(1, 2, 3)),  # (N,): one per sample
        "norm": lambda y: snn.reductions.norm(y, m),
        "var_mean": lambda y: snn.reductions.var_mean(y, m)[0],
        "max_dim": lambda y: snn.reductions.max_dim(y, m, 2)[0].sum(),
        "logsumexp": lambda y: snn.reductions.logsumexp(y, m, (2,)).sum(),
    }[name]
    whole = {
        "mean": lambda y: y.square().mean(),
        "sum_per_sample": lambda y: y.square().sum((1, 2, 3)),
        "norm": lambda y: torch.linalg.vector_norm(y),
        "var_mean": lambda y: torch.var_mean(y)[0],
        "max_dim": lambda y: y.max(2)[0].sum(),
        "logsumexp": lambda y: torch.logsumexp(y, 2).sum(),
    }[name]
    ref_loss = whole(ref(x))
    ref_loss.backward(torch.ones_like(ref_loss))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = reduce(model(snn.shard(x, m)))
        loss.backward(torch.ones_like(loss))  # no share: P times the gradient
        warned = [str(w.message) for w in caught if issubclass(w.category, snn.ShardingWarning)]
        model.zero_grad()
        n = len(caught)
        loss = snn.losses.share(reduce(model(snn.shard(x, m))), m)
        loss.backward(torch.ones_like(loss))  # shared: quiet and exact
        quiet = len(caught) == n
    grads = reduce_param_grads(model, m)
    err = max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters())
    return warned[:1], quiet, err


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("name", ["mean", "sum_per_sample", "norm", "var_mean", "max_dim", "logsumexp"])
def test_unshared_reduction_called_by_a_script_warns(run, domain, name):
    # A loss built after the model with a public reduction (not inside a converted forward,
    # whose outputs are checked) backed up without share: P times the gradient, silent before
    # session 63.
    for warned, quiet, err in run(domain, _script_reduction, domain, name):
        assert warned and "this rank seeded its backward with ones" in warned[0], warned
        assert f"sharded_nn.reductions.{name.split('_')[0]}" in warned[0] and f"{domain} times" in warned[0], warned
        assert quiet and err < 1e-10, (quiet, err)


def _refused(domain, what: str):
    m = mesh(domain)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    if what == "target_layout":
        # A target sharded along W while the scores are sharded along H.
        model = snn.convert(LossModel("ce").double(), m, input_dims={"target": 2})
        target = torch.randint(0, 4, (2, 6, 4))
        args = (snn.shard(x, m), snn.shard(target, m, dims=[2]))
    elif what == "bad_target":
        # A class index out of range in the last rank's rows only: torch raises there alone,
        # and the others would wait in the reduction; every rank raises instead.
        model = snn.convert(LossModel("ce").double(), m, input_dims={"target": 1})
        target = torch.randint(0, 4, (2, 6, 4))
        target[0, -1, 0] = 7
        args = (snn.shard(x, m), snn.shard(target, m, dims=[1]))
    else:  # torch's internal form of a loss, called on slabs
        model = snn.convert(LossModel("mse").double(), m)
        model.forward = lambda x, t, w=None: torch.poisson_nll_loss(model.conv(x), t.abs(), True, False, 1e-8, 1)
        target = torch.randn(2, 4, 6, 4, dtype=torch.float64)
        args = (snn.shard(x, m), snn.shard(target, m))
    try:
        model(*args)
    except snn.ShardingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "what, expected",
    [("target_layout", "its target is laid out as"), ("internal", "internal form of the loss"),
     ("bad_target", "torch's loss raised on the slab of at least one rank")],
)
def test_loss_refusals_are_alike_on_every_rank(run, what, expected):
    out = run(2, _refused, 2, what)
    assert all(expected in o for o in out), out
    if what != "bad_target":  # (that one says which rank's slab raised)
        assert len(set(out)) == 1, out


class WeightedHead(Classifier):
    """An L1 loss with weights on replicated logits: torch's own dispatch drops ``F.l1_loss``'s
    ``weight`` under any torch function mode (torch 2.14); the guard reads it back."""

    def forward(self, x, target=None, weight=None):
        logits = self.head(self.conv(x).mean((2, 3)))
        return F.l1_loss(logits, target, weight=weight)


def _weighted_l1_on_whole_tensors(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = WeightedHead().double()
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    target, weight = torch.randn(2, 5, dtype=torch.float64), torch.rand(2, 5, dtype=torch.float64)
    expected = ref(x, target, weight)
    got = snn.convert(copy.deepcopy(ref), m, input_dims={"target": None, "weight": None})(snn.shard(x, m), target,
                                                                                           weight)
    return float(expected), float(got)


def test_l1_loss_weights_are_kept_under_the_guard(run):
    for expected, got in run(2, _weighted_l1_on_whole_tensors, 2):
        assert abs(expected - got) < 1e-12, (expected, got)
