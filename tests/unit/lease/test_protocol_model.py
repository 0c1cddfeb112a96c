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
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RULE_MARKER,
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.state import LeaseStatus, ReleaseOutcome, Reservation, as_text
from celery_fenced._lease.store import LeaseStore
from tests.support.redis_server import RedisServer
from tests.unit.lease.protocol_model import (
    MAX_TAKEOVERS,
    TASK_IDS,
    WORKERS,
    Owner,
    ProtocolModel,
    Violations,
    violation_class,
)

#: Sequences per run: CI's fixed budget, or the long run's. Two runs (with and without data
#: loss) and the mutants (test_model_mutants.py) share about a minute of one core.
EXAMPLES = int(os.environ.get("FENCED_MODEL_EXAMPLES", "150"))

#: Steps per sequence.
STEPS = int(os.environ.get("FENCED_MODEL_STEPS", "40"))

#: The database the machine owns (FLUSHDB is one of its steps).
MODEL_DB = 7

#: A lease lives this long unless time is made to pass (never runs out by itself in a run).
TTL_MS = 600_000

#: The reaper's requeue timeout: a claimed task is due again only when time passes for it.
REQUEUE_MS = 600_000

#: Until a retry Celery sends for a lost process is overdue (its countdown and the requeue
#: timeout): far off, as the requeue timeout, so only time passing makes it due.
RETRY_DUE_MS = 600_000

#: Until a received message's reservation expires (its eta's delay and the start timeout): far
#: off, so only time passing makes it due.
RESERVE_MS = 600_000

#: The reaper's takeover grace, when a claim has one: a lease held or given up is due only
#: once time passed past its expiry by more than this.
GRACE_MS = 60_000

#: The result expiry of a write that has one (``expires_ms > 0``): long, so that keys expire
#: only when the machine says so (:meth:`ProtocolMachine.keys_expire`).
EXPIRES_MS = 3_600_000

#: What an owner's heartbeat can say of its last accepted renewal (``renewal_age_ms``): while
#: its own clock has not seen its lease run out, and once it has.
FRESH_AGES = (0, 1, TTL_MS - 1)
EXPIRED_AGES = (TTL_MS, TTL_MS + 1, 2 * TTL_MS)

#: What the worker counts as a finished hand-off (``celery_fenced._worker.lifecycle.hand_off``:
#: only OK; a missing lease is a lost one). Change it with the hand-off's own rule.
HANDOFF_SUCCEEDS = frozenset({ReleaseOutcome.OK})

#: The replacement a recorded hand-off keeps (JSON of its signature), for the reaper to send again.
REPLACEMENT = '{"task": "model.task", "args": [], "kwargs": {}}'

#: How long a forgotten task's tombstone lives: longer than any run of the machine.
FORGET_KEEP_MS = 3_600_000

KEYS = KeySpace.build("fenced", "celery-task-meta-")

#: How often each rule ran, and with which answer, over the runs of this session (the
#: per-rule coverage the runs print, and check: a rule that never runs checks nothing).
COVERAGE: Counter[tuple[str, str]] = Counter()

#: The rules that lose the store's data (run only by a machine with ``losses``).
LOSS_RULES = ("flushdb", "evict_lease", "evict_result", "keys_expire")


class ProtocolMachine(RuleBasedStateMachine):
    """Real scripts on one side, the model on the other: each rule runs one step on both."""

    client: redis.Redis  # set by the test before the run

    #: Whether the store loses data in the run (FLUSHDB, an evicted or expired key).
    losses = True

    owners = Bundle("owners")

    #: Whether the run goes through the known holes of the scripts (:data:`HOLES`); a run that
    #: passes keeps out of them, and their counterexamples pin them.
    holes_open = False

    def __init__(self) -> None:
        super().__init__()
        self.client.flushdb()
        self.store = LeaseStore(self.client, KEYS)
        self.violations = Violations(os.environ.get("FENCED_MODEL_TOLERATE", ""))
        self.model = ProtocolModel(self.violations)

    @classmethod
    def rule_names(cls) -> set[str]:
        """The rules this machine runs."""
        names = {name for name in dir(cls) if getattr(getattr(cls, name), RULE_MARKER, None) is not None}
        return names if cls.losses else names - set(LOSS_RULES)

    def count(self, rule: str, answer: object = "") -> None:
        COVERAGE[rule, str(getattr(answer, "value", answer))] += 1

    def lease_fields(self, task_id: str) -> dict[str, str]:
        stored = self.client.hgetall(KEYS.lease(task_id))
        return {as_text(name): as_text(value) for name, value in stored.items()}

    def teardown(self) -> None:
        self.store.close()

    # -- helpers --------------------------------------------------------------------------

    def now_ms(self) -> int:
        return self.store.server_time_ms()

    def lease_exists(self, task_id: str) -> bool:
        return bool(self.client.exists(KEYS.lease(task_id)))

    # -- deliveries and owners ------------------------------------------------------------

    @initialize(target=owners, task_id=st.sampled_from(TASK_IDS))
    def first_delivery(self, task_id: str) -> object:
        """Every sequence starts with an owner: the rules about owners run from its first step."""
        return self.deliver(task_id, False, WORKERS[0])

    @rule(target=owners, task_id=st.sampled_from(TASK_IDS), replacement=st.booleans(), worker=st.sampled_from(WORKERS))
    def deliver(self, task_id: str, replacement: bool, worker: str = WORKERS[0]) -> object:
        """A delivery of the task's message acquires, on one of the workers: a copy of the
        original message, or of the newest replacement a hand-off sent (its message names the
        token handed off from)."""
        message = self.model.publish_to_deliver(task_id, replacement)
        owner = self.model.new_owner(task_id, message, worker)
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
        self.count("deliver", answer.outcome)
        self.model.acquired(owner, answer.outcome.value, answer.token, answer.attempt, answer.takeovers)
        return owner if answer.outcome.runs else multiple()

    @rule(task_id=st.sampled_from(TASK_IDS), replacement=st.booleans(), worker=st.sampled_from(WORKERS))
    def receive(self, task_id: str, replacement: bool, worker: str = WORKERS[0]) -> None:
        """A worker receives a copy of the task's message (the original, or the newest
        replacement) and holds it before any process starts it (prefetched, an eta):
        ``reserve.lua`` records its reservation, filed under the worker."""
        message = self.model.publish_to_deliver(task_id, replacement)
        reservation = Reservation(
            task_id,
            expires_in_ms=RESERVE_MS,
            task_name="model.task",
            call={"args": [], "kwargs": {}},
            max_takeovers=MAX_TAKEOVERS,
            publish_id=self.model.tasks[task_id].publish_of(message),
            handed_off_by=self.model.handed_off_by(task_id, message),
        )
        (code,) = self.store.reserve_many([reservation], reserved_by=worker.split("/")[0], worker_id=worker)
        self.count("receive", code)
        self.model.received(task_id, message, worker, code.value)

    @rule(owner=owners)
    def renew(self, owner: Owner) -> None:
        """The owner's heartbeat renews its lease (owner, token and status checked)."""
        (code,) = self.store.renew_many([owner.renew_request(TTL_MS)])
        self.count("renew", code)
        self.model.renewed(owner, code.value)

    @rule(owner=owners, mode=st.sampled_from(["release", "expire", "unfinished"]))
    def stall(self, owner: Owner, mode: str) -> None:
        """``on_stall``: give the lease up now (``release``) or let it run out (``expire``);
        or the body stopped without finishing (``unfinished``): given up now, for a takeover."""
        code = self.store.lapse(owner.task_id, owner.owner_id, owner.token, mode=mode)
        self.count("stall", code)
        self.model.stalled(owner, code.value, mode != "expire")

    @rule(owner=owners, retried=st.booleans())
    def process_lost(self, owner: Owner, retried: bool = False) -> None:
        """A prefork process lost under ``task_reject_on_worker_lost``: the worker's main
        process gives up the lease that process owns (``lapse_now`` with its owner prefix);
        ``retried``: under Celery 5.7's ``retry_on_worker_lost``, whose retry it waits for."""
        retry_due_ms = RETRY_DUE_MS if retried else None
        code = self.store.lapse_now(owner.task_id, owner_prefix=owner.process, retry_due_ms=retry_due_ms)
        self.count("process_lost", f"{code}{' (retried)' if retried else ''}")
        self.model.process_lost(owner, code.value, retried)

    @rule(task_id=st.sampled_from(TASK_IDS), past_grace=st.booleans())
    def time_passes(self, task_id: str, past_grace: bool = False) -> None:
        """Every deadline of the task's lease passes: its expiry (a live lease), its due time
        (a requeued or retrying one); ``past_grace``: by more than the takeover grace too. The
        scripts' clock is the server's: this is what the passing of time means to them,
        written into the lease itself."""
        key = KEYS.lease(task_id)
        if self.client.hexists(key, "leaseExpireAt"):
            self.client.hset(key, "leaseExpireAt", self.now_ms() - (GRACE_MS + 1 if past_grace else 1))
        self.count("time_passes", "past-grace" if past_grace else "")
        self.model.time_passed(task_id, past_grace)

    @rule(owner=owners, lapsed=st.booleans(), age=st.sampled_from(range(len(FRESH_AGES))))
    def restore(self, owner: Owner, lapsed: bool, age: int = 0) -> None:
        """The owner's heartbeat found its lease missing and puts it back (``restore.lua``).
        The heartbeat asks only while the owner holds the lease as far as it knows. Its
        renewal age is honest: less than a TTL (``FRESH_AGES``) until time passed for its
        lease, then a TTL or more (``EXPIRED_AGES``: its own clock saw the lease run out).
        ``lapsed``: a lease its own clock gave up is written back given up, for the reaper
        (the heartbeat asks that only then)."""
        if not owner.believes_live or (lapsed and not owner.expired):
            self.count("restore", "not-asked")
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
            renewal_age_ms=(EXPIRED_AGES if owner.expired else FRESH_AGES)[age],
            lapsed=lapsed,
            publish_id=owner.publish_id,
            handed_off_by=owner.handed_off_by,
        )
        self.count("restore", code)
        self.model.restored(owner, code.value, lapsed)

    # -- writes and ends ----------------------------------------------------------------

    @rule(
        owner=owners,
        state=st.sampled_from(["SUCCESS", "FAILURE", "REVOKED", "RETRY", "STARTED"]),
        expires=st.booleans(),
    )
    def write(self, owner: Owner, state: str, expires: bool = False) -> None:
        """The fenced backend stores a result with the owner's token (a READY one carries the
        finished lease's fence), with the result expiry or none."""
        kind = {"RETRY": "retry", "STARTED": "other"}.get(state, "ready")
        answer = self.store.store(
            owner.task_id,
            owner.token,
            owner.meta(state),
            state=state,
            kind=kind,
            expires_ms=EXPIRES_MS if expires else 0,
            retry_due_ms=REQUEUE_MS,
            owner_id=owner.owner_id,
        )
        self.count("write", f"{state}:{answer.code.value}")
        self.model.wrote(owner, state, answer.code.value)

    @rule(owner=owners, kind=st.sampled_from(["worker-lost", "revoked", "put-back"]))
    def main_process_write(self, owner: Owner, kind: str) -> None:
        """The worker's main process stores for the owner's process without a token: one
        rule for the three kinds, so that together they come as often as one owner's step."""
        self.count("main_process_write", kind)
        if kind == "put-back":
            self.put_back_write(owner)
        else:
            self.tokenless_write(owner, kind == "worker-lost")

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
        self.count("tokenless_write", answer.code)
        self.model.wrote_tokenless(owner, worker_lost, answer.code.value)

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
        self.count("put_back_write", answer.code)
        self.model.wrote_put_back(owner, answer.code.value)

    @rule(owner=owners, status=st.sampled_from([LeaseStatus.DONE, LeaseStatus.RETRYING]))
    def release(self, owner: Owner, status: LeaseStatus) -> None:
        """The owner ends its attempt without a READY result: ``Ignore`` (DONE) or a retry."""
        code = self.store.release(owner.task_id, owner.owner_id, owner.token, status=status, due_in_ms=REQUEUE_MS)
        self.count("release", code)
        self.model.released(owner, status.value, code.value)

    @rule(owner=owners, recorded=st.booleans())
    def hand_off(self, owner: Owner, recorded: bool = False) -> None:
        """``Task.replace()``: the owner passes the task id to a replacement, recorded with the
        hand-off (as the worker does for one it can write as JSON) or not."""
        had_lease = self.lease_exists(owner.task_id)
        code = self.store.hand_off(
            owner.task_id,
            owner.owner_id,
            owner.token,
            worker_id=owner.worker,
            replacement=REPLACEMENT if recorded else "",
        )
        self.count("hand_off", f"{code.value}{':recorded' if recorded else ''}")
        self.model.handed_off(owner, code in HANDOFF_SUCCEEDS, code.value, had_lease, recorded)

    @rule(owner=owners, filed=st.booleans())
    def replacement_sent(self, owner: Owner, filed: bool = True) -> None:
        """``Task.replace()`` sent the replacement: the owner that handed off says so, with the
        requeue timeout after which the reaper looks whether it started (as the worker does);
        ``filed``: with its worker's id (without it, when the process does not know it)."""
        code = self.store.replacement_sent(
            owner.task_id,
            owner.owner_id,
            owner.token,
            worker_id=owner.worker if filed else None,
            due_in_ms=REQUEUE_MS,
        )
        self.count("replacement_sent", code)
        self.model.said_sent(owner, code.value, filed)

    @rule(owner=owners)
    def hand_back(self, owner: Owner) -> None:
        """The replacement's send failed: the owner takes its hand-off back."""
        code = self.store.hand_back(owner.task_id, owner.owner_id, owner.token, ttl_ms=TTL_MS, worker_id=owner.worker)
        self.count("hand_back", code)
        self.model.handed_back(owner, code.value)

    @precondition(lambda self: any(t.filed_worker or t.reservation_filed for t in self.model.tasks.values()))
    @rule(worker=st.sampled_from(WORKERS))
    def worker_lapses(self, worker: str = WORKERS[0]) -> None:
        """One of the owners' workers dies or freezes: it said it was alive
        (``worker_alive.lua``), then its liveness record lapses, and a reaper pass sees it
        (``lapse_worker.lua``)."""
        self.store.liveness.worker_alive(worker, TTL_MS)
        self.client.zadd(KEYS.workers, {worker: self.now_ms() - 1})  # its last renewal ran out
        made_due = self.store.liveness.lapse_dead_workers()
        self.count("worker_lapses", made_due.get(worker, "unknown"))
        self.model.worker_lapsed(worker, made_due.get(worker, 0))

    # -- the reaper and the operator ------------------------------------------------------

    @rule(target=owners, task_id=st.sampled_from(TASK_IDS), grace=st.booleans(), worker=st.sampled_from(WORKERS))
    def runs_out_and_claim(self, task_id: str, grace: bool, worker: str = WORKERS[0]) -> object:
        """The task's lease runs out (past the grace too), the reaper's next pass claims it,
        and the message it sends again is delivered: the way to a takeover (and, past
        MAX_TAKEOVERS, to an abandon), in one step, so that most sequences have several."""
        self.count("runs_out_and_claim")
        self.time_passes(task_id, True)
        self.claim(task_id, grace)
        return self.deliver(task_id, False, worker)

    @rule(task_id=st.sampled_from(TASK_IDS), grace=st.booleans())
    def claim(self, task_id: str, grace: bool = False) -> None:
        """The reaper claims the task's lease (it re-validates it: not-due is an answer),
        with the takeover grace or none."""
        (answer,) = self.store.claim_due(
            [task_id],
            grace_ms=GRACE_MS if grace else 0,
            requeue_ms=REQUEUE_MS,
            abandoned_meta=lambda tid, token: abandoned_meta(tid, token).encode(),
            expires_ms=0,
        )
        # The token reserved for the claim (for an abandon) was handed out: one per claim.
        reserved = int(self.client.get(KEYS.token) or 0)
        self.count("claim", f"{answer.code.value}{':grace' if grace else ''}")
        self.model.claimed(task_id, answer.code.value, answer.cause, reserved, grace)

    @rule(
        task_id=st.sampled_from(TASK_IDS), action=st.sampled_from(["cancel", "cancel-unknown-too", "redrive", "forget"])
    )
    def operator(self, task_id: str, action: str) -> None:
        """An operator's or a client's call: cancel, redrive, ``forget()`` (one rule, so that
        together they come as often as one owner's step: each ends what it touches)."""
        self.count("operator", action)
        if action == "redrive":
            self.redrive(task_id)
        elif action == "forget":
            self.forget(task_id)
        else:
            self.cancel(task_id, action == "cancel-unknown-too")

    def cancel(self, task_id: str, unknown_too: bool) -> None:
        """``celery fenced cancel``: a fenced REVOKED with a fresh token."""
        taken: list[int] = []

        def revoked_meta(token: int) -> bytes:
            taken.append(token)
            return f'{{"status": "REVOKED", "result": null, "task_id": "{task_id}", "fence_token": {token}}}'.encode()

        answer = self.store.cancel(task_id, revoked_meta, expires_ms=0, unknown_too=unknown_too)
        self.count("cancel", answer.code)
        self.model.cancelled(task_id, answer.code.value, taken[0], unknown_too)

    def redrive(self, task_id: str) -> None:
        """``celery fenced redrive``: an ABANDONED task back for a fresh set of takeovers."""
        code = self.store.redrive(task_id)
        self.count("redrive", code)
        self.model.redriven(task_id, code.value)

    def forget(self, task_id: str) -> None:
        """``AsyncResult.forget()``: the backend's forget (``forget.lua``): the result goes, a
        finished task's fence stays as a tombstone."""
        code = self.store.forget(task_id, keep_ms=FORGET_KEEP_MS)
        self.count("forget", code)
        self.model.forgotten(task_id, code.value)

    # -- what happens to the Redis ----------------------------------------------------------

    def heartbeats_tick(self) -> None:
        """Every owner that has not been told it lost its lease ticks its heartbeat: it renews, and writes a missing lease back (given up, once its
        own clock saw it run out). Before every loss: two losses are further apart than a
        heartbeat interval (the known hole below, HOLES, is two within one)."""
        if self.holes_open:
            return
        for owner in list(self.model.owners):
            if owner.token and owner.believes_live:
                self.renew(owner)
                if owner.believes_live and owner.lease_gone:
                    self.restore(owner, owner.expired, 0)

    @precondition(lambda self: self.losses)
    @rule()
    def flushdb(self) -> None:
        """FLUSHDB of the lease database (or a restart of a Redis that kept no data)."""
        self.heartbeats_tick()
        leases = {task_id: self.lease_fields(task_id) for task_id in TASK_IDS}
        self.client.flushdb()
        self.count("flushdb")
        self.model.flushed(leases)

    @precondition(lambda self: self.losses)
    @rule(task_id=st.sampled_from(TASK_IDS))
    def evict_lease(self, task_id: str) -> None:
        """The task's lease hash alone is evicted (``allkeys-*``), its result kept."""
        self.heartbeats_tick()
        fields = self.lease_fields(task_id)
        self.client.delete(KEYS.lease(task_id))
        self.count("evict_lease", fields.get("status", "none"))
        self.model.lease_lost(task_id, fields, whole=False)

    @precondition(lambda self: self.losses)
    @rule(task_id=st.sampled_from(TASK_IDS))
    def evict_result(self, task_id: str) -> None:
        """The task's result key alone is evicted, its lease hash kept."""
        self.heartbeats_tick()
        gone = self.client.delete(KEYS.result(task_id))
        self.count("evict_result", gone)
        if gone:
            self.model.result_lost(task_id)

    @precondition(lambda self: self.losses)
    @rule()
    def keys_expire(self) -> None:
        """Time passes past every expiry a key has (a result's, a finished lease's, a
        forgotten task's tombstone): those keys are gone, as the server removes them."""
        self.heartbeats_tick()
        for task_id in TASK_IDS:
            lease, result = KEYS.lease(task_id), KEYS.result(task_id)
            if self.client.pttl(lease) > 0:
                fields = self.lease_fields(task_id)
                self.client.delete(lease)
                self.count("keys_expire", "lease")
                self.model.lease_lost(task_id, fields, whole=False)
            if self.client.pttl(result) > 0:
                self.client.delete(result)
                self.count("keys_expire", "result")
                self.model.result_lost(task_id)
        self.count("keys_expire")

    @rule(action=st.sampled_from(["lost", "evicted", "failover-1", "failover-3"]))
    def counter_moves(self, action: str) -> None:
        """The token counter lost or moved back (one rule for the three ways)."""
        self.count("counter_moves", action)
        if action == "lost":
            self.counter_lost()
        elif action == "evicted":
            self.counter_evicted()
        else:
            self.failover(int(action[-1]))

    def counter_lost(self) -> None:
        """A first failover to a replica that never received the counter (nor its epoch)."""
        self.client.delete(KEYS.token, KEYS.token_epoch)
        self.count("counter_lost")
        self.model.counter_lost()

    def counter_evicted(self) -> None:
        """The token counter alone gone, its epoch kept: evicted under an ``allkeys-*``
        maxmemory policy, or deleted by hand."""
        self.client.delete(KEYS.token)
        self.count("counter_evicted")
        self.model.counter_lost()

    def failover(self, lost: int) -> None:
        """A failover that lost the counter's last increments: another server's epoch."""
        counter = int(self.client.get(KEYS.token) or 0)
        if counter > lost:
            self.client.set(KEYS.token, counter - lost)
        else:  # it never received the counter
            self.client.delete(KEYS.token)
        self.client.set(KEYS.token_epoch, "0" * 40)
        self.count("failover")
        self.model.failed_over()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def redis_agrees_with_the_truth(self) -> None:
        """What Redis holds says no more than the truth lets it: a live lease only for the
        task's newest owner, a result no older owner's and never of a lower fence than the one
        it replaced; a finished task still finished."""
        pipe = self.client.pipeline(transaction=False)
        for task_id in TASK_IDS:
            pipe.hgetall(KEYS.lease(task_id))
            pipe.get(KEYS.result(task_id))
        read = pipe.execute()
        for n, task_id in enumerate(TASK_IDS):
            fields = {as_text(name): as_text(value) for name, value in read[2 * n].items()}
            self.model.check_redis(task_id, fields, read[2 * n + 1])


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


def machine_settings(examples: int, shrink: bool = True) -> settings:
    """A derandomized run of ``examples`` sequences (no example database: the same run each
    time); without ``shrink``, the first failing sequence is reported as found."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        stateful_step_count=STEPS,
        derandomize=True,
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class ProtocolWithoutLosses(ProtocolMachine):
    """The machine whose store never loses data (the protocol's every other path)."""

    losses = False


def report_coverage(before: Counter[tuple[str, str]], machine: type[ProtocolMachine], capsys: object) -> None:
    """Print how often each rule ran (and with which answers) in one run, and fail on a rule
    that never ran: it checked nothing."""
    ran = COVERAGE - before
    per_rule: dict[str, dict[str, int]] = {}
    for (name, answer), times in sorted(ran.items()):
        per_rule.setdefault(name, {})[answer or "-"] = times
    lines = [f"{machine.__name__}: rule coverage (times run, by answer)"]
    for name, answers in per_rule.items():
        total = sum(answers.values())
        lines.append(f"  {name:<17} {total:>5}  " + ", ".join(f"{a} {n}" for a, n in answers.items()))
    with capsys.disabled():  # type: ignore[attr-defined]
        print("\n" + "\n".join(lines))
    never = sorted(rule for rule in machine.rule_names() if rule not in per_rule)
    assert not never, f"rules that never ran: {never}"


def run_machine(machine: type[ProtocolMachine], client: redis.Redis, capsys: object) -> None:
    machine.client = client
    before = COVERAGE.copy()
    run_state_machine_as_test(machine, settings=machine_settings(EXAMPLES))
    report_coverage(before, machine, capsys)


@pytest.mark.timeout(3600)
def test_the_lease_protocol_against_its_model(model_client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    """Every path of the protocol while the store keeps its data."""
    run_machine(ProtocolWithoutLosses, model_client, capsys)


@pytest.mark.timeout(3600)
def test_the_lease_protocol_against_its_model_through_data_loss(
    model_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same, with FLUSHDB, evicted and expired keys among the steps (§4.10)."""
    run_machine(ProtocolMachine, model_client, capsys)


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
        [("deliver", {}), ("flushdb", {}), ("write", {"owner": OWNER + "0", "state": "SUCCESS"})],
        id="issue-51-a-write-without-its-lease-after-flushdb",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("time_passes", {}),
            ("claim", {}),
            ("deliver", {}),
            ("flushdb", {}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ],
        id="issue-51-the-stale-owner-wins-after-flushdb",
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


class ThroughTheHoles(ProtocolMachine):
    """The machine that goes through the known holes (:data:`HOLES`)."""

    holes_open = True


#: The known holes of the scripts: sequences the fixed scripts still get wrong, which the runs
#: above keep out of (:attr:`ProtocolMachine.holes_open`). Each ends with a stale owner's
#: result stored over the newest owner's run (its write-back tolerated, to show what lands).
HOLES = [
    pytest.param(
        [
            ("deliver", {}),
            ("runs_out_and_claim", {"grace": False}),
            ("flushdb", {}),
            ("restore", {"owner": OWNER + "0", "lapsed": True}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ],
        id="a-taken-over-owner-writes-back-its-lease-given-up-after-flushdb",
    ),
    pytest.param(
        [
            ("deliver", {}),
            ("flushdb", {}),
            ("deliver", {}),
            ("flushdb", {}),
            ("restore", {"owner": OWNER + "0"}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ],
        id="two-losses-within-a-heartbeat-interval",
        marks=pytest.mark.xfail(
            strict=True,
            raises=violation_class("stale-write-landed"),
            reason="the older owner never ticked between the two losses: nothing in Redis remembers "
            "the newer owner, and the older one's renewal is less than a TTL ago",
        ),
    ),
]


@pytest.mark.parametrize("steps", HOLES)
def test_a_known_hole(model_client: redis.Redis, steps: list[tuple[str, dict]]) -> None:
    run_sequence(ThroughTheHoles, model_client, steps, tolerate="stale-restore,live-lease-not-newest")


@pytest.mark.parametrize("steps", COUNTEREXAMPLES)
def test_a_sequence_that_broke_the_contract(model_client: redis.Redis, steps: list[tuple[str, dict]]) -> None:
    run_sequence(ProtocolMachine, model_client, steps)


def run_sequence(
    machine_class: type[ProtocolMachine], client: redis.Redis, steps: list[tuple[str, dict]], tolerate: str = ""
) -> None:
    """Replay ``steps`` on a machine of ``machine_class``, the invariants after each."""
    machine_class.client = client
    machine = machine_class()
    machine.violations.tolerated |= {name for name in tolerate.split(",") if name}
    owners: list[Owner] = []
    defaults = {"task_id": TASK_IDS[0], "replacement": False, "unknown_too": False, "lapsed": False, "grace": False}
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
            machine.redis_agrees_with_the_truth()
    finally:
        machine.teardown()
