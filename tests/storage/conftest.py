"""Fixtures of the storage tests: one real redis-server for the session."""

from __future__ import annotations

import pytest

from .redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()
