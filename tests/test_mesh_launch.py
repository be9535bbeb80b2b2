"""Meshes (axis names, wrong sizes, meshes without a domain axis) and ``snn.launch``."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import sharded_nn as snn
from sharded_nn.launch import RemoteTraceback

from .harness import mesh

# ---------------------------------------------------------------------------------------------
# init_mesh
# ---------------------------------------------------------------------------------------------


def _describe(m):
    return {
        "names": m.mesh_dim_names,
        "shape": tuple(m.shape),
        "domain_axes": snn.domain_axes(m),
        "data_axis": snn.data_axis(m),
        "domain_size": snn.domain_size(m),
        "domain_group_size": dist.get_world_size(snn.domain_group(m)),
    }


def _mesh_names(domain, data):
    return _describe(mesh(domain, data))


@pytest.mark.parametrize(
    ("world", "domain", "data", "expected"),
    [
        (1, 1, 1, {"names": ("domain",), "shape": (1,), "domain_axes": ("domain",), "data_axis": None,
                   "domain_size": 1, "domain_group_size": 1}),
        (2, 2, 1, {"names": ("domain",), "shape": (2,), "domain_axes": ("domain",), "data_axis": None,
                   "domain_size": 2, "domain_group_size": 2}),
        (4, 2, 2, {"names": ("data", "domain"), "shape": (2, 2), "domain_axes": ("domain",), "data_axis": "data",
                   "domain_size": 2, "domain_group_size": 2}),
        (4, (2, 2), 1, {"names": ("domain0", "domain1"), "shape": (2, 2), "domain_axes": ("domain0", "domain1"),
                        "data_axis": None, "domain_size": 4, "domain_group_size": 4}),
        (4, 4, 1, {"names": ("domain",), "shape": (4,), "domain_axes": ("domain",), "data_axis": None,
                   "domain_size": 4, "domain_group_size": 4}),
    ],
)
def test_init_mesh_axis_names(run, world, domain, data, expected):
    assert run(world, _mesh_names, domain, data) == [expected] * world


def _init_mesh_defaults():
    # domain=None takes every rank not used by data.
    a = _describe(snn.init_mesh(device_type="cpu"))
    b = _describe(snn.init_mesh(data=2, device_type="cpu"))
    return a, b


def test_init_mesh_defaults(run):
    res = run(4, _init_mesh_defaults)
    a, b = res[0]
    assert a["names"] == ("domain",) and a["shape"] == (4,)
    assert b["names"] == ("data", "domain") and b["shape"] == (2, 2) and b["domain_size"] == 2
    assert res == [res[0]] * 4


def _init_mesh_wrong_sizes():
    cases = [
        (dict(domain=3), r"data=1 x domain=\(3,\) needs 3 ranks, but the process group has 2"),
        (dict(domain=(2, 2)), r"domain=\(2, 2\) needs 4 ranks, but the process group has 2"),
        (dict(domain=2, data=2), r"data=2 x domain=\(2,\) needs 4 ranks"),
        (dict(domain=1), r"needs 1 ranks, but the process group has 2"),
        (dict(data=3), r"world size 2 is not divisible by data=3"),
        (dict(data=0), r"data must be >= 1, got 0"),
        (dict(domain=0), r"domain sizes must be >= 1, got 0"),
        (dict(domain=(2, 0)), r"domain sizes must be >= 1, got \(2, 0\)"),
        (dict(domain=()), r"domain sizes must be >= 1, got \(\)"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            snn.init_mesh(**kwargs, device_type="cpu")
    return len(cases)


def test_init_mesh_wrong_sizes_raise_on_every_rank(run):
    assert run(2, _init_mesh_wrong_sizes) == [9, 9]


# ---------------------------------------------------------------------------------------------
# Meshes without a domain axis
# ---------------------------------------------------------------------------------------------


def _foo_mesh():
    m = init_device_mesh("cpu", (2,), mesh_dim_names=("foo",))
    match = r"needs a mesh with a 'domain' axis .*got a mesh with axes \('foo',\).*init_mesh"
    with pytest.raises(ValueError, match=match):
        snn.domain_axes(m)
    with pytest.raises(ValueError, match=match):
        snn.domain_size(m)
    with pytest.raises(ValueError, match=match):
        snn.domain_group(m)
    with pytest.raises(ValueError, match=match):
        snn.shard(torch.zeros(1, 1, 4), m, dims=(2,))
    with pytest.raises(ValueError, match=match):
        snn.gather(torch.zeros(1, 1, 2), m, dims=(2,))
    assert snn.data_axis(m) is None
    return True


def test_domain_axes_without_domain_axis(run):
    assert run(2, _foo_mesh) == [True, True]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("domain",), ("domain",)),
        (("data", "domain"), ("domain",)),
        (("domain1", "domain0"), ("domain0", "domain1")),
        (("data", "domain0", "domain1", "domain2"), ("domain0", "domain1", "domain2")),
        # Numeric, not lexicographic, order.
        (tuple(f"domain{i}" for i in range(12)), tuple(f"domain{i}" for i in range(12))),
    ],
)
def test_domain_axes_names(names, expected):
    assert snn.domain_axes(SimpleNamespace(mesh_dim_names=names)) == expected


@pytest.mark.parametrize("names", [None, (), ("data",), ("domainX",), ("dom",), ("x", "domain_0")])
def test_domain_axes_missing(names):
    with pytest.raises(ValueError, match=r"needs a mesh with a 'domain' axis"):
        snn.domain_axes(SimpleNamespace(mesh_dim_names=names))


def test_data_axis_name():
    assert snn.data_axis(SimpleNamespace(mesh_dim_names=("data", "domain"))) == "data"
    assert snn.data_axis(SimpleNamespace(mesh_dim_names=("domain",))) is None
    assert snn.data_axis(SimpleNamespace(mesh_dim_names=None)) is None


# ---------------------------------------------------------------------------------------------
# launch: a few fresh process groups (slow: keep these few)
# ---------------------------------------------------------------------------------------------


def _launch_ok(tag):
    m = snn.init_mesh(domain=2, device_type="cpu")
    t = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t.item(),
        "tag": tag,
        "names": m.mesh_dim_names,
        "threads": torch.get_num_threads(),
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        # A tensor must survive the trip after this process exits (no shared-memory handle).
        "tensor": torch.arange(4.0) * (dist.get_rank() + 1),
    }


def _launch_fail():
    if dist.get_rank() == 1:
        raise KeyError("rank one exploded")
    # Rank 0 blocks in a collective that rank 1 never joins.
    dist.barrier()
    time.sleep(120)
    return "unreachable"


def _launch_die():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    time.sleep(120)


def _children() -> set[int]:
    # The harness's worker pools are children of this process too; compare against a snapshot.
    return {p.pid for p in mp.active_children()}


def test_launch_returns_rank0_result():
    before = _children()
    env = os.environ.get("THP_MEM_ALLOC_ENABLE")
    out = snn.launch(_launch_ok, 2, "hello", timeout=120, device_type="cpu", threads=1)
    tensor = out.pop("tensor")
    assert torch.equal(tensor, torch.arange(4.0))
    thp = env if env is not None else "1"  # huge pages on by default, a user's setting kept
    expected = {"rank": 0, "world": 2, "sum": 3.0, "tag": "hello", "names": ("domain",), "threads": 1, "thp": thp}
    assert out == expected
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == env  # the parent's environment is left as it was
    assert _children() <= before


def test_launch_reraises_rank_exception_fast():
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank one exploded") as info:
        snn.launch(_launch_fail, 2, timeout=120, device_type="cpu", threads=1)
    elapsed = time.monotonic() - t0
    # Fails fast: not after the 120 s timeout.
    assert elapsed < 40, elapsed
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    text = str(cause)
    assert "rank 1 traceback" in text
    assert "_launch_fail" in text and "rank one exploded" in text
    assert _children() <= before


def test_launch_rank_dies_without_traceback():
    before = _children()
    t0 = time.monotonic()
    # Either launch notices the dead rank first, or rank 0's collective fails on the closed
    # connection first and that error is re-raised; both end the run quickly.
    with pytest.raises(RuntimeError, match=r"rank 1 died with exit code 3|peer"):
        snn.launch(_launch_die, 2, timeout=120, device_type="cpu", threads=1)
    assert time.monotonic() - t0 < 40
    assert _children() <= before


@pytest.mark.parametrize("nprocs", [0, -1])
def test_launch_bad_nprocs(nprocs):
    before = _children()
    with pytest.raises(ValueError, match="nprocs must be >= 1"):
        snn.launch(_launch_ok, nprocs, "x")
    assert _children() <= before
