"""Tokens never repeat and never go back: across a failover that lost writes (a first one, to a
replica that never received the counter, or a later one), a restart, a FLUSHDB.

A replica that is promoted may lack the last increments of the token counter its primary made
and acknowledged, or the counter itself; it takes a new replication id. A FLUSHDB, or a server
that keeps no data, loses the counter and its epoch key. The first script to hand out a token
there begins the server's token epoch: the counter moves on to at least the server's clock in
microseconds, the replicas take the move (WAIT), and only then are tokens handed out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore
from celery_fenced._lease.tokens import EPOCH_WAIT_MS
from tests.support.processes import wait_until
from tests.support.redis_server import RedisServer, default_binary
from tests.support.replication import HoldingProxy
from tests.unit.lease.helpers import acquire, renew_req

KEYS = KeySpace.build("fenced", "celery-task-meta-")


def tokens(store: LeaseStore, prefix: str, count: int) -> list[int]:
    """Start ``count`` new tasks; their tokens."""
    return [acquire(store, f"{prefix}-{n}").token for n in range(count)]


def replid(client: redis.Redis) -> str:
    return str(client.info("replication")["master_replid"])


def server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def test_a_new_counter_starts_from_the_servers_clock_in_its_epoch(store: LeaseStore, redis_client: redis.Redis) -> None:
    before = server_us(redis_client)
    first = tokens(store, "a", 3)
    assert before < first[0] <= server_us(redis_client) + 1
    assert first == [first[0], first[0] + 1, first[0] + 2]
    assert redis_client.get(KEYS.token_epoch).decode() == replid(redis_client)
    assert max(first) < 2**53  # a Lua number holds it exactly; a bigint column, too


def test_after_a_flushdb_every_token_is_above_every_earlier_one(store: LeaseStore, redis_client: redis.Redis) -> None:
    before = [*tokens(store, "before", 3), store.tokens.reserve(2) + 1]
    redis_client.flushdb()
    after = tokens(store, "after", 3)
    assert min(after) > max(before)
    redis_client.flushdb()
    assert store.tokens.reserve(4) > max(after)  # the reaper's and a cancel's tokens, too


def test_a_server_with_another_servers_epoch_moves_the_counter_to_its_clock_once(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    before = tokens(store, "before", 5)
    redis_client.set(KEYS.token_epoch, "0" * 40)  # the epoch of another server: a restart, a promotion
    redis_client.set(KEYS.token, max(before) - 3)  # whose counter lacks the last increments
    clock = server_us(redis_client)
    after = tokens(store, "after", 3)
    assert min(after) > max(before) and min(after) > clock
    assert after == [after[0], after[0] + 1, after[0] + 2]  # moved once
    assert redis_client.get(KEYS.token_epoch).decode() == replid(redis_client)


def test_the_reapers_and_a_cancels_tokens_begin_the_epoch_too(store: LeaseStore, redis_client: redis.Redis) -> None:
    tokens(store, "before", 2)
    redis_client.set(KEYS.token_epoch, "0" * 40)
    redis_client.set(KEYS.token, 2)
    clock = server_us(redis_client)
    assert store.tokens.reserve(4) > clock


def test_a_counter_without_an_epoch_was_used_before_it_had_one(store: LeaseStore, redis_client: redis.Redis) -> None:
    # A counter an earlier version wrote (from 1), or one whose epoch key a promotion lost: moved on.
    redis_client.set(KEYS.token, 7)
    clock = server_us(redis_client)
    assert tokens(store, "a", 1)[0] > clock


def test_a_counter_gone_while_its_epoch_stayed_starts_again_from_the_clock(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # Evicted under an allkeys-* maxmemory policy, or deleted by hand: the epoch key is still
    # this server's, so no new epoch begins; the counter must not start again at 1.
    before = [*tokens(store, "before", 3), store.tokens.reserve(2)]
    redis_client.delete(KEYS.token)
    after = tokens(store, "after", 2)
    assert min(after) > max(before) and after == [after[0], after[0] + 1]
    redis_client.delete(KEYS.token)
    assert store.tokens.reserve(3) - 2 > max(after)  # the reaper's and a cancel's tokens, too


def test_a_counter_above_the_clock_goes_on_from_where_it_is(store: LeaseStore, redis_client: redis.Redis) -> None:
    # A clock that stepped back, or a counter moved moments ago: tokens never go back.
    ahead = server_us(redis_client) + 10**12
    redis_client.set(KEYS.token, ahead)
    redis_client.set(KEYS.token_epoch, "0" * 40)
    assert tokens(store, "a", 2) == [ahead + 1, ahead + 2]


def test_a_fresh_server_hands_out_tokens_above_an_old_servers(tmp_path: Path) -> None:
    # A restart of a Redis that keeps no data: another server, the same clock.
    handed_out = []
    for run in ("old", "fresh"):
        server = RedisServer(default_binary(), tmp_path / run).start()
        client = server.client()
        try:
            store = LeaseStore(client, KEYS)
            handed_out.append(tokens(store, run, 3))
            store.close()
        finally:
            client.close()
            server.stop()
    old, fresh = handed_out
    assert min(fresh) > max(old)


class Replicated:
    """A primary reached through a :class:`HoldingProxy`, and one replica linked through it."""

    def __init__(self, tmp_path: Path) -> None:
        self.primary = RedisServer(default_binary(), tmp_path / "primary").start()
        self.proxy = HoldingProxy(self.primary.port).start()
        self.replica = RedisServer(default_binary(), tmp_path / "replica").start()
        self.clients: list[redis.Redis] = []
        self.link(self.replica, self.proxy.port)

    def client(self, server: RedisServer) -> redis.Redis:
        client = server.client()
        self.clients.append(client)
        return client

    def link(self, replica: RedisServer, port: int) -> None:
        client = self.client(replica)
        client.replicaof("127.0.0.1", port)
        wait_until(lambda: client.info("replication").get("master_link_status") == "up", 20, "the replica's sync")

    def caught_up(self, primary: RedisServer, replica: RedisServer) -> None:
        source, copy = self.client(primary), self.client(replica)
        wait_until(
            lambda: (
                copy.info("replication").get("slave_repl_offset", -1)
                >= source.info("replication")["master_repl_offset"]
            ),
            20,
            "the replica to catch up",
        )

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.proxy.stop()
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Replicated]:
    group = Replicated(tmp_path)
    yield group
    group.stop()


def kill(server: RedisServer) -> None:
    assert server.process is not None
    server.process.kill()
    server.process.wait(10)
    server.process = None


def test_a_promoted_replica_that_lost_tokens_hands_out_only_later_ones(replicated: Replicated) -> None:
    primary = LeaseStore(replicated.client(replicated.primary), KEYS)
    replicated_tokens = tokens(primary, "replicated", 20)
    replicated.caught_up(replicated.primary, replicated.replica)
    replicated.proxy.hold()  # the link stays open, nothing passes
    lost = tokens(primary, "lost", 20)
    kill(replicated.primary)
    promoted_client = replicated.client(replicated.replica)
    promoted_client.replicaof("NO", "ONE")  # what Sentinel does
    assert int(promoted_client.get(KEYS.token)) == max(replicated_tokens)  # the 20 increments are lost

    promoted = LeaseStore(promoted_client, KEYS)
    after = tokens(promoted, "after", 20)
    assert min(after) > max(lost) > max(replicated_tokens)
    assert after == sorted(after)
    primary.close()
    promoted.close()


def test_a_first_promotion_of_a_replica_that_never_received_the_counter_hands_out_later_tokens(
    replicated: Replicated,
) -> None:
    primary = LeaseStore(replicated.client(replicated.primary), KEYS)
    replicated.caught_up(replicated.primary, replicated.replica)
    replicated.proxy.hold()  # before the first token: the replica never sees the counter
    lost = tokens(primary, "lost", 3)
    kill(replicated.primary)
    promoted_client = replicated.client(replicated.replica)
    promoted_client.replicaof("NO", "ONE")
    assert promoted_client.get(KEYS.token) is None

    promoted = LeaseStore(promoted_client, KEYS)
    after = tokens(promoted, "after", 3)
    assert min(after) > max(lost)
    primary.close()
    promoted.close()


def test_a_second_promotion_moves_on_again_from_the_first(replicated: Replicated, tmp_path: Path) -> None:
    # P fails over to R1; R1 hands out tokens its replica R2 never gets; R1 fails over to R2.
    primary = LeaseStore(replicated.client(replicated.primary), KEYS)
    tokens(primary, "first", 5)
    replicated.caught_up(replicated.primary, replicated.replica)
    kill(replicated.primary)
    first_promoted = replicated.replica
    replicated.client(first_promoted).replicaof("NO", "ONE")
    second = RedisServer(default_binary(), tmp_path / "second").start()
    proxy = HoldingProxy(first_promoted.port).start()
    try:
        replicated.link(second, proxy.port)
        on_first = LeaseStore(replicated.client(first_promoted), KEYS)
        epoch_one = tokens(on_first, "epoch-one", 5)  # begins R1's epoch: WAIT sees R2 take the move
        replicated.caught_up(first_promoted, second)
        proxy.hold()
        lost = tokens(on_first, "lost", 5)
        kill(first_promoted)
        second_client = replicated.client(second)
        second_client.replicaof("NO", "ONE")
        on_second = LeaseStore(second_client, KEYS)
        after = tokens(on_second, "after", 5)
        assert min(after) > max(lost) > max(epoch_one)
        on_first.close()
        on_second.close()
    finally:
        proxy.stop()
        second.stop()
    primary.close()


def test_an_epoch_its_replica_did_not_take_in_time_is_said_and_tokens_go_on(
    replicated: Replicated, caplog: pytest.LogCaptureFixture
) -> None:
    client = replicated.client(replicated.primary)
    client.set(KEYS.token, 3)  # a used counter without an epoch: this server begins one
    replicated.caught_up(replicated.primary, replicated.replica)
    replicated.proxy.hold()
    store = LeaseStore(client, KEYS)
    clock = server_us(client)
    with caplog.at_level(logging.WARNING, logger="celery_fenced.tokens"):
        assert tokens(store, "a", 1)[0] > clock
    assert f"reached 0 of 1 replicas within {EPOCH_WAIT_MS} ms" in caplog.text
    store.close()


def test_a_thawed_owner_whose_lease_came_back_with_a_failover_does_not_store(replicated: Replicated) -> None:
    """A owns the task and freezes; its lease expires, the reaper claims it and B acquires, on a
    primary that then dies before its replica received either write; the replica is promoted.
    The promoted server holds A's own lease, RUNNING with A's token, expired, no claim visible:
    A, thawed past a TTL, may not have it back (B is live). Its lease ran out on another server
    than the one it was acquired on (its ``primary``), so its renewal and its write are answered
    as on a vanished lease (``missing``), and its write-back is refused (``expired``); B, live,
    writes its own lease back over A's and stores its result. (Before, A's renewal and write
    were accepted, as for a lease nobody claimed, and A's stale result was stored.)"""
    primary = LeaseStore(replicated.client(replicated.primary), KEYS)
    a = acquire(primary, "t1", "host/1/a", ttl=200)
    replicated.caught_up(replicated.primary, replicated.replica)
    replicated.proxy.hold()  # nothing more reaches the replica
    primary_client = replicated.client(replicated.primary)
    wait_until(
        lambda: server_us(primary_client) // 1000 > int(primary_client.hget(KEYS.lease("t1"), "leaseExpireAt")),
        5,
        "A's expiry",
    )
    [claimed] = primary.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda *_: b"", expires_ms=0)
    assert claimed.code == "requeued"
    b = acquire(primary, "t1", "host/2/b", ttl=60_000)
    assert b.token > a.token
    kill(replicated.primary)
    promoted_client = replicated.client(replicated.replica)
    promoted_client.replicaof("NO", "ONE")  # what Sentinel does
    promoted = LeaseStore(promoted_client, KEYS)
    lease = promoted.read("t1")
    assert lease is not None and lease.owner_token == a.token and lease.status == "RUNNING"  # A's, come back
    a_state = promoted.read("t1")
    assert a_state is not None
    assert promoted.renew_many([renew_req(a_state, "host/1/a")]) == ["missing"]
    meta = f'{{"status": "SUCCESS", "result": "A", "fence_token": {a.token}}}'.encode()
    write = promoted.store("t1", a.token, meta, state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a")
    assert write.code == "missing", "the thawed owner's result was stored"
    assert promoted.hand_off("t1", "host/1/a", a.token) == "missing"
    assert restore_as(promoted, "host/1/a", a.token, ttl_ms=200, age_ms=5_000) == "expired"  # thawed: never back
    # B, live (renewed a moment ago), finds A's older lease where its own was: it writes its own back.
    assert restore_as(promoted, "host/2/b", b.token, ttl_ms=60_000, age_ms=500) == "restored"
    meta = f'{{"status": "SUCCESS", "result": "B", "fence_token": {b.token}}}'.encode()
    stored = promoted.store("t1", b.token, meta, state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/2/b")
    assert stored.code == "stored"
    late = promoted.store("t1", a.token, b"late", state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a")
    assert late.code == "stale"
    primary.close()
    promoted.close()


def restore_as(store: LeaseStore, owner: str, token: int, *, ttl_ms: int, age_ms: int) -> str:
    """An owner's write-back of its lease (restore.lua), its last renewal ``age_ms`` ago."""
    return store.restore(
        "t1", owner, token, ttl_ms=ttl_ms, task_name="proj.task", call={}, attempt=1, takeovers=0,
        max_takeovers=3, renewal_age_ms=age_ms,
    )  # fmt: skip


def test_a_live_owner_whose_lease_ran_out_during_a_failover_writes_it_back_and_renews(
    replicated: Replicated,
) -> None:
    """The owner is live: its lease ran out while Sentinel moved the primary (its renewals could
    not reach a server), and it renewed less than a TTL ago on its own clock. Its renewal on the
    promoted server is answered as for a vanished lease, and its write-back puts it back as its
    own, on the new server, keeping what the lease held (its details): it goes on."""
    primary = LeaseStore(replicated.client(replicated.primary), KEYS)
    a = acquire(primary, "t1", "host/1/a", ttl=200)
    replicated.client(replicated.primary).hset(KEYS.lease("t1"), "details", '{"row": 7}')
    replicated.caught_up(replicated.primary, replicated.replica)
    kill(replicated.primary)
    promoted_client = replicated.client(replicated.replica)
    promoted_client.replicaof("NO", "ONE")
    promoted = LeaseStore(promoted_client, KEYS)
    state = promoted.read("t1")
    assert state is not None
    wait_until(lambda: server_us(promoted_client) // 1000 > (state.lease_expire_at or 0), 5, "the lease to run out")
    assert promoted.renew_many([renew_req(state, "host/1/a", ttl_ms=200)]) == ["missing"]
    assert restore_as(promoted, "host/1/a", a.token, ttl_ms=200, age_ms=100) == "restored"
    back = promoted.read("t1")
    assert back is not None and back.owner_token == a.token and back.status == "RUNNING"
    assert back.raw["primary"] == replid(promoted_client) and back.details == {"row": 7}
    assert promoted.renew_many([renew_req(back, "host/1/a", ttl_ms=200)]) == ["ok"]
    primary.close()
    promoted.close()
