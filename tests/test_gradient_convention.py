"""The gradient convention, function by function, against single-device autograd.

The rule (DESIGN.md section 3): every rank calls ``backward()`` and the global loss is the sum of
the per-rank losses. Reductions, ``gather`` and ``domain_sum`` return replicated *values*; a loss
built from a replicated value goes through ``losses.share`` (over the axes it is replicated on);
the loss helpers (``global_mean``, ``mse_loss``, ``relative_l2``) return shared losses. Doing
just that must give exact input-slab gradients and parameter gradients whose sum over the domain
ranks is the single-device gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.comm import comm_device

from .harness import mesh, world_of

TOL = {"atol": 1e-12, "rtol": 1e-12}


def _data(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _reductions_case(domain):
    """loss = share(f(reduction(x), w)); backward on every rank; x slab grads and w grads exact."""
    m = mesh(domain)
    x = _data((2, 3, 11, 7), 0)
    w = _data((2, 3), 1).requires_grad_()
    ops = {
        "sum": (lambda t: t.sum((2, 3)), lambda t: snn.reductions.sum(t, m, (2, 3))),
        "mean": (lambda t: t.mean((2, 3)), lambda t: snn.reductions.mean(t, m, (2, 3))),
        "max": (lambda t: t.amax((2, 3)), lambda t: snn.reductions.max(t, m, (2, 3))),
    }
    for name, (full, sharded) in ops.items():
        xr = x.clone().requires_grad_()
        w.grad = None
        loss_ref = (full(xr) * w).sin().sum()
        loss_ref.backward()
        w_ref = w.grad.clone()

        w.grad = None
        x_local = snn.shard(x, m).requires_grad_()
        loss = snn.losses.share((sharded(x_local) * w).sin().sum(), m)
        torch.testing.assert_close(loss, loss_ref.detach(), **TOL)
        loss.backward()
        torch.testing.assert_close(snn.gather(x_local.grad, m), xr.grad, **TOL, msg=lambda s, n=name: f"{n}: {s}")
        # w is replicated (a parameter): its gradients are partial, their sum is exact.
        torch.testing.assert_close(snn.losses.domain_sum(w.grad, m), w_ref, **TOL, msg=lambda s, n=name: f"{n}: {s}")

    # argmax has no gradient: its result is an index, never part of the graph.
    x_local = snn.shard(x, m).requires_grad_()
    idx = snn.reductions.argmax(x_local, m, 2, keepdim=True)
    # H is reduced; on the 2x2 mesh W stays sharded: compare this rank's W slab.
    w_slab = snn.local_slices(x.shape, m)[3]
    assert not idx.requires_grad and torch.equal(idx, x.argmax(2, keepdim=True)[..., w_slab])
    return True


@pytest.mark.parametrize("domain", [3, (2, 2)], ids=["P3", "2x2"])
def test_reductions_with_shared_loss(run, domain):
    assert all(run(world_of(domain), _reductions_case, domain))


def _unshared_reduction_is_p_times():
    # The trap the convention names: a replicated value used as a loss without share counts the
    # loss once per rank, so the gradient is P times the single-device one (as documented).
    m = mesh(3)
    x = _data((1, 2, 10, 3), 2)
    xr = x.clone().requires_grad_()
    xr.square().mean().backward()
    x_local = snn.shard(x, m).requires_grad_()
    snn.reductions.mean(x_local.square(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), 3 * xr.grad, **TOL)
    # ... and global_mean, the loss form of the same value, is shared.
    x_local.grad = None
    snn.losses.global_mean(x_local.square(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), xr.grad, **TOL)
    return True


def test_unshared_reduction_counts_every_rank(run):
    assert all(run(3, _unshared_reduction_is_p_times))


def _losses_case(domain):
    """The loss helpers: ``loss.backward()`` on every rank; value and gradient of single device."""
    m = mesh(domain)
    pred = _data((2, 3, 9, 7), 3)
    target = _data((2, 3, 9, 7), 4)
    cases = {
        "global_mean": (lambda p, t: p.sin().mean(), lambda p, t: snn.losses.global_mean(p.sin(), m)),
        "mse_loss": (F.mse_loss, lambda p, t: snn.losses.mse_loss(p, t, m)),
        "relative_l2": (
            lambda p, t: ((p - t).flatten(1).norm(dim=1) / t.flatten(1).norm(dim=1)).mean(),
            lambda p, t: snn.losses.relative_l2(p, t, m),
        ),
    }
    for name, (full, sharded) in cases.items():
        pr = pred.clone().requires_grad_()
        ref = full(pr, target)
        ref.backward()
        p_local = snn.shard(pred, m).requires_grad_()
        loss = sharded(p_local, snn.shard(target, m))
        torch.testing.assert_close(loss, ref.detach(), **TOL, msg=lambda s, n=name: f"{n}: {s}")
        loss.backward()
        torch.testing.assert_close(snn.gather(p_local.grad, m), pr.grad, **TOL, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("domain", [2, (2, 2)], ids=["P2", "2x2"])
def test_loss_helpers(run, domain):
    assert all(run(world_of(domain), _losses_case, domain))


def _share_one_axis_case():
    """A value replicated over ONE axis of a 2x2 mesh is shared over that axis only."""
    m = mesh((2, 2))
    x = _data((1, 2, 9, 7), 5)
    g = _data((1, 2, 7), 6)
    xr = x.clone().requires_grad_()
    (xr.sum(2) * g).sum().backward()

    x_local = snn.shard(x, m).requires_grad_()
    # Summed over H (the "domain0" axis): replicated over domain0, still sharded along W by domain1.
    y = snn.reductions.sum(x_local, m, (2,))
    w_slice = (slice(None), slice(None), snn.local_slices(x.shape, m)[3])
    assert y.shape == g[w_slice].shape
    # This rank's loss is a partial sum over domain1 (its W slab) and a replica over domain0.
    loss = (y * g[w_slice]).sum()
    snn.losses.share(loss, m, mesh_axes="domain0").backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), xr.grad, **TOL)
    # Sharing over every domain axis would halve it: the domain1 ranks hold different terms.
    x_local.grad = None
    snn.losses.share((snn.reductions.sum(x_local, m, (2,)) * g[w_slice]).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), xr.grad / 2, **TOL)
    return True


def test_share_over_one_axis_of_2x2(run):
    assert all(run(4, _share_one_axis_case))


def _domain_sum_and_gather_case():
    m = mesh((2, 2))
    x = _data((1, 2, 9, 7), 7)
    xr = x.clone().requires_grad_()
    (xr.square().sum().sin() + (xr.cos() * _data(x.shape, 8)).sum()).backward()

    x_local = snn.shard(x, m).requires_grad_()
    # domain_sum: per-rank partial -> replicated total -> shared loss.
    total = snn.losses.domain_sum(x_local.square().sum(), m)
    # gather: replicated full tensor -> shared loss.
    full = snn.gather(x_local.cos(), m)
    loss = snn.losses.share(total.sin() + (full * _data(x.shape, 8)).sum(), m)
    loss.backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), xr.grad, **TOL)

    # gather over fewer dims than domain axes: the slab is a replica over domain1, so its
    # gradient there is a share; the replicas' shares add up to the exact slab gradient.
    h_local = snn.shard(x, m, dims=(2,)).requires_grad_()
    snn.losses.share((snn.gather(h_local.cos(), m, dims=(2,)) * _data(x.shape, 8)).sum(), m).backward()
    hr = x.clone().requires_grad_()
    (hr.cos() * _data(x.shape, 8)).sum().backward()
    summed = snn.losses.domain_sum(h_local.grad, m, mesh_axes="domain1")
    torch.testing.assert_close(summed, hr.grad[snn.local_slices(x.shape, m, dims=(2,))], **TOL)
    return True


def test_domain_sum_and_gather(run):
    assert all(run(4, _domain_sum_and_gather_case))


# ---------------------------------------------------------------------------------------------
# Precision: float32 accumulation for half inputs
# ---------------------------------------------------------------------------------------------


def _half_case(dtype):
    m = mesh(2)
    gen = torch.Generator().manual_seed(9)
    # 90000 elements: more than fp16 can count (max 65504), and a sum of squares that overflows
    # fp16 where torch's own losses (float32 accumulation) are finite.
    pred32 = torch.randn(1, 1, 300, 300, generator=gen)
    target32 = torch.randn(1, 1, 300, 300, generator=gen)
    pred, target = pred32.to(dtype), target32.to(dtype)
    # Single-device float32 math on the same (rounded) inputs.
    p32, t32 = pred.float(), target.float()
    want = {
        "mse_loss": F.mse_loss(p32, t32),
        "global_mean": p32.square().mean(),
        "relative_l2": (p32 - t32).flatten(1).norm(dim=1).div(t32.flatten(1).norm(dim=1)).mean(),
        "reductions.mean": p32.square().mean((2, 3)),
        "reductions.sum": p32.sum((2, 3)),
    }
    p_loc, t_loc = snn.shard(pred, m), snn.shard(target, m)
    got = {
        "mse_loss": snn.losses.mse_loss(p_loc, t_loc, m),
        "global_mean": snn.losses.global_mean(p_loc.square(), m),
        "relative_l2": snn.losses.relative_l2(p_loc, t_loc, m),
        "reductions.mean": snn.reductions.mean(p_loc.square(), m, (2, 3)),
        "reductions.sum": snn.reductions.sum(p_loc, m, (2, 3)),
    }
    for name, value in want.items():
        assert got[name].dtype == dtype, (name, got[name].dtype)
        # The rounding of the inputs' difference and of the result to the input dtype, nothing more.
        tol = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        torch.testing.assert_close(got[name].float(), value, rtol=tol, atol=tol, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_accumulates_in_float32(run, dtype):
    assert all(run(2, _half_case, dtype))


# ---------------------------------------------------------------------------------------------
# Errors: decided on facts every rank shares, so every rank raises the same error
# ---------------------------------------------------------------------------------------------


def _loss_mismatch_on_one_rank(fn_name):
    m = mesh(2)
    r = m.get_local_rank("domain")
    pred = torch.zeros(1, 2, 4, 3, dtype=torch.float64)
    target = torch.zeros(1, 2, 4, 3 + r, dtype=torch.float64)  # wrong on rank 1 only
    try:
        getattr(snn.losses, fn_name)(pred, target, m)
    except ValueError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("fn_name", ["mse_loss", "relative_l2"])
def test_loss_shape_mismatch_on_one_rank_raises_everywhere(pools, fn_name):
    assert pools.run(2, _ready) == [True, True]
    # A short timeout: the bug is rank 0 waiting in the all-reduce while rank 1 raised alone.
    res = pools.run(2, _loss_mismatch_on_one_rank, fn_name, timeout=30)
    assert res[0] == res[1] and res[0] is not None, res
    assert res[0][0] == "ValueError" and "differ on domain rank(s) [1]" in res[0][1], res


def _share_bad_axes():
    m = mesh((2, 2))
    out = []
    for bad in ("data", ("domain0", "domain0"), "nope"):
        try:
            snn.losses.share(torch.ones(()), m, mesh_axes=bad)
        except ValueError as e:
            out.append(str(e))
    return out


def test_share_rejects_bad_axes_on_every_rank(run):
    res = run(4, _share_bad_axes)
    assert all(r == res[0] for r in res) and len(res[0]) == 3 and all("mesh_axes" in s for s in res[0])


def _src_device_case():
    """shard(x, src=r) picks the device from the domain group, the same on every rank.

    On CPU there is no NCCL, so the communication device is replaced by "meta" (different from
    x's CPU device, as CUDA is on an NCCL mesh) and the scatter is recorded instead of run.
    """
    from sharded_nn import sharding

    m = mesh(2)
    seen = {}

    def fake_scatter(parts, shape, dtype, device, group, src, shapes):
        seen["device"] = torch.device(device)
        seen["parts"] = None if parts is None else sorted({str(p.device) for p in parts})
        return torch.empty(shape, dtype=dtype, device=device)

    real_device, real_scatter = sharding.comm_device, sharding.scatter_uneven
    sharding.comm_device, sharding.scatter_uneven = (lambda group: torch.device("meta")), fake_scatter
    try:
        x = torch.randn(1, 2, 6) if m.get_local_rank("domain") == 1 else None
        y = snn.shard(x, m, src=1)
    finally:
        sharding.comm_device, sharding.scatter_uneven = real_device, real_scatter
    assert str(comm_device(snn.domain_group(m))) == "cpu"
    return str(seen["device"]), seen["parts"], str(y.device)


def test_shard_src_device_is_the_groups(run):
    res = run(2, _src_device_case)
    assert res[0] == ("meta", None, "meta")
    assert res[1] == ("meta", ["meta"], "meta")  # the CPU x was moved there on src


def _ready():
    return True
