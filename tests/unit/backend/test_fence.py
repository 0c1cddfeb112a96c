"""The fence a worker puts on a request: plain data, replaced (never changed) on the rare paths."""

from __future__ import annotations

import pytest
from celery.app.task import Context

from celery_fenced._backend.fence import SKIPPED, WriterFence, fence_of, put_fence


def test_a_request_without_a_fence_writes_without_a_token() -> None:
    assert fence_of(Context(id="t1")) is None
    assert fence_of(None) is None


def test_the_fence_rides_on_its_request() -> None:
    request = Context(id="t1")
    fence = WriterFence("t1", 7, "h/1/a", "pub1", 2, 1)
    put_fence(request, fence)
    assert fence_of(request) is fence
    assert (fence.retry_delay, fence.result_stored, fence.skipped) == (0.0, False, False)


def test_a_fence_is_replaced_not_changed() -> None:
    fence = WriterFence("t1", 7, "h/1/a", "pub1", 2, 1)
    with pytest.raises(AttributeError):
        fence.token = 8  # type: ignore[misc]
    retried = fence.retried(4.5)
    assert retried.retry_delay == 4.5 and retried[:6] == fence[:6] and not retried.result_stored
    stored = retried.result_written()
    assert stored.result_stored and stored.retry_delay == 4.5 and stored[:6] == fence[:6]
    assert fence == WriterFence("t1", 7, "h/1/a", "pub1", 2, 1)  # the original is untouched


def test_a_skipped_delivery_has_one_fence_that_drops_every_write() -> None:
    assert SKIPPED.skipped and SKIPPED.token == 0
