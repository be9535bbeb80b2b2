"""Transolver: PhysicsNeMo / thuml reference fixtures, and the sharded model against the plain one.

The fixtures in tests/fixtures/transolver were made with nvidia-physicsnemo 2.2.2 and the
thuml/Transolver model files in a scratch environment (see the README, "Point clouds and
Transolver"); they hold float32 weights, float64 inputs, outputs and input gradients.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from sharded_nn.converters import thuml_transolver_kwargs, transolver_from_thuml
from sharded_nn.zoo.transolver import ShardedTransolver, Transolver

import sharded_nn as snn
from sharded_nn.errors import ShardingError

from .harness import assert_compiled_cleanly, mesh
from .reference import reduce_param_grads

FIXTURES = Path(__file__).parent / "fixtures" / "transolver"
PNEMO = [
    "pnemo_unstructured", "pnemo_time", "pnemo_structured2d", "pnemo_structured3d", "pnemo_unified_pos", "pnemo_plus"
]


def _load(name: str) -> dict:
    return torch.load(FIXTURES / f"{name}.pt", weights_only=True)


def _config(blob: dict) -> dict:
    cfg = dict(blob["config"])
    if cfg.get("structured_shape") is not None:
        cfg["structured_shape"] = tuple(cfg["structured_shape"])
    return cfg


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", PNEMO)
def test_physicsnemo_checkpoint(name):
    blob = _load(name)
    model = Transolver(**_config(blob))
    model.load_state_dict(blob["state_dict"], strict=True)
    # Same keys in the same order as PhysicsNeMo's state_dict().
    assert list(model.state_dict()) == list(blob["state_dict"])
    model = model.double().eval()
    if model.blocks[0].Attn.plus:
        model.set_gumbel_noise("never")
    ins = {k: (v.clone().requires_grad_(k in blob["input_grads"]) if v is not None else None)
           for k, v in blob["inputs"].items()}  # fmt: skip
    out = model(ins["fx"], embedding=ins["embedding"], time=ins["time"])
    _close(out, blob["output"], "output")
    grads = torch.autograd.grad(out, [ins[k] for k in blob["input_grads"]], blob["grad_output"])
    for k, g in zip(blob["input_grads"], grads):
        _close(g, blob["input_grads"][k], f"grad {k}")
    if model.blocks[0].Attn.plus:
        # Noise on, same seed: the same torch.rand_like draws as PhysicsNeMo.
        model.set_gumbel_noise("always")
        torch.manual_seed(blob["extra"]["noise_seed"])
        out = model(ins["fx"], embedding=ins["embedding"], time=ins["time"])
        _close(out, blob["extra"]["noise_output"], "noisy output")
        assert not torch.allclose(out, blob["output"], atol=1e-8, rtol=0)


def test_gumbel_noise_train_mode_switch():
    blob = _load("pnemo_plus")
    model = Transolver(**_config(blob), gumbel_noise="train")
    model.load_state_dict(blob["state_dict"])
    model = model.double()
    fx, emb = blob["inputs"]["fx"], blob["inputs"]["embedding"]
    model.eval()
    _close(model(fx, embedding=emb), blob["output"], "eval output (noise off)")
    model.train()
    assert not torch.allclose(model(fx, embedding=emb), blob["output"], atol=1e-8, rtol=0)
    with pytest.raises(ValueError, match="gumbel_noise must be one of"):
        Transolver(**_config(blob), gumbel_noise="sometimes")


@pytest.mark.parametrize(
    "name, kind, functional_input",
    [("thuml_irregular", "irregular", None), ("thuml_structured2d", "structured2d", True),
     ("thuml_structured3d", "structured3d", False)],  # fmt: skip
)
def test_thuml_checkpoint(name, kind, functional_input):
    blob = _load(name)
    model = Transolver(**thuml_transolver_kwargs(kind, **blob["config"])).double()
    # Converted in float64 so that the folded placeholder adds no float32 rounding.
    sd64 = {k: v.double() for k, v in blob["state_dict"].items()}
    sd = transolver_from_thuml(sd64, functional_input=functional_input)
    model.load_state_dict(sd, strict=True)
    model.eval()
    ins = blob["inputs"]
    x = ins["x"].clone().requires_grad_()
    has_fx = ins["fx"] is not None
    fx = ins["fx"].clone().requires_grad_() if has_fx else x.new_zeros(*x.shape[:2], 0)
    out = model(fx, embedding=x, time=None if ins["T"] is None else ins["T"][:, 0])
    _close(out, blob["output"], "output")
    grads = torch.autograd.grad(out, [x, fx] if has_fx else [x], blob["grad_output"])
    for k, g in zip(blob["input_grads"], grads):
        _close(g, blob["input_grads"][k], f"grad {k}")


def test_thuml_converter_errors():
    sd = _load("thuml_structured2d")["state_dict"]
    with pytest.raises(ValueError, match="needs functional_input=True"):
        transolver_from_thuml(sd)
    with pytest.raises(ValueError, match="keys this converter does not know: \\['extra.weight'\\]"):
        transolver_from_thuml({**sd, "extra.weight": torch.zeros(1)}, functional_input=True)
    with pytest.raises(ValueError, match="structured checkpoints only"):
        transolver_from_thuml(_load("thuml_irregular")["state_dict"], functional_input=True)


def test_legacy_mlp_keys_and_use_te():
    blob = _load("pnemo_unstructured")
    sd = dict(blob["state_dict"])
    for old, new in (("linear_pre.0", "layers.0"), ("linear_post", "layers.2")):
        for p in ("weight", "bias"):
            sd[f"preprocess.{old}.{p}"] = sd.pop(f"preprocess.{new}.{p}")
    model = Transolver(**_config(blob))
    model.load_state_dict(sd, strict=True)
    torch.testing.assert_close(model.preprocess.layers[0].weight, blob["state_dict"]["preprocess.layers.0.weight"])
    with pytest.raises(ValueError, match="use_te=True"):
        Transolver(3, 1, 3, use_te=True)


# ---------------------------------------------------------------------------------------------
# Sharded model against the single-device one (float64): forward, input and parameter gradients.

CONFIGS = {
    "unstructured": dict(functional_dim=3, out_dim=2, embedding_dim=3, n_layers=2, n_hidden=16, n_head=2,
                         mlp_ratio=2, slice_num=5),
    "time": dict(functional_dim=2, out_dim=1, embedding_dim=3, n_layers=2, n_hidden=16, n_head=4, mlp_ratio=2,
                 slice_num=4, time_input=True),
    "plus": dict(functional_dim=2, out_dim=2, embedding_dim=3, n_layers=2, n_hidden=16, n_head=2, mlp_ratio=2,
                 slice_num=6, plus=True, gumbel_noise="never"),
    "structured2d": dict(functional_dim=2, out_dim=1, embedding_dim=2, n_layers=2, n_hidden=8, n_head=2,
                         mlp_ratio=2, slice_num=4, structured_shape=(9, 5)),
    "structured3d": dict(functional_dim=1, out_dim=1, embedding_dim=3, n_layers=2, n_hidden=8, n_head=2,
                         mlp_ratio=2, slice_num=3, structured_shape=(7, 4, 3)),
    "unified_pos": dict(functional_dim=2, out_dim=1, n_layers=2, n_hidden=8, n_head=2, mlp_ratio=2, slice_num=4,
                        structured_shape=(9, 4), unified_pos=True, ref=3),
}  # fmt: skip


def _reference(cfg: dict, seed: int = 0) -> Transolver:
    torch.manual_seed(seed)
    model = Transolver(**cfg).double()
    with torch.no_grad():  # non-trivial values everywhere (the init leaves biases 0, LN 1)
        for name, p in model.named_parameters():
            if name.endswith("temperature"):
                p.uniform_(0.3, 1.5)
            else:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _sharded_case(name: str, domain: int, sizes: list[int] | None, flat: bool, via_factory: bool,
                  compiled: bool = False):
    cfg = CONFIGS[name]
    m = mesh(domain)
    rank = snn.domain_group(m).rank()
    ref = _reference(cfg)
    if via_factory:
        model = snn.zoo.create_model("transolver", mesh=m, **cfg).double()
        model.load_state_dict(ref.state_dict(), strict=True)
    else:
        model = snn.convert(copy.deepcopy(ref), m, strict=True)
    assert isinstance(model, ShardedTransolver)
    assert list(model.state_dict()) == list(ref.state_dict())
    if compiled:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        model.compile(backend="aot_eager")

    gen = torch.Generator().manual_seed(1)
    b = 2
    shape = cfg.get("structured_shape")
    spatial = shape if shape is not None else (sizes and sum(sizes) or 37,)
    fx = torch.randn(b, *spatial, cfg["functional_dim"], generator=gen, dtype=torch.float64)
    emb = None if cfg.get("unified_pos") else torch.randn(b, *spatial, cfg["embedding_dim"], generator=gen,
                                                          dtype=torch.float64)  # fmt: skip
    time = torch.rand(b, generator=gen, dtype=torch.float64) if cfg.get("time_input") else None

    # This rank's points: an arbitrary (random) partition of the points for unstructured
    # models, a slab of whole rows of the first spatial dim for grids.
    n0 = spatial[0]
    layout = sizes if sizes is not None else list(snn.Layout.balanced(n0, domain).sizes)
    if shape is None:
        perm = torch.randperm(n0, generator=torch.Generator().manual_seed(7))
        start = sum(layout[:rank])
        idx = perm[start : start + layout[rank]]
    else:
        start = sum(layout[:rank])
        idx = torch.arange(start, start + layout[rank])

    def local(t):
        if t is None:
            return None
        t = t.index_select(1, idx)
        return t.reshape(b, -1, t.shape[-1]) if flat else t

    fx_ref = fx.clone().requires_grad_()
    emb_ref = emb.clone().requires_grad_() if emb is not None else None
    y = ref(fx_ref, embedding=emb_ref, time=time)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (y * g).sum().backward()

    fx_l = local(fx).requires_grad_()
    emb_l = local(emb).requires_grad_() if emb is not None else None
    y_l = model(fx_l, embedding=emb_l, time=time)
    _close(y_l, local(y.detach()), "output")
    # Per-rank losses sum to the global loss (DESIGN.md section 3).
    (y_l * local(g)).sum().backward()
    _close(fx_l.grad, local(fx_ref.grad), "grad fx")
    if emb is not None:
        _close(emb_l.grad, local(emb_ref.grad), "grad embedding")
    grads = reduce_param_grads(model, m)
    for pname, p in ref.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, atol=1e-11, rtol=1e-9, msg=lambda s, n=pname: f"{n}: {s}")
    if compiled:
        assert_compiled_cleanly()
    return True


@pytest.mark.parametrize("domain, sizes", [(1, None), (2, [23, 14]), (3, None), (4, [5, 11, 1, 20])])
def test_sharded_unstructured(run, domain, sizes):
    assert all(run(domain, _sharded_case, "unstructured", domain, sizes, False, False))


def test_sharded_compiled(run):
    # torch.compile (aot_eager) of the converted model: the same values as the plain model.
    assert all(run(2, _sharded_case, "unstructured", 2, [23, 14], False, False, True))


@pytest.mark.parametrize("name", ["time", "plus"])
@pytest.mark.parametrize("domain, sizes", [(2, [9, 28]), (3, [12, 3, 22])])
def test_sharded_variants(run, name, domain, sizes):
    assert all(run(domain, _sharded_case, name, domain, sizes, False, domain == 3))


@pytest.mark.parametrize("name", ["structured2d", "structured3d", "unified_pos"])
@pytest.mark.parametrize("domain, flat", [(2, False), (3, True), (4, False)])
def test_sharded_structured(run, name, domain, flat):
    # Uneven slabs of rows of the first spatial dim (9 rows for the 2-D grids, 7 for the 3-D one).
    rows = CONFIGS[name]["structured_shape"][0]
    sizes = {(9, 2): [6, 3], (9, 3): [4, 1, 4], (7, 2): [2, 5], (7, 3): [3, 1, 3]}.get((rows, domain))
    assert all(run(domain, _sharded_case, name, domain, sizes, flat, name == "structured2d"))


def _error_case(kind: str):
    m = mesh(2)
    rank = snn.domain_group(m).rank()
    ref = _reference(CONFIGS["structured2d" if kind == "rows" else "unstructured"])
    model = snn.convert(copy.deepcopy(ref), m)
    try:
        if kind == "rows":
            # 45 grid points split 23 / 22: not whole rows of 5.
            n = [23, 22][rank]
            model(torch.randn(1, n, 2, dtype=torch.float64), embedding=torch.randn(1, n, 2, dtype=torch.float64))
        else:
            b = [1, 2][rank]  # the ranks disagree on the batch size
            model(torch.randn(b, 10, 3, dtype=torch.float64), embedding=torch.randn(b, 10, 3, dtype=torch.float64))
    except ShardingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind, match", [("rows", "whole rows of the grid"), ("batch", "with the same B")])
def test_sharded_errors_on_every_rank(run, kind, match):
    msgs = run(2, _error_case, kind)
    assert all(match in m for m in msgs), msgs
    assert msgs[0] == msgs[1]


# ---------------------------------------------------------------------------------------------
# End to end: PointCloudPartition + sharded Transolver; the training example (bench/car_surface.py).


def _partition_case(domain: int, method: str):
    from sharded_nn.points import PointCloudPartition

    m = mesh(domain)
    ref = _reference(CONFIGS["unstructured"])
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    gen = torch.Generator().manual_seed(3)
    pos = torch.rand(61, 3, generator=gen, dtype=torch.float64)
    fx = torch.randn(2, 61, 3, generator=gen, dtype=torch.float64)
    part = PointCloudPartition(m, method=method)
    pos_l, fx_l = part(pos, fx)
    y = part.restore(model(fx_l, embedding=pos_l.expand(2, -1, -1)))
    _close(y, ref(fx, embedding=pos.expand(2, -1, -1)).detach(), "restored output")
    return True


@pytest.mark.parametrize("domain, method", [(2, "rcb"), (3, "morton")])
def test_partitioned_transolver_output_independent_of_split(run, domain, method):
    assert all(run(domain, _partition_case, domain, method))


def _car_case():
    import importlib.util

    spec = importlib.util.spec_from_file_location("car_surface", Path(__file__).parents[1] / "bench" / "car_surface.py")
    car = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(car)
    kw = dict(points=150, samples=2, steps=3, hidden=16, layers=2, heads=2, slices=4, dtype=torch.float64)
    losses = car.train(mesh(2, data=2), **kw)
    ref = car.train(None, **kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-10, atol=0)
    assert losses[-1] < losses[0]
    return losses


def test_car_surface_training_matches_single_device(run):
    out = run(4, _car_case)
    assert all(o == out[0] for o in out)
