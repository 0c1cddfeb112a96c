"""One (pool, fault) scenario of the result-path matrix, run on real workers, and what it stored.

A scenario starts the faulted worker (``w1``), sends every result path's task in one go, starts
the second worker of the same pool (``w2``) and beat (the reaper), injects the fault, then
collects for every task id what was stored: Celery's result, the lease, the steps each
execution completed, and what a client's ``AsyncResult.get(timeout=...)`` answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psutil
from celery import chord, group
from celery.exceptions import TimeoutError as CeleryTimeoutError

from tests.integration.conftest import Cluster, lease, stored
from tests.matrix.app import FAULT, FAULTED, RELEASE
from tests.support.processes import CeleryProcess, wait_until

POOLS = ("prefork", "threads", "solo", "gevent")
FAULTS = ("none", "stall", "freeze", "warm", "cold")
PATHS = (
    "success",
    "failure",
    "retry",
    "replace",
    "reject",
    "ignore",
    "ignore_result",
    "revoke",
    "revoke_terminate",
    "soft_time_limit",
    "hard_time_limit",
    "forget",
    "chord_part",
    "group_member",
)
#: The paths with a plain twin: those whose outcome depends on the pool.
PLAIN_TWINS = ("failure", "reject", "ignore", "ignore_result", "revoke_terminate", "soft_time_limit", "hard_time_limit")
READY_STATES = ("SUCCESS", "FAILURE", "REVOKED")

#: Processes (or threads, greenlets) of the faulted worker: every path's first attempt at once.
CONCURRENCY = 16
#: The second worker takes over; its tasks do not hold, so fewer slots drain them in rounds.
TAKEOVER_CONCURRENCY = 8
#: How long a client waits for a result the scenario already waited for.
CLIENT_TIMEOUT = 5.0
#: How long a cold-stopped worker is given to exit before its held tasks are released anyway
#: (a threads worker cannot stop a running thread: it exits once the bodies end).
COLD_EXIT_SECONDS = 8.0


@dataclass
class Seen:
    """What was stored for one task id, and what its client was answered."""

    role: str
    task_id: str
    fenced: bool = True
    meta: dict[str, Any] | None = None
    lease: dict[str, str] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    #: ``("value", v)``, ``("error", type name, message)``, ``("timeout",)`` or ``("not waited",)``.
    client: tuple[Any, ...] = ("not waited",)

    @property
    def state(self) -> str:
        return self.meta["status"] if self.meta else "PENDING"

    def count(self, step: str) -> int:
        return sum(1 for entry in self.steps if entry["step"] == step)


@dataclass
class Observed:
    """A scenario's result: the ``Seen`` of each path's task ids, notes and the logs."""

    pool: str
    fault: str
    paths: dict[str, list[Seen]] = field(default_factory=dict)
    plain: dict[str, Seen] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    logs: str = ""

    def log_lines(self, task_id: str) -> str:
        """The workers' log lines that name ``task_id``."""
        return "\n".join(line for line in self.logs.splitlines() if task_id in line or line.startswith("====="))


def steps_of(cluster: Cluster, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in cluster.record.lrange(f"steps:{task_id}", 0, -1)]


def attempt_over(entry: dict[str, Any], steps: list[dict[str, Any]]) -> bool:
    """Whether the execution that recorded ``entry`` (its start) has left its body or its process."""
    ended = any(s["step"] == "exit" and s["token"] == entry["token"] and s["pid"] == entry["pid"] for s in steps)
    return ended or not psutil.pid_exists(entry["pid"])


class Scenario:
    """Runs one (pool, fault) scenario on ``cluster``."""

    def __init__(self, cluster: Cluster, pool: str, fault: str) -> None:
        self.cluster = cluster
        self.pool = pool
        self.fault = fault
        self.observed = Observed(pool, fault)
        self.ids: dict[str, list[tuple[str, str]]] = {}  # path -> [(role, task id)]
        self.plain_ids: dict[str, str] = {}
        self.w1: CeleryProcess | None = None
        self.forget_client: tuple[Any, ...] = ("not waited",)
        self.started = time.monotonic()
        self.w2: CeleryProcess | None = None
        self.app: Any = None
        self.held: list[str] = []

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> Observed:
        cluster = self.cluster
        module = cluster.app()
        # One app (and one result backend) for the whole scenario: a second cluster.app() would
        # drop the backend the results sent so far subscribe through.
        self.app = module.app
        from tests.matrix import app as matrix

        cluster.record.set(FAULT, self.fault)
        if self.fault == "none":
            cluster.record.set(RELEASE, 1)
        concurrency = 1 if self.pool == "solo" else CONCURRENCY
        self.w1 = cluster.worker(FAULTED, pool=self.pool, concurrency=concurrency)
        self.phase("w1 ready")
        self.send(module.app, matrix)
        held = self.wait_first_attempts()
        self.held = held
        self.phase("tasks sent and started")
        takeover_concurrency = 1 if self.pool == "solo" else TAKEOVER_CONCURRENCY
        self.w2 = cluster.worker("w2", pool=self.pool, concurrency=takeover_concurrency)
        # w2 runs without mingle: it is told of the revoked id too (w1 took its message first,
        # when it was the only worker; a solo w2 busy with a task reads this only after it).
        module.app.control.revoke(self.ids["revoke"][0][1])
        cluster.beat()
        self.phase("w2 and beat ready")
        if self.fault in ("warm", "cold"):
            # A worker shutting down takes no control command: the revoke reaches w1 first.
            self.revoke_terminate(module.app, held_too=True)
            self.inject(held)
        else:
            # The revoke goes to the attempt that runs once the fault is over (the takeover, or
            # the woken owner): sent as soon as it runs, while the scenario goes on.
            revoker = threading.Thread(target=self.revoke_terminate, args=(module.app,), daemon=True)
            revoker.start()
            self.inject(held)
            revoker.join(60)
        self.phase("fault injected and over, revoked")
        self.collect(module.app)
        self.phase("collected")
        return self.observed

    def phase(self, name: str) -> None:
        """Note how long the scenario took to reach ``name``."""
        self.observed.notes.append(f"{time.monotonic() - self.started:6.1f}s {name}")

    def send(self, app: Any, matrix: Any) -> None:
        """Every path's task in one go, each its own task id (and the plain twins, without a fault)."""
        revoked = str(uuid.uuid4())
        self.revoke_known(app, revoked, FAULTED)  # before it is sent: w1 knows it
        self.ids["revoke"] = [("task", matrix.path_revoke.apply_async(task_id=revoked).id)]
        for path in PATHS:
            if path in ("revoke", "chord_part", "group_member"):
                continue
            task = getattr(matrix, f"path_{path}")
            self.ids[path] = [("task", task.delay().id)]
        header = [matrix.path_member.s(0), matrix.path_member.s(1)]
        callback = chord(header, matrix.path_count_parts.s()).apply_async()
        parts = [("part", r.id) for r in callback.parent.results]
        self.ids["chord_part"] = [*parts, ("callback", callback.id)]
        members = group(matrix.path_member.s(10), matrix.path_member.s(11)).apply_async()
        self.ids["group_member"] = [("member", r.id) for r in members.results]
        if self.fault == "none":
            for path in PLAIN_TWINS:
                self.plain_ids[path] = getattr(matrix, f"plain_{path}").delay().id

    def revoke_known(self, app: Any, task_id: str, worker: str) -> None:
        """Revoke ``task_id`` on ``worker`` and wait for its reply (a worker just ready may not
        listen to broadcasts yet: the revoke is sent again until it answers)."""
        destination = [f"{worker}@{socket.gethostname()}"]

        def answered() -> bool:
            return bool(app.control.revoke(task_id, destination=destination, reply=True, limit=1, timeout=1))

        wait_until(answered, 30, f"{worker} to know {task_id} revoked", interval=0)

    def running_ids(self) -> list[str]:
        """The task ids whose first attempt runs on w1 before the fault (all but the revoked one
        and the chord's callback)."""
        return [
            task_id
            for path, roles in self.ids.items()
            if path != "revoke"
            for role, task_id in roles
            if role != "callback"
        ]

    def wait_first_attempts(self) -> list[str]:
        """Wait until w1 runs every first attempt it can (one on solo); the ids it runs."""
        if self.fault == "none":
            return []
        ids = self.running_ids()

        def started() -> list[str]:
            return [task_id for task_id in ids if any(s["step"] == "start" for s in steps_of(self.cluster, task_id))]

        if self.pool == "solo":
            return wait_until(started, 30, "w1 to start a task")  # type: ignore[return-value]
        wait_until(lambda: len(started()) == len(ids), 60, "w1 to start every path")
        return started()

    def settled(self, task_id: str) -> bool:
        """Whether a held task was taken over (a later attempt started) or ended."""
        starts = [s for s in steps_of(self.cluster, task_id) if s["step"] == "start"]
        if len(starts) >= 2:
            return True
        meta = stored(self.cluster, task_id)
        if meta is not None and meta["status"] in READY_STATES:
            return True
        return lease(self.cluster, task_id).get("status") in ("DONE", "ABANDONED")

    def wait_settled(self, held: list[str], what: str) -> None:
        try:
            wait_until(lambda: all(self.settled(t) for t in held), 40, what)
        except AssertionError as exc:
            unsettled = [t for t in held if not self.settled(t)]
            self.observed.notes.append(f"{exc}: not taken over: {unsettled}")

    def inject(self, held: list[str]) -> None:
        cluster = self.cluster
        assert self.w1 is not None
        if self.fault == "none":
            self.forget()
            return
        if self.fault == "stall":
            self.wait_settled(held, "every stalled owner's task to be taken over")
            self.forget()
            cluster.record.set(RELEASE, 1)
        elif self.fault == "freeze":
            self.w1.signal_group(signal.SIGSTOP)
            try:
                self.wait_settled(held, "every frozen owner's task to be taken over")
                self.forget()
            finally:
                self.w1.signal_group(signal.SIGCONT)
            cluster.record.set(RELEASE, 1)
        elif self.fault == "warm":
            os.kill(self.w1.pid, signal.SIGTERM)
            wait_until(lambda: "Warm shutdown" in self.w1.log(), 20, "w1's warm shutdown")  # type: ignore[union-attr]
            cluster.record.set(RELEASE, 1)
            self.wait_exit(self.w1)
            self.forget()
        elif self.fault == "cold":
            os.kill(self.w1.pid, signal.SIGTERM)
            wait_until(lambda: "Warm shutdown" in self.w1.log(), 20, "w1's warm shutdown")  # type: ignore[union-attr]
            os.kill(self.w1.pid, signal.SIGQUIT)
            if self.wait_exit(self.w1, COLD_EXIT_SECONDS):
                self.wait_settled(held, "every task of the cold-stopped worker to be taken over")
                self.forget()
                cluster.record.set(RELEASE, 1)
            else:
                # The worker lives on (its pool cannot stop the bodies): its owners keep their
                # leases, and go on to their end once released.
                cluster.record.set(RELEASE, 1)
                self.forget()
                self.wait_exit(self.w1)

    def wait_exit(self, worker: CeleryProcess, timeout: float = 40) -> bool:
        """Wait until ``worker`` exited; whether it did (a note says when it did not)."""
        try:
            wait_until(lambda: worker.proc.poll() is not None, timeout, f"{worker.name} to exit")
        except AssertionError as exc:
            self.observed.notes.append(str(exc))
            return False
        return True

    def forget(self) -> None:
        """The forget path's client: waits for its result, then forgets it."""
        [(_, task_id)] = self.ids["forget"]
        result = self.app.AsyncResult(task_id)
        seen = Seen("task", task_id)
        seen.client = self.ask(result, 30)
        with contextlib.suppress(Exception):
            result.forget()
        self.forget_client = seen.client

    def revoke_terminate(self, app: Any, held_too: bool = False) -> None:
        """Revoke the long task with terminate=True once an attempt of it runs that owns its
        lease and is not held on w1 (unless ``held_too``): the takeover, or the woken owner.

        The body learns of the revoke (and, where the pool cannot terminate it, goes on to its
        end) only once the attempt's worker handled the command: a late command would let it
        finish where the pool can terminate it."""
        [(_, task_id)] = self.ids["revoke_terminate"]
        twin = self.plain_ids.get("revoke_terminate")
        targets = [(task_id, True), *([(twin, False)] if twin else [])]
        for target, fenced in targets:

            def running(target: str = target, fenced: bool = fenced) -> dict[str, Any] | None:
                steps = steps_of(self.cluster, target)
                starts = [s for s in steps if s["step"] == "start"]
                if not starts:
                    return None
                last = starts[-1]
                if attempt_over(last, steps):
                    return None
                if not fenced:
                    return last
                held = last["hostname"].startswith(f"{FAULTED}@") and last["attempt"] == 1
                if held and not held_too and not self.cluster.record.exists(RELEASE):
                    return None
                owner = lease(self.cluster, target)
                mine = owner.get("status") == "RUNNING" and owner.get("ownerToken") == str(last["token"])
                return last if mine else None

            attempt = None
            try:
                attempt = wait_until(running, 40, f"an attempt of {target} to run")
            except AssertionError as exc:
                self.observed.notes.append(str(exc))
            app.control.revoke(target, terminate=True)
            # A solo worker reads the command only once its running task ended.
            if attempt is not None and self.pool != "solo":
                self.wait_handled(attempt["hostname"].split("@")[0], f"Terminating {target}")
            self.cluster.record.set(f"matrix:revoked:{target}", 1)

    def wait_handled(self, worker: str, line: str) -> None:
        """Wait until ``worker``'s log says ``line`` (a note says when it did not)."""
        proc = self.w1 if worker == FAULTED else self.w2
        assert proc is not None
        try:
            wait_until(lambda: line in proc.log(), 15, f"{worker} to log {line!r}")
        except AssertionError as exc:
            self.observed.notes.append(str(exc))

    # -- what was stored ------------------------------------------------------------------------

    def expected_ready(self, path: str, role: str) -> bool:
        return path not in ("ignore", "ignore_result", "forget")

    def collect(self, app: Any) -> None:
        cluster = self.cluster
        every = [(path, role, t) for path, roles in self.ids.items() for role, t in roles]
        ready = [t for path, role, t in every if self.expected_ready(path, role)]
        ready += [t for path, t in self.plain_ids.items() if self.expected_ready(path, "plain")]

        def all_ready() -> bool:
            return all((stored(cluster, t) or {}).get("status") in READY_STATES for t in ready)

        try:
            wait_until(all_ready, 60, "every result to be stored")
        except AssertionError as exc:
            self.observed.notes.append(str(exc))
        # Every execution that is still running (a late owner, a body a revoke could not stop)
        # leaves its body before the verdict: its steps are then all recorded.
        all_ids = [t for _, _, t in every] + list(self.plain_ids.values())

        def quiet() -> bool:
            for task_id in all_ids:
                steps = steps_of(cluster, task_id)
                if any(not attempt_over(s, steps) for s in steps if s["step"] == "start"):
                    return False
            return True

        try:
            wait_until(quiet, 30, "every execution to leave its body")
        except AssertionError as exc:
            self.observed.notes.append(str(exc))
        for path, role, task_id in every:
            seen = self.seen(role, task_id)
            if path == "forget":
                seen.client = self.forget_client
            elif self.expected_ready(path, role):
                seen.client = self.ask(app.AsyncResult(task_id), CLIENT_TIMEOUT)
            self.observed.paths.setdefault(path, []).append(seen)
        for path, task_id in self.plain_ids.items():
            seen = self.seen("plain", task_id, fenced=False)
            if self.expected_ready(path, "plain"):
                seen.client = self.ask(app.AsyncResult(task_id), CLIENT_TIMEOUT)
            self.observed.plain[path] = seen
        self.observed.logs = cluster.logs()
        if self.held:
            over = [t for t in self.held if len({s["token"] for s in steps_of(cluster, t) if s["step"] == "start"}) > 1]
            self.observed.notes.append(f"{len(over)} of the {len(self.held)} held first attempts taken over")

    def seen(self, role: str, task_id: str, fenced: bool = True) -> Seen:
        cluster = self.cluster
        return Seen(
            role,
            task_id,
            fenced=fenced,
            meta=stored(cluster, task_id),
            lease=lease(cluster, task_id),
            steps=steps_of(cluster, task_id),
        )

    @staticmethod
    def ask(result: Any, timeout: float) -> tuple[Any, ...]:
        """What ``AsyncResult.get(timeout=...)`` answers a client."""
        try:
            return ("value", result.get(timeout=timeout, disable_sync_subtasks=False))
        except CeleryTimeoutError:
            return ("timeout",)
        except Exception as exc:
            return ("error", type(exc).__name__, str(exc))


def run_scenario(cluster: Cluster, pool: str, fault: str) -> Observed:
    """Run one scenario; its observations (the logs included, whatever happened)."""
    started = time.monotonic()
    scenario = Scenario(cluster, pool, fault)
    try:
        observed = scenario.run()
    except BaseException:
        print(cluster.logs()[-30000:])
        raise
    observed.notes.append(f"scenario took {time.monotonic() - started:.1f}s")
    return observed
