"""Loss helpers users had to write themselves (issue 15, item 5), against single-device autograd.

``dice_loss`` and ``global_sum`` return shared losses (value: the global loss on every rank;
gradient: this rank's share), so ``backward()`` on every rank gives exact input-slab gradients and
parameter gradients whose sum over the domain ranks is the single-device gradient, with no
``share`` to forget. ``batch_slice`` / ``local_slices(batch_dim=)`` / ``shard(batch_dim=)`` cut a
global batch by the data axis, and ``global_loss_value`` is the loss of the whole global batch on
a data x domain mesh: together with parallelize's averaging over data they reproduce
single-device training on the global batch.
"""

from __future__ import annotations

import pytest
import torch

import sharded_nn as snn
from sharded_nn.mesh import axis_group

from .harness import mesh

TOL = {"atol": 1e-12, "rtol": 1e-12}


def _data(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _labels(shape, classes, seed):
    return torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(seed))


def _dice_ref(p, t, *, smooth_nr=1e-5, smooth_dr=1e-5, squared_pred=False, include_background=True, reduction="mean"):
    """Single-device soft Dice (MONAI's formula), per sample and class."""
    if not include_background:
        p, t = p[:, 1:], t[:, 1:]
    dims = tuple(range(2, p.dim()))
    inter = (p * t).sum(dims)
    den = (p.square() if squared_pred else p).sum(dims) + (t.square() if squared_pred else t).sum(dims)
    loss = 1 - (2 * inter + smooth_nr) / (den + smooth_dr)
    return {"mean": loss.mean(), "sum": loss.sum(), "none": loss}[reduction]


def test_dice_reference_is_monais():
    """The reference above is MONAI's DiceLoss (the formula the helper documents)."""
    from monai.losses import DiceLoss

    p = _data((2, 3, 7, 5), 0).softmax(1)
    t = torch.nn.functional.one_hot(_labels((2, 7, 5), 3, 1), 3).movedim(-1, 1).double()
    for kw in ({}, {"squared_pred": True, "include_background": False}):
        torch.testing.assert_close(_dice_ref(p, t, **kw), DiceLoss(**kw)(p, t), **TOL)


def _model(x, w):
    """A pointwise segmentation head: class probabilities from a channel mix (runs on slabs unchanged)."""
    return torch.einsum("oc,nc...->no...", w, x).softmax(1)


def _dice_case(domain):
    m = mesh(domain)
    x = _data((2, 3, 11, 4), 0)  # D = 11: 6+5 at P=2, 4+4+3 at P=3
    labels = _labels((2, 11, 4), 3, 1)
    labels[1, :, :] = labels[1].clamp(max=1)  # sample 1 has no class 2: the smooth terms matter
    onehot = torch.nn.functional.one_hot(labels, 3).movedim(-1, 1).double()
    w0 = _data((3, 3), 2)
    cases = [
        ({}, "indices"),
        ({}, "onehot"),
        ({"squared_pred": True, "include_background": False, "smooth_nr": 0.0, "smooth_dr": 1e-3}, "onehot"),
        ({"reduction": "sum"}, "indices (N, 1, ...)"),
        ({"reduction": "none"}, "indices"),
    ]
    for kw, kind in cases:
        what = f"P={domain} {kw} {kind}"
        xr, wr = x.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = _dice_ref(_model(xr, wr), onehot, **kw)
        ref.sum().backward()

        w = w0.clone().requires_grad_()
        x_l = snn.shard(x, m).requires_grad_()
        target = {"indices": labels, "onehot": onehot, "indices (N, 1, ...)": labels[:, None]}[kind]
        t_l = snn.shard(target, m, dims=(target.dim() - 2,))  # D: dim 1 of (N, D, H), dim 2 otherwise
        loss = snn.losses.dice_loss(_model(x_l, w), t_l, m, **kw)
        torch.testing.assert_close(loss, ref.detach(), **TOL, msg=lambda s: f"{what}: {s}")
        loss.sum().backward()  # no share: the helper's result is a loss already
        torch.testing.assert_close(snn.gather(x_l.grad, m), xr.grad, **TOL, msg=lambda s: f"{what} dx: {s}")
        torch.testing.assert_close(snn.losses.domain_sum(w.grad, m), wr.grad, **TOL, msg=lambda s: f"{what} dw: {s}")
    return True


def _global_sum_case(domain):
    m = mesh(domain)
    x = _data((2, 3, 11, 6), 3)
    w0 = _data((3, 1, 1), 4)
    xr, wr = x.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = (xr.square() * wr).sum()
    ref.backward()
    x_l, w = snn.shard(x, m).requires_grad_(), w0.clone().requires_grad_()
    loss = snn.losses.global_sum(x_l.square() * w, m)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    loss.backward()
    torch.testing.assert_close(snn.gather(x_l.grad, m), xr.grad, **TOL)
    torch.testing.assert_close(snn.losses.domain_sum(w.grad, m), wr.grad, **TOL)
    # The hazard it removes: the replicated *value* domain_sum, backpropagated on every rank
    # without share, counts the loss once per rank: P times the gradient.
    x_v = snn.shard(x, m).requires_grad_()
    snn.losses.domain_sum((x_v.square() * w0).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_v.grad, m), snn.domain_size(m) * xr.grad, **TOL)
    return True


@pytest.mark.parametrize("domain", [2, 3])
def test_dice_loss_matches_single_device(run, domain):
    assert all(run(domain, _dice_case, domain))


@pytest.mark.parametrize("domain", [2, 3, (2, 2)])
def test_global_sum_is_a_shared_loss(run, domain):
    world = domain if isinstance(domain, int) else 4
    assert all(run(world, _global_sum_case, domain))


def _data_domain_case():
    """2 data x 2 domain: each replica's half of the global batch, sharded along D."""
    m = mesh(2, data=2)
    batch = 4
    x = _data((batch, 3, 9, 4), 5)
    labels = _labels((batch, 9, 4), 3, 6)
    target = _data((batch, 3, 9, 4), 7)
    w0 = _data((3, 3), 8)
    replica = m.get_local_rank("data")

    sl = snn.local_slices(x.shape, m, batch_dim=0)
    mine = snn.batch_slice(m, batch)
    assert mine == slice(2 * replica, 2 * replica + 2) and sl[0] == mine and sl[2] == snn.local_slices(x.shape, m)[2]
    assert torch.equal(snn.shard(x, m, batch_dim=0), x[sl])

    # Single device, global batch.
    xr, wr = x.clone().requires_grad_(), w0.clone().requires_grad_()
    p = _model(xr, wr)
    onehot = torch.nn.functional.one_hot(labels, 3).movedim(-1, 1).double()
    ref_dice, ref_mse = _dice_ref(p, onehot), torch.nn.functional.mse_loss(p, target)
    (ref_dice + ref_mse).backward()

    # Sharded: this replica's samples, this rank's slab of each.
    w = w0.clone().requires_grad_()
    x_l = snn.shard(x, m, batch_dim=0).requires_grad_()
    p_l = _model(x_l, w)
    dice = snn.losses.dice_loss(p_l, labels[snn.local_slices(labels.shape, m, dims=(1,), batch_dim=0)], m)
    mse = snn.losses.mse_loss(p_l, snn.shard(target, m, batch_dim=0), m)
    (dice + mse).backward()
    # What parallelize's hook does: sum over the domain ranks, average over the data replicas.
    data = axis_group(m, "data")
    grad_w = snn.comm.all_reduce_sum(snn.losses.domain_sum(w.grad, m), data) / 2
    torch.testing.assert_close(grad_w, wr.grad, **TOL)
    torch.testing.assert_close(snn.gather(x_l.grad, m), xr.grad[mine] * 2, **TOL)  # a replica's mean: 2x its share
    values = {name: snn.losses.global_loss_value(v, m) for name, v in (("dice", dice), ("mse", mse))}
    torch.testing.assert_close(values["dice"], ref_dice.detach(), **TOL)
    torch.testing.assert_close(values["mse"], ref_mse.detach(), **TOL)
    assert not values["dice"].requires_grad
    try:
        snn.batch_slice(m, 5)
    except ValueError as exc:
        error = str(exc)
    return error


def test_data_x_domain_batch_slice_and_logged_loss(run):
    errors = run(4, _data_domain_case)
    assert len(set(errors)) == 1 and "must be a positive multiple of the 2 data replicas" in errors[0]
