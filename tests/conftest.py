import pytest

from .harness import Pools


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


@pytest.fixture
def run(pools):
    """``run(world, fn, *args)``: ``fn(*args)`` on every rank; the list of per-rank results."""
    return pools.run
