"""The fenced backend's keys and URL forms: the global key prefix, a unix socket, Sentinel."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_fenced import FencedRedisBackend
from tests.support.redis_server import RedisServer, free_port


def backend_of(url: str, **conf: object) -> FencedRedisBackend:
    app = Celery("b", set_as_current=False)
    app.conf.update(result_backend=url, **conf)
    backend = app.backend
    assert isinstance(backend, FencedRedisBackend)
    return backend


def test_the_global_keyprefix_is_honoured_end_to_end(redis_server: RedisServer) -> None:
    backend = backend_of(
        "fenced+" + redis_server.url(7), result_backend_transport_options={"global_keyprefix": "tenant1"}
    )
    store = backend.lease_store
    state = store.acquire("g1", "h/1/a", ttl_ms=3000, task_name="t", max_takeovers=1).state
    assert store.store("g1", state.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0).stored
    with redis_server.client(7) as client:
        keys = sorted(k.decode() for k in client.keys("*"))
        client.flushdb()
    assert "tenant1_celery-task-meta-g1" in keys
    assert "tenant1_fenced:lease:{tenant1_celery-task-meta-g1}" in keys
    assert "tenant1_fenced:token" in keys
    assert state.owner_token > 1


def test_a_unix_socket_url_works(redis_server: RedisServer, tmp_path: Path) -> None:
    socket_path = redis_server.unix_socket
    assert socket_path is not None, "the session Redis has no unix socket (its data directory path is too long)"
    backend = backend_of(f"fenced+socket://{socket_path}?virtual_host=8")
    assert backend.lease_store.acquire("u1", "h/1/a", ttl_ms=3000, task_name="t", max_takeovers=1).outcome.runs
    with redis.Redis(unix_socket_path=socket_path, db=8) as client:
        assert client.exists("fenced:lease:{celery-task-meta-u1}") == 1
        client.flushdb()


@pytest.fixture
def sentinel(redis_server: RedisServer, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real redis-sentinel watching the session's private Redis as master "mymaster"."""
    import subprocess

    from tests.support.processes import wait_until

    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor mymaster 127.0.0.1 {redis_server.port} 1\n"
        "sentinel down-after-milliseconds mymaster 60000\n"
    )
    proc = subprocess.Popen([redis_server.executable, str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)

    def ready() -> bool:
        try:
            return bool(client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster"))
        except redis.ConnectionError:
            return False

    wait_until(ready, 15, "the sentinel")
    client.close()
    yield port
    proc.terminate()
    proc.wait(10)


def test_a_sentinel_url_gets_the_fenced_sentinel_backend(sentinel: int, redis_server: RedisServer) -> None:
    from celery_fenced._backend.backend import FencedSentinelBackend

    backend = backend_of(
        f"fenced+sentinel://127.0.0.1:{sentinel}/9",
        result_backend_transport_options={"master_name": "mymaster"},
    )
    assert isinstance(backend, FencedSentinelBackend)
    state = backend.lease_store.acquire("s1", "h/1/a", ttl_ms=3000, task_name="t", max_takeovers=1).state
    assert backend.lease_store.store("s1", state.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0).stored
    with redis_server.client(9) as client:
        assert client.exists("celery-task-meta-s1") == 1
        client.flushdb()


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_an_owners_ready_write_carries_the_fence_or_leaves_a_tombstone(
    redis_server: RedisServer, serializer: str
) -> None:
    from celery.app.task import Context

    from celery_fenced._task.owner import OwnedLease
    from celery_fenced._worker.attempt import begin
    from celery_fenced.conf import FencedConfig

    backend = backend_of(
        "fenced+" + redis_server.url(8), result_serializer=serializer, accept_content=["json", "pickle"]
    )
    store = backend.lease_store
    policy = FencedConfig.from_mapping({}).policy
    acquired = store.acquire("b1", "h/1/a", ttl_ms=3000, task_name="t", max_takeovers=3, publish_id="pub1")
    lease = OwnedLease("b1", "t", "h/1/a", acquired.token, 1, 0, policy, publish_id="pub1")
    request = Context(id="b1", task="t")
    begin(request, lease)
    backend.store_result("b1", {"rows": 1}, "SUCCESS", request=request)
    meta = backend.get_task_meta("b1")
    assert meta["result"] == {"rows": 1} and meta["fence_token"] == acquired.token
    assert meta["fence_run"] == "pub1/1/0"
    with redis_server.client(8) as client:
        if serializer == "json":  # the result carries the fence: no lease hash
            assert client.get(store.keys.result("b1")).endswith(
                f'"fence_run": "pub1/1/0", "fence_token": {acquired.token}}}'.encode()
            )
            assert not client.exists(store.keys.lease("b1"))
        else:  # the script cannot read a pickled meta: a small tombstone
            assert client.object("encoding", store.keys.lease("b1")) in (b"listpack", b"ziplist")
        finished = store.read("b1")  # either way, inspect shows the finished lease
        assert finished is not None and (finished.status, finished.owner_token) == ("DONE", acquired.token)
        assert (finished.attempt, finished.takeovers) == (1, 0)
        client.flushdb()


def test_the_store_runs_a_call_again_under_the_backends_retry_policy(fenced_app: Celery) -> None:
    fenced_app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 2, "interval_start": 0}}
    backend = fenced_app.backend
    retry = backend.lease_store.retry
    assert retry.errors == tuple(backend.connection_errors)
    calls: list[int] = []

    def blip(answer: str) -> str:
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("a blip")
        return answer

    assert retry(blip, "answered") == "answered" and len(calls) == 3

    def down() -> None:
        calls.append(1)
        raise redis.ConnectionError("down")

    calls.clear()
    with pytest.raises(redis.ConnectionError):
        retry(down)
    assert len(calls) == 4  # once, then Celery's loop: its own call and the max_retries (2) more
