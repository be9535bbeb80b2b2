"""Hypothesis fuzzing of losses inside a converted model's forward (``sharded_nn/guard_losses.py``).

``tests/test_guard_losses.py`` checks chosen cases; this file draws them: every routed loss
(``mse``/``l1`` with and without ``weight``, ``huber``, ``smooth_l1``, ``binary_cross_entropy``
with and without logits, ``weight`` and ``pos_weight``, ``soft_margin``, ``poisson_nll``
(``log_input``, ``full``), ``gaussian_nll`` (a variance per element, per sample or a float,
``full``), ``kl_div`` (``log_target``, ``batchmean``), ``cross_entropy`` (class indices with class
weights, ignored positions, label smoothing, or probabilities) and ``nll_loss``), every
reduction, grids of 1-3 spatial dims of lengths 1-7 with any of them sharded, or tokens
``(L, C)`` sharded along dim 0, slabs of random uneven lengths (empty ones too), on 2-4 ranks or
a 2x2 mesh (float64). The model is a per-channel affine map followed by the loss; the loss value
(gathered for ``none``), the input-slab gradient and the summed parameter gradients must be the
single device's. Empty slabs (one draw in ten) compute since session 61 (the sums and means
take them; since session 67 every reduction does): a refusal fails as any mismatch does.

- ``test_fuzz_guard_losses_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_guard_losses_campaign`` (``pytest -m slow``): ``SNN_FUZZ_GUARD_LOSSES_EXAMPLES``
  examples (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .test_fuzz_fft_modes import _split

KINDS = ["mse", "l1", "huber", "smooth_l1", "bce_logits", "bce", "soft_margin", "poisson", "gaussian", "kl_div", "ce",
         "nll"]
BY_CLASS = ("ce", "nll")
IGNORE = -1


class Head(nn.Module):
    """A per-channel affine map, then the drawn loss of its output against ``target``."""

    def __init__(self, cfg: dict, channels: int, channel_dim: int, ndim: int):
        super().__init__()
        view = [1] * ndim
        view[channel_dim] = channels
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(view))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.3, channels).view(view))
        self.register_buffer("class_weight", torch.linspace(0.3, 1.7, channels))
        self.register_buffer("pos_weight", torch.linspace(0.5, 2.0, channels).view(view[1:]))
        self.cfg = cfg

    def forward(self, x, target, weight):
        c, y = self.cfg, x * self.scale + self.shift
        k, r, o = c["kind"], c["reduction"], c["option"]
        w = weight if o else None
        if k == "mse":
            return F.mse_loss(y, target, reduction=r, weight=w)
        if k == "l1":
            return F.l1_loss(y, target, reduction=r, weight=w)
        if k == "huber":
            return F.huber_loss(y, target, reduction=r, delta=0.7, weight=w)
        if k == "smooth_l1":
            return F.smooth_l1_loss(y, target, reduction=r, beta=0.0 if o else 0.4)
        if k == "bce_logits":
            return F.binary_cross_entropy_with_logits(y, target.sigmoid(), weight=w, reduction=r,
                                                      pos_weight=self.pos_weight if c["flag"] else None)
        if k == "bce":
            return F.binary_cross_entropy(y.sigmoid(), target.sigmoid(), weight=w, reduction=r)
        if k == "soft_margin":
            return F.soft_margin_loss(y, target.sign(), reduction=r)
        if k == "poisson":
            return F.poisson_nll_loss(y if c["flag"] else y.exp(), target.abs(), log_input=c["flag"], full=bool(o),
                                      reduction=r)
        if k == "gaussian":
            var = {0: 0.7, 1: weight + 0.1, 2: weight.narrow(1, 0, 1) + 0.1}[o]  # a float, per element, per sample
            return F.gaussian_nll_loss(y, target, var, full=c["flag"], reduction=r)
        if k == "kl_div":
            t = target.log_softmax(1) if c["flag"] else target.softmax(1)
            return F.kl_div(y.log_softmax(1), t, reduction=r, log_target=c["flag"])
        weights = self.class_weight if o else None
        if k == "ce":
            if c["flag"]:  # class probabilities
                return F.cross_entropy(y, target.softmax(1), weight=weights, reduction=r, label_smoothing=c["smooth"])
            return F.cross_entropy(y, target, weight=weights, ignore_index=IGNORE, reduction=r,
                                   label_smoothing=c["smooth"])
        return F.nll_loss(y.log_softmax(1), target, weight=weights, ignore_index=IGNORE, reduction=r)


def _indices(cfg) -> bool:
    return cfg["kind"] == "nll" or (cfg["kind"] == "ce" and not cfg["flag"])


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    gen = torch.Generator().manual_seed(cfg["seed"])
    shape = cfg["shape"]  # (N, C, S...) or tokens (L, C): the classes (channels) along dim 1
    torch.manual_seed(0)
    ref = Head(cfg, shape[1], 1, len(shape)).double()
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(shape, generator=gen, dtype=torch.float64)
    if _indices(cfg):
        target = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=gen)
        target[torch.rand(target.shape, generator=gen) < cfg["ignored"]] = IGNORE
    else:
        target = torch.randn(shape, generator=gen, dtype=torch.float64)

    def block(t, drop_class: bool = False):
        for (d, split), c in zip(splits, coords):
            d = d - 1 if drop_class and d > 1 else d
            t = t.narrow(d, sum(split[:c]), split[c])
        return t.contiguous()

    out = ref(x, target, weight)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * g).sum().backward()
    sharded = [d for d, _ in splits]
    input_dims = {"target": tuple(d - 1 if d > 1 else d for d in sharded)} if _indices(cfg) else {}
    model = snn.convert(copy.deepcopy(ref), m, dims=sharded, input_dims=input_dims)
    xl = block(x.detach()).requires_grad_()
    got = model(xl, block(target, drop_class=_indices(cfg)), block(weight))
    per_position = cfg["kind"] in BY_CLASS
    if cfg["reduction"] == "none":
        gl = block(g, drop_class=per_position)
        (got * gl).sum().backward()
        full = snn.gather(got.detach(), m, dims=[d - 1 if per_position and d > 1 else d for d in sharded])
        torch.testing.assert_close(full, out.detach(), atol=1e-11, rtol=1e-11, msg=lambda s: f"value: {s}")
    else:
        (snn.losses.share(got, m) * g).backward()
        torch.testing.assert_close(got.detach(), out.detach(), atol=1e-11, rtol=1e-11,
                                   equal_nan=True, msg=lambda s: f"value: {s}")
    torch.testing.assert_close(xl.grad, block(x.grad), atol=1e-11, rtol=1e-11, equal_nan=True,
                               msg=lambda s: f"input grad: {s}")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        torch.testing.assert_close(grad, q.grad, atol=1e-11, rtol=1e-11, equal_nan=True,
                                   msg=lambda s, n=name: f"{n} grad: {s}")
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    kind = draw(st.sampled_from(KINDS))
    tokens = domain != (2, 2) and draw(st.booleans())
    # One example in ten may hold empty slabs (every loss and reduction takes them).
    empty = draw(st.integers(0, 9)) == 0
    if tokens:  # (L, C): tokens along dim 0, the classes (channels) along dim 1
        shape = [draw(st.integers(1 if empty else axes[0], 9)), draw(st.integers(1, 4))]
        sharded = [0]
    else:
        nsp = draw(st.integers(len(axes), 3))
        sharded = draw(st.permutations(range(2, 2 + nsp)))[: len(axes)]
        least = {d: 1 if empty else p for d, p in zip(sharded, axes)}
        shape = [draw(st.integers(1, 2)), draw(st.integers(1, 4))] + [
            draw(st.integers(least.get(d, 1), 7)) for d in range(2, 2 + nsp)
        ]
    reductions = ["mean", "sum", "none"] + (["batchmean"] if kind == "kl_div" else [])
    return dict(
        domain=domain, kind=kind, tokens=tokens, shape=shape, reduction=draw(st.sampled_from(reductions)),
        option=draw(st.integers(0, 2 if kind == "gaussian" else 1)), flag=draw(st.booleans()),
        smooth=draw(st.sampled_from([0.0, 0.0, 0.15])), ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        splits=[(d, (_split if empty else _nonempty_split)(draw, shape[d], p)) for d, p in zip(sharded, axes)],
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _nonempty_split(draw, n: int, parts: int) -> list[int]:
    """``n >= parts`` rows in ``parts`` slabs of random uneven lengths, none empty."""
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=parts - 1, max_size=parts - 1, unique=True)))
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: a weighted cross entropy with ignored positions and label
# smoothing on a 2x2 mesh; kl_div's batchmean of tokens sharded along dim 0 on 3 uneven ranks.
EXAMPLES = [
    dict(domain=(2, 2), kind="ce", tokens=False, shape=[2, 3, 5, 4], reduction="mean", option=1, flag=False,
         smooth=0.15, ignored=0.3, splits=[(3, [1, 3]), (2, [4, 1])], seed=1),
    dict(domain=3, kind="kl_div", tokens=True, shape=[8, 3], reduction="batchmean", option=0, flag=True,
         smooth=0.0, ignored=0.0, splits=[(0, [5, 1, 2])], seed=2),
]  # fmt: skip

test_fuzz_guard_losses_fast, test_fuzz_guard_losses_campaign = fuzz_tests(
    "guard losses fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_GUARD_LOSSES_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_GUARD_LOSSES_EXAMPLES", 300), every=50,
)
