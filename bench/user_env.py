"""Run a benchmark's rank function the way a user would, instead of through ``snn.launch``.

``launch_as_user(fn, nprocs, *args)`` is a drop-in for ``snn.launch(fn, nprocs, *args, threads=1,
...)`` in the per-model benchmarks' ``--env user`` mode (issue 12, item 4: scaling "in the default
environment a user has"):

* ``nprocs == 1``: plain torch in a fresh ``python`` process in the user's default environment
  (``bench.torchrun_env.user_env``: one thread, no allocator variables) with sharded_nn's process
  tuning and host cache switched off (``SHARDED_NN_HOST_TUNING=0``, ``SHARDED_NN_HOST_CACHE=0``):
  a process that never imported sharded_nn. A one-rank gloo group exists (rank functions that
  ask for the world size find 1), which changes nothing in how the process allocates.
* ``nprocs > 1``: ``python -m torch.distributed.run --standalone --nproc_per_node N`` in the
  same default environment, the group made as a user's script makes it
  (``init_process_group("gloo")``): what the library sets for itself (``init_mesh`` installs the
  host cache on CPU meshes) and nothing more.

``fn`` must be a module-level function of a ``bench/<name>.py`` script (pickled by reference, with
its arguments); rank 0's return value comes back through ``torch.save``.
"""

from __future__ import annotations

import inspect
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _module_of(fn) -> str:
    """``bench.<name>`` for a function of ``bench/<name>.py`` (also when that file runs as ``__main__``)."""
    path = Path(inspect.getfile(fn)).resolve()
    if path.parent != _ROOT / "bench":
        raise ValueError(f"launch_as_user: {fn.__qualname__} must be defined in a bench/<name>.py script, got {path}.")
    return f"bench.{path.stem}"


class _Unpickler(pickle.Unpickler):
    """Arguments pickled by a script run as ``__main__`` name its classes ``__main__.X``: here
    they are the bench module's."""

    def __init__(self, f, module: str) -> None:
        super().__init__(f)
        self._module = module

    def find_class(self, module: str, name: str):  # noqa: D102
        return super().find_class(self._module if module == "__main__" else module, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_as_user(fn, nprocs: int, *args, timeout: float = 7200.0, plain: bool = False):
    """``fn(*args)`` on ``nprocs`` processes as a user runs them (see the module docstring);
    rank 0's result. ``plain``: every process gets P=1's environment (sharded_nn's process tuning
    and host cache off), also under torchrun (independent plain processes running at once)."""
    import torch

    from bench.torchrun_env import user_env

    module = _module_of(fn)
    env = user_env()
    with tempfile.TemporaryDirectory(prefix="snn-user-env-") as tmp:
        call, out = Path(tmp) / "call.pkl", Path(tmp) / "result.pt"
        # The function by name first, its arguments after: they may name the script's classes as
        # ``__main__.X``, which only the child's ``_Unpickler`` maps to the bench module.
        call.write_bytes(pickle.dumps((module, fn.__name__)) + pickle.dumps(args))
        me = [str(Path(__file__).resolve()), str(call), str(out)]
        if plain or nprocs == 1:
            env |= {"SHARDED_NN_HOST_TUNING": "0", "SHARDED_NN_HOST_CACHE": "0"}
        if nprocs == 1:
            env |= {"MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
            cmd = [sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs), *me]
        proc = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode or not out.exists():
            raise RuntimeError(f"bench: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return torch.load(out, weights_only=False)


def launcher(env: str):
    """``snn.launch`` for ``--env launch``; for ``--env user`` a function called like it (the
    ``snn.launch`` options are ignored, but ``timeout``) that runs ``launch_as_user``."""
    if env == "launch":
        import sharded_nn as snn

        return snn.launch
    if env != "user":
        raise ValueError(f"--env: expected 'launch' or 'user', got {env!r}.")

    def launch(fn, nprocs: int, *args, timeout: float = 7200.0, plain: bool = False, **_launch_options):
        return launch_as_user(fn, nprocs, *args, timeout=timeout, plain=plain)

    return launch


def probe() -> dict:
    """What a rank of ``launch_as_user`` runs with (``tests/test_bench_user_env.py`` checks it): the world
    size, whether sharded_nn's host cache is torch's allocator after ``init_mesh`` on more than
    one rank, the allocator variables and the thread count."""
    import torch
    import torch.distributed as dist

    import sharded_nn as snn
    from sharded_nn import host_cache

    world = dist.get_world_size()
    if world > 1:
        snn.init_mesh(domain=world, device_type="cpu")
    return {"world": world, "host_cache": host_cache.installed(), "why_not": host_cache.why_not(),
            "threads": torch.get_num_threads(),
            "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"), "mmap": os.environ.get("MALLOC_MMAP_THRESHOLD_")}  # fmt: skip


def _child(call: str, out: str) -> None:
    sys.path.insert(0, str(_ROOT))
    import importlib

    import torch
    import torch.distributed as dist

    with open(call, "rb") as f:
        module, name = pickle.load(f)
        mod = importlib.import_module(module)
        args = _Unpickler(f, module).load()
    dist.init_process_group(backend="gloo")  # from torchrun's (or our one-rank) environment
    result = getattr(mod, name)(*args)
    rank = dist.get_rank()
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
