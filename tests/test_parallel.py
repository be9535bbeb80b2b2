"""parallelize() and the loss helpers: single-device gradients from per-rank losses."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn

from .harness import mesh


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.Tanh(), nn.Conv2d(6, 6, 3, stride=2, padding=1, padding_mode="circular"),
        nn.Tanh(), nn.Conv2d(6, 1, 1),
    ).double()


def _reference_grads(ref, x, y_true, loss_fn):
    loss = loss_fn(ref(x), y_true)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _ddp_case(domain, data, loss_name):
    m = mesh(domain, data)
    torch.manual_seed(1)
    x = torch.randn(data * 1, 2, 18, 7, dtype=torch.float64)  # one sample per data replica
    y_true = torch.randn(data * 1, 1, 9, 4, dtype=torch.float64)
    ref = _model()

    def rel_l2(pred, target):
        b = pred.shape[0]
        return ((pred - target).reshape(b, -1).norm(dim=1) / target.reshape(b, -1).norm(dim=1)).mean()

    full_loss = {"mse": F.mse_loss, "rel_l2": rel_l2}[loss_name]
    loss_ref, grads_ref = _reference_grads(ref, x, y_true, full_loss)

    ddp = snn.parallelize(copy.deepcopy(_model()), m)
    b = m.get_local_rank("data") if data > 1 else 0
    x_local = snn.shard(x[b : b + 1], m, dims=(2,), align=2)
    y_local = snn.shard(y_true[b : b + 1], m, dims=(2,))
    pred = ddp(x_local)
    loss = {"mse": snn.losses.mse_loss, "rel_l2": snn.losses.relative_l2}[loss_name](pred, y_local, m)
    loss.backward()
    if data == 1:
        torch.testing.assert_close(loss.detach(), loss_ref, atol=1e-12, rtol=1e-12)
    for n, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[n], atol=1e-12, rtol=1e-10, msg=lambda s, n=n: f"{n}: {s}")
    return loss.item()


def test_parallelize_domain_only_mse(run):
    run(2, _ddp_case, 2, 1, "mse")


def test_parallelize_domain_only_relative_l2(run):
    run(3, _ddp_case, 3, 1, "rel_l2")


def test_parallelize_data_x_domain(run):
    # 2 data replicas x 2 domain ranks: sum over the domain, mean over the data axis.
    run(4, _ddp_case, 2, 2, "mse")


def _losses(domain):
    m = mesh(domain)
    torch.manual_seed(2)
    pred = torch.randn(2, 3, 13, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 3, 13, 5, dtype=torch.float64)
    out = {}
    for name, fn_full, fn_sharded in (
        ("mean", lambda p, t: p.mean(), lambda p, t: snn.losses.global_mean(p, m)),
        ("mse", F.mse_loss, lambda p, t: snn.losses.mse_loss(p, t, m)),
        (
            "rel_l2",
            lambda p, t: ((p - t).flatten(1).norm(dim=1) / t.flatten(1).norm(dim=1)).mean(),
            lambda p, t: snn.losses.relative_l2(p, t, m),
        ),
    ):
        pred.grad = None
        ref = fn_full(pred, target)
        ref.backward()
        p_local = snn.shard(pred.detach(), m).requires_grad_()
        loss = fn_sharded(p_local, snn.shard(target, m))
        torch.testing.assert_close(loss.detach(), ref.detach(), atol=1e-13, rtol=1e-12)  # same value on every rank
        loss.backward()
        torch.testing.assert_close(snn.gather(p_local.grad, m), pred.grad, atol=1e-13, rtol=1e-12)
        out[name] = loss.item()
    return out


def test_losses_value_and_gradient(run):
    res = run(3, _losses, 3)
    assert res[0] == res[1] == res[2]


def _loss_shape_error():
    import pytest

    with pytest.raises(ValueError, match="same shape"):
        snn.losses.mse_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), mesh(2))
    return True


def test_loss_shape_mismatch(run):
    assert all(run(2, _loss_shape_error))


def test_parallelize_rejects_bad_mode():
    import pytest

    # Decided from the arguments alone, before any communication: the same error on every rank.
    with pytest.raises(ValueError, match="mode must be 'ddp' or 'fsdp', got 'zero'"):
        snn.parallelize(nn.Linear(1, 1), None, mode="zero")
    with pytest.raises(ValueError, match="fsdp_modules=.*needs mode='fsdp'"):
        snn.parallelize(nn.Linear(1, 1), None, fsdp_modules=("fc",))
