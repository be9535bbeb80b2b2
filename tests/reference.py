"""Reference-first checks: a single-device module against its converted copy on slabs."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.mesh import domain_axes
from sharded_nn.sharding import default_dims


def reduce_param_grads(model: nn.Module, mesh) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over the domain ranks (what ``parallelize`` does with DDP)."""
    out = {}
    group = snn.domain_group(mesh)
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        out[name] = g
    return out


def assert_param_grads(ref: nn.Module, model: nn.Module, mesh, tol_of=None, **tol) -> None:
    """Every parameter gradient of ``model`` (summed over the domain ranks) equals ``ref``'s (zero
    where ``ref``'s forward never used the parameter); ``tol_of(name)``: a parameter's own tolerance."""
    grads = reduce_param_grads(model, mesh)
    for name, p in ref.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        t = tol_of(name) if tol_of is not None else tol
        torch.testing.assert_close(grads[name], want, **t, msg=lambda s, n=name: f"{n}: {s}")


def check_against_reference(
    ref: nn.Module,
    x: torch.Tensor,
    mesh,
    *,
    dims: Sequence[int] | None = None,
    align: int | Sequence[int] = 1,
    sharded: nn.Module | None = None,
    sizes: Sequence[int] | None = None,
    atol: float = 1e-10,
    rtol: float = 1e-10,
    seed: int = 0,
    inference: bool = True,
) -> dict[str, float]:
    """Forward and backward of ``ref`` on ``x`` against the converted copy on this rank's slab.

    ``sizes`` gives explicit per-rank slab sizes along ``dims[0]`` (1-D meshes), or one tuple per
    sharded dim (2-D meshes), instead of the balanced split. Compares the gathered output, the gathered input gradient and every parameter gradient
    (summed over the domain ranks) with ``torch.testing.assert_close``; returns the max errors.
    ``inference=False`` leaves out the ``no_grad`` forward described below (a compiled model
    compiles it again, for a test whose point is another path).
    ``dims`` defaults to the library default (one spatial dim per domain axis).
    """
    if dims is None:
        dims = default_dims(mesh)
    model = sharded if sharded is not None else snn.convert(copy.deepcopy(ref), mesh)
    x = x.detach().clone().requires_grad_()
    y = ref(x)
    gen = torch.Generator().manual_seed(seed)
    g_out = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    (y * g_out).sum().backward()

    if sizes is None:
        x_local = snn.shard(x.detach(), mesh, dims=dims, align=align)
    else:
        # One tuple of slab sizes per sharded dim (a 2-D mesh), or one tuple for dims[0].
        per_dim = sizes if isinstance(sizes[0], (tuple, list)) else (sizes,)
        x_local = x.detach()
        for d, split, axis in zip(dims, per_dim, domain_axes(mesh)):
            r = mesh.get_local_rank(axis)
            x_local = x_local.narrow(d, sum(split[:r]), split[r])
        x_local = x_local.clone()
    if inference and not any(m.training and any(True for _ in m.buffers(recurse=False)) for m in model.modules()):
        # The inference forward too (no autograd: layers take their no-grad paths, e.g. thin
        # slabs convolved on one extended copy), where a second forward changes no state (no
        # module with buffers in training mode: a BatchNorm would update its statistics again),
        # and the global random state restored after it (the forward below draws as it would).
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            y_inf = snn.gather(model(x_local), mesh, dims=dims)
        torch.testing.assert_close(y_inf, y.detach(), atol=atol, rtol=rtol, msg=lambda m: f"no_grad forward: {m}")
    x_local.requires_grad_()
    y_local = model(x_local)
    y_full = snn.gather(y_local, mesh, dims=dims)
    torch.testing.assert_close(y_full, y.detach(), atol=atol, rtol=rtol)
    snn.losses.share((y_full * g_out).sum(), mesh).backward()

    gx = snn.gather(x_local.grad, mesh, dims=dims)
    torch.testing.assert_close(gx, x.grad, atol=atol, rtol=rtol)
    errors = {"out": (y_full - y).abs().max().item(), "grad_in": (gx - x.grad).abs().max().item()}
    grads = reduce_param_grads(model, mesh)
    for name, p in ref.named_parameters():
        # A parameter the forward never uses (MONAI's cross-attention norms) has no gradient on
        # one device: the sharded model's must then be zero on every rank.
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[name], expected, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
        errors[name] = (grads[name] - expected).abs().max().item()
    return errors


def compare_on_slabs(ref: nn.Module, model: nn.Module, m, x: torch.Tensor, sizes, replicated: bool = True) -> float:
    """``ref`` on ``x`` against ``model`` on slabs of ``x`` along dim 2 of explicit ``sizes``:
    forward, input gradient and summed parameter gradients (1e-10). The output is replicated
    (logits) or a slab along dim 2, gathered by its own slabs (a crop changes them)."""
    x = x.detach().requires_grad_()
    y_ref = ref(x)
    g = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(5))
    (y_ref * g).sum().backward()
    r = m.get_local_rank("domain")
    x_local = x.detach().narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    y = model(x_local)
    y = y if replicated else snn.gather(y, m, dims=(2,))
    snn.losses.share((y * g).sum(), m).backward()
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-10, rtol=1e-10)
    errs = [(y - y_ref).abs().max().item()]
    # (A slab that no output depends on has no gradient: zeros, as in the reference's rows.)
    gx = snn.gather(x_local.grad if x_local.grad is not None else torch.zeros_like(x_local), m, dims=(2,))
    torch.testing.assert_close(gx, x.grad, atol=1e-10, rtol=1e-10)
    errs.append((gx - x.grad).abs().max().item())
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[name], expected, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
        errs.append((grads[name] - expected).abs().max().item())
    return max(errs)


def error_on_slab(model: nn.Module, x: torch.Tensor, m, sizes, dim: int = 2) -> str:
    """Run ``model`` on this rank's slab of ``x`` (``sizes`` along ``dim``, a 1-D mesh): the
    ``ShardingError``'s message, or ``"no error"`` (tests that a refusal comes alike on every rank)."""
    r = m.get_local_rank("domain")
    try:
        model(x.narrow(dim, sum(sizes[:r]), sizes[r]))
    except snn.ShardingError as e:
        return str(e)
    return "no error"
