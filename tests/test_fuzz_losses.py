"""Hypothesis fuzzing of ``snn.losses``: shared losses of random slabs against the whole sample.

``tests/test_loss_helpers.py`` checks chosen cases; this file draws them: ``mse_loss``,
``relative_l2`` (with ``eps``), ``dice_loss`` (probabilities against one-hot, soft or integer
labels, ``(N, S...)`` or ``(N, 1, S...)`` indices with out-of-range ones, or a one-class mask, ``squared_pred``,
``include_background``, the smoothing terms, every ``reduction``), ``global_mean``,
``global_sum``; 1-3 spatial dims of lengths 1-7, batches of 1-2, any spatial dims sharded,
slabs of random uneven lengths with empty ones, on 1-4 ranks or a 2x2 mesh (float64). Each
rank's loss value must be the single-device loss of the whole sample (written out here from
the documented formulas), and ``backward()`` on every rank must give each rank its slab of the
single device's input gradient. Any mismatch fails.

- ``test_fuzz_losses_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_losses_campaign`` (``pytest -m slow``): ``SNN_FUZZ_LOSSES_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import sharded_nn as snn

from .fuzzing import fuzz_tests, outcome
from .harness import mesh
from .test_fuzz_fft_modes import _split


def _dice(p, t, cfg):
    """MONAI's soft Dice on whole tensors, written out."""
    if not cfg["background"]:
        p, t = p[:, 1:], t[:, 1:]
    spatial = tuple(range(2, p.dim()))
    power = (lambda v: v * v) if cfg["squared"] else (lambda v: v)
    loss = 1 - (2 * (p * t).sum(spatial) + cfg["snr"]) / (power(p).sum(spatial) + power(t).sum(spatial) + cfg["sdr"])
    return {"mean": loss.mean(), "sum": loss.sum(), "none": loss}[cfg["reduction"]]


def _case(cfg: dict):
    m = mesh(cfg["domain"])
    splits = cfg["splits"]
    coords = [m.get_local_rank(a) for a in m.mesh_dim_names]
    gen = torch.Generator().manual_seed(cfg["seed"])
    shape = cfg["shape"]
    name = cfg["name"]
    pred = torch.randn(shape, generator=gen, dtype=torch.float64)
    if name == "dice":
        pred = pred.softmax(1)
    pred.requires_grad_()
    labels = cfg["labels"]
    if labels == "indices" or labels == "indices1":
        target = torch.randint(-1, shape[1] + 1, (shape[0], *shape[2:]), generator=gen)  # out of range too
        if labels == "indices1":
            target = target.unsqueeze(1)
    else:
        target = torch.rand(shape, generator=gen, dtype=torch.float64)
        if labels == "onehot":
            target = F.one_hot(target.argmax(1), shape[1]).movedim(-1, 1).double()

    def block(t, shift=0):
        for (d, split), c in zip(splits, coords):
            t = t.narrow(d - shift, sum(split[:c]), split[c])
        return t

    p_l = block(pred.detach()).clone().requires_grad_()
    t_l = block(target, shift=1 if labels == "indices" else 0)
    if name == "mse":
        ref, ours = F.mse_loss(pred, target), snn.losses.mse_loss(p_l, t_l, m)
    elif name == "relative_l2":
        b = shape[0]
        err = (pred - target).reshape(b, -1).norm(dim=1) / ((target.reshape(b, -1).norm(dim=1)) + cfg["eps"])
        ref, ours = err.mean(), snn.losses.relative_l2(p_l, t_l, m, eps=cfg["eps"])
    elif name == "global_mean":
        ref, ours = (pred * target).mean(), snn.losses.global_mean(p_l * t_l, m)
    elif name == "global_sum":
        ref, ours = (pred * target).sum(), snn.losses.global_sum(p_l * t_l, m)
    else:
        one_hot = target.double()
        # Integer labels are class indices, but for one class (N, 1, S...) is the mask itself
        # (MONAI's reading without to_onehot_y).
        if labels == "indices" or (labels == "indices1" and shape[1] > 1):
            idx = target if labels == "indices" else target.squeeze(1)
            one_hot = (idx.unsqueeze(1) == torch.arange(shape[1]).view(1, -1, *(1,) * (idx.dim() - 1))).double()
        ref = _dice(pred, one_hot, cfg)
        ours = snn.losses.dice_loss(
            p_l, t_l, m, smooth_nr=cfg["snr"], smooth_dr=cfg["sdr"], squared_pred=cfg["squared"],
            include_background=cfg["background"], reduction=cfg["reduction"],
        )  # fmt: skip
    torch.testing.assert_close(ours, ref.detach(), atol=1e-12, rtol=1e-12, msg=lambda s: f"value: {s}")
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)  # a 'none' reduction's weights
    (ref * w).sum().backward()
    (ours * w).sum().backward()
    torch.testing.assert_close(p_l.grad, block(pred.grad), atol=1e-12, rtol=1e-12, msg=lambda s: f"grad: {s}")
    return "ok"


@st.composite
def configs(draw):
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    axes = [2, 2] if domain == (2, 2) else [domain]
    nsp = draw(st.integers(len(axes), 3))
    name = draw(st.sampled_from(["mse", "relative_l2", "dice", "global_mean", "global_sum"]))
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 3))] + [draw(st.integers(1, 7)) for _ in range(nsp)]
    labels = draw(st.sampled_from(["onehot", "soft", "indices", "indices1"])) if name == "dice" else "soft"
    sharded = draw(st.permutations(range(2, 2 + nsp)))[: len(axes)]
    return dict(
        domain=domain, name=name, shape=shape, labels=labels, eps=draw(st.sampled_from([0.0, 1e-3])),
        snr=draw(st.sampled_from([1e-5, 0.0, 1.0])), sdr=draw(st.sampled_from([1e-5, 1.0])),
        squared=draw(st.booleans()), background=draw(st.booleans()) if shape[1] > 1 else True,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        splits=[(d, _split(draw, shape[d], p)) for d, p in zip(sharded, axes)], seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)


# Cases the fast run always includes: Dice of (N, S...) integer labels with out-of-range ones at 3
# ranks with an empty slab; relative L2 on a 2x2 mesh.
EXAMPLES = [
    dict(domain=3, name="dice", shape=[2, 3, 7, 2], labels="indices", eps=0.0, snr=1e-5, sdr=1e-5, squared=True,
         background=False, reduction="none", splits=[(2, [3, 0, 4])], seed=1),
    dict(domain=(2, 2), name="relative_l2", shape=[2, 1, 3, 5], labels="soft", eps=1e-3, snr=1e-5, sdr=1e-5,
         squared=False, background=True, reduction="mean", splits=[(3, [1, 4]), (2, [2, 1])], seed=2),
]  # fmt: skip

test_fuzz_losses_fast, test_fuzz_losses_campaign = fuzz_tests(
    "losses fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_LOSSES_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_LOSSES_EXAMPLES", 300), every=50,
)
