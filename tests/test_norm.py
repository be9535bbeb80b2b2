"""Sharded normalization layers against the torch layers on the full tensor, forward and backward."""

from __future__ import annotations

import copy
from functools import partial
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import sharded_nn as snn
from sharded_nn.layers.norm import global_moments

from .harness import mesh, world_of
from .reference import check_against_reference, reduce_param_grads


def _input(*shape, seed=1, offset=0.0):
    torch.manual_seed(seed)
    # A large common offset makes E[x^2] - E[x]^2 lose every digit; two-pass keeps them.
    return torch.randn(*shape, dtype=torch.float64) + offset


def _module(factory):
    torch.manual_seed(0)
    m = factory().double()
    # Non-trivial affine parameters, so that wrong slicing or channel views show up.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


def _check_buffers(ref: nn.Module, sharded: nn.Module) -> None:
    for (name, a), (_, b) in zip(ref.named_buffers(), sharded.named_buffers()):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"buffer {n}: {m}")


# (factory, input shape, dims) cases; sizes chosen so that slabs are uneven on 2, 3 and 4 ranks.
CASES_1D = [
    (partial(nn.GroupNorm, 2, 4), (2, 4, 11), (2,)),
    (partial(nn.GroupNorm, 3, 6), (2, 6, 11, 5), (2,)),
    (partial(nn.GroupNorm, 1, 4, affine=False), (2, 4, 7, 3, 2), (2,)),
    (partial(nn.GroupNorm, 4, 4), (2, 4, 5, 11), (3,)),
    (partial(nn.InstanceNorm1d, 3, affine=True), (2, 3, 11), (2,)),
    (partial(nn.InstanceNorm2d, 3), (2, 3, 11, 4), (2,)),
    (partial(nn.InstanceNorm2d, 3, affine=True, track_running_stats=True), (2, 3, 11, 4), (2,)),
    (partial(nn.InstanceNorm3d, 2, affine=True, track_running_stats=True, momentum=0.3), (2, 2, 9, 3, 2), (2,)),
    (partial(nn.BatchNorm1d, 3), (2, 3, 11), (2,)),
    (partial(nn.BatchNorm2d, 3), (2, 3, 11, 4), (2,)),
    (partial(nn.BatchNorm2d, 3, momentum=None), (2, 3, 11, 4), (2,)),
    (partial(nn.BatchNorm2d, 3, affine=False, track_running_stats=False), (3, 3, 11, 4), (2,)),
    (partial(nn.BatchNorm3d, 2, momentum=0.5), (2, 2, 9, 3, 2), (2,)),
    (partial(nn.LayerNorm, [4, 11, 5]), (2, 4, 11, 5), (2,)),
    (partial(nn.LayerNorm, [11, 5], elementwise_affine=True, bias=False), (2, 4, 11, 5), (2,)),
    (partial(nn.LayerNorm, [5, 11]), (2, 4, 5, 11), (3,)),  # shards the last dim
    (partial(nn.LayerNorm, [3, 11]), (2, 3, 11), (2,)),
]
CASES_2D = [
    (partial(nn.GroupNorm, 2, 4), (2, 4, 7, 5), (2, 3)),
    (partial(nn.InstanceNorm3d, 2, affine=True, track_running_stats=True), (2, 2, 5, 7, 2), (2, 3)),
    (partial(nn.BatchNorm2d, 3), (2, 3, 7, 5), (2, 3)),
    (partial(nn.BatchNorm3d, 3, momentum=None), (2, 3, 5, 7, 2), (3, 4)),
    (partial(nn.LayerNorm, [4, 7, 5]), (2, 4, 7, 5), (2, 3)),
]


def _check_cases(domain, cases, steps=2):
    m = mesh(domain)
    for i, (factory, shape, dims) in enumerate(cases):
        ref = _module(factory)
        sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
        assert type(sharded).__name__.startswith("Sharded"), type(sharded)
        # Several training steps: running statistics (momentum, cumulative average,
        # num_batches_tracked) must evolve exactly as on one device.
        for step in range(steps if any(True for _ in ref.buffers()) else 1):
            for p in (*ref.parameters(), *sharded.parameters()):
                p.grad = None
            x = _input(*shape, seed=10 * i + step)
            check_against_reference(ref, x, m, dims=dims, sharded=sharded, atol=1e-9, rtol=1e-9)
            _check_buffers(ref, sharded)
        # Eval mode uses the (identical) running statistics, or batch statistics without them.
        ref.eval(), sharded.eval()
        with torch.no_grad():
            x = _input(*shape, seed=99)
            y = snn.gather(sharded(snn.shard(x, m, dims=dims)), m, dims=dims)
            torch.testing.assert_close(y, ref(x), atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("domain", [1, 2, 3, 4])
def test_norms_match_torch_1d_mesh(run, domain):
    assert all(run(domain, _check_cases, domain, CASES_1D))


def test_norms_match_torch_2x2_mesh(run):
    assert all(run(4, _check_cases, (2, 2), CASES_2D))


def _deep_copy_after_training():
    # A converted model stays deep-copyable after it has run (nothing unpicklable, such as a
    # process group, is cached on its modules), and the copy computes the same.
    m = mesh(2)
    model = snn.convert(_module(lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))), m).train()
    x = snn.shard(_input(1, 3, 9, 5), m)
    model(x)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), model(x), atol=0, rtol=0)
    _check_buffers(model, twin)
    return True


def test_converted_norms_deep_copy_after_training(run):
    assert all(run(2, _deep_copy_after_training))


def _convert_dims_reach_norms():
    # convert's dims= default reaches every sharded norm (it reads their _init_sharding signature).
    m = mesh(2)
    model = snn.convert(nn.Sequential(nn.BatchNorm2d(3), nn.GroupNorm(1, 3), nn.InstanceNorm2d(3)), m, dims=(3,))
    return [tuple(layer.dims) for layer in model]


def test_convert_dims_reach_the_norms(run):
    for dims in run(2, _convert_dims_reach_norms):
        assert dims == [(3,), (3,), (3,)], dims


def _torch_only_statistics(domain, cases):
    # Where the native statistics kernel cannot be built (no C++ compiler) the norms take their
    # slab statistics with torch: the same results.
    import os

    from sharded_nn import moments

    os.environ[moments.OPT_OUT_ENV] = "0"
    try:
        assert not moments.available()
        return _check_cases(domain, cases)
    finally:
        del os.environ[moments.OPT_OUT_ENV]


def test_norms_match_torch_without_the_native_kernel(run):
    cases = [c for c in CASES_1D if c[0].func in (nn.GroupNorm, nn.BatchNorm2d, nn.BatchNorm3d)]
    assert all(run(2, _torch_only_statistics, 2, cases))


def _cuda_kernel_contract(domain, cases):
    """The norms' backward through a stand-in of ``native_batch_norm_backward`` that checks what
    the CUDA kernel asserts (saved statistics given as tensors, possibly empty, never None) and
    then runs torch's own: CI has no GPU, and None passed on CPU (session 40 found it on an H200)."""
    from types import SimpleNamespace

    from sharded_nn.layers import norm

    real = torch.ops.aten.native_batch_norm_backward
    calls = []

    def native_batch_norm_backward(g, x, w, rm, rv, save_mean, save_invstd, train, eps, mask):
        assert isinstance(save_mean, torch.Tensor) and isinstance(save_invstd, torch.Tensor)
        calls.append(train)
        return real(g, x, w, rm, rv, save_mean, save_invstd, train, eps, mask)

    saved = norm._aten
    norm._aten = SimpleNamespace(native_batch_norm_backward=native_batch_norm_backward)
    try:
        ok = _check_cases(domain, cases, steps=1)
    finally:
        norm._aten = saved
    assert calls, "the sharded norms' backward did not reach the kernel"
    return ok


def test_norm_backward_keeps_the_cuda_kernel_contract(run):
    cases = [c for c in CASES_1D if c[0].func in (nn.GroupNorm, nn.BatchNorm2d, nn.BatchNorm3d)]
    assert all(run(2, _cuda_kernel_contract, 2, cases))


def _stable_with_offset():
    # x ~ 1e8 + N(0, 1): E[x^2] - E[x]^2 cancels every digit even in float64 (the variance would
    # come out as a multiple of ~1e16 * 2^-52 ~ 2, or negative); the two passes keep ~1e-8. torch's
    # own kernel is no more exact than that, so compare to a float64 reference computed from the
    # centred data, which is exact.
    m = mesh(3)
    x = _input(2, 4, 11, offset=1e8)
    gn = snn.convert(nn.GroupNorm(2, 4, affine=False).double(), m)
    y = snn.gather(gn(snn.shard(x, m)), m)
    xg = (x - 1e8).reshape(2, 2, -1)  # exact: the offset is an integer in float64
    want = ((xg - xg.mean(2, keepdim=True)) / (xg.var(2, unbiased=False, keepdim=True) + gn.eps).sqrt())
    torch.testing.assert_close(y, want.reshape(x.shape), atol=1e-6, rtol=0)
    return True


def test_norms_are_stable_with_a_large_offset(run):
    assert all(run(3, _stable_with_offset))


def _moments_uneven():
    # Explicit, very uneven slabs (1 vs 9 positions): counts are summed, never assumed.
    m = mesh(2)
    x = _input(2, 3, 10)
    r = m.get_local_rank("domain")
    x_local = x[..., :1] if r == 0 else x[..., 1:]
    mean, var, count = global_moments(x_local, (2,), snn.domain_group(m))
    torch.testing.assert_close(mean.squeeze(-1), x.mean(2))
    torch.testing.assert_close(var.squeeze(-1), x.var(2, unbiased=False))
    assert count.item() == 10
    return True


def test_moments_on_very_uneven_slabs(run):
    assert all(run(2, _moments_uneven))


def _batchnorm_data_and_domain(domain, dims, shape, momentum):
    """Statistics over the data ranks and the domain ranks equal those of the global batch."""
    m = mesh(domain, data=2)
    d = m.get_local_rank("data")
    factory = {4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    ref = _module(lambda: factory(shape[1], momentum=momentum))
    sharded = snn.convert(copy.deepcopy(ref), m, plan={"*": {"dims": dims}})
    n_local = shape[0] // 2
    for step in range(2):
        for p in (*ref.parameters(), *sharded.parameters()):
            p.grad = None
        x = _input(*shape, seed=step).requires_grad_()
        y = ref(x)
        g = torch.randn_like(y)
        (y * g).sum().backward()
        batch = slice(d * n_local, (d + 1) * n_local)
        x_local = snn.shard(x.detach()[batch], m, dims=dims).requires_grad_()
        y_full = snn.gather(sharded(x_local), m, dims=dims)
        torch.testing.assert_close(y_full, y.detach()[batch], atol=1e-10, rtol=1e-10)
        snn.losses.share((y_full * g[batch]).sum(), m).backward()
        torch.testing.assert_close(snn.gather(x_local.grad, m, dims=dims), x.grad[batch], atol=1e-10, rtol=1e-10)
        for (name, p_ref), p in zip(ref.named_parameters(), sharded.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # every rank of the mesh holds a partial sum of the global batch
            torch.testing.assert_close(grad, p_ref.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
        _check_buffers(ref, sharded)
    return True


@pytest.mark.parametrize(
    "domain,dims,shape,momentum",
    [(2, (2,), (4, 3, 9, 4), 0.1), (1, (2,), (4, 3, 5, 4), None), ((2, 2), (2, 3), (2, 3, 7, 5, 2), 0.2)],
    ids=["data2xdomain2", "data2xdomain1", "data2xdomain2x2"],
)
def test_batchnorm_over_data_and_domain(run, domain, dims, shape, momentum):
    assert all(run(world_of(domain, 2), _batchnorm_data_and_domain, domain, dims, shape, momentum))


def _batchnorm_eval_is_local():
    m = mesh(2)
    bn = snn.convert(_module(partial(nn.BatchNorm2d, 3)), m).eval()
    calls = []
    orig = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(a) or orig(*a, **k)
    try:
        bn(torch.randn(1, 3, 4 + m.get_local_rank("domain"), 4, dtype=torch.float64))
    finally:
        dist.all_reduce = orig
    assert not calls
    return True


def test_batchnorm_eval_mode_does_not_reduce(run):
    assert all(run(2, _batchnorm_eval_is_local))


def _channel_layernorms_are_local():
    import timm.layers

    m = mesh(2)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.LayerNorm(5), timm.layers.LayerNorm(5), nn.Conv2d(5, 4, 1), timm.layers.LayerNorm2d(4)
    ).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ShardingWarning: channel LayerNorms are pointwise
        sharded = snn.convert(copy.deepcopy(model), m)
    assert isinstance(sharded[0], snn.ShardedLayerNorm) and sharded[0].dims == ()
    # timm's variants subclass nn.LayerNorm over one (channel) dim: convert keeps them as they are.
    assert type(sharded[1]) is timm.layers.LayerNorm and type(sharded[3]) is timm.layers.LayerNorm2d
    assert list(sharded.state_dict()) == list(model.state_dict())
    check_against_reference(model, _input(2, 5, 9, 5), m, sharded=sharded)
    calls = []
    orig = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(a) or orig(*a, **k)
    try:
        sharded(snn.shard(_input(2, 5, 9, 5), m))
    finally:
        dist.all_reduce = orig
    assert not calls  # the LayerNorms never reduce (the conv only exchanges halos)
    return True


def test_channel_layernorms_stay_local(run):
    assert all(run(2, _channel_layernorms_are_local))


def _tokens_layernorm():
    # Tokens (B, L, C) sharded along L: LayerNorm([L, C]) with dims=(1,).
    m = mesh(3)
    ref = _module(partial(nn.LayerNorm, [10, 4]))
    sharded = snn.ShardedLayerNorm.from_module(copy.deepcopy(ref), m, dims=(1,))
    check_against_reference(ref, _input(2, 10, 4), m, dims=(1,), sharded=sharded)
    return True


def test_layernorm_over_sharded_tokens(run):
    assert all(run(3, _tokens_layernorm))


# --- bad input: the same clear error on every rank ------------------------------------------


def _errors():
    m = mesh(2)
    r = m.get_local_rank("domain")
    gn = snn.ShardedGroupNorm(2, 4, mesh=m).double()
    with pytest.raises(snn.ShardingError, match="expected 4 channels"):
        gn(torch.randn(1, 6, 5, 3, dtype=torch.float64))
    with pytest.raises(snn.ShardingError, match="differs across ranks"):
        gn(torch.randn(1, 4, 5, 3 + r, dtype=torch.float64))  # only rank 1 is off
    bn = snn.ShardedBatchNorm1d(3, mesh=m).double()
    with pytest.raises(snn.ShardingError, match="more than 1 value per channel"):
        bn(torch.randn(1, 3, dtype=torch.float64))  # replicated (N=1, C): one value globally
    with pytest.raises(snn.ShardingError, match="expected a 2-d or 3-d"):
        bn(torch.randn(1, 3, 2, 2, dtype=torch.float64))
    ln = snn.ShardedLayerNorm([4, 10, 3], mesh=m).double()
    with pytest.raises(snn.ShardingError, match="must match the trailing dims"):
        ln(torch.randn(1, 4, 4 + r, 3, dtype=torch.float64))  # global H = 9, not 10
    with pytest.raises(snn.ShardingError, match="not spatial dims"):
        snn.ShardedInstanceNorm2d(3, mesh=m, dims=(4,))
    with pytest.raises(snn.ShardingError, match="non-batch tensor dims"):
        snn.ShardedLayerNorm([3, 4], mesh=m, dims=(0,))
    return True


def test_bad_input_raises_on_every_rank(run):
    assert all(run(2, _errors))


def test_state_dict_keys_and_repr(run):
    assert all(run(2, _state_dict))


def _state_dict():
    m = mesh(2)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.GroupNorm(1, 3), nn.InstanceNorm2d(3, track_running_stats=True))
    keys = list(model.state_dict())
    sharded = snn.convert(model, m)
    assert list(sharded.state_dict()) == keys
    assert "mesh_axes=('domain',)" in repr(sharded[0])
    return True


# --- half precision: statistics accumulate in float32 ---------------------------------------

HALF_CASES = [
    (partial(nn.GroupNorm, 2, 4), (1, 4, 128, 160)),  # fp16 sums of 41k values overflow: NaN before
    # Counts such as 2747 are not bf16 numbers (they round to 2752): odd sizes catch that.
    (partial(nn.InstanceNorm2d, 4, affine=True, track_running_stats=True), (1, 4, 67, 41)),
    (partial(nn.BatchNorm2d, 4), (2, 4, 67, 41)),
    (partial(nn.LayerNorm, [4, 67, 41]), (1, 4, 67, 41)),
]


def _half_precision(dtype_name: str):
    """Sharded norms on fp16/bf16 slabs against torch's norm on the same half input.

    Both are compared with the float32 result (the float32 module on the same half values); the
    sharded error may not exceed twice torch's own (plus one unit in the last place), for the
    output, the input gradient and the running statistics.
    """
    dtype = getattr(torch, dtype_name)
    m = mesh(2)
    out = []
    for factory, shape in HALF_CASES:
        torch.manual_seed(0)
        ref32 = factory().float()
        with torch.no_grad():
            for p in ref32.parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p))
        half = copy.deepcopy(ref32).to(dtype)
        sharded = snn.convert(copy.deepcopy(ref32).to(dtype), m)
        # An offset that a half-precision sum cannot hold (fp16 overflows) or resolve (bf16 rounds
        # the sum and the count, shifting the mean by far more than the output's rounding).
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2 + 30).to(dtype)
        g = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)

        def run(module, inp, grad):
            inp = inp.detach().clone().requires_grad_()
            y = module(inp)
            (y * grad).sum().backward()
            return y.detach(), inp.grad

        y32, gx32 = run(ref32, x.float(), g.float())
        y_half, gx_half = run(half, x, g)
        x_loc = snn.shard(x, m, dims=(2,)).requires_grad_()
        y_loc = sharded(x_loc)
        (y_loc * snn.shard(g, m, dims=(2,))).sum().backward()
        assert y_loc.dtype == dtype, (type(sharded).__name__, y_loc.dtype)
        y_sh = snn.gather(y_loc.detach(), m, dims=(2,))
        gx_sh = snn.gather(x_loc.grad, m, dims=(2,))
        assert torch.isfinite(y_sh).all() and torch.isfinite(gx_sh).all(), type(sharded).__name__
        ulp = torch.finfo(dtype).eps
        for what, ref, single, mine in (("out", y32, y_half, y_sh), ("grad_in", gx32, gx_half, gx_sh)):
            e_single = (single.float() - ref).abs().max().item()
            e_sharded = (mine.float() - ref).abs().max().item()
            floor = ulp * ref.abs().max().item()
            assert e_sharded <= 2 * e_single + floor, (type(sharded).__name__, what, e_sharded, e_single, floor)
            out.append((type(sharded).__name__, what, e_sharded, e_single))
        for (name, b32), (_, b_half), (_, b_sh) in zip(
            ref32.named_buffers(), half.named_buffers(), sharded.named_buffers()
        ):
            if b32.is_floating_point():
                e_single = (b_half.float() - b32).abs().max().item()
                e_sharded = (b_sh.float() - b32).abs().max().item()
                floor = torch.finfo(dtype).eps * b32.abs().max().item()
                assert e_sharded <= 2 * e_single + floor, (type(sharded).__name__, name, e_sharded, e_single)
    return out


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_precision_statistics(run, dtype_name):
    run(2, _half_precision, dtype_name)


def _groupnorm_memory_and_double_backward():
    """The sharded GroupNorm keeps no more for backward than torch's fused kernel (its input),
    and second derivatives through it (gradient penalties) equal single device."""
    import torch.distributed as dist

    m = mesh(dist.get_world_size())
    torch.manual_seed(0)
    ref = nn.GroupNorm(2, 4).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    sharded = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(2, 4, 37, 20, dtype=torch.float64) * 2 + 1

    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    xl = snn.shard(x, m).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sharded(xl)
    slab = xl.numel() * xl.element_size()
    assert sum(saved.values()) < 1.1 * slab, (sum(saved.values()), slab)

    # d/dx of a penalty on the input gradient: exercises the backward's own derivative.
    _check_double_backward(ref, sharded, x, xl, m, check_first=False)
    return True


def _check_double_backward(ref, sharded, x, xl, m, *, check_first: bool) -> None:
    """A penalty on the input gradient, backpropagated: sharded against ``ref``, float64.

    Per-rank losses sum to the global one, so each rank's first derivative is its exact slab
    and the per-rank penalties sum to the global penalty (no replicated value involved).
    """
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((ref(xr) ** 3).sum(), xr, create_graph=True)
    g.pow(2).sum().backward()
    (gl,) = torch.autograd.grad((sharded(xl) ** 3).sum(), xl, create_graph=True)
    gl.pow(2).sum().backward()
    with torch.no_grad():
        if check_first:
            torch.testing.assert_close(snn.gather(gl, m), g, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(snn.gather(xl.grad, m), xr.grad, atol=1e-9, rtol=1e-9)
    grads = reduce_param_grads(sharded, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_groupnorm_saves_only_its_input_and_double_backward(run, world):
    assert all(run(world, _groupnorm_memory_and_double_backward))


def _fused_norms(domain, dtype_name, sizes):
    """BatchNorm and GroupNorm (float32/float64: torch's fused batch-norm kernels with merged
    statistics) against torch, forward and backward, on explicit very uneven slabs (an empty one
    included: that rank takes the elementwise form, with the same collectives)."""
    dtype = getattr(torch, dtype_name)
    m = mesh(domain)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for factory, shape in (
        (partial(nn.BatchNorm2d, 3), (2, 3, sum(sizes), 4)),
        (partial(nn.BatchNorm2d, 3, affine=False, momentum=None), (1, 3, sum(sizes), 5)),
        (partial(nn.BatchNorm3d, 2), (1, 2, sum(sizes), 3, 2)),
        (partial(nn.GroupNorm, 2, 4), (2, 4, sum(sizes), 3)),
        (partial(nn.GroupNorm, 3, 6, affine=False), (1, 6, sum(sizes), 2, 2)),
    ):
        ref = _module(factory).to(dtype)
        sharded = snn.convert(copy.deepcopy(ref), m)
        check_against_reference(
            ref, _input(*shape, offset=3.0).to(dtype), m, dims=(2,), sharded=sharded, sizes=sizes, atol=tol, rtol=tol
        )
        if dtype == torch.float64:
            _check_buffers(ref, sharded)
    return True


@pytest.mark.parametrize(
    "domain,dtype_name,sizes",
    [(2, "float64", (1, 8)), (3, "float64", (4, 0, 5)), (2, "float32", (5, 4)), (4, "float64", (2, 3, 0, 4))],
)
def test_fused_norms_match_torch_on_uneven_slabs(run, domain, dtype_name, sizes):
    assert all(run(domain, _fused_norms, domain, dtype_name, sizes))


def _norm_collectives(factory):
    """Train-mode BatchNorm and GroupNorm exchange their statistics in one collective forward
    and their gradient sums in one backward (the elementwise BatchNorm needed two all-reduces
    each way, GroupNorm two forward)."""
    from sharded_nn.comm import traffic

    m = mesh(2)
    bn = snn.convert(_module(factory), m)
    x = snn.shard(_input(2, 4, 9, 5), m).requires_grad_()
    with traffic.count_traffic() as fwd:
        y = bn(x)
    with traffic.count_traffic() as bwd:
        y.backward(torch.randn_like(y))
    return fwd, bwd


@pytest.mark.parametrize("factory", [partial(nn.BatchNorm2d, 4), partial(nn.GroupNorm, 2, 4)], ids=["bn", "gn"])
def test_norms_one_collective_each_way(run, factory):
    for fwd, bwd in run(2, _norm_collectives, factory):
        # (A layer outside a layout scope also agrees on its layout: a metadata call.)
        assert fwd.calls["reduction"] == 1 and bwd.calls == {"reduction": 1}, (fwd.calls, bwd.calls)


def _batchnorm_double_backward(world):
    m = mesh(world)
    ref = _module(partial(nn.BatchNorm2d, 3))
    sharded = snn.convert(copy.deepcopy(ref), m)
    x = _input(2, 3, 13, 4) * 2 + 1
    _check_double_backward(ref, sharded, x, snn.shard(x, m).requires_grad_(), m, check_first=True)
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batchnorm_double_backward(run, world):
    assert all(run(world, _batchnorm_double_backward, world))


def _functional_group_norm(domain, dims, shape):
    """``sharded_nn.functional.group_norm`` against ``F.group_norm`` on the whole tensor: affine
    weight and bias, weight only, none; forward, input gradient and the summed weight gradients."""
    import torch.nn.functional as F

    m = mesh(domain)
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(*shape, dtype=torch.float64, generator=gen) * 2 + 0.5
    c = shape[1]
    for groups, affine in ((2, "both"), (1, "weight"), (c, "none")):
        w = (1 + torch.randn(c, dtype=torch.float64, generator=gen) * 0.3) if affine != "none" else None
        b = torch.randn(c, dtype=torch.float64, generator=gen) * 0.1 if affine == "both" else None
        params = [p.requires_grad_() for p in (w, b) if p is not None]
        x = x_full.clone().requires_grad_()
        y = F.group_norm(x, groups, w, b, 1e-5)
        g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        ref_grads = torch.autograd.grad((y * g).sum(), [x, *params])
        lw = w.detach().clone().requires_grad_() if w is not None else None
        lb = b.detach().clone().requires_grad_() if b is not None else None
        x_local = snn.shard(x_full, m, dims=dims).requires_grad_()
        y_local = snn.functional.group_norm(x_local, groups, lw, lb, 1e-5, mesh=m, dims=dims)
        torch.testing.assert_close(snn.gather(y_local, m, dims=dims), y.detach(), atol=1e-12, rtol=1e-12)
        local_params = [p for p in (lw, lb) if p is not None]
        got = torch.autograd.grad((y_local * snn.shard(g, m, dims=dims)).sum(), [x_local, *local_params])
        torch.testing.assert_close(snn.gather(got[0], m, dims=dims), ref_grads[0], atol=1e-12, rtol=1e-12)
        for gp, want in zip(got[1:], ref_grads[1:]):
            # Parameter gradients are this rank's partial sums (the gradient convention).
            total = gp.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, want, atol=1e-11, rtol=1e-11)
    return True


@pytest.mark.parametrize("domain,dims,shape", [(1, (2,), (2, 4, 9, 5)), (2, (2,), (2, 4, 9, 5)),
                                               (3, (3,), (1, 6, 4, 11)), ((2, 2), (2, 3), (2, 4, 7, 9))])
def test_functional_group_norm(run, domain, dims, shape):
    assert all(run(world_of(domain), _functional_group_norm, domain, dims, shape))


def _sync_batch_norm(domain, shape, train: bool):
    # nn.SyncBatchNorm (what convert_sync_batchnorm makes of a model's batch norms for DDP) is
    # swapped: the statistics of the whole sample, like one device's batch norm over the batch
    # (torch's own SyncBatchNorm trains on GPUs only: the reference is the plain BatchNorm).
    m = mesh(domain)
    nd = len(shape) - 2
    torch.manual_seed(0)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[nd]
    ref = nn.Sequential(conv(2, 4, 3, padding=1), bn(4, momentum=None), nn.GELU(), conv(4, 3, 1)).double()
    with torch.no_grad():
        ref[1].weight.normal_()
        ref[1].running_mean.normal_()
        ref[1].running_var.uniform_(0.5, 1.5)
    ref.train(train)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    assert type(synced[1]) is nn.SyncBatchNorm
    sharded = snn.convert(synced, m)
    assert type(sharded[1]).__name__ == "ShardedSyncBatchNorm"
    x = _input(*shape)
    dims = (2,) if isinstance(domain, int) else (2, 3)
    sizes = {2: (5, 4), 3: (3, 3, 3)}.get(domain) if isinstance(domain, int) else None
    check_against_reference(ref, x, m, sharded=sharded, dims=dims, sizes=sizes)
    for (name, a), b in zip(sharded.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("domain,shape", [(2, (2, 2, 9)), (3, (2, 2, 9, 5)), ((2, 2), (2, 2, 8, 6)),
                                          (2, (1, 2, 9, 4, 3))])
@pytest.mark.parametrize("train", [True, False])
def test_sync_batch_norm_is_swapped_and_exact(run, domain, shape, train):
    assert all(run(world_of(domain), _sync_batch_norm, domain, shape, train))
