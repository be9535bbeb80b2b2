"""The bad-input catalogue: misuses of the public API, each raising alike on every rank with advice.

Every entry of ``CATALOGUE`` is one misuse (often on ONE rank only: the dangerous kind, which
used to leave the other ranks waiting in a collective). The worker runs the misuse, catches the
exception and returns ``(type name, message)``; the test asserts that every rank raised, with
the same type and the same message, that the message names the problem (``match``) and that it
says what to do (``advice``). The README's "Bad-input catalogue" table lists the same entries
(``test_readme_lists_the_catalogue`` keeps them in step). Layer-by-layer variants of the same
misuses (every public layer, ranks 2 and 3) are in ``tests/test_layer_errors.py``.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

import sharded_nn as snn
from sharded_nn import checkpoint as ckpt

from .harness import mesh

D = torch.float64


@dataclass(frozen=True)
class Misuse:
    """One catalogue entry; ``make(r, tmp)`` returns the call that misbehaves on domain rank ``r``."""

    misuse: str
    error: str
    match: str  # regex: names the problem
    advice: str  # regex: says what to do
    make: Callable[[int, str], Callable[[], object]]


def _grid(shape=(2, 4, 9, 6), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _slab(m, x=None, **kw):
    return snn.shard(_grid() if x is None else x, m, **kw)


def _conv(m, **kw):
    torch.manual_seed(0)
    return snn.ShardedConv2d(4, 3, 3, padding=1, mesh=m, **kw).double()


def _one(r, bad, good):
    return bad() if r == 1 else good()


def _m():
    return mesh(2)


def _dp_mesh():
    # A mesh without a domain axis (a plain data-parallel mesh).
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


def _misaligned(r, tmp):
    m = _m()
    conv = snn.ShardedConv2d(4, 3, 3, stride=2, padding=1, mesh=m).double()
    x = _grid((1, 4, 10, 6))
    return lambda: conv(x[:, :, :5] if r == 0 else x[:, :, 5:])  # rank 1 starts at 5: not a multiple of 2


def _no_keys(r, tmp):
    # Empty slabs are taken (a deep stage on many ranks; ring attention since session 67), but
    # queries over no key at all have no answer.
    m = _m()
    q = torch.randn(1, 2, 4 if r == 0 else 0, 8, dtype=D)
    k = torch.randn(1, 2, 0, 8, dtype=D)
    return lambda: snn.functional.ring_attention(q, k, k, m)


def _dtype(r, tmp):
    m = _m()
    x = _slab(m)
    return lambda: _conv(m)(_one(r, x.float, lambda: x))


def _channels(r, tmp):
    m = _m()
    x = _slab(m)
    return lambda: snn.ShardedGroupNorm(2, 4, mesh=m).double()(_one(r, lambda: x[:, :2], lambda: x))


def _batch(r, tmp):
    m = _m()
    x = _slab(m)
    return lambda: _conv(m)(_one(r, lambda: x[:1], lambda: x))


def _requires_grad(r, tmp):
    m = _m()
    x = _slab(m)
    return lambda: _conv(m)(_one(r, lambda: x.requires_grad_(), lambda: x))


def _dims_range(r, tmp):
    return lambda: snn.ShardedConv2d(4, 3, 3, mesh=_m(), dims=(4,))


def _no_domain_axis(r, tmp):
    dp = _dp_mesh()
    return lambda: snn.convert(nn.Conv2d(4, 3, 3), dp)


def _mesh_not_mesh(r, tmp):
    return lambda: snn.ShardedConv2d(4, 3, 3, mesh="domain")


def _init_mesh_size(r, tmp):
    return lambda: snn.init_mesh(domain=3, device_type="cpu")


def _init_mesh_data(r, tmp):
    return lambda: snn.init_mesh(data=0, device_type="cpu")


def _too_many_ranks(r, tmp):
    return lambda: snn.shard(_grid((1, 1, 1, 4)), _m())


def _layout_align(r, tmp):
    return lambda: snn.Layout((3, 4), align=2)


def _other_mesh(r, tmp):
    m = _m()
    data_mesh = mesh(1, 2)  # the same two ranks as data replicas
    model = snn.convert(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU()).double(), m)
    return lambda: snn.parallelize(model, data_mesh)


def _strict_unsupported(r, tmp):
    return lambda: snn.convert(nn.Sequential(nn.Conv2d(4, 4, 3), nn.PixelShuffle(2)), _m(), strict=True)


def _plan_typo(r, tmp):
    import warnings

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            snn.convert(nn.Sequential(nn.Conv2d(4, 4, 3)), _m(), plan={"encoder.*": {"dims": (2,)}})

    return call


def _heads(r, tmp):
    m = _m()
    q = snn.shard(torch.randn(2, 3, 9, 4, dtype=D), m, dims=(2,))
    return lambda: snn.UlyssesAttention(m)(q, q, q)


def _output_size(r, tmp):
    m = _m()
    layer = snn.ShardedConvTranspose2d(4, 3, 3, stride=2, padding=1, mesh=m).double()
    x = _slab(m)
    return lambda: layer(x, output_size=(17 + r, 11))


def _loss_shapes(r, tmp):
    m = _m()
    y = _slab(m)
    return lambda: snn.losses.mse_loss(y, _one(r, lambda: y[:, :1], lambda: y), m)


def _vit_patch(r, tmp):
    import timm

    m = _m()
    model = snn.convert(timm.create_model("vit_tiny_patch16_224", embed_dim=32, depth=1, num_heads=2,
                                          img_size=(64, 32)).double().eval(), m)
    x = torch.randn(1, 3, 64, 32, dtype=D)
    return lambda: model(x[:, :, :24] if r == 0 else x[:, :, 24:])  # rank 1 starts inside a patch


def _transolver_rows(r, tmp):
    from sharded_nn.zoo import Transolver

    m = _m()
    model = snn.convert(Transolver(functional_dim=2, out_dim=1, embedding_dim=2, n_layers=1, n_hidden=8, n_head=2,
                                   mlp_ratio=2, slice_num=4, structured_shape=(9, 5)).double(), m)
    n = [23, 22][r]  # 45 grid points split 23 / 22: not whole rows of 5
    return lambda: model(torch.randn(1, n, 2, dtype=D), embedding=torch.randn(1, n, 2, dtype=D))


def _knn_width(r, tmp):
    m = _m()
    pos = torch.randn(5, 3 if r == 0 else 2, dtype=D)
    return lambda: snn.points.knn(pos, pos, k=2, mesh=m)


def _ckpt_keys(r, tmp):
    m = _m()
    path = f"{tmp}/linear.safetensors"
    ckpt.save(nn.Linear(3, 2), path, mesh=m)
    return lambda: ckpt.load(nn.Linear(3, 4), path, mesh=m)  # another shape on every rank


def _ckpt_other_file(r, tmp):
    m = _m()
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    ckpt.save(a, f"{tmp}/a.safetensors", mesh=m)
    ckpt.save(b, f"{tmp}/b.safetensors", mesh=m)
    return lambda: ckpt.load(nn.Linear(3, 2), f"{tmp}/{'a' if r == 0 else 'b'}.safetensors", mesh=m)


def _ckpt_missing_on_one(r, tmp):
    m = _m()
    ckpt.save(nn.Linear(3, 2), f"{tmp}/c.safetensors", mesh=m)
    return lambda: ckpt.load(nn.Linear(3, 2), f"{tmp}/c.safetensors" if r == 0 else f"{tmp}/none.safetensors", mesh=m)


def _ckpt_pickle(r, tmp):
    m = _m()
    path = f"{tmp}/model.pt"
    if r == 0:
        torch.save(nn.Linear(3, 2).state_dict(), path)
    ckpt.save({}, f"{tmp}/sync.safetensors", mesh=m)  # a barrier: the file exists on every rank
    return lambda: ckpt.load(nn.Linear(3, 2), path, mesh=m)


def _parallelize_mode(r, tmp):
    return lambda: snn.parallelize(nn.Conv2d(4, 4, 3), _m(), mode="zero3")


def _causal_one_rank(r, tmp):
    m = _m()
    q = torch.randn(1, 2, 5, 4, dtype=D, generator=torch.Generator().manual_seed(r))
    return lambda: snn.functional.ring_attention(q, q, q, m, is_causal=(r == 0))


def _zoo_unknown(r, tmp):
    from sharded_nn import zoo

    return lambda: zoo.create_model("vit_smal_patch16_224", mesh=_m(), img_size=64)  # a typo


def _shard_other_dims(r, tmp):
    m = _m()
    torch.manual_seed(0)
    model = snn.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)).double(), m)
    x = torch.randn(1, 3, 8, 8, dtype=D)
    return lambda: model(snn.shard(x, m, dims=[3]))  # the model takes H (dim 2)


def _input_dims_unknown(r, tmp):
    return lambda: snn.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)), _m(), input_dims={"target": 1})


class _SegLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.conv(x), target)


def _loss_bad_target(r, tmp):
    m = _m()
    torch.manual_seed(0)
    model = snn.convert(_SegLoss().double(), m, input_dims={"target": 1})
    x = torch.randn(1, 3, 8, 4, dtype=D)
    target = torch.randint(0, 4, (1, 8, 4))
    target[0, -1, 0] = 9  # out of range, in rank 1's rows only
    return lambda: model(snn.shard(x, m), snn.shard(target, m, dims=(1,)))


def _gather_other_dims(r, tmp):
    m = _m()
    torch.manual_seed(0)
    model = snn.convert(nn.Sequential(nn.Linear(6, 6)).double(), m, dims=(1,))  # tokens (B, L, C) along L
    y = model(snn.shard(torch.randn(2, 8, 6, dtype=D), m, dims=(1,)))
    return lambda: snn.gather(y, m)  # the default dims (2,) are a grid's


CATALOGUE: dict[str, Misuse] = {
    "misaligned-slab": Misuse("a slab starts off the alignment (strided conv, rank 1 starts at 5, stride 2)",
                              "ShardingError", r"needs every slab to start at a multiple of 2",
                              r"Shard the input with align", _misaligned),
    "no-keys": Misuse("queries but no key on any rank (ring attention)", "ShardingError", r"no rank holds a key",
                      r"Pass at least one key", _no_keys),
    "dtype-one-rank": Misuse("another dtype on one rank", "ShardingError", r"disagree on dtype",
                             r"must call the layer alike", _dtype),
    "channels-one-rank": Misuse("another channel count on one rank", "ShardingError",
                                r"dim 1 is not sharded but its size differs", r"must hold the same extent", _channels),
    "batch-one-rank": Misuse("another batch size on one rank", "ShardingError",
                             r"dim 0 is not sharded but its size differs", r"must hold the same extent", _batch),
    "requires-grad-one-rank": Misuse("requires_grad on one rank only", "ShardingError", r"disagree on requires_grad",
                                     r"set requires_grad alike", _requires_grad),
    "dims-not-spatial": Misuse("layer dims= out of range (dim 4 of a Conv2d)", "ShardingError",
                               r"not spatial dims", r"Pass dims=", _dims_range),
    "mesh-without-domain": Misuse("a mesh without a domain axis", "ValueError", r"needs a mesh with a 'domain' axis",
                                  r"init_mesh\(domain=P\)|name the axes", _no_domain_axis),
    "mesh-not-a-mesh": Misuse("mesh= is not a DeviceMesh", "TypeError", r"must be a torch DeviceMesh",
                              r"DeviceMesh", _mesh_not_mesh),
    "init-mesh-size": Misuse("init_mesh sizes that do not multiply to the world size", "ValueError",
                             r"needs 3 ranks", r"product is the world size", _init_mesh_size),
    "init-mesh-data": Misuse("init_mesh(data=0)", "ValueError", r"data must be >= 1", r"Pass data=1", _init_mesh_data),
    "more-ranks-than-positions": Misuse("shard a dim shorter than the number of ranks", "ShardingError",
                                        r"fewer than the 2 ranks", r"Use fewer ranks", _too_many_ranks),
    "layout-misaligned": Misuse("Layout with starts off the alignment", "ShardingError", r"not multiples of align",
                                r"shard\(\.\.\., align=2\)", _layout_align),
    "model-for-other-mesh": Misuse("a model converted for one mesh parallelized on another", "ValueError",
                                   r"converted for another mesh", r"Convert the single-device model once",
                                   _other_mesh),
    "strict-unsupported-layer": Misuse("convert(strict=True) with a layer that has no sharded version",
                                       "ShardingNotImplementedError", r"no sharded version",
                                       r"Register a sharded class", _strict_unsupported),
    "plan-glob-typo": Misuse("a plan glob that matches no module (as an error under -W error)", "ShardingWarning",
                             r"matches no module", r"check the name against", _plan_typo),
    "heads-not-divisible": Misuse("Ulysses with heads not divisible by the ranks", "ShardingError",
                                  r"must both be divisible by the 2 domain ranks", r"Use ring_attention", _heads),
    "output-size-one-rank": Misuse("ConvTranspose output_size differing by rank (taken from a local slab)",
                                   "ShardingError", r"disagree on output_size", r"Every rank must call the layer alike",
                                   _output_size),
    "loss-shapes": Misuse("pred and target slabs of different shapes on one rank", "ValueError",
                          r"must have the same shape on every rank", r"Shard both with the same dims", _loss_shapes),
    "vit-patch-misaligned": Misuse("a ViT slab that starts inside a patch", "ShardingError", r"whole patches",
                                   r"Shard with snn.shard\(x, mesh, dims=\(2,\), align=16\)", _vit_patch),
    "transolver-rows": Misuse("structured Transolver slabs that are not whole rows", "ShardingError", r"whole rows",
                              r"Shard the \(B, S0, \.\.\.\) grid along S0", _transolver_rows),
    "knn-width": Misuse("knn with point widths differing between ranks", "ValueError", r"same d",
                        r"every rank needs", _knn_width),
    "checkpoint-shapes": Misuse("a checkpoint whose shapes do not fit the model", "ShardingError", r"does not fit",
                                r"same keys and shapes", _ckpt_keys),
    "checkpoint-other-file": Misuse("ranks loading different checkpoints", "ShardingError",
                                    r"loaded different values", r"pass the same path", _ckpt_other_file),
    "checkpoint-missing-one-rank": Misuse("a checkpoint file missing on one rank", "ShardingError",
                                          r"failed on mesh rank\(s\) \[1\]", r"pass a path that every rank can read",
                                          _ckpt_missing_on_one),
    "checkpoint-pickle": Misuse("a pickled torch.save checkpoint (would execute code)", "ShardingError",
                                r"does not fit.*pickles are refused", r"Load a safetensors file", _ckpt_pickle),
    "zoo-unknown-model": Misuse("zoo.create_model with a misspelt model name", "ValueError", r"unknown model",
                                r"timm model name.*check the spelling", _zoo_unknown),
    "parallelize-mode": Misuse("parallelize with an unknown mode", "ValueError", r"mode must be", r"'ddp' or 'fsdp'",
                               _parallelize_mode),
    "attention-causal-one-rank": Misuse("ring attention with is_causal on one rank only", "ShardingError",
                                        r"disagree on is_causal, scale or layout",
                                        r"pass the same is_causal, scale and layout", _causal_one_rank),
    "shard-other-dims": Misuse("a slab cut by shard along another dim than the model takes", "ShardingError",
                               r"was cut by sharded_nn.shard along dims \(3,\), but the model takes it along dims "
                               r"\(2,\)", r"Shard the input along the dims the model takes", _shard_other_dims),
    "input-dims-unknown": Misuse("convert(input_dims=) naming no input of forward", "ValueError",
                                 r"not a tensor input of Sequential.forward", r"Name an input of forward",
                                 _input_dims_unknown),
    "loss-bad-target-one-rank": Misuse("a class index out of range in one rank's slab, in a loss inside forward",
                                       "ShardingError", r"torch's loss raised on the slab of at least one rank",
                                       r"check the values of the targets", _loss_bad_target),
    "gather-other-dims": Misuse("gather a model's output along other dims than its slabs", "ShardingError",
                                r"this slab was cut along dims \(1,\)", r"Pass dims=\(1,\)", _gather_other_dims),
}


def _first_line(msg: str) -> str:
    # checkpoint errors add the raising rank's own cause after " This rank:"; everything before it is shared.
    return msg.split(" This rank:")[0]


def _run_catalogue(names: list[str], tmp: str) -> dict[str, tuple[str, str] | None]:
    m = _m()
    r = m.get_local_rank("domain")
    out = {}
    for name in names:
        # Every entry builds its modules from the same seed on every rank (this torch seeds each
        # process differently: an entry built unseeded failed the weights check instead of its
        # own misuse when the pool's workers were fresh).
        torch.manual_seed(0)
        call = CATALOGUE[name].make(r, tmp)
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the point is to report whatever was raised
            out[name] = (type(e).__name__, _first_line(str(e)))
        else:
            out[name] = None
    return out


def test_catalogue_has_at_least_25_entries():
    assert len(CATALOGUE) >= 25


def test_every_misuse_raises_alike_with_advice(run, tmp_path):
    names = list(CATALOGUE)
    results = run(2, _run_catalogue, names, str(tmp_path))
    failures = []
    for name in names:
        got = [res[name] for res in results]
        entry = CATALOGUE[name]
        if got[0] is None or any(g != got[0] for g in got):
            failures.append(f"{name}: ranks raised differently or not at all: {got}")
            continue
        typ, msg = got[0]
        if typ != entry.error:
            failures.append(f"{name}: expected {entry.error}, got {typ}: {msg}")
        if not re.search(entry.match, msg):
            failures.append(f"{name}: message does not name the problem ({entry.match!r}): {msg}")
        if not re.search(entry.advice, msg):
            failures.append(f"{name}: message does not say what to do ({entry.advice!r}): {msg}")
    assert not failures, "\n".join(failures)


def test_readme_lists_the_catalogue():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in readme]
    assert not missing, f"README's bad-input catalogue lacks {missing}"
