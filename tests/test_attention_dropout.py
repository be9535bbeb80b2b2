"""Position-keyed attention dropout: ring / Ulysses attention and the sharded timm ViT against a
single-process reference that applies the same mask law (``attention_kernels.dropout_keep``)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import sharded_nn as snn
import sharded_nn.zoo  # noqa: F401 - registers the sharded ViT classes with convert
from sharded_nn import functional as snf
from sharded_nn.attention_kernels import dropout_keep

from .harness import mesh as make_mesh
from .harness import world_of
from .reference import reduce_param_grads
from .test_attention import UNEVEN, Cfg, _local, _unshard

P_DROP = 0.3
SEED = 12345


def reference_attention(q, k, v, pad, cfg: Cfg, p: float, seed: int, q_pos=None, k_pos=None):
    """Single-process attention (float64 math) with the dropout mask law on global positions."""
    b, h, n, d = q.shape
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = cfg.scale if cfg.scale is not None else d**-0.5
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if pad is not None:
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    if cfg.causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    q_pos = torch.arange(n) if q_pos is None else q_pos
    k_pos = torch.arange(n) if k_pos is None else k_pos
    keep = dropout_keep(seed, p, torch.arange(b), torch.arange(h), q_pos, k_pos)
    return torch.matmul(s.softmax(-1) * keep / (1 - p), v)


def _check(domain, cases, kind, pieces=None, permute=False):
    m = make_mesh(domain)
    fn = snf.ring_attention if kind == "ring" else snf.ulysses_attention
    old = snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL
    if pieces is not None:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = pieces, 1
    try:
        for cfg in cases:
            q, k, v, pad, grad = cfg.tensors()
            # Explicit positions: a fixed permutation of the token indices (keys gathered).
            perm = torch.randperm(cfg.length, generator=torch.Generator().manual_seed(5)) if permute else None
            leaves = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
            ref = reference_attention(*leaves, pad, cfg, P_DROP, SEED, perm, perm)
            ref.backward(grad)
            local = [_local(cfg, m, t.detach(), 2).requires_grad_() for t in (q, k, v)]
            pad_local = _local(cfg, m, pad, 1) if pad is not None else None
            pos = {}
            if permute:
                pos = {"q_positions": _local(cfg, m, perm, 0), "k_positions": _local(cfg, m, perm, 0)}
            out = fn(
                *local, m, cfg.causal, cfg.scale, key_padding_mask=pad_local, layout=cfg.layout,
                dropout_p=P_DROP, dropout_seed=SEED, **pos,
            )
            out.backward(_local(cfg, m, grad, 2))
            tol = {"atol": 1e-10, "rtol": 1e-10}
            torch.testing.assert_close(_unshard(cfg, m, out.detach(), 2), ref.detach(), **tol, msg=lambda s: f"{cfg}: {s}")
            for name, loc, leaf in zip("qkv", local, leaves):
                torch.testing.assert_close(
                    _unshard(cfg, m, loc.grad, 2), leaf.grad, **tol, msg=lambda s, n=name: f"{cfg} d{n}: {s}"
                )
    finally:
        snf._RING_CHUNKS, snf._MIN_CHUNK_NUMEL = old
    return True


RING_CASES = [
    Cfg(),
    Cfg(causal=True, layout="zigzag", mask=True, kv_heads=2),
    Cfg(kv_heads=1, dim_v=5, scale=0.4),
]


@pytest.mark.parametrize("domain", [2, 3, (2, 2)], ids=str)
def test_ring_dropout_matches_reference(run, domain):
    world = world_of(domain)
    cases = RING_CASES + ([Cfg(sizes=UNEVEN[world], causal=True, mask=True)] if world in UNEVEN else [])
    assert all(run(world, _check, domain, cases, "ring"))


@pytest.mark.parametrize("world,pieces", [(2, 8), (3, 3)])
def test_ring_dropout_chunked(run, world, pieces):
    # K/V cut into pieces along batch and heads: each piece keys its mask on the global head.
    assert all(run(world, _check, world, [Cfg(kv_heads=2, mask=True), Cfg(causal=True)], "ring", pieces))


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_dropout_matches_reference(run, world):
    cases = [Cfg(), Cfg(heads=8, kv_heads=4, mask=True, causal=True), Cfg(causal=True, layout="zigzag", length=19)]
    assert all(run(world, _check, world, cases, "ulysses"))


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_dropout_explicit_positions(run, kind):
    assert all(run(2, _check, 2, [Cfg(), Cfg(mask=True, kv_heads=2)], kind, None, True))


def _zero_is_exact(world):
    m = make_mesh(world)
    cfg = Cfg(mask=True, causal=True)
    q, k, v, pad, _ = cfg.tensors()
    local = [_local(cfg, m, t, 2) for t in (q, k, v)]
    pad_local = _local(cfg, m, pad, 1)
    out = {}
    for fn in (snf.ring_attention, snf.ulysses_attention):
        a = fn(*local, m, True, key_padding_mask=pad_local)
        b = fn(*local, m, True, key_padding_mask=pad_local, dropout_p=0.0, dropout_seed=SEED)
        out[fn.__name__] = torch.equal(a, b)
    return out


def test_dropout_zero_is_exact(run):
    assert all(all(r.values()) for r in run(2, _zero_is_exact, 2))


def _revealed_mask(world, seeds):
    """With q = k = 0 every probability is 1/L and v = identity reveals it: out * L * (1 - p) is
    the keep mask (b, h, i, j) of the sharded forward itself."""
    m = make_mesh(world)
    b, h, n = 2, 2, 96
    q = torch.zeros(b, h, n, 4, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(b, h, n, n).contiguous()
    sl = snn.Layout.balanced(n, world).slice(torch.distributed.get_rank())
    masks = []
    for seed in seeds:
        out = snf.ring_attention(q[:, :, sl], q[:, :, sl], v[:, :, sl], m, dropout_p=0.25, dropout_seed=seed)
        masks.append(out * n * 0.75)
    return torch.stack(masks), dropout_keep(seeds[0], 0.25, torch.arange(b), torch.arange(h), torch.arange(n)[sl],
                                            torch.arange(n))


def test_dropout_rate_and_fresh_masks(run):
    for masks, law in run(2, _revealed_mask, 2, [1, 2, 3]):
        assert torch.allclose(masks, masks.round(), atol=1e-9)
        keep = masks.round()
        assert set(keep.unique().tolist()) <= {0.0, 1.0}
        assert torch.equal(keep[0].bool(), law)  # the ring applied exactly the law's mask
        rate = 1 - keep.mean().item()
        assert abs(rate - 0.25) < 0.02, rate  # 3 x 18432 draws: std 0.002
        # Another seed (another step) gives another mask: agreement ~ p^2 + (1-p)^2 = 0.625.
        for a, b in ((0, 1), (1, 2)):
            agree = (keep[a] == keep[b]).double().mean().item()
            assert 0.58 < agree < 0.67, agree


def test_mask_law_properties():
    ar = torch.arange
    keep = dropout_keep(7, 0.4, ar(3), ar(4), ar(200), ar(300))
    assert abs((1 - keep.double().mean().item()) - 0.4) < 0.005
    # A block of it is the law on that block's global indices.
    assert torch.equal(keep[1:, 2:, 50:120, 100:], dropout_keep(7, 0.4, ar(1, 3), ar(2, 4), ar(50, 120), ar(100, 300)))
    assert dropout_keep(7, 0.0, ar(3), ar(4), ar(20), ar(30)).all()
    # Neighbouring entries are uncorrelated (no visible structure along any index).
    f = keep.double() - keep.double().mean()
    for corr in ((f[..., 1:] * f[..., :-1]).mean(), (f[:, :, 1:] * f[:, :, :-1]).mean(), (f[:, 1:] * f[:, :-1]).mean()):
        assert abs(corr.item()) < 0.01


def _error_of(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares the ranks' errors
        return type(err).__name__, str(err)
    return None


def _dropout_errors(world):
    m = make_mesh(world)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    rank = torch.distributed.get_rank()
    return [
        _error_of(lambda: snf.ring_attention(q, q, q, m, dropout_p=0.1)),
        _error_of(lambda: snf.ring_attention(q, q, q, m, dropout_p=0.1, dropout_seed=rank)),
        _error_of(lambda: snf.ulysses_attention(q, q, q, m, dropout_p=1.0, dropout_seed=1)),
        _error_of(lambda: snf.ring_attention(q, q, q, m, dropout_p=0.1, dropout_seed=1,
                                             q_positions=torch.arange(4 + rank))),
    ]


def test_dropout_errors_on_every_rank(run):
    r0, r1 = run(2, _dropout_errors, 2)
    assert r0 == r1
    assert r0[0][0] == "ValueError" and "needs dropout_seed" in r0[0][1]
    assert r0[1][0] == "ShardingError" and "disagree on the dropout options" in r0[1][1]
    assert r0[2][0] == "ValueError" and "[0, 1)" in r0[2][1]
    assert r0[3][0] == "ShardingError" and "q_positions / k_positions" in r0[3][1]


# --------------------------------------------------------------------------- the sharded ViT

TINY = dict(embed_dim=32, depth=2, num_heads=2)
VIT = {
    "vit_reg": ("vit_tiny_patch16_224", dict(TINY, img_size=(80, 48), reg_tokens=2), 16),
    "eva02": ("eva02_tiny_patch14_224", dict(TINY, img_size=(70, 42)), 14),
}


def _reference_forward(attn, seed: int, p: float):
    """timm attention forward with the mask law on timm's token indices (the single-device model)."""

    def forward(self, x, *args, rope=None, **kwargs):
        b, n, _ = x.shape
        if hasattr(self, "q_bias") and getattr(self, "q_bias", None) is not None:
            qkv = torch.nn.functional.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            from timm.layers import apply_rot_embed_cat

            npt = self.num_prefix_tokens
            half = getattr(self, "rotate_half", False)
            q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], 2).type_as(v)
            k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], 2).type_as(v)
        probs = (torch.matmul(q, k.transpose(-1, -2)) * self.scale).softmax(-1)
        ar = torch.arange
        keep = dropout_keep(seed, p, ar(b), ar(self.num_heads), ar(n), ar(n))
        y = torch.matmul(probs * keep / (1 - p), v).transpose(1, 2).reshape(b, n, -1)
        return self.proj_drop(self.proj(self.norm(y)))

    return types.MethodType(forward, attn)


def _vit_dropout(domain, family):
    import timm

    name, kwargs, patch = VIT[family]
    m = make_mesh(domain)
    dims = (2,) if isinstance(domain, int) else (2, 3)
    torch.manual_seed(0)
    ref = timm.create_model(name, **kwargs, attn_drop_rate=0.25).double().train()
    model = snn.convert(copy.deepcopy(ref), m, plan={"": {"seed": 11}}).train()
    x = torch.randn(2, 3, *kwargs["img_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xl = x[snn.local_slices(x.shape, m, dims=dims, align=patch)].clone().requires_grad_()
    out = model(xl)
    # Logits are replicated: each rank back-propagates its 1/P share (DESIGN.md section 3).
    snn.losses.share(out.square().sum(), m).backward()
    seeds = [blk.attn.dropout_seed for blk in model.blocks]
    out2 = model(xl).detach()  # the next step draws fresh masks
    seeds2 = [blk.attn.dropout_seed for blk in model.blocks]
    for blk, seed in zip(ref.blocks, seeds):
        blk.attn.forward = _reference_forward(blk.attn, seed, 0.25)
    xr = x.clone().requires_grad_()
    ref_out = ref(xr)
    ref_out.square().sum().backward()
    torch.testing.assert_close(out.detach(), ref_out.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(xl.grad, xr.grad[snn.local_slices(x.shape, m, dims=dims, align=patch)],
                               atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for pname, param in ref.named_parameters():
        torch.testing.assert_close(grads[pname], param.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=pname: f"{n}: {s}")
    # Without dropout the same model (eval) differs: the masks did something.
    assert not torch.allclose(out.detach(), model.eval()(xl).detach())
    return seeds, seeds2, out.detach(), out2


@pytest.mark.parametrize("domain,family", [(2, "vit_reg"), (3, "vit_reg"), ((2, 2), "vit_reg"), (2, "eva02")], ids=str)
def test_vit_attention_dropout_matches_reference(run, domain, family):
    results = run(world_of(domain), _vit_dropout, domain, family)
    seeds, seeds2, out, out2 = results[0]
    for r in results[1:]:  # one mask law on every rank: the same seeds and replicated logits
        assert r[0] == seeds and r[1] == seeds2 and torch.equal(r[2], out)
    assert len(set(seeds + seeds2)) == len(seeds) * 2  # fresh seeds per layer and per step
    assert not torch.allclose(out, out2)


# ------------------------------------------------- blocks that compute their attention inline

INLINE = {
    # ParallelScalingBlock (one attention per block), DiffParallelScalingBlock (two per block).
    "vit_xp": ("vit_base_patch16_xp_224", dict(TINY, img_size=(80, 48), reg_tokens=1)),
    "vit_diff": ("vit_tiny_patch16_224", dict(TINY, img_size=(80, 48), reg_tokens=2, block_fn="diff")),
}


def _masked_sdpa(seeds: list[int]):
    """``F.scaled_dot_product_attention`` of timm's fused path with the mask law on timm's token
    indices, one seed per call in call order (the sharded blocks' recorded seeds)."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **_):
        assert attn_mask is None and not is_causal and dropout_p > 0
        b, h, n, _d = q.shape
        probs = (torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1)
        ar = torch.arange
        keep = dropout_keep(seeds.pop(0), dropout_p, ar(b), ar(h), ar(n), ar(n))
        return torch.matmul(probs * keep / (1 - dropout_p), v)

    return sdpa


def _inline_dropout(domain, family):
    import timm
    import timm.models.vision_transformer as tv

    name, kwargs = INLINE[family]
    kwargs = dict(kwargs)
    if kwargs.pop("block_fn", None) == "diff":
        kwargs["block_fn"] = tv.DiffParallelScalingBlock
    m = make_mesh(domain)
    dims = (2,) if isinstance(domain, int) else (2, 3)
    torch.manual_seed(0)
    ref = timm.create_model(name, **kwargs, attn_drop_rate=0.25).double().train()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every parameter matters (layer scales, lambdas, biases start at 0 or 1e-5)
        for prm in ref.parameters():
            prm.add_(torch.randn(prm.shape, generator=gen, dtype=prm.dtype) * 0.2)
    model = snn.convert(copy.deepcopy(ref), m, plan={"": {"seed": 11}}).train()
    assert all(type(b).__name__.startswith("Sharded") for b in model.blocks)
    x = torch.randn(2, 3, *kwargs["img_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xl = x[snn.local_slices(x.shape, m, dims=dims, align=16)].clone().requires_grad_()
    out = model(xl)
    snn.losses.share(out.square().sum(), m).backward()
    seeds = [s for blk in model.blocks for s in (getattr(blk, "dropout_seeds", None) or (blk.dropout_seed,))]
    assert None not in seeds and len(set(seeds)) == len(seeds), seeds
    for blk in ref.blocks:
        blk.fused_attn = True  # the path whose dropout the patched kernel reproduces
    pending = list(seeds)
    real = tv.F
    tv.F = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    tv.F.scaled_dot_product_attention = _masked_sdpa(pending)
    try:
        xr = x.clone().requires_grad_()
        ref_out = ref(xr)
    finally:
        tv.F = real
    assert not pending  # as many attention calls as recorded seeds
    ref_out.square().sum().backward()
    torch.testing.assert_close(out.detach(), ref_out.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(xl.grad, xr.grad[snn.local_slices(x.shape, m, dims=dims, align=16)],
                               atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for pname, param in ref.named_parameters():
        # Differential attention's lambda is computed in float32 by timm (see tests/test_vit.py).
        tol = 1e-6 if ".lambda_" in pname else 1e-10
        torch.testing.assert_close(grads[pname], param.grad, atol=tol, rtol=tol, msg=lambda s, n=pname: f"{n}: {s}")
    assert not torch.allclose(out.detach(), model.eval()(xl).detach())  # the masks did something
    return seeds


@pytest.mark.parametrize("domain,family", [(2, "vit_xp"), ((2, 2), "vit_xp"), (3, "vit_diff")], ids=str)
def test_inline_attention_blocks_dropout_matches_reference(run, domain, family):
    results = run(world_of(domain), _inline_dropout, domain, family)
    assert all(r == results[0] for r in results)  # one mask law: the same seeds on every rank
