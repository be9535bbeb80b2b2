"""Packaging: zoo/ and converters/ install as sharded_nn.zoo / sharded_nn.converters."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_directory_is_listed():
    cfg = _setuptools_config()
    listed = set(cfg["packages"])
    mapping = {v: k for k, v in cfg.get("package-dir", {}).items()}
    found = set()
    for top in ("sharded_nn", "zoo", "converters"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            head, _, rest = rel.partition("/")
            name = mapping.get(head, head)
            found.add(name + ("." + rest.replace("/", ".") if rest else ""))
    assert found == listed, f"pyproject packages {sorted(listed)} != package dirs {sorted(found)}"


def test_top_level_folders_import_as_subpackages():
    for name in ("sharded_nn.zoo", "sharded_nn.converters"):
        mod = importlib.import_module(name)
        assert Path(mod.__file__).parent.name == name.rsplit(".", 1)[1].replace("sharded_nn", "")
