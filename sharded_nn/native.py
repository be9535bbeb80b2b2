"""Small C++ libraries compiled on first use: the host cache's allocator and the one-pass moments.

Not part of the public API. The sources live in ``sharded_nn/csrc`` (shipped with the package);
each is compiled with the machine's C++ compiler (``$CXX``, ``c++`` or ``g++``) the first time a
process needs it, about two seconds, and kept in ``$SHARDED_NN_CACHE_DIR`` (default
``~/.cache/sharded_nn``) under a name that hashes the source, the torch build and the Python ABI,
so a new torch or a changed source gets a fresh library. Concurrent processes (a launch's ranks)
wait on a file lock while one of them compiles. Without a compiler :func:`build` raises
``RuntimeError`` and the callers keep their torch-only path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

#: Where compiled libraries are kept (default ``~/.cache/sharded_nn``).
CACHE_DIR_ENV = "SHARDED_NN_CACHE_DIR"

_CSRC = Path(__file__).with_name("csrc")


def source(name: str) -> Path:
    """The C++ source of library ``name`` (``csrc/<name>.cpp``)."""
    return _CSRC / f"{name}.cpp"


def compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return cxx if cxx is not None and shutil.which(cxx) is not None else None


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    return Path(root) if root else Path.home() / ".cache" / "sharded_nn"


def _flags(link_torch: bool) -> list[str]:
    # The allocator is control flow (-O2); the kernels want the vectorizer (-O3).
    return ["-O2" if link_torch else "-O3", "-std=c++17", "-shared", "-fPIC"]


def _compile_command(name: str, out: Path, link_torch: bool) -> list[str] | None:
    cxx = compiler()
    if cxx is None:
        return None
    cmd = [cxx, *_flags(link_torch)]
    if link_torch:
        torch_dir = Path(torch.__file__).resolve().parent
        abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
        cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(torch_dir / "include")]
        cmd += [str(source(name)), "-L", str(torch_dir / "lib"), "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    else:
        cmd += [str(source(name))]
    return cmd + ["-o", str(out)]


def library_path(name: str, link_torch: bool = False) -> Path:
    """Where library ``name`` for this source, its flags, the torch build and the Python ABI is (or
    will be) kept."""
    key = hashlib.sha256()
    key.update(source(name).read_bytes())
    key.update(" ".join(_flags(link_torch)).encode())
    key.update(torch.__version__.encode())
    key.update(str(Path(torch.__file__).resolve()).encode())
    key.update((sysconfig.get_config_var("SOABI") or "").encode())
    return _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def build(name: str, *, link_torch: bool = False, opt_out_hint: str = "") -> Path:
    """Compile library ``name`` once (concurrent processes wait on a file lock); return its path.

    Args:
        name: the source ``csrc/<name>.cpp``.
        link_torch: compile against the installed torch's headers and link ``libc10``.
        opt_out_hint: appended to the no-compiler error (how to do without the library).

    Raises:
        RuntimeError: not Linux, no C++ compiler, or the compile failed (its output is in the message).
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"sharded_nn's native {name} library is built on Linux only; this is {sys.platform}")
    import fcntl  # here, not at import time: POSIX only

    path = library_path(name, link_torch)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while this one waited
            return path
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.partial")
        os.close(fd)
        cmd = _compile_command(name, Path(tmp), link_torch)
        if cmd is None:
            os.unlink(tmp)
            raise RuntimeError(
                "no C++ compiler found (tried $CXX, c++, g++); install one (e.g. `apt install g++`)" + opt_out_hint
            )
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {source(name).name} failed:\n$ {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, path)
    return path
