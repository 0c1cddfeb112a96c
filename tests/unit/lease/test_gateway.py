"""The gateway's connections for the scripts: one per thread, in step with their replies, made again when lost."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import pytest
import redis

from celery_fenced._celery.compat import is_connected
from celery_fenced._lease.gateway import (
    NO_RETRY,
    LeaseScript,
    Retry,
    ScriptSet,
    ThreadConnections,
    _packed,
    denied_commands_text,
    denied_redis_commands,
)
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.scripts import SCRIPT_NAMES
from celery_fenced._lease.state import AcquireOutcome
from celery_fenced._lease.store import LeaseStore
from celery_fenced.harness import wait_until
from tests.unit.lease.helpers import acquire


def client_id(connections: ThreadConnections) -> int:
    return int(connections.execute("CLIENT", "ID"))


@pytest.fixture
def store(redis_client: redis.Redis) -> LeaseStore:
    return LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))


def test_a_thread_keeps_its_connection_and_another_thread_has_its_own(redis_client: redis.Redis) -> None:
    connections = ThreadConnections(redis_client)
    mine = client_id(connections)
    assert client_id(connections) == mine
    theirs: list[int] = []
    thread = threading.Thread(target=lambda: theirs.append(client_id(connections)))
    thread.start()
    thread.join()
    assert theirs and theirs[0] != mine


def test_the_connection_has_the_clients_settings(redis_client: redis.Redis) -> None:
    database = redis_client.connection_pool.connection_kwargs.get("db", 0)
    other = redis.Redis(
        host=redis_client.connection_pool.connection_kwargs["host"],
        port=redis_client.connection_pool.connection_kwargs["port"],
        db=database + 1,
    )
    try:
        connections = ThreadConnections(other)
        connections.execute("SET", "where-am-i", "here")
        assert other.get("where-am-i") == b"here"
        assert redis_client.get("where-am-i") is None
    finally:
        other.delete("where-am-i")
        other.close()


def test_a_connection_the_server_closed_is_made_again(store: LeaseStore, redis_client: redis.Redis) -> None:
    assert acquire(store).outcome is AcquireOutcome.NEW
    connections = store.scripts.acquire.connections
    before = client_id(connections)
    redis_client.client_kill_filter(_id=before)
    # The call that meets the closed socket connects again and runs: the task is not lost.
    assert acquire(store, task_id="t2").outcome is AcquireOutcome.NEW
    assert client_id(connections) != before


def test_an_exception_between_the_command_and_its_reply_does_not_leave_the_reply_behind(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    connections = store.scripts.acquire.connections
    assert connections.execute("PING")  # connected: what follows is the command's own send
    connection = connections.connection()
    send = connection.send_packed_command
    interrupted = []

    def sent_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        send(*args, **kwargs)
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt  # as an exception raised into the thread would be
        return None

    # This connection's only: another thread's (a worker's reaper another test left running)
    # must not take the interrupt.
    monkeypatch.setattr(connection, "send_packed_command", sent_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        connections.execute("ECHO", "first")
    # The next command reads its own reply, not the first one's.
    assert connections.execute("ECHO", "second") == b"second"


def test_a_script_error_keeps_the_connection(redis_client: redis.Redis) -> None:
    connections = ThreadConnections(redis_client)
    before = client_id(connections)
    with pytest.raises(redis.ResponseError):
        connections.execute("EVAL", "return redis.call('NO-SUCH-COMMAND')", 0)
    assert client_id(connections) == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_makes_its_own_connection(redis_client: redis.Redis) -> None:
    connections = ThreadConnections(redis_client)
    parent = client_id(connections)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its connection's id, then leave at once
        try:
            os.write(write, str(client_id(connections)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = int(pipe.read() or "0")
    os.waitpid(pid, 0)
    assert child not in (0, parent)
    assert client_id(connections) == parent  # the parent's connection is untouched


def test_close_closes_every_threads_connection_and_a_later_call_connects_again(redis_client: redis.Redis) -> None:
    connections = ThreadConnections(redis_client)
    before = client_id(connections)
    theirs: list[Any] = []
    release = threading.Event()

    def other_thread() -> None:
        client_id(connections)
        theirs.append(connections.connection())
        release.wait(10)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        wait_until(lambda: theirs, 10, "the other thread's connection")
        mine = connections.connection()
        connections.close()
        assert not is_connected(mine) and not is_connected(theirs[0])
    finally:
        release.set()
        thread.join()
    assert client_id(connections) != before


def test_the_connection_of_a_thread_that_ended_is_closed_when_a_thread_makes_its_own(
    redis_client: redis.Redis,
) -> None:
    connections = ThreadConnections(redis_client)
    ended: list[Any] = []

    def short_lived() -> None:
        client_id(connections)
        ended.append(connections.connection())

    thread = threading.Thread(target=short_lived)
    thread.start()
    thread.join()
    assert is_connected(ended[0])
    client_id(connections)  # this thread's first call
    assert not is_connected(ended[0])


def test_the_connections_are_closed_when_their_owner_is_collected(redis_client: redis.Redis) -> None:
    connections = ThreadConnections(redis_client)
    client_id(connections)
    connection = connections.connection()  # still referenced here: nothing but the owner closes it
    del connections
    gc.collect()
    assert not is_connected(connection)


def test_a_store_closes_its_scripts_connections(store: LeaseStore) -> None:
    assert acquire(store).outcome is AcquireOutcome.NEW
    connection = store.scripts.connections.connection()
    store.close()
    assert not is_connected(connection)
    assert acquire(store, task_id="t2").outcome is AcquireOutcome.NEW  # and it still works


GREENLET_PROCESS = """
from gevent import monkey

monkey.patch_all()
import sys

import gevent
from celery import Celery

from celery_fenced import install
from celery_fenced._lease.gateway import PooledConnections, threads_are_greenlets

app = Celery("greenlets", broker=sys.argv[1] + "/0", backend="fenced+" + sys.argv[1] + "/1")
install(app)
assert threads_are_greenlets()
seen = []


def task_greenlet(n):
    backend = app.backend  # Celery's backend is per thread: per greenlet here
    store = backend.lease_store
    seen.append((backend, store, int(store.scripts.connections.execute("CLIENT", "ID"))))
    assert store.acquire(f"t{n}", "host/1/a", ttl_ms=5000, task_name="t", max_takeovers=3).token > 0


for n in range(20):  # one task after another, each in a greenlet of its own, as the pool runs them
    gevent.spawn(task_greenlet, n).get()
backends, stores, clients = zip(*seen)
assert len({id(b) for b in backends}) == 20, "Celery made one backend per greenlet"
assert len({id(s) for s in stores}) == 1, "the greenlets' backends share one lease store"
assert isinstance(stores[0].scripts.connections, PooledConnections)
print("connections", len(set(clients)))
"""


def test_where_threads_are_greenlets_the_backends_share_one_store_on_the_pool(redis_server: Any) -> None:
    """gevent's patching: the backend Celery makes per greenlet shares one store and its pool."""
    from tests.support.processes import run_project_python

    output = run_project_python(["-c", GREENLET_PROCESS, redis_server.url(0).rsplit("/", 1)[0]], dict(os.environ), 60)
    connections = int(output.split("connections", 1)[1].split()[0])
    assert connections == 1, output  # the pool's, lent per call: not one per greenlet's task


def test_a_process_that_gevent_did_not_patch_keeps_a_connection_per_thread(redis_client: redis.Redis) -> None:
    from celery_fenced._lease.gateway import ScriptSet, threads_are_greenlets

    assert not threads_are_greenlets()
    assert isinstance(ScriptSet(redis_client).connections, ThreadConnections)


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "fenced:lease:{celery-task-meta-t1}", "fenced:token", "host/1/a", 15000, ""),
        ("SET", "k", 'é☃ {"rows": 1}'),
        ("SET", "k", b"\x00\xff", -5, 2**53),
    ],
    ids=["script", "text", "bytes-and-ints"],
)
def test_a_command_is_packed_as_redis_py_packs_it(redis_client: redis.Redis, args: tuple[Any, ...]) -> None:
    connection = redis_client.connection_pool.make_connection()
    assert b"".join(_packed(connection, args)) == b"".join(connection.pack_command(*args))


def test_what_hiredis_does_not_pack_gets_redis_pys_own_error(redis_client: redis.Redis) -> None:
    connection = redis_client.connection_pool.make_connection()
    with pytest.raises(redis.DataError):
        _packed(connection, ("SET", "k", True))
    # Another encoding: whatever redis-py's own packer makes of it (redis-py 8 encodes by it).
    latin = redis.Redis(port=redis_client.connection_pool.connection_kwargs["port"], encoding="latin-1")
    other = latin.connection_pool.make_connection()
    assert b"".join(_packed(other, ("SET", "k", "é"))) == b"".join(other.pack_command("SET", "k", "é"))


def test_every_script_file_has_its_typed_attribute(redis_client: redis.Redis) -> None:
    scripts = ScriptSet(redis_client)
    named = {name for name, value in vars(scripts).items() if isinstance(value, LeaseScript)}
    assert named == set(SCRIPT_NAMES)
    assert scripts.script("acquire") is scripts.acquire
    with pytest.raises(KeyError, match="no lease script 'nothing'"):
        scripts.script("nothing")
    scripts.close()


def test_a_script_runs_on_the_threads_connection_and_loads_itself_again_after_a_flush(
    redis_client: redis.Redis,
) -> None:
    scripts = ScriptSet(redis_client)
    keys = KeySpace.build("fenced", "celery-task-meta-")
    until = scripts.worker_alive(keys=[keys.workers], args=["w/1/a", 60_000])
    redis_client.script_flush()
    assert scripts.worker_left(keys=[keys.workers, keys.reserved_by("w/1/a")], args=["w/1/a"]) == 1
    assert isinstance(until, int) and until > 0
    scripts.close()


def test_retry_runs_a_call_again_only_after_one_of_its_errors() -> None:
    runs: list[str] = []

    def again(operation: Any) -> Any:
        runs.append("again")
        return operation()

    def flaky(answer: str) -> str:
        runs.append("call")
        if runs == ["call"]:
            raise redis.ConnectionError("lost")
        return answer

    def refused() -> None:
        raise redis.ResponseError("ERR an answer of the server's")

    def down() -> None:
        raise redis.ConnectionError("down")

    retry = Retry((redis.ConnectionError,), again)
    assert retry(flaky, "ok") == "ok" and runs == ["call", "again", "call"]
    with pytest.raises(redis.ResponseError):
        retry(refused)
    assert runs == ["call", "again", "call"]  # not run again
    with pytest.raises(redis.ConnectionError):
        NO_RETRY(down)


def test_the_commands_a_restricted_user_may_not_run_are_named_with_the_fix(redis_server: Any) -> None:
    """An ACL user without INFO and WAIT: both found in one round trip, and said in one line."""
    user = "gateway-no-info-wait"
    with redis_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "&*", "+@all", "-info", "-wait")
    try:
        client = redis.Redis.from_url(redis_server.url(0).replace("redis://", f"redis://{user}:pw@", 1))
        denied = denied_redis_commands(client)
        client.close()
        assert [command for command, _ in denied] == ["INFO", "WAIT"]
        assert denied_commands_text(denied) == (
            "the lease Redis user may not run INFO, WAIT (the scripts that hand out fencing tokens read the "
            "server's replication id; a new token epoch waits for the replicas): grant it "
            "(ACL SETUSER <user> +info +wait)"
        )
    finally:
        with redis_server.client() as admin:
            admin.execute_command("ACL", "DELUSER", user)


def test_a_redis_that_cannot_be_reached_denies_nothing() -> None:
    client = redis.Redis(port=1, socket_connect_timeout=0.5)
    assert denied_redis_commands(client) == []
    client.close()
