"""The lease protocol checked against a model (DESIGN.md §3–§4).

A hypothesis state machine drives the real Lua scripts, through :class:`LeaseStore`, on the
tests' private Redis through random interleavings of what happens to a task id: deliveries of
its message (copies of the original, and of a replacement after a hand-off), renewals, stalls,
the passing of time, the reaper's claims, result writes with a token and without one (the
worker's main process), hand-offs (``Task.replace()``), cancel, redrive, ``forget()``, an
owner putting back a vanished lease, FLUSHDB, a lost token counter and a failover that lost
the counter's last increments.

:class:`~tests.unit.lease.protocol_model.ProtocolModel` says what the contract lets each step
answer; after every step the invariants of :mod:`tests.unit.lease.protocol_model` are checked.
The scripts read the server's clock, so time passes for a lease the way the scripts see it:
its ``leaseExpireAt`` is set in the past (:meth:`ProtocolMachine.time_passes`).

Budget: ``FENCED_MODEL_EXAMPLES`` sequences (CI's default below, derandomized, no example
database); a long run sets it, e.g. ``FENCED_MODEL_EXAMPLES=20000``. ``FENCED_MODEL_TOLERATE``
(comma-separated violation names) lets a run go on past known holes to find the next one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, multiple, rule, run_state_machine_as_test

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.state import LeaseStatus, ReleaseOutcome, as_text
from celery_fenced._lease.store import LeaseStore
from tests.support.redis_server import RedisServer
from tests.unit.lease.protocol_model import (
    MAX_TAKEOVERS,
    TASK_IDS,
    Owner,
    ProtocolModel,
    Violations,
)

#: Sequences per run: CI's fixed budget (about half a minute on two shared cores), or the long run's.
EXAMPLES = int(os.environ.get("FENCED_MODEL_EXAMPLES", "600"))

#: Steps per sequence.
STEPS = int(os.environ.get("FENCED_MODEL_STEPS", "40"))

#: The database the machine owns (FLUSHDB is one of its steps).
MODEL_DB = 7

#: A lease lives this long unless time is made to pass (never runs out by itself in a run).
TTL_MS = 600_000

#: The reaper's requeue timeout: a claimed task is due again only when time passes for it.
REQUEUE_MS = 600_000

#: What the worker counts as a finished hand-off (``celery_fenced._worker.lifecycle.hand_off``:
#: only OK; a missing lease is a lost one). Change it with the hand-off's own rule.
HANDOFF_SUCCEEDS = frozenset({ReleaseOutcome.OK})

#: How long a forgotten task's tombstone lives: longer than any run of the machine.
FORGET_KEEP_MS = 3_600_000

KEYS = KeySpace.build("fenced", "celery-task-meta-")

#: The one worker (one start of it) every owner's process belongs to.
WORKER = "model-host/1/start"


class ProtocolMachine(RuleBasedStateMachine):
    """Real scripts on one side, the model on the other: each rule runs one step on both."""

    client: redis.Redis  # set by the test before the run

    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        self.client.flushdb()
        self.store = LeaseStore(self.client, KEYS)
        self.violations = Violations(os.environ.get("FENCED_MODEL_TOLERATE", ""))
        self.model = ProtocolModel(self.violations)

    def teardown(self) -> None:
        self.store.close()

    # -- helpers --------------------------------------------------------------------------

    def now_ms(self) -> int:
        return self.store.server_time_ms()

    def lease_exists(self, task_id: str) -> bool:
        return bool(self.client.exists(KEYS.lease(task_id)))

    # -- deliveries and owners ------------------------------------------------------------

    @rule(target=owners, task_id=st.sampled_from(TASK_IDS), replacement=st.booleans())
    def deliver(self, task_id: str, replacement: bool) -> object:
        """A delivery of the task's message acquires: a copy of the original message, or of
        the newest replacement a hand-off sent (its message names the token handed off from)."""
        message = self.model.publish_to_deliver(task_id, replacement)
        owner = self.model.new_owner(task_id, message)
        answer = self.store.acquire(
            task_id,
            owner.owner_id,
            ttl_ms=TTL_MS,
            task_name="model.task",
            max_takeovers=MAX_TAKEOVERS,
            call={"args": [], "kwargs": {}},
            publish_id=owner.publish_id,
            handed_off_by=owner.handed_off_by,
        )
        self.model.acquired(owner, answer.outcome.value, answer.token, answer.attempt, answer.takeovers)
        return owner if answer.outcome.runs else multiple()

    @rule(owner=owners)
    def renew(self, owner: Owner) -> None:
        """The owner's heartbeat renews its lease (owner, token and status checked)."""
        (code,) = self.store.renew_many([owner.renew_request(TTL_MS)])
        self.model.renewed(owner, code.value)

    @rule(owner=owners, mode=st.sampled_from(["release", "expire", "unfinished"]))
    def stall(self, owner: Owner, mode: str) -> None:
        """``on_stall``: give the lease up now (``release``) or let it run out (``expire``);
        or the body stopped without finishing (``unfinished``): given up now, for a takeover."""
        code = self.store.lapse(owner.task_id, owner.owner_id, owner.token, mode=mode)
        self.model.stalled(owner, code.value, mode != "expire")

    @rule(owner=owners)
    def process_lost(self, owner: Owner) -> None:
        """A prefork process lost under ``task_reject_on_worker_lost``: the worker's main
        process gives up the lease that process owns (``lapse_now`` with its owner prefix)."""
        code = self.store.lapse_now(owner.task_id, owner_prefix=owner.process)
        self.model.process_lost(owner, code.value)

    @rule(task_id=st.sampled_from(TASK_IDS))
    def time_passes(self, task_id: str) -> None:
        """Every deadline of the task's lease passes: its expiry (a live lease), its due time
        (a requeued or retrying one). The scripts' clock is the server's: this is what the
        passing of time means to them, written into the lease itself."""
        key = KEYS.lease(task_id)
        if self.client.hexists(key, "leaseExpireAt"):
            self.client.hset(key, "leaseExpireAt", self.now_ms() - 1)
        self.model.time_passed(task_id)

    @rule(owner=owners, lapsed=st.booleans())
    def restore(self, owner: Owner, lapsed: bool) -> None:
        """The owner's heartbeat found its lease missing and puts it back (``restore.lua``).
        The heartbeat asks only while the owner holds the lease as far as it knows. Its
        renewal age is honest: a TTL once time passed for its lease (its own clock saw the
        lease run out), else none. ``lapsed``: a lease its own clock gave up is written back
        given up, for the reaper (the heartbeat asks that only then)."""
        if not owner.believes_live or (lapsed and not owner.expired):
            return
        code = self.store.restore(
            owner.task_id,
            owner.owner_id,
            owner.token,
            ttl_ms=TTL_MS,
            task_name="model.task",
            call={"args": [], "kwargs": {}},
            attempt=owner.attempt,
            takeovers=owner.takeovers,
            max_takeovers=MAX_TAKEOVERS,
            renewal_age_ms=TTL_MS if owner.expired else 0,
            lapsed=lapsed,
            publish_id=owner.publish_id,
            handed_off_by=owner.handed_off_by,
        )
        self.model.restored(owner, code.value, lapsed)

    # -- writes and ends ----------------------------------------------------------------

    @rule(owner=owners, state=st.sampled_from(["SUCCESS", "RETRY", "STARTED"]))
    def write(self, owner: Owner, state: str) -> None:
        """The fenced backend stores a result with the owner's token."""
        kind = {"SUCCESS": "ready", "RETRY": "retry", "STARTED": "other"}[state]
        answer = self.store.store(
            owner.task_id,
            owner.token,
            owner.meta(state),
            state=state,
            kind=kind,
            expires_ms=0,
            retry_due_ms=REQUEUE_MS,
            owner_id=owner.owner_id,
        )
        self.model.wrote(owner, state, answer.code.value)

    @rule(owner=owners, worker_lost=st.booleans())
    def tokenless_write(self, owner: Owner, worker_lost: bool) -> None:
        """The worker's main process (the owner's process) stores without a token: a
        ``WorkerLostError`` FAILURE, or a REVOKED."""
        state = "FAILURE" if worker_lost else "REVOKED"
        meta = f'{{"status": "{state}", "result": null, "task_id": "{owner.task_id}"}}'
        answer = self.store.store(
            owner.task_id,
            None,
            meta,
            state=state,
            kind="ready",
            expires_ms=0,
            retry_due_ms=REQUEUE_MS,  # as the backend sends it: the requeue timeout
            writer=owner.process,
            worker_lost=worker_lost,
            handed_off_by=owner.handed_off_by,
        )
        self.model.wrote_tokenless(owner, worker_lost, answer.code.value)

    @rule(owner=owners)
    def put_back_write(self, owner: Owner) -> None:
        """A hard time limit with ``task_acks_late`` and ``acks_on_timeout`` off: the worker's
        main process stores the FAILURE without a token, and Celery puts the message back."""
        meta = f'{{"status": "FAILURE", "result": null, "task_id": "{owner.task_id}"}}'
        answer = self.store.store(
            owner.task_id,
            None,
            meta,
            state="FAILURE",
            kind="ready",
            expires_ms=0,
            retry_due_ms=REQUEUE_MS,
            writer=owner.process,
            put_back=True,
            handed_off_by=owner.handed_off_by,
        )
        self.model.wrote_put_back(owner, answer.code.value)

    @rule(owner=owners, status=st.sampled_from([LeaseStatus.DONE, LeaseStatus.RETRYING]))
    def release(self, owner: Owner, status: LeaseStatus) -> None:
        """The owner ends its attempt without a READY result: ``Ignore`` (DONE) or a retry."""
        code = self.store.release(owner.task_id, owner.owner_id, owner.token, status=status, due_in_ms=REQUEUE_MS)
        self.model.released(owner, status.value, code.value)

    @rule(owner=owners)
    def hand_off(self, owner: Owner) -> None:
        """``Task.replace()``: the owner passes the task id to a replacement."""
        had_lease = self.lease_exists(owner.task_id)
        code = self.store.hand_off(owner.task_id, owner.owner_id, owner.token, worker_id=WORKER)
        self.model.handed_off(owner, code in HANDOFF_SUCCEEDS, code.value, had_lease)

    @rule(owner=owners)
    def replacement_sent(self, owner: Owner) -> None:
        """``Task.replace()`` sent the replacement: the owner that handed off says so."""
        code = self.store.replacement_sent(owner.task_id, owner.owner_id, owner.token, worker_id=WORKER)
        self.model.said_sent(owner, code.value)

    @rule(owner=owners)
    def hand_back(self, owner: Owner) -> None:
        """The replacement's send failed: the owner takes its hand-off back."""
        code = self.store.hand_back(owner.task_id, owner.owner_id, owner.token, ttl_ms=TTL_MS, worker_id=WORKER)
        self.model.handed_back(owner, code.value)

    @rule()
    def worker_lapses(self) -> None:
        """The owners' worker dies or freezes: its liveness record lapses, and a reaper pass
        sees it (``lapse_worker.lua``)."""
        self.client.zadd(KEYS.workers, {WORKER: self.now_ms() - 1})  # its last renewal ran out
        made_due = self.store.liveness.lapse_dead_workers().get(WORKER, 0)
        self.model.worker_lapsed(made_due)

    # -- the reaper and the operator ------------------------------------------------------

    @rule(task_id=st.sampled_from(TASK_IDS))
    def claim(self, task_id: str) -> None:
        """The reaper claims the task's lease (it re-validates it: not-due is an answer)."""
        (answer,) = self.store.claim_due(
            [task_id],
            grace_ms=0,
            requeue_ms=REQUEUE_MS,
            abandoned_meta=lambda tid, token: abandoned_meta(tid, token).encode(),
            expires_ms=0,
        )
        # The token reserved for the claim (for an abandon) was handed out: one per claim.
        reserved = int(self.client.get(KEYS.token) or 0)
        self.model.claimed(task_id, answer.code.value, answer.cause, reserved)

    @rule(task_id=st.sampled_from(TASK_IDS), unknown_too=st.booleans())
    def cancel(self, task_id: str, unknown_too: bool) -> None:
        """``celery fenced cancel``: a fenced REVOKED with a fresh token."""
        taken: list[int] = []

        def revoked_meta(token: int) -> bytes:
            taken.append(token)
            return f'{{"status": "REVOKED", "result": null, "task_id": "{task_id}", "fence_token": {token}}}'.encode()

        answer = self.store.cancel(task_id, revoked_meta, expires_ms=0, unknown_too=unknown_too)
        self.model.cancelled(task_id, answer.code.value, taken[0], unknown_too)

    @rule(task_id=st.sampled_from(TASK_IDS))
    def redrive(self, task_id: str) -> None:
        """``celery fenced redrive``: an ABANDONED task back for a fresh set of takeovers."""
        self.model.redriven(task_id, self.store.redrive(task_id).value)

    @rule(task_id=st.sampled_from(TASK_IDS))
    def forget(self, task_id: str) -> None:
        """``AsyncResult.forget()``: the backend's forget (``forget.lua``): the result goes, a
        finished task's fence stays as a tombstone."""
        code = self.store.forget(task_id, keep_ms=FORGET_KEEP_MS)
        self.model.forgotten(task_id, code.value)

    # -- what happens to the Redis ----------------------------------------------------------

    @rule()
    def flushdb(self) -> None:
        """FLUSHDB of the lease database (or a restart of a Redis that kept no data)."""
        self.client.flushdb()
        self.model.flushed()

    @rule()
    def counter_lost(self) -> None:
        """A first failover to a replica that never received the counter (nor its epoch)."""
        self.client.delete(KEYS.token, KEYS.token_epoch)
        self.model.counter_lost()

    @rule()
    def counter_evicted(self) -> None:
        """The token counter alone gone, its epoch kept: evicted under an ``allkeys-*``
        maxmemory policy, or deleted by hand."""
        self.client.delete(KEYS.token)
        self.model.counter_lost()

    @rule(lost=st.integers(min_value=1, max_value=3))
    def failover(self, lost: int) -> None:
        """A failover that lost the counter's last increments: another server's epoch."""
        counter = int(self.client.get(KEYS.token) or 0)
        if counter > lost:
            self.client.set(KEYS.token, counter - lost)
        else:  # it never received the counter
            self.client.delete(KEYS.token)
        self.client.set(KEYS.token_epoch, "0" * 40)
        self.model.failed_over()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def redis_agrees_with_the_model(self) -> None:
        """What Redis holds says no more than the contract lets it: a live lease only for the
        task's newest token, a finished task still finished."""
        for task_id in TASK_IDS:
            stored = self.client.hgetall(KEYS.lease(task_id))
            fields = {as_text(name): as_text(value) for name, value in stored.items()}
            result = self.client.get(KEYS.result(task_id))
            self.model.check_redis(task_id, fields, result)

    @invariant()
    def one_live_owner(self) -> None:
        self.model.check_one_live_owner()


def abandoned_meta(task_id: str, token: int) -> str:
    return f'{{"status": "FAILURE", "result": null, "task_id": "{task_id}", "fence_token": {token}}}'


@pytest.fixture
def model_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    # Each failover step moves the counter on, with a warning each time: not what is checked.
    tokens_logger = logging.getLogger("celery_fenced.tokens")
    level = tokens_logger.level
    tokens_logger.setLevel(logging.ERROR)
    client = redis_server.client(MODEL_DB)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()
    tokens_logger.setLevel(level)


@pytest.mark.timeout(3600)
def test_the_lease_protocol_against_its_model(model_client: redis.Redis) -> None:
    ProtocolMachine.client = model_client
    run_state_machine_as_test(
        ProtocolMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


#: The shortest sequences the machine found breaking a rule, replayed as they were found: each
#: passes once the scripts keep the contract. ``("deliver", {...})`` names a delivery that runs
#: (it becomes owner 0, 1, ... in order); ``OWNER(n)`` stands for the n-th such owner.
OWNER = "owner:"

COUNTEREXAMPLES = [
    pytest.param(
        [
            ("deliver", {}),
            ("renew", {"owner": OWNER + "0"}),
            ("write", {"owner": OWNER + "0", "state": "STARTED"}),
            ("deliver", {}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
            ("deliver", {}),
        ],
        id="a-run-that-keeps-the-contract",
    ),
    pytest.param(
        [("deliver", {}), ("write", {"owner": OWNER + "0", "state": "SUCCESS"}), ("hand_off", {"owner": OWNER + "0"})],
        id="missing-handoff-succeeded-after-its-own-success",
    ),
    pytest.param(
        [("deliver", {}), ("flushdb", {}), ("hand_off", {"owner": OWNER + "0"})],
        id="missing-handoff-succeeded-after-flushdb",
    ),
    pytest.param(
        [("deliver", {}), ("hand_off", {"owner": OWNER + "0"}), ("deliver", {})],
        id="copy-after-handoff-ran",
    ),
    pytest.param(
        [("deliver", {}), ("hand_off", {"owner": OWNER + "0"}), ("write", {"owner": OWNER + "0", "state": "SUCCESS"})],
        id="write-after-handoff",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("time_passes", {}),
            ("claim", {}),
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "1"}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ],
        id="stale-write-landed-after-handoff",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("deliver", {"replacement": True}),
            ("release", {"owner": OWNER + "1", "status": LeaseStatus.DONE}),
            ("deliver", {}),
        ],
        id="copy-after-handoff-ran-after-the-replacement-finished",
    ),
    pytest.param(
        [("deliver", {}), ("write", {"owner": OWNER + "0", "state": "SUCCESS"}), ("forget", {}), ("deliver", {})],
        id="forgotten-done-ran-again",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("time_passes", {}),
            ("claim", {}),
            ("deliver", {}),
            ("write", {"owner": OWNER + "1", "state": "SUCCESS"}),
            ("forget", {}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ],
        id="stale-write-landed-after-forget",
    ),
    pytest.param([("deliver", {}), ("flushdb", {}), ("deliver", {})], id="token-repeated-after-flushdb"),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("hand_back", {"owner": OWNER + "0"}),
            ("deliver", {}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
            ("deliver", {}),
        ],
        id="a-hand-back-then-the-owners-write",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("deliver", {"replacement": True}),
            ("hand_back", {"owner": OWNER + "0"}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ],
        id="no-hand-back-once-the-replacement-started",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("deliver", {"replacement": True}),
            ("hand_off", {"owner": OWNER + "1"}),
            ("hand_back", {"owner": OWNER + "1"}),
            ("time_passes", {}),
            ("claim", {}),
            ("deliver", {}),
        ],
        id="a-replacement-run-taken-back-keeps-its-hand-off-token",
    ),
    pytest.param([("cancel", {}), ("counter_lost", {}), ("claim", {})], id="token-repeated-after-counter-lost"),
    pytest.param(
        [("deliver", {}), ("counter_evicted", {}), ("deliver", {"task_id": "t2"})],
        id="token-repeated-after-counter-evicted",
    ),
    pytest.param(
        [("cancel", {}), ("counter_evicted", {}), ("claim", {})], id="reaper-token-repeated-after-counter-evicted"
    ),
    pytest.param(
        [("deliver", {}), ("time_passes", {}), ("flushdb", {}), ("restore", {"owner": OWNER + "0"})],
        id="restore-of-expired-lease",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("flushdb", {}),
            ("failover", {"lost": 1}),
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "1"}),
            ("restore", {"owner": OWNER + "0"}),
        ],
        id="stale-restore-over-a-handoff",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("deliver", {"replacement": True}),
            ("time_passes", {}),
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "1"}),
            ("deliver", {"replacement": True}),
        ],
        id="copy-after-handoff-ran-while-the-replacement-runs",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("time_passes", {}),
            ("claim", {}),
            ("deliver", {}),
            ("flushdb", {}),
            ("restore", {"owner": OWNER + "0", "lapsed": True}),
            ("renew", {"owner": OWNER + "1"}),
            ("deliver", {}),
        ],
        id="a-lapsed-write-back-after-flushdb",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("flushdb", {}),
            ("cancel", {}),
            ("counter_evicted", {}),
            ("restore", {"owner": OWNER + "0"}),
            ("deliver", {"task_id": TASK_IDS[1]}),
        ],
        id="a-write-back-after-the-counter-was-evicted",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("replacement_sent", {"owner": OWNER + "0"}),
            ("tokenless_write", {"owner": OWNER + "0", "worker_lost": True}),
            ("time_passes", {}),
            ("claim", {}),
        ],
        id="a-process-lost-after-it-sent-its-replacement",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("tokenless_write", {"owner": OWNER + "0", "worker_lost": True}),
            ("replacement_sent", {"owner": OWNER + "0"}),
            ("time_passes", {}),
            ("claim", {}),
        ],
        id="a-hand-off-said-sent-after-its-process-was-taken-for-lost",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("tokenless_write", {"owner": OWNER + "0", "worker_lost": False}),
            ("deliver", {"replacement": True}),
        ],
        id="a-handing-process-terminated-before-its-send",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("put_back_write", {"owner": OWNER + "0"}),
            ("time_passes", {}),
            ("claim", {}),
            ("deliver", {}),
        ],
        id="a-handing-process-timed-out-before-its-send-its-message-put-back",
    ),
    pytest.param(
        [("deliver", {}), ("hand_off", {"owner": OWNER + "0"}), ("worker_lapses", {}), ("claim", {})],
        id="a-whole-worker-lost-before-its-send",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("replacement_sent", {"owner": OWNER + "0"}),
            ("worker_lapses", {}),
            ("claim", {}),
            ("deliver", {"replacement": True}),
        ],
        id="a-whole-worker-lost-after-its-send",
    ),
]


@pytest.mark.parametrize("steps", COUNTEREXAMPLES)
def test_a_sequence_that_broke_the_contract(model_client: redis.Redis, steps: list[tuple[str, dict]]) -> None:
    ProtocolMachine.client = model_client
    machine = ProtocolMachine()
    owners: list[Owner] = []
    defaults = {"task_id": TASK_IDS[0], "replacement": False, "unknown_too": False, "lapsed": False}
    try:
        for name, given in steps:
            step = getattr(machine, name)
            arguments = {key: value for key, value in defaults.items() if key in step.__code__.co_varnames}
            for key, value in given.items():
                is_owner = isinstance(value, str) and value.startswith(OWNER)
                arguments[key] = owners[int(value.removeprefix(OWNER))] if is_owner else value
            answer = step(**arguments)
            if isinstance(answer, Owner):
                owners.append(answer)
            machine.redis_agrees_with_the_model()
            machine.one_live_owner()
    finally:
        machine.teardown()
