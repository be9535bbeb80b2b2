"""Reading environment variables on hot paths.

``os.environ.get`` is several Python calls (a ``Mapping.get``, the key encoded, a ``KeyError``
raised and caught when the variable is unset, the usual case): 0.65 us in a tight loop on the
hosts we measure, against 0.08 us for :func:`getenv`, and more amid a forward's work. The
same-host transport reads three of its settings on every message so that they can be changed
between calls. :func:`getenv` reads the same mapping (``os.environ``'s own store,
which every ``os.environ[...] = ...``, ``pop`` and ``pytest``'s ``monkeypatch.setenv`` update) with
one dictionary lookup, and falls back to ``os.environ.get`` where that store is not the one
CPython keeps on POSIX systems.
"""

from __future__ import annotations

import os

__all__ = ["getenv"]

# CPython keeps os.environ's contents in ``_data``, keyed by encoded names (bytes on POSIX).
_DATA = getattr(os.environ, "_data", None)
_FAST = isinstance(_DATA, dict) and os.name == "posix" and all(isinstance(k, bytes) for k in list(_DATA)[:1])
_KEYS: dict[str, bytes] = {}


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, in one dictionary lookup where CPython allows it."""
    if not _FAST:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)  # type: ignore[attr-defined]
    raw = _DATA.get(key)  # type: ignore[union-attr]
    return default if raw is None else os.environ.decodevalue(raw)  # type: ignore[attr-defined]
