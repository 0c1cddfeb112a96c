"""The Celery app the integration tests run in real worker processes.

Settings come from the environment (the test fixtures set them): ``FENCED_TEST_BROKER_URL``,
``FENCED_TEST_BACKEND_URL``, ``FENCED_TEST_RECORD_URL`` (where bodies record their runs)
and ``FENCED_TEST_SETTINGS`` (JSON of extra settings).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_fenced import LeaseLostError, ProgressLeasedTask, install
from celery_fenced._celery.compat import CELERY_VERSION
from celery_fenced._worker.attempt import attempt_of
from celery_fenced.exceptions import LeaseInterrupted

app = Celery("fenced_app")
app.conf.update(
    broker_url=os.environ.get("FENCED_TEST_BROKER_URL", "redis://127.0.0.1:6379/0"),
    result_backend=os.environ.get("FENCED_TEST_BACKEND_URL", "fenced+redis://127.0.0.1:6379/1"),
    worker_prefetch_multiplier=1,
    task_track_started=True,
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    fenced_lease_ttl=3,
    fenced_heartbeat_interval=0.5,
    fenced_default_stage_timeout=2,
    fenced_stage_timeouts={"slow-stage": 30, "load-data": 2},
    fenced_reaper_interval=1,
    fenced_requeue_timeout=5,
)
if app.conf.broker_url.startswith(("redis", "sentinel")) and CELERY_VERSION >= (5, 6):
    # Take a message only when a process is free: a worker whose only process is stuck
    # must not hold the re-sent message in its prefetch buffer (see docs/guarantees).
    app.conf.worker_disable_prefetch = True
else:
    # RabbitMQ, and Celery 5.5: worker_disable_prefetch is Redis-only, and Celery 5.6's. Late
    # acks keep the running message counted against the prefetch limit, so a stuck process
    # holds no second message.
    app.conf.task_acks_late = True
app.conf.update(json.loads(os.environ.get("FENCED_TEST_SETTINGS", "{}")))
if os.environ.get("FENCED_TEST_HOLD_BEFORE_LEASE"):
    # The fault: a process that accepted a task is held before it takes the lease (connected
    # before install(), so it runs before the fenced task_prerun receiver), for the test to
    # kill it there.
    @signals.task_prerun.connect(weak=False)
    def hold_before_lease(task_id: str | None = None, **_: Any) -> None:
        record().set(f"before-lease:{task_id}", os.getpid())
        wait_for_key(f"release-before-lease:{task_id}", 60)


if os.environ.get("FENCED_TEST_FREEZE_ON_PUBLISH"):
    # The fault: a process that publishes a message whose parent is a task id named by the key
    # ``freeze-publish:<parent id>`` stops itself (SIGSTOP) right before the message goes out,
    # once: an owner frozen between its last lease check and the send of its callbacks or its
    # chain's next step (a VM pause, a GC pause, a broker that holds the publish).
    # ``freeze-publish-of:<task id>`` does the same for a message of that task id itself (a
    # retry's message). ``exit-on-publish-of:<task id>`` raises SystemExit there instead (a
    # BaseException escaping the send: an interrupt, gevent's hard time limit).
    @signals.before_task_publish.connect(weak=False)
    def freeze_before_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
        parent, own = (headers or {}).get("parent_id"), (headers or {}).get("id")
        if own and record().delete(f"exit-on-publish-of:{own}"):
            raise SystemExit("raised as the message is sent")
        if parent and record().delete(f"freeze-publish:{parent}"):
            record().rpush(f"frozen-publish:{parent}", os.getpid())
            os.kill(os.getpid(), signal.SIGSTOP)
        elif own and record().delete(f"freeze-publish-of:{own}"):
            record().rpush(f"frozen-publish-of:{own}", os.getpid())
            os.kill(os.getpid(), signal.SIGSTOP)

    # ``kill-after-publish:<parent id>``: the process that published a message whose parent is
    # that task id is killed (SIGKILL: an OOM kill) right after the publish, once.
    @signals.after_task_publish.connect(weak=False)
    def kill_after_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
        parent = (headers or {}).get("parent_id")
        if parent and record().delete(f"kill-after-publish:{parent}"):
            os.kill(os.getpid(), signal.SIGKILL)


install(app)
if os.environ.get("FENCED_TEST_TRACE_FILE"):
    from tests.integration.apps import traced  # noqa: F401 (OpenTelemetry, for the tracing test)

_record: redis.Redis | None = None


def record() -> redis.Redis:
    """The client of the database where bodies record what they did."""
    global _record
    if _record is None or _record.connection_pool.pid != os.getpid():
        _record = redis.Redis.from_url(os.environ.get("FENCED_TEST_RECORD_URL", "redis://127.0.0.1:6379/2"))
    return _record


def attempt_number(task: Any) -> int:
    """Which execution of its task id this attempt is (0 without a lease)."""
    attempt = attempt_of(task.request)
    return attempt.lease.attempt if attempt is not None and attempt.lease is not None else 0


def note_run(task: Any, **extra: Any) -> None:
    entry = {
        "pid": os.getpid(),
        "hostname": task.request.hostname,
        "token": task.fencing_token,
        "attempt": attempt_number(task),
        "started": time.time(),
        **extra,
    }
    record().rpush(f"runs:{task.request.id}", json.dumps(entry))


def interruption(exc: BaseException) -> str:
    """What stopped a body, as the tests read it: ``"LeaseInterrupted"`` for the interrupt."""
    return "LeaseInterrupted" if isinstance(exc, LeaseInterrupted) else type(exc).__name__


def wait_for_key(key: str, timeout: float) -> bool:
    """Block (without progress) until ``key`` exists: the test decides when a zombie wakes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if record().exists(key):
            return True
        time.sleep(0.05)
    return False


@app.task(bind=True, base=ProgressLeasedTask)
def stuck_downstream(self: Any) -> str:
    """The first attempt blocks in a socket read that never returns (a downstream outage)."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        try:
            redis.Redis.from_url(os.environ["FENCED_TEST_RECORD_URL"]).blpop([f"never:{self.request.id}"], timeout=0)
        except BaseException as exc:
            record().rpush(
                f"interrupted:{self.request.id}",
                interruption(exc),
            )
            raise
    return f"owner {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def steady(self: Any, steps: int, pause: float) -> str:
    """Progresses ``steps`` times, ``pause`` seconds apart."""
    note_run(self)
    for i in range(steps):
        time.sleep(pause)
        self.progress("load-data", step=i)
    return f"done by {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def zombie_once(self: Any, label: str = "") -> str:
    """The first attempt reports one stage, then blocks without progress until told to wake."""
    note_run(self)
    self.progress("load-data")
    runs = record().llen(f"runs:{self.request.id}")
    if runs == 1:
        wait_for_key(f"wake:{self.request.id}", 60)
        try:
            self.progress("persist-result")
        except (LeaseLostError, LeaseInterrupted) as exc:
            record().rpush(f"lost:{self.request.id}", exc.reason)
        return f"zombie {label}"
    return f"owner {self.fencing_token} {label}"


@app.task(bind=True, base=ProgressLeasedTask)
def blocked_until_interrupted(self: Any) -> str:
    """The first attempt loops in Python without progress; later attempts return at once."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        try:
            for _ in range(600):
                time.sleep(0.1)
        except BaseException as exc:
            record().rpush(
                f"interrupted:{self.request.id}",
                interruption(exc),
            )
            raise
        return "not interrupted"
    return "owner"


@app.task(bind=True, base=ProgressLeasedTask)
def ends_in_another_stage(self: Any) -> str:
    """Renewed in one stage, then ends in the next before another heartbeat tick."""
    note_run(self)
    self.progress("load-data", rows=3)
    time.sleep(1.2)  # two heartbeat ticks: the attempt is announced with its first stage
    self.progress("persist-result", rows=3, saved=True)
    return "saved"


@app.task(bind=True, base=ProgressLeasedTask)
def swallows_errors(self: Any) -> str:
    """The first attempt retries a failing call for ever, swallowing every ``Exception`` of it."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        try:
            for _ in range(600):
                try:
                    time.sleep(0.1)  # a database call, say, that fails now and then
                except Exception:  # what real bodies do around such a call
                    record().rpush(f"swallowed:{self.request.id}", 1)
                    continue
        except BaseException as exc:
            record().rpush(f"interrupted:{self.request.id}", interruption(exc))
            raise
        return "not interrupted"
    return "owner"


@app.task(bind=True, base=ProgressLeasedTask)
def shielded_block(self: Any) -> str:
    """The first attempt is lost inside a shielded block: the interrupt waits for its end."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        try:
            with self.shield():
                wait_for_key(f"wake:{self.request.id}", 60)  # the block no interrupt may cut
                record().rpush(f"shielded:{self.request.id}", "block finished")
            for _ in range(600):
                time.sleep(0.1)
        except BaseException as exc:
            record().rpush(f"interrupted:{self.request.id}", interruption(exc))
            raise
        return "not interrupted"
    return "owner"


@app.task(bind=True, base=ProgressLeasedTask)
def slow_stage(self: Any, quiet: float) -> str:
    """Enters a stage with a long deadline and stays quiet for ``quiet`` seconds."""
    note_run(self)
    self.progress("SLOW_STAGE")
    time.sleep(quiet)
    self.progress("persist-result")
    return "slow ok"


@app.task(bind=True, base=ProgressLeasedTask)
def killed_once(self: Any) -> str:
    """The first attempt waits to be killed (SIGKILL of its process) while progressing."""
    note_run(self)
    if record().llen(f"runs:{self.request.id}") == 1:
        for _ in range(600):
            self.progress("load-data")
            time.sleep(0.1)
    return f"finished by {os.getpid()}"


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def chain_step(self: Any, name: str) -> str:
    """A chain link that records its runs under its own name."""
    note_run(self)
    record().rpush(f"chain:{name}", self.request.id)
    self.progress("load-data")
    if name.startswith("zombie") and record().llen(f"runs:{self.request.id}") == 1:
        wait_for_key(f"wake:{self.request.id}", 60)
    return name


@app.task(bind=True, base=ProgressLeasedTask)
def bad_details(self: Any) -> list[str]:
    """Reports good details, then details no checkpoint can hold (each refused at the call),
    then progresses without details until told, so the test can read what was published."""
    self.progress("load-data", done=1)
    refused = []
    for details in ({"payload": object()}, {"ratio": float("nan")}, {"text": "x" * 5000}):
        try:
            self.progress("load-data", **details)
        except (TypeError, ValueError) as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    deadline = time.monotonic() + 30
    while not record().exists(f"wake:{self.request.id}") and time.monotonic() < deadline:
        self.progress("load-data")
        time.sleep(0.1)
    return refused


@app.task(bind=True, base=ProgressLeasedTask)
def unknown_stage(self: Any) -> str:
    """Uses a stage missing from the table."""
    self.progress("not-in-the-table")
    time.sleep(0.8)
    self.progress("not-in-the-table")
    self.progress("laod_data")  # a typo of "load-data"
    time.sleep(0.8)
    return "ok"


@app.task(bind=True, base=ProgressLeasedTask, on_stall="alert")
def alert_stall(self: Any, quiet: float) -> str:
    """An alert-mode task that stalls for ``quiet`` seconds, then finishes."""
    note_run(self)
    self.progress("load-data")
    time.sleep(quiet)
    self.progress("persist-result")
    return "alert ok"


@app.task(bind=True, base=ProgressLeasedTask, on_stall="expire", interrupt_on_loss=False)
def expire_stall(self: Any) -> str:
    """An expire-mode task whose first attempt stalls until told to wake."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        wait_for_key(f"wake:{self.request.id}", 60)
        return "zombie"
    return f"owner {self.fencing_token}"


@app.task
def plain_add(x: int, y: int) -> int:
    """A plain Celery task through the fenced backend."""
    return x + y


@app.task(bind=True, base=ProgressLeasedTask)
def fenced_add(self: Any, x: int, y: int) -> int:
    """A short fenced task for groups and chords."""
    self.progress("load-data")
    return x + y


@app.task(bind=True, base=ProgressLeasedTask)
def fenced_sum(self: Any, values: list[int]) -> int:
    """A chord body."""
    self.progress("load-data")
    return sum(values)


@app.task(bind=True, base=ProgressLeasedTask)
def failing(self: Any) -> None:
    """Raises: the FAILURE is stored with the token and ends the lease."""
    note_run(self)
    raise ValueError("boom")


@app.task(bind=True, base=ProgressLeasedTask, default_retry_delay=1)
def retry_once(self: Any) -> str:
    """Retries once, then succeeds: the retried run acquires anew."""
    note_run(self)
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    return f"retried {self.request.retries} token {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def retry_in(self: Any, seconds: float) -> str:
    """Retries once with ``countdown=seconds``, then succeeds."""
    note_run(self)
    if self.request.retries == 0:
        raise self.retry(countdown=seconds)
    return "retried"


@app.task(bind=True, base=ProgressLeasedTask)
def ignoring(self: Any) -> None:
    """Ends without a result (Ignore)."""
    from celery.exceptions import Ignore

    note_run(self)
    raise Ignore()


@app.task(bind=True, base=ProgressLeasedTask, ignore_result=True)
def result_ignored(self: Any) -> str:
    """Its result is not stored: the lease still ends DONE."""
    note_run(self)
    self.progress("load-data")
    return "ignored"


@app.task(bind=True, base=ProgressLeasedTask, max_task_duration=2)
def endless(self: Any) -> str:
    """Progresses forever: only fenced_max_task_duration ends it."""
    note_run(self)
    try:
        for _ in range(300):
            self.progress("load-data")
            time.sleep(0.1)
    except (LeaseLostError, LeaseInterrupted) as exc:
        record().rpush(f"lost:{self.request.id}", exc.reason)
        raise
    return "never"


@app.task(bind=True, base=ProgressLeasedTask)
def progress_until_told(self: Any) -> str:
    """Progresses until a key is set (so a test can look at it while it runs)."""
    note_run(self)
    deadline = time.monotonic() + 60
    polls = 0
    while not record().exists(f"wake:{self.request.id}") and time.monotonic() < deadline:
        polls += 1
        self.progress("load-data", polls=polls, note="é")
        time.sleep(0.1)
    return f"told {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def batches(self: Any, total: int, stall_after: int = 0, pause: float = 0.0) -> str:
    """Processes batches ``done + 1 .. total``, resuming from its checkpoint's ``done``.

    Each batch's execution is recorded under ``batches:<task id>`` with the token that ran it.
    The first attempt blocks without progress after batch ``stall_after`` until woken, then
    tries to report progress again, as a zombie would.
    """
    checkpoint = self.checkpoint
    done = int(checkpoint.details.get("done", 0)) if checkpoint is not None else 0
    seen = (
        None
        if checkpoint is None
        else [checkpoint.stage, dict(checkpoint.details), checkpoint.attempt, checkpoint.token]
    )
    note_run(self, resumed_from=done, checkpoint=seen)
    for batch in range(done + 1, total + 1):
        time.sleep(pause)
        record().rpush(f"batches:{self.request.id}", json.dumps([batch, self.fencing_token]))
        self.progress("process", done=batch)
        if batch == stall_after and attempt_number(self) == 1:
            wait_for_key(f"wake:{self.request.id}", 60)
            try:
                self.progress("process", done=99)
            except (LeaseLostError, LeaseInterrupted) as exc:
                record().rpush(f"lost:{self.request.id}", exc.reason)
            return "zombie"
    return f"{total} batches by {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False, stage_timeouts={"call-api": 120})
def long_call(self: Any) -> str:
    """Its own deadline (120 s, not the app's): the first attempt reports ``call-api``, then
    waits for ``wake:<task id>`` without progress, well within that deadline, and returns."""
    note_run(self)
    self.progress("call-api")
    if attempt_number(self) == 1:
        record().rpush(f"waiting:{self.request.id}", os.getpid())
        wait_for_key(f"wake:{self.request.id}", 60)
        return "the first owner"
    return f"owner {self.fencing_token}"


#: ``reported_then_busy``'s heartbeat interval: long enough that no renewal comes between its
#: reports and a test's kill, unless the worker's stop sends one.
SLOW_HEARTBEAT = 8


@app.task(
    bind=True,
    base=ProgressLeasedTask,
    heartbeat_interval=SLOW_HEARTBEAT,
    lease_ttl=2 * SLOW_HEARTBEAT + 1,
    stage_timeouts={"process": 120},
)
def reported_then_busy(self: Any, total: int) -> str:
    """Reports batches 1 .. ``total`` at once (far faster than its heartbeat), each recorded
    under ``reported:<task id>``, then, on its first attempt, works on without reporting until
    woken (or killed). A later attempt returns where its checkpoint says it resumes."""
    checkpoint = self.checkpoint
    seen = (
        None
        if checkpoint is None
        else [checkpoint.stage, dict(checkpoint.details), checkpoint.attempt, checkpoint.token]
    )
    note_run(self, checkpoint=seen)
    if checkpoint is not None:
        return f"resumed after batch {checkpoint.details.get('done', 0)}"
    for batch in range(1, total + 1):
        self.progress("process", done=batch)
        record().rpush(f"reported:{self.request.id}", batch)
    wait_for_key(f"wake:{self.request.id}", 120)
    return "finished where it started"


@app.task(bind=True, base=ProgressLeasedTask)
def retried_from_checkpoint(self: Any) -> str:
    """Reports a page, then retries once; the retry records the checkpoint it was given."""
    checkpoint = self.checkpoint
    seen = (
        None
        if checkpoint is None
        else [checkpoint.stage, dict(checkpoint.details), checkpoint.attempt, checkpoint.token]
    )
    note_run(self, retries=self.request.retries, checkpoint=seen)
    if self.request.retries == 0:
        self.progress("fetch", page=3)
        raise self.retry(countdown=0)
    return "retried"


@app.task(bind=True, base=ProgressLeasedTask)
def progress_steps(self: Any, steps: int, pause: float) -> str:
    """Progresses ``steps`` times; records why, if its lease is lost on the way."""
    note_run(self)
    try:
        for i in range(steps):
            time.sleep(pause)
            self.progress("load-data", step=i)
    except (LeaseLostError, LeaseInterrupted) as exc:
        record().rpush(f"lost:{self.request.id}", exc.reason)
        raise
    return f"steps by {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask, max_takeovers=20)
def soak(self: Any, index: int, stall: bool) -> str:
    """The chaos soak's task: a few stages; the first attempt of some stalls (a zombie)."""
    note_run(self)
    first = record().llen(f"runs:{self.request.id}") == 1
    try:
        self.progress("load-data")
        time.sleep(0.2)
        if stall and first:
            wait_for_key("soak:wake", 120)  # a zombie until the test wakes them all
        self.progress("call-ai")
        time.sleep(0.2)
        self.progress("persist-result")
    except (LeaseLostError, LeaseInterrupted) as exc:
        record().rpush(f"lost:{self.request.id}", exc.reason)
        raise
    record().rpush(f"completed:{self.request.id}", self.fencing_token)
    return f"{index} by {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def stream_ai(self: Any, url: str, inject: str, first: float, idle: float, total: float) -> list[str]:
    """Streams from the stand-in AI provider inside ``self.stream(...)``."""
    import httpx

    note_run(self)
    attempt = record().llen(f"runs:{self.request.id}")
    chunks: list[str] = []
    try:
        with self.stream("call-ai", first_token_timeout=first, idle_timeout=idle, total_timeout=total) as stream:
            params = {"report": self.request.id, "inject": inject if attempt == 1 else ""}
            with httpx.stream("GET", f"{url}/v1/stream", params=params, timeout=None) as response:
                for line in stream.wrap(response.iter_lines()):
                    if line:
                        chunks.append(line)
    except (LeaseLostError, LeaseInterrupted) as exc:
        record().rpush(f"lost:{self.request.id}", exc.reason)
        raise
    return chunks


# -- Celery's own features on fenced tasks -----------------------------------------------------


@app.task(bind=True, base=ProgressLeasedTask)
def replaced_by(self: Any, kind: str) -> Any:
    """Replaces itself: by a fenced task, a plain task, a chain or a group."""
    from celery import chain, group

    note_run(self)
    self.progress("load-data")
    if kind == "fenced":
        return self.replace(fenced_add.s(2, 3))
    if kind == "plain":
        return self.replace(plain_add.s(20, 3))
    if kind == "queued":  # a replacement that waits in a queue no worker consumes yet
        return self.replace(fenced_add.s(2, 3).set(queue="later"))
    if kind == "unsendable":  # a replacement whose message cannot be sent (its argument is no JSON)
        return self.replace(replacement_run.s(self.request.id, object()))
    if kind == "chain":  # the chain's last task runs under the task id
        return self.replace(chain(fenced_add.s(1, 1), fenced_add.s(3)))
    return self.replace(group(fenced_add.s(1, 1), plain_add.s(2, 2)))


@app.task
def plain_failing() -> None:
    """A plain task that raises."""
    raise ValueError("plain boom")


@app.task(bind=True, base=ProgressLeasedTask, acks_late=True)
def rejecting(self: Any, requeue: bool) -> None:
    """Rejects its message (late ack: a requeued message goes back to the queue)."""
    from celery.exceptions import Reject

    note_run(self)
    if requeue and record().llen(f"runs:{self.request.id}") > 1:
        return None
    raise Reject("not for me", requeue=requeue)


@app.task(bind=True, base=ProgressLeasedTask)
def write_row(self: Any, key: str) -> str:
    """Fences its own write of ``key``; a newer token may have written it already."""
    from celery_fenced.fencing import fenced_set

    note_run(self)
    fenced_set(record(), key, f"by {self.fencing_token}", self.fencing_token)
    return "written"


@app.task(bind=True, base=ProgressLeasedTask, max_takeovers=0, interrupt_on_loss=False)
def abandoned_then_progresses(self: Any) -> str:
    """The first attempt stalls (no progress until woken) and is abandoned at once; a later
    attempt (after a redrive) progresses until ``told:<id>`` is set."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        wait_for_key(f"wake:{self.request.id}", 60)
        return "zombie"
    deadline = time.monotonic() + 60
    while not record().exists(f"told:{self.request.id}") and time.monotonic() < deadline:
        try:
            self.progress("call-ai")
        except LeaseLostError as exc:
            record().rpush(f"lost:{self.request.id}", exc.reason)
            return "lost"
        time.sleep(0.1)
    return f"told {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask, max_takeovers=1, interrupt_on_loss=False)
def always_stalls(self: Any) -> str:
    """Every attempt stalls without progress: taken over until abandoned."""
    note_run(self)
    self.progress("load-data")
    wait_for_key(f"wake:{self.request.id}", 60)
    return "woke"


@app.task
def record_errback(request: Any, exc: Any, traceback: Any) -> None:
    """An errback (new style): records which task failed with what."""
    record().rpush(f"errback:{request.id}", type(exc).__name__)


@app.task(bind=True)
def bound_errback_of_task_id(self: Any, task_id: str) -> None:
    """A bound errback. Celery's rule: a bound task (``bind=True``) is always an old-style
    errback, sent as a task of its own with the failed task's id as its one argument, whatever
    else its signature says (only an unbound one with more arguments, as :func:`record_errback`,
    is called with the request, the exception and the traceback)."""
    record().rpush(f"bound-errback:{task_id}", json.dumps({"errback": self.name, "task_id": task_id}))


@app.task(
    bind=True,
    base=ProgressLeasedTask,
    autoretry_for=(ConnectionError,),
    retry_backoff=1,
    retry_backoff_max=1,
    retry_jitter=False,
    max_retries=3,
)
def autoretried(self: Any) -> str:
    """Fails with a ConnectionError twice: Celery's ``autoretry_for`` retries it, each retry
    after the backoff (1 s: ``retry_backoff=1`` capped by ``retry_backoff_max=1``)."""
    note_run(self, retries=self.request.retries)
    self.progress("load-data")
    if self.request.retries < 2:
        raise ConnectionError("the service is down")
    return f"ran after {self.request.retries} retries"


@app.task(bind=True, base=ProgressLeasedTask, time_limit=7, interrupt_on_loss=False)
def stalls_into_time_limit(self: Any) -> str:
    """The first attempt stalls until its hard time limit kills it; the next progresses past it."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        wait_for_key(f"wake:{self.request.id}", 60)
        return "zombie"
    for _ in range(25):  # 5 s of progress (below its own limit): the first attempt's limit fires meanwhile
        time.sleep(0.2)
        self.progress("load-data")
    return f"owner {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask, lease_ttl=1.5, heartbeat_interval=0.3)
def short_lease(self: Any, steps: int) -> str:
    """A task whose own TTL is far below the app's heartbeat interval."""
    note_run(self)
    for _ in range(steps):
        time.sleep(0.2)
        self.progress("load-data")
    return f"short {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def retry_now(self: Any) -> str:
    """Retries once with countdown=0, then succeeds.

    Between sending the retry message and raising it (after which Celery stores RETRY) it
    pauses, as a slow process would: the retry message arrives before the RETRY write.
    """
    note_run(self, retries=self.request.retries)
    if self.request.retries == 0:
        retry = self.retry(countdown=0, throw=False)
        time.sleep(1)
        raise retry
    return f"retried {self.request.retries}"


@app.task(bind=True, base=ProgressLeasedTask)
def updates_another(self: Any, other_id: str) -> str:
    """Writes a custom state for another task id, then finishes its own work."""
    note_run(self)
    self.update_state(task_id=other_id, state="PROGRESS", meta={"by": self.request.id})
    for _ in range(5):
        time.sleep(0.1)
        self.progress("load-data")
    return f"mine {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def fenced_failing_once(self: Any) -> str:
    """Fails on its first run, succeeds on the others (each run is recorded)."""
    note_run(self)
    if len(record().lrange(f"runs:{self.request.id}", 0, -1)) == 1:
        raise ValueError("first run fails")
    return "ok"


def wait_on_a_socket(seconds: float) -> None:
    """Wait ``seconds`` for a byte that never comes, in a socket read (a slow downstream call)."""
    reader, writer = socket.socketpair()
    try:
        reader.settimeout(seconds)
        with contextlib.suppress(TimeoutError):
            reader.recv(1)
    finally:
        reader.close()
        writer.close()


@app.task(bind=True, base=ProgressLeasedTask)
def socket_waits(self: Any, waits: int, seconds: float) -> str:
    """Waits on a socket ``waits`` times, ``seconds`` each, with progress after each wait."""
    note_run(self)
    for _ in range(waits):
        wait_on_a_socket(seconds)
        self.progress("load-data")
    return f"waited by {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def hogs_the_hub(self: Any, seconds: float) -> str:
    """The first attempt progresses until told to wake, then runs Python code that never yields
    for ``seconds`` (on gevent, the whole hub is blocked); later attempts return at once."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        while not record().exists(f"wake:{self.request.id}"):
            time.sleep(0.1)
            self.progress("load-data")
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            pass
        self.progress("persist-result")
        return "the hog"
    return f"owner {self.fencing_token}"


# -- bodies that never finish: time limits, revoke, cold shutdown, SystemExit ------------------


def _progress_for(task: Any, seconds: float) -> None:
    """Progress every 0.1 s for ``seconds`` (a healthy body, as long as it is left to run)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if task is not None:
            task.progress("load-data")


@app.task(bind=True, base=ProgressLeasedTask)
def healthy_for(self: Any, seconds: float) -> str:
    """Progresses for ``seconds``; each run is recorded (a run started again reruns it all)."""
    note_run(self)
    _progress_for(self, seconds)
    record().rpush(f"finished:{self.request.id}", self.fencing_token)
    return f"healthy by {self.fencing_token}"


@app.task(bind=True)
def plain_healthy_for(self: Any, seconds: float) -> str:
    """A plain task that runs ``seconds``: what Celery itself stores, to compare with."""
    record().rpush(f"runs:{self.request.id}", json.dumps({"pid": os.getpid(), "started": time.time()}))
    _progress_for(None, seconds)
    return "plain healthy"


@app.task(bind=True, base=ProgressLeasedTask)
def exits_once(self: Any, kind: str) -> str:
    """The first run raises ``SystemExit`` (``kind`` "exit") or ``KeyboardInterrupt``; later runs return."""
    note_run(self)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        raise SystemExit(3) if kind == "exit" else KeyboardInterrupt()
    return f"finished by {self.fencing_token}"


@app.task(bind=True)
def plain_exits(self: Any, kind: str) -> str:
    """A plain task whose body raises ``SystemExit`` or ``KeyboardInterrupt``."""
    raise SystemExit(3) if kind == "exit" else KeyboardInterrupt()


# -- hand-off and forget --------------------------------------------------------------------------


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def replaced_after_hold(self: Any) -> Any:
    """Replaces itself by :func:`replacement_run`; the first attempt holds first, until told to
    wake (the test freezes its worker meanwhile). What each attempt's ``replace()`` did is recorded."""
    from celery.exceptions import Ignore

    note_run(self)
    self.progress("slow-stage")
    token = self.fencing_token
    task_id = self.request.id
    if record().llen(f"runs:{task_id}") == 1:
        record().rpush(f"holding:{task_id}", token)
        wait_for_key(f"wake:{task_id}", 60)
    try:
        return self.replace(replacement_run.s(task_id, token))
    except Ignore:
        record().rpush(f"replace-sent:{task_id}", token)
        raise
    except LeaseLostError:
        record().rpush(f"replace-refused:{task_id}", token)
        raise


@app.task(bind=True, base=ProgressLeasedTask)
def replacement_run(self: Any, task_id: str, from_token: int) -> int:
    """A replacement: records which owner's hand-off sent it."""
    record().rpush(f"replacement:{task_id}", f"from-token={from_token}")
    return from_token


@app.task(bind=True, base=ProgressLeasedTask)
def noted_add(self: Any, x: int, y: int) -> int:
    """A short fenced task that records each run of its body."""
    note_run(self)
    return x + y


@app.task(bind=True, base=ProgressLeasedTask, retry_on_worker_lost=True, default_retry_delay=4, max_retries=3)
def killed_then_retried(self: Any) -> str:
    """The first run kills its own process (SIGKILL: an OOM kill, say); Celery 5.7's
    ``retry_on_worker_lost`` retries it after ``default_retry_delay``. Each run records its
    ``retries``."""
    note_run(self, retries=self.request.retries)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return f"retried {self.request.retries}"


@app.task(bind=True, base=ProgressLeasedTask, max_retries=5)
def retry_with_cursor(self: Any, cursor: int, countdown: float) -> str:
    """Works through a cursor, one step per run: each run but the last retries with the next
    cursor (the work of the run done, the retry carries on from it)."""
    note_run(self, cursor=cursor, retries=self.request.retries)
    self.progress("load-data", cursor=cursor)
    if cursor < 1:
        raise self.retry(args=(cursor + 1, countdown), countdown=countdown)
    return f"cursor {cursor} after {self.request.retries} retries"


@app.task(bind=True, base=ProgressLeasedTask, time_limit=2, acks_late=True, acks_on_failure_or_timeout=False)
def over_time_first_run(self: Any) -> str:
    """The first run outlives its hard time limit; later runs return at once."""
    note_run(self)
    if record().llen(f"runs:{self.request.id}") == 1:
        for _ in range(100):
            time.sleep(0.1)
            self.progress("load-data")
    return "in time"


@app.task(bind=True, time_limit=2, acks_late=True, acks_on_failure_or_timeout=False)
def plain_over_time_first_run(self: Any) -> str:
    """:func:`over_time_first_run`, as a plain task."""
    record().rpush(f"runs:{self.request.id}", json.dumps({"pid": os.getpid()}))
    if record().llen(f"runs:{self.request.id}") == 1:
        time.sleep(10)
    return "in time"


@app.task(bind=True, base=ProgressLeasedTask)
def fails_when_woken(self: Any) -> None:
    """Progresses until told to wake, then does its side effect and fails: its own error."""
    note_run(self)
    deadline = time.monotonic() + 60
    while not record().exists(f"wake:{self.request.id}") and time.monotonic() < deadline:
        time.sleep(0.05)
        self.progress("load-data")
    self.progress("load-data")
    record().rpush(f"finished:{self.request.id}", self.fencing_token)
    raise ValueError("failed by its own error")


class SendsTwiceAfterBody(ProgressLeasedTask):
    """Sends ``chain_step("twice")`` under one task id twice from ``on_success`` (after the
    body returned), the second once the first has finished: as Celery runs a finished task id
    applied again, both sends run."""

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        child_id = f"{task_id}-child"
        chain_step.apply_async(("twice",), task_id=child_id)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.AsyncResult(child_id).state != "SUCCESS":
            time.sleep(0.05)
        chain_step.apply_async(("twice",), task_id=child_id)


@app.task(bind=True, base=SendsTwiceAfterBody)
def sends_twice_after_body(self: Any) -> str:
    """Its ``on_success`` sends one task id twice (:class:`SendsTwiceAfterBody`)."""
    note_run(self)
    return "sent"


@signals.after_task_publish.connect(weak=False)
def pause_after_sending_a_retry(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """The fault: the process that sent the retry of a task id named by the key
    ``pause-after-retry:<task id>`` pauses 1.5 s right after the send, once (a GC pause, a slow
    Redis): Celery's main process sends ``retry_on_worker_lost``'s retry before it stores RETRY."""
    task_id, retries = (headers or {}).get("id"), (headers or {}).get("retries") or 0
    if task_id and retries and record().delete(f"pause-after-retry:{task_id}"):
        time.sleep(1.5)


@app.task(bind=True, base=ProgressLeasedTask, retry_on_worker_lost=True, default_retry_delay=0, max_retries=3)
def killed_then_retried_at_once(self: Any) -> str:
    """:func:`killed_then_retried` with no retry delay."""
    note_run(self, retries=self.request.retries)
    self.progress("load-data")
    if record().llen(f"runs:{self.request.id}") == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return f"retried {self.request.retries}"


# -- hand-off faults --------------------------------------------------------------------------------


def note_replacement_run(task: Any, origin: str, name: str) -> None:
    """Record one run of a replacement's step, under the replaced task id ``origin``."""
    entry = {"name": name, "id": task.request.id, "token": getattr(task, "fencing_token", 0)}
    record().rpush(f"replacement-runs:{origin}", json.dumps(entry))


@app.task(bind=True, base=ProgressLeasedTask)
def replacement_step(self: Any, origin: str, name: str) -> str:
    """A fenced step of a replacement: records each run of its body."""
    note_replacement_run(self, origin, name)
    return name


@app.task(bind=True)
def plain_replacement_step(self: Any, origin: str, name: str) -> str:
    """A plain (not fenced) replacement: records each run of its body."""
    record().rpush(f"replacement-runs:{origin}", json.dumps({"name": name, "id": self.request.id, "token": 0}))
    return name


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def replaced_with(self: Any, kind: str) -> Any:
    """Replaces itself: by a fenced task (``kind`` "fenced"), a plain one ("plain"), or a chain of
    two fenced steps whose first has an id of its own ("chain"); each step records its runs.
    With the key ``vanish-before-replace:<task id>`` set, its lease hash is deleted right
    before ``replace()``."""
    from celery import chain

    note_run(self)
    self.progress("load-data")
    origin = self.request.id
    if record().delete(f"vanish-before-replace:{origin}"):
        # The fault: the lease hash vanishes (an eviction, a FLUSH, a failover that lost the
        # last writes) after the heartbeat's last renewal and before the hand-off.
        self.backend.client.delete(self.backend.lease_store.keys.lease(origin))
    if kind == "fenced":
        return self.replace(replacement_step.s(origin, "fenced"))
    if kind == "plain":
        return self.replace(plain_replacement_step.s(origin, "plain"))
    if kind == "queued-chain":  # the chain waits in a queue no worker consumes yet
        return self.replace(
            chain(
                replacement_step.si(origin, "first").set(queue="later"),
                replacement_step.si(origin, "last").set(queue="later"),
            )
        )
    return self.replace(chain(replacement_step.si(origin, "first"), replacement_step.si(origin, "last")))


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def replaced_twice(self: Any, level: int) -> Any:
    """Level 1 replaces itself by level 2, which replaces itself by :func:`replacement_step`.
    The first run of level 2 holds first (no progress, in a stage with a long deadline) until
    told to wake."""
    note_run(self, level=level)
    self.progress("slow-stage")
    origin = self.request.id
    if level == 1:
        return self.replace(replaced_twice.s(2))
    if record().incr(f"level-2-runs:{origin}") == 1:
        record().rpush(f"holding:{origin}", self.fencing_token)
        wait_for_key(f"wake:{origin}", 60)
    return self.replace(replacement_step.s(origin, "second"))


@app.task(bind=True, base=ProgressLeasedTask)
def collected(self: Any, values: list[Any]) -> list[Any]:
    """A chord body that records each run of its body."""
    note_run(self, values=values)
    return values


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def owner_until_told(self: Any) -> str:
    """Each attempt holds in a stage with a long deadline, progressing, until the test sets
    ``finish:<id>:<attempt>``; it returns the value of its owner's token."""
    note_run(self)
    self.progress("slow-stage")
    key = f"finish:{self.request.id}:{attempt_number(self)}"
    while not record().exists(key):
        time.sleep(0.05)
    return f"owner {self.fencing_token}"


@app.task(bind=True, base=ProgressLeasedTask)
def received(self: Any, value: Any) -> Any:
    """A chain's next step: records each run with the value it received."""
    note_run(self, value=value)
    return value


# -- data loss at the end of a body ------------------------------------------------------------


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def lost_before_its_end(self: Any, kind: str) -> Any:
    """Ends by ``kind``: ``"retry"`` (retries once, then returns), ``"group"`` (replaces itself by
    a group of a fenced and a plain step, which Celery makes a chord whose body runs under the
    task id), ``"fenced"`` (replaces itself by a fenced step). With the key ``flush-before-end:<task id>`` set, the lease store is flushed
    (FLUSHDB: every lease, token and result gone) right before, after the heartbeat's last
    renewal: the owner is live, and renewed less than a TTL ago."""
    from celery import group

    note_run(self, retries=self.request.retries)
    self.progress("load-data")
    origin = self.request.id
    if record().delete(f"flush-before-end:{origin}"):
        self.backend.client.flushdb()
    if kind == "retry":
        if self.request.retries == 0:
            raise self.retry(countdown=0.2)
        return f"retried {self.request.retries}"
    if kind == "fenced":
        return self.replace(replacement_step.si(origin, "fenced"))
    return self.replace(group(replacement_step.si(origin, "fenced"), plain_replacement_step.si(origin, "plain")))


@app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)
def flushes_when_told(self: Any) -> str:
    """Each attempt holds, progressing, until the test sets ``finish:<id>:<attempt>``, and returns
    the value of its owner's token. A second attempt, once the test sets ``flush:<id>``, flushes
    the lease store (FLUSHDB) right after a renewal of its own lease, so its next renewal is a
    heartbeat interval away, and says so (``flushed:<id>``)."""
    note_run(self)
    self.progress("slow-stage")
    origin = self.request.id
    key = f"finish:{origin}:{attempt_number(self)}"
    if attempt_number(self) == 2:
        wait_for_key(f"flush:{origin}", 60)
        lease_key = self.backend.lease_store.keys.lease(origin)
        renewed = self.backend.client.hget(lease_key, "heartbeatAt")
        deadline = time.monotonic() + 30
        while self.backend.client.hget(lease_key, "heartbeatAt") == renewed and time.monotonic() < deadline:
            time.sleep(0.01)
        self.backend.client.flushdb()
        record().set(f"flushed:{origin}", 1)
    while not record().exists(key):
        time.sleep(0.05)
    return f"owner {self.fencing_token}"
