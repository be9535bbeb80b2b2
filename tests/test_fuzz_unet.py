"""Hypothesis fuzzing of converted UNets: our zoo ``UNet`` and MONAI's ``UNet`` and ``BasicUNet``.

``tests/test_unet.py`` and ``tests/test_third_party_unets.py`` check named configurations; this
file draws the constructors' options together, with the mesh and the slabs:

- zoo ``UNet``: 1-3 spatial dims, 1-3 levels, 1-2 residual blocks, every norm (group, batch,
  instance, none), down step (strided conv, max or average pool) and up step (transposed conv,
  nearest or linear upsampling), self-attention at any levels with 1-2 heads, one padding mode
  per dim (zeros, reflect, replicate, circular), grid sizes that are not multiples of the
  alignment (far-edge pad and crop), training or eval mode.
- MONAI ``UNet``: strides, kernel sizes, residual units, activation, norm, bias, the
  activation/dropout/norm ordering; ``BasicUNet``: features, activation, norm, upsampling
  (transposed conv, pixel shuffle, interpolation).

The mesh: 1-4 ranks sharding any one spatial dim with random uneven slabs that start at
multiples of ``snn.alignment(model)``, or a 2x2 mesh sharding two spatial dims. Each example
converts a float64 model (``convert(strict=True)``) and compares the output, the no-grad output,
the input gradient, every parameter gradient (summed over the ranks) and the buffers (BatchNorm's
running statistics) with the model on the whole grid, to 1e-9. A refusal (``ShardingError``)
alike on every rank is counted apart, as is a configuration the model itself rejects on one
device; any mismatch fails.

- ``test_fuzz_unet_fast``: the CI subset (derandomized, a few examples).
- ``test_fuzz_unet_campaign`` (``pytest -m slow``): ``SNN_FUZZ_UNET_EXAMPLES`` examples
  (default 300), counts printed, fails on any mismatch or timeout.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st

import sharded_nn as snn
from sharded_nn.alignment import alignment
from sharded_nn.zoo import UNet
from sharded_nn.zoo.unet import DOWNS, NORMS, PADDING_MODES, UPS

from .fuzzing import fuzz_tests, outcome, randomize_
from .harness import mesh
from .reference import check_against_reference


def _build(cfg: dict):
    """The float64 model of ``cfg`` (parameters randomised so that every one matters)."""
    torch.manual_seed(cfg["seed"])
    kw = dict(cfg["kwargs"])
    try:
        if cfg["arch"] == "zoo":
            model = UNet(cfg["spatial_dims"], cfg["cin"], cfg["cout"], **kw)
        else:
            from monai.networks import nets as monai_nets  # in the test extras

            cls = monai_nets.UNet if cfg["arch"] == "monai_unet" else monai_nets.BasicUNet
            model = cls(cfg["spatial_dims"], cfg["cin"], cfg["cout"], **kw)
    except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
        return None, f"{type(e).__name__}: {e}"
    return randomize_(model.double().train(cfg["train"]), cfg["seed"] + 1, 0.1), None


def _sizes(cfg: dict, align: tuple[int, ...]) -> tuple[tuple[int, ...], list[int] | None]:
    """The global grid and, on 1-D meshes, the slab sizes along the sharded dim: ``blocks``
    alignment blocks per rank (per mesh row on 2x2), the last slab ``cut`` shorter when the model
    pads a far edge (zoo UNet), the unsharded dims as drawn."""
    shape = list(cfg["other"])
    dims = cfg["dims"]
    if isinstance(cfg["domain"], int):
        sizes = [b * align[0] for b in cfg["blocks"]]
        sizes[-1] -= min(cfg["cut"], sizes[-1] - 1)
        shape[dims[0] - 2] = sum(sizes)
        return tuple(shape), sizes
    for d, a in zip(dims, align):
        shape[d - 2] = 2 * max(cfg["blocks"]) * a - min(cfg["cut"], a - 1)
    return tuple(shape), None


def _case(cfg: dict):
    """One example on this rank: ``"ok"``, ``("refused", ...)`` or ``("invalid", ...)``; raises on a mismatch."""
    m = mesh(cfg["domain"])
    ref, why = _build(cfg)
    if ref is None:
        return ("invalid", why)
    dims = cfg["dims"]
    try:
        align = alignment(ref, dims, input_shape=(1, cfg["cin"]) + (64,) * cfg["spatial_dims"])
    except ValueError as e:
        return ("invalid", f"alignment probe: {e}"[:200])
    shape, sizes = _sizes(cfg, align)
    x = torch.randn(cfg["batch"], cfg["cin"], *shape, generator=torch.Generator().manual_seed(cfg["seed"] + 2),
                    dtype=torch.float64)  # fmt: skip
    try:
        with torch.no_grad():
            copy.deepcopy(ref)(x)  # a copy: a training forward moves BatchNorm's statistics
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return ("invalid", f"{type(e).__name__}: {e}"[:200])
    try:
        model = snn.convert(copy.deepcopy(ref), m, dims=dims, strict=True)
        check_against_reference(ref, x, m, dims=dims, align=align, sharded=model, sizes=sizes, atol=1e-9,
                                rtol=1e-9, seed=cfg["seed"] + 3)  # fmt: skip
    except (snn.ShardingError, snn.ShardingNotImplementedError) as e:
        return ("refused", type(e).__name__, str(e)[:200])
    for (name, b_ref), b in zip(ref.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, b_ref, atol=1e-12, rtol=1e-10, msg=lambda s, n=name: f"buffer {n}: {s}")
    return "ok"


# --------------------------------------------------------------------------- configs


@st.composite
def _mesh(draw, spatial_dims: int) -> dict:
    """Mesh, sharded dims, alignment blocks per rank (per mesh row on 2x2) and the far-edge cut."""
    domains = [1, 2, 3, 4] + ([(2, 2)] if spatial_dims > 1 else [])
    domain = draw(st.sampled_from(domains))
    if isinstance(domain, int):
        dims = (draw(st.integers(2, 1 + spatial_dims)),)
        blocks = [draw(st.integers(1, 2)) for _ in range(domain)]
    else:
        dims = tuple(sorted(draw(st.permutations(range(2, 2 + spatial_dims)))[:2]))
        blocks = [draw(st.integers(1, 2))]
    return dict(domain=domain, dims=dims, blocks=blocks)


@st.composite
def zoo_configs(draw):
    """Our zoo ``UNet``: every option."""
    spatial_dims = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 2))
    levels = draw(st.integers(1, 3 if spatial_dims < 3 else 2))
    channels = tuple(heads * draw(st.sampled_from([1, 2, 3])) for _ in range(levels))
    modes = tuple(draw(st.sampled_from(PADDING_MODES)) for _ in range(spatial_dims))
    attention = tuple(i for i in range(levels) if draw(st.integers(0, 3)) == 0)
    kwargs = dict(
        channels=channels, num_res_blocks=draw(st.integers(1, 2)), norm=draw(st.sampled_from(NORMS)),
        down=draw(st.sampled_from(DOWNS)), up=draw(st.sampled_from(UPS)), attention_levels=attention,
        num_heads=heads, padding_mode=modes if draw(st.booleans()) else modes[0],
    )  # fmt: skip
    align = 2 ** (levels - 1)
    other = tuple(draw(st.integers(max(1, align - 1), 2 * align + 2)) for _ in range(spatial_dims))
    return dict(
        arch="zoo", spatial_dims=spatial_dims, cin=draw(st.integers(1, 2)), cout=draw(st.integers(1, 2)),
        kwargs=kwargs, other=other, cut=draw(st.integers(0, max(0, align - 1))), batch=draw(st.integers(1, 2)),
        train=draw(st.booleans()), seed=draw(st.integers(0, 2**16)), **draw(_mesh(spatial_dims)),
    )  # fmt: skip


ACTS = ("PRELU", "RELU", "LEAKYRELU", "GELU", "ELU", "SWISH", "TANH")
MONAI_NORMS = ("INSTANCE", "BATCH", ("GROUP", {"num_groups": 1}), ("instance", {"affine": True}), None)


@st.composite
def monai_configs(draw):
    """MONAI's ``UNet`` and ``BasicUNet``: global sizes multiples of the alignment (their
    ``forward`` needs it on one device too)."""
    spatial_dims = draw(st.integers(2, 3))
    arch = draw(st.sampled_from(["monai_unet", "monai_basic"]))
    if arch == "monai_unet":
        levels = draw(st.integers(2, 3))
        kwargs = dict(
            channels=tuple(draw(st.sampled_from([2, 4])) for _ in range(levels)),
            strides=tuple(draw(st.sampled_from([1, 2, 2])) for _ in range(levels - 1)),
            kernel_size=draw(st.sampled_from([3, 3, 5])), up_kernel_size=draw(st.sampled_from([3, 3, 1])),
            num_res_units=draw(st.integers(0, 2)), act=draw(st.sampled_from(ACTS)),
            norm=draw(st.sampled_from(MONAI_NORMS)), bias=draw(st.booleans()),
            adn_ordering=draw(st.sampled_from(["NDA", "AND", "NA", "A"])),
        )  # fmt: skip
    else:
        kwargs = dict(
            features=tuple(draw(st.sampled_from([2, 4])) for _ in range(6)), act=draw(st.sampled_from(ACTS)),
            norm=draw(st.sampled_from(MONAI_NORMS)), bias=draw(st.booleans()),
            upsample=draw(st.sampled_from(["deconv", "nontrainable", "pixelshuffle"])),
        )  # fmt: skip
    # Unsharded dims: small multiples of 16 (BasicUNet's four halvings) or of MONAI UNet's strides.
    other = tuple(draw(st.sampled_from([16, 32])) for _ in range(spatial_dims))
    return dict(
        arch=arch, spatial_dims=spatial_dims, cin=draw(st.integers(1, 2)), cout=draw(st.integers(1, 2)),
        kwargs=kwargs, other=other, cut=0, batch=draw(st.integers(1, 2)), train=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)), **draw(_mesh(spatial_dims)),
    )  # fmt: skip


@st.composite
def configs(draw):
    return draw(st.one_of(zoo_configs(), monai_configs()))


def _run(pools, cfg, timeout: float = 300.0):
    return outcome(pools, _case, cfg, timeout)




def _example(arch, spatial_dims, domain, dims, blocks, other, cut=0, train=True, **kwargs):
    return dict(arch=arch, spatial_dims=spatial_dims, cin=2, cout=1, kwargs=kwargs, other=other, cut=cut, batch=2,
                train=train, seed=5, domain=domain, dims=dims, blocks=blocks)  # fmt: skip


# Cases the fast run always includes: uneven slabs with a far edge along W and per-dim padding
# modes, a 3-D volume on a 2x2 mesh, MONAI's residual UNet and BasicUNet.
EXAMPLES = [
    _example("zoo", 2, 3, (3,), [2, 1, 2], (7, 0), cut=3, channels=(2, 4, 4), norm="batch", down="maxpool",
             up="linear", attention_levels=(1,), num_heads=2, padding_mode=("reflect", "circular")),
    _example("zoo", 3, (2, 2), (2, 4), [1], (0, 5, 0), cut=1, train=False, channels=(2, 3), norm="instance",
             down="avgpool", up="nearest", padding_mode="replicate", num_res_blocks=2),
    _example("monai_unet", 2, 2, (2,), [2, 1], (0, 16), channels=(2, 4, 4), strides=(2, 1), num_res_units=1,
             norm="BATCH", act="LEAKYRELU", adn_ordering="AND"),
    _example("monai_basic", 2, 3, (3,), [1, 1, 2], (16, 0), features=(2, 2, 4, 4, 4, 2), upsample="nontrainable",
             norm=("GROUP", {"num_groups": 1}), act="GELU"),
]


test_fuzz_unet_fast, test_fuzz_unet_campaign = fuzz_tests(
    "unet fuzz", configs(), _run, EXAMPLES,
    fast=("SNN_FUZZ_UNET_FAST_EXAMPLES", 6), campaign=("SNN_FUZZ_UNET_EXAMPLES", 300), every=25,
    count=lambda cfg: cfg["arch"],
)
