"""``sharded_nn.env.getenv``: the hot paths' environment reads see every change made through ``os.environ``."""

from __future__ import annotations

import os

from sharded_nn.env import getenv


def test_getenv_follows_os_environ(monkeypatch):
    name = "SHARDED_NN_TEST_ENV_READ"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None and getenv(name, "d") == "d"
    monkeypatch.setenv(name, "1")
    assert getenv(name) == "1" == os.environ.get(name)
    os.environ[name] = "x y\u00e9"
    assert getenv(name) == "x y\u00e9"
    del os.environ[name]
    assert getenv(name, "gone") == "gone"
    monkeypatch.setenv(name, "")
    assert getenv(name, "d") == ""  # set but empty is not unset
