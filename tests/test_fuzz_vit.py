"""Hypothesis fuzzing of converted timm ViTs: random ``VisionTransformer`` configurations.

``tests/test_vit.py`` checks named timm families; this file draws the constructor's options
together: patch size, image size (with a partial last patch under ``dynamic_img_pad``), class and
register tokens, position embedding on or off and with or without the prefix rows, every global
pool (``avg``, ``avgmax``, ``max``, ``token``, ``map``, ``prr``) with or without the prefix tokens,
pre/final/fc norms, qk norm and the attention/MLP scale norms, layer scale, timm's block kinds
(``Block``, ``ResPostBlock``, ``ParallelScalingBlock``, ``ParallelThingsBlock``,
``DiffParallelScalingBlock``), MLP kinds (``Mlp``, ``GluMlp``, ``SwiGLUPacked``), activation and
norm layers, a patch-embedding norm, a dynamic image size, ring or Ulysses attention, and the
mesh: 1-4 ranks with random uneven patch-aligned slabs of the image height, or a 2x2 mesh.

Each example converts a float64 timm model (parameters randomised so that every one matters) with
``snn.convert`` and compares, in eval mode, the logits, the input gradient and every parameter
gradient (summed over the ranks) with timm's on the whole image, to 1e-9. A refusal
(``ShardingError``/``ShardingNotImplementedError``) alike on every rank is counted apart, as is a
configuration timm itself rejects; any mismatch fails.

- ``test_fuzz_vit_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_vit_campaign`` (``pytest -m slow``): ``SNN_FUZZ_VIT_EXAMPLES`` examples (default
  300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st

import sharded_nn as snn
import sharded_nn.zoo  # noqa: F401 - registers the sharded ViT classes with convert

from .fuzzing import fuzz_tests, outcome, randomize_
from .harness import mesh, world_of
from .reference import assert_param_grads

BLOCKS = ("Block", "ResPostBlock", "ParallelScalingBlock", "ParallelThingsBlock", "DiffParallelScalingBlock")
MLPS = ("Mlp", "GluMlp", "SwiGLUPacked")
POOLS = ("avg", "avgmax", "max", "token", "map", "prr")


def _build(cfg: dict):
    """The float64 timm model of ``cfg`` with randomised parameters, or the reason timm refused it."""
    import timm.layers as tl
    import timm.models.eva as te
    import timm.models.vision_transformer as tv

    kw = dict(cfg["kwargs"])
    if cfg["arch"] == "vit":
        kw["block_fn"] = getattr(tv, cfg["block"])
        kw["mlp_layer"] = getattr(tl, cfg["mlp"])
    torch.manual_seed(cfg["seed"])
    try:
        model = tv.VisionTransformer(**kw) if cfg["arch"] == "vit" else te.Eva(**kw)
    except (AssertionError, ValueError, TypeError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"
    return randomize_(model.double().eval(), cfg["seed"] + 1, 0.2), None


def _case(cfg: dict):
    """One example on this rank: ``"ok"``, ``("refused", ...)`` or ``("invalid", ...)``; raises on a mismatch."""
    domain = cfg["domain"]
    m = mesh(domain)
    ref, why = _build(cfg)
    if ref is None:
        return ("invalid", why)
    x = torch.randn(2, 3, *cfg["run_size"], generator=torch.Generator().manual_seed(cfg["seed"] + 2),
                    dtype=torch.float64)
    xr = x.clone().requires_grad_()
    try:
        y_ref = ref(xr)
    except (AssertionError, ValueError, RuntimeError) as e:  # timm refuses the run size
        return ("invalid", f"{type(e).__name__}: {e}")
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(cfg["seed"] + 3), dtype=y_ref.dtype)
    (y_ref * g).sum().backward()

    plan = {"": {"attention": cfg["attention"]}}
    try:
        model = snn.convert(copy.deepcopy(ref), m, plan=plan)
        if isinstance(domain, int):
            r, sizes = m.get_local_rank("domain"), cfg["sizes"]
            x_local = x.narrow(2, sum(sizes[:r]), sizes[r]).clone()
        else:
            x_local = snn.shard(x, m, dims=(2, 3), align=cfg["patch"])
        x_local.requires_grad_()
        y = model(x_local)
        snn.losses.share((y * g).sum(), m).backward()
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", type(e).__name__, str(e)[:200])
    tol = dict(atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(y, y_ref.detach(), **tol, msg=lambda s: f"logits: {s}")
    dims = (2,) if isinstance(domain, int) else (2, 3)
    gx = snn.gather(x_local.grad, m, dims=dims)
    torch.testing.assert_close(gx, xr.grad, **tol, msg=lambda s: f"input grad: {s}")

    def tol_of(name: str) -> dict:
        # timm resamples a dynamic size's position embedding, computes differential attention's
        # lambda and mixed rotary angles (``get_mixed_freqs``) in float32: their backward sums the
        # ranks' slices in another order (float32 rounding, see tests/test_vit.py).
        f32 = (name == "pos_embed" and cfg["kwargs"].get("dynamic_img_size")) or ".lambda_" in name
        f32 = f32 or name == "rope.freqs"
        return dict(atol=1e-6, rtol=1e-4) if f32 else tol

    assert_param_grads(ref, model, m, tol_of)
    return "ok"


# --------------------------------------------------------------------------- configs


@st.composite
def _geometry(draw, domain, patch: int) -> dict:
    """Image, slabs and sizes: patch rows per rank (1-D meshes: uneven) or per mesh row (2x2:
    balanced by ``snn.shard``), a dynamic size with a partial last patch, or a fixed size."""
    p = world_of(domain)
    dynamic = draw(st.booleans())
    pad = dynamic and draw(st.booleans())
    # Patch rows per rank (1-D meshes: uneven), or per mesh row (2x2: balanced by snn.shard).
    rows = [draw(st.integers(1, 3)) for _ in range(p if isinstance(domain, int) else 2)]
    hp = sum(rows) if isinstance(domain, int) else 2 * max(rows)
    wp = draw(st.integers(2, 4)) if isinstance(domain, int) else draw(st.integers(2, 5))
    run_size = (hp * patch, wp * patch)
    sizes = [n * patch for n in rows] if isinstance(domain, int) else None
    if pad:
        # A partial last patch (timm pads it): the last slab is that much shorter.
        cut = draw(st.integers(1, patch - 1))
        run_size = (run_size[0] - cut, run_size[1] - draw(st.integers(0, patch - 1)))
        if sizes is not None:
            sizes[-1] -= cut
    img_size = run_size if not dynamic else (draw(st.integers(2, 4)) * patch, draw(st.integers(2, 4)) * patch)
    return dict(run_size=run_size, sizes=sizes, img_size=img_size, patch_size=patch, dynamic_img_size=dynamic,
                dynamic_img_pad=pad)


def _case_cfg(draw, domain, arch: str, geo: dict, kwargs: dict, heads: int, **extra) -> dict:
    p = world_of(domain)
    run_size, sizes = geo.pop("run_size"), geo.pop("sizes")
    return dict(
        arch=arch, domain=domain, seed=draw(st.integers(0, 2**16)), patch=geo["patch_size"], run_size=run_size,
        sizes=sizes, kwargs={**kwargs, **geo},
        attention="ulysses" if heads % p == 0 and draw(st.integers(0, 3)) == 0 else "ring", **extra,
    )  # fmt: skip


@st.composite
def _shape(draw):
    """(mesh, image geometry, heads, head size, class token): what both model kinds draw."""
    domain = draw(st.sampled_from([1, 2, 3, 4, (2, 2)]))
    geo = draw(_geometry(domain, draw(st.sampled_from([4, 8]))))
    return domain, geo, draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([4, 8])), draw(st.booleans())


@st.composite
def vit_configs(draw):
    """timm ``VisionTransformer`` options."""
    domain, geo, heads, head_dim, class_token = draw(_shape())
    pool = draw(st.sampled_from([x for x in POOLS if class_token or x != "token"]))
    kwargs = dict(
        num_classes=draw(st.sampled_from([0, 5])), global_pool=pool,
        embed_dim=heads * head_dim, depth=draw(st.integers(1, 2)), num_heads=heads,
        mlp_ratio=draw(st.sampled_from([1.0, 2.0])), qkv_bias=draw(st.booleans()), qk_norm=draw(st.booleans()),
        scale_attn_norm=draw(st.booleans()), scale_mlp_norm=draw(st.booleans()), proj_bias=draw(st.booleans()),
        init_values=draw(st.sampled_from([None, 0.5])), class_token=class_token,
        pos_embed=draw(st.sampled_from(["learn", "learn", "none"])), no_embed_class=draw(st.booleans()),
        reg_tokens=draw(st.sampled_from([0, 0, 1, 2])), pre_norm=draw(st.booleans()),
        final_norm=draw(st.booleans()), fc_norm=draw(st.sampled_from([None, True, False])),
        pool_include_prefix=draw(st.booleans()),
        act_layer=draw(st.sampled_from(["gelu", "gelu_tanh", "silu", "relu"])),
        norm_layer=draw(st.sampled_from(["layernorm", "layernorm", "rmsnorm"])),
        embed_norm_layer=draw(st.sampled_from([None, None, "layernorm"])),
    )  # fmt: skip
    block = draw(st.sampled_from(BLOCKS))
    if block in ("ParallelScalingBlock", "DiffParallelScalingBlock"):
        kwargs.update(scale_attn_norm=False, scale_mlp_norm=False)  # timm asserts them off there
    mlp = draw(st.sampled_from(MLPS))
    if mlp == "SwiGLUPacked":
        kwargs["act_layer"] = "silu"  # timm's SwiGLU models pair it with SiLU
        kwargs["mlp_ratio"] = 2.0
    return _case_cfg(draw, domain, "vit", geo, kwargs, heads, block=block, mlp=mlp)


@st.composite
def eva_configs(draw):
    """timm ``Eva`` options (EVA-02, rotary ViTs): rotary embeddings of every type."""
    domain, geo, heads, head_dim, class_token = draw(_shape())
    rope = draw(st.booleans())
    kwargs = dict(
        num_classes=draw(st.sampled_from([0, 5])),
        global_pool=draw(st.sampled_from(["avg", "avgmax", "max", "map"] + (["token"] if class_token else []))),
        embed_dim=heads * head_dim, depth=draw(st.integers(1, 2)), num_heads=heads, qkv_bias=draw(st.booleans()),
        qkv_fused=draw(st.booleans()), qk_norm=draw(st.booleans()), mlp_ratio=draw(st.sampled_from([1.0, 2.0])),
        swiglu_mlp=draw(st.booleans()), scale_mlp=draw(st.booleans()), scale_attn_inner=draw(st.booleans()),
        init_values=draw(st.sampled_from([None, 0.5])), attn_only_layer_scale=draw(st.booleans()),
        class_token=class_token, num_reg_tokens=draw(st.sampled_from([0, 0, 1, 2])),
        no_embed_class=draw(st.booleans()), use_abs_pos_emb=draw(st.booleans()), use_rot_pos_emb=rope,
        use_post_norm=draw(st.booleans()), use_pre_transformer_norm=draw(st.booleans()),
        use_fc_norm=draw(st.sampled_from([None, True, False])), attn_type=draw(st.sampled_from(["eva", "rope"])),
    )  # fmt: skip
    if kwargs["attn_type"] == "rope" and draw(st.booleans()):
        # AttentionRope's grouped-query K/V heads (separate projections, pre-norm blocks only).
        kwargs.update(num_kv_heads=draw(st.sampled_from([x for x in (1, 2) if heads % x == 0])), qkv_fused=False,
                      use_post_norm=False)
    if kwargs["use_post_norm"]:
        kwargs.update(qk_norm=False, attn_only_layer_scale=False)  # timm asserts them off there
    if rope:
        kind = draw(st.sampled_from(["cat", "cat", "mixed", "dinov3"]))
        kwargs.update(
            rope_type=kind, rope_grid_offset=draw(st.sampled_from([0.0, 1.0])),
            rope_grid_indexing=draw(st.sampled_from(["ij", "xy"])),
            rope_rotate_half=kind != "mixed" and draw(st.booleans()),  # timm refuses it with mixed
            rope_temperature=draw(st.sampled_from([10000.0, 100.0])),
        )  # fmt: skip
        if not geo["dynamic_img_size"] and draw(st.booleans()):
            # Rotary frequencies for a reference grid other than the model's (EVA-02's pretraining).
            kwargs["ref_feat_shape"] = (draw(st.integers(2, 5)), draw(st.integers(2, 5)))
    return _case_cfg(draw, domain, "eva", geo, kwargs, heads)


@st.composite
def configs(draw):
    return draw(st.one_of(vit_configs(), eva_configs()))


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)




def _example(domain, sizes, run_size, block="Block", mlp="Mlp", attention="ring", arch="vit", **kw):
    base = dict(img_size=run_size, patch_size=4, num_classes=5, embed_dim=8, depth=1, num_heads=2)
    return dict(arch=arch, domain=domain, seed=7, patch=4, run_size=run_size, sizes=sizes, block=block, mlp=mlp,
                kwargs={**base, **kw}, attention=attention)


# Three cases the fast run always includes (uneven slabs, prefix tokens, the three pool kinds).
EXAMPLES = [
    _example(3, [4, 12, 8], (24, 12), reg_tokens=2, global_pool="map", qk_norm=True, init_values=0.5),
    _example(2, [12, 7], (19, 10), mlp="SwiGLUPacked", act_layer="silu", mlp_ratio=2.0, dynamic_img_size=True,
             dynamic_img_pad=True, img_size=(16, 16), class_token=False, global_pool="avgmax", reg_tokens=1),
    _example((2, 2), None, (16, 20), block="ResPostBlock", attention="ulysses", num_heads=4, no_embed_class=True,
             norm_layer="rmsnorm", pool_include_prefix=True, global_pool="max", reg_tokens=1),
    _example(3, [8, 4, 12], (24, 16), arch="eva", use_rot_pos_emb=True, rope_type="mixed", num_reg_tokens=1,
             swiglu_mlp=True, global_pool="avg", depth=2),
]


test_fuzz_vit_fast, test_fuzz_vit_campaign = fuzz_tests(
    "vit fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_VIT_FAST_EXAMPLES", 8), campaign=("SNN_FUZZ_VIT_EXAMPLES", 300), every=25,
    count=lambda cfg: cfg["arch"],
)
