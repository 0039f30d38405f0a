"""Fixtures of the storage tests: one real redis-server and one Mooncake Store for the session."""

from __future__ import annotations

import pytest

from .mooncake_server import MooncakeServer
from .redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_server():
    """One mooncake_master and 256 MiB lent to it, for the session (a client closes in ~2 s)."""
    server = MooncakeServer()
    yield server
    server.close()
