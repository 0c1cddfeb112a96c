"""Streamed downstream calls: the three deadlines of ``self.stream(...)``, on real workers.

The stand-in AI provider of the example project serves the streams: it can be slow to its
first token, stop mid-stream and stay open, or answer normally.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from example_project.ai_server import CHUNKS, AIServer
from tests.integration.conftest import Cluster
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def ai() -> Iterator[AIServer]:
    server = AIServer(chunk_pause=0.05, slow_first=4, hang=30).start()
    yield server
    server.stop()


def lost_reason(cluster: Cluster, task_id: str) -> str:
    reasons = wait_until(lambda: cluster.record.lrange(f"lost:{task_id}", 0, -1), 20, "the stream to be stopped")
    return reasons[0]  # type: ignore[index]


def test_a_healthy_stream_is_progress(cluster: Cluster, ai: AIServer) -> None:
    app = cluster.app()
    cluster.worker("w1", fenced_interrupt_on_loss=True)
    result = app.stream_ai.delay(ai.url, "", 2, 1, 20)
    assert result.get(timeout=20) == CHUNKS
    assert len(cluster.runs(result.id)) == 1


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_stream_that_stops_mid_way_fires_the_idle_timeout(cluster: Cluster, ai: AIServer, pool: str) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", pool=pool, concurrency=2, fenced_interrupt_on_loss=True)
    result = app.stream_ai.delay(ai.url, "hang-once", 2, 1, 20)
    assert result.get(timeout=30) == CHUNKS  # the second attempt streams it all
    assert "idle timeout" in worker.log()
    assert len(cluster.runs(result.id)) == 2


def test_a_slow_first_token_fires_the_first_token_timeout(cluster: Cluster, ai: AIServer) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, fenced_interrupt_on_loss=True)
    result = app.stream_ai.delay(ai.url, "slow", 1, 5, 20)  # the first chunk comes after 4 s
    # The stall is logged first, then the loss that names the deadline: wait for the second.
    wait_until(lambda: "first token timeout (1s)" in worker.log(), 20, "the first-token timeout")
    assert "(first token timeout 1.0s), on_stall=release" in worker.log()
    assert result.get(timeout=30) == CHUNKS  # the task asks for "slow" on its first attempt only
    runs = cluster.runs(result.id)
    assert len(runs) == 2 and runs[1]["token"] > runs[0]["token"]


def test_the_total_timeout_bounds_a_stream_that_keeps_trickling(cluster: Cluster, ai: AIServer) -> None:
    ai.chunk_pause = 0.6  # every chunk in time, the whole stream too long
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, fenced_interrupt_on_loss=True)
    app.stream_ai.delay(ai.url, "", 2, 1, 2)
    wait_until(lambda: "stream total timeout" in worker.log(), 20, "the total timeout")
