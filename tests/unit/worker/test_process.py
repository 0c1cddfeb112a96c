"""The worker state of one process (_worker/process.py): a forked child forgets the interrupt under
way, the cancelled requests and the lock, and keeps its pool, its SIGUSR1 handler and its
attempt ids."""

from __future__ import annotations

import os

from celery_fenced._task.owner import OwnedLease
from celery_fenced._worker.process import WORKER_PROCESS, WorkerProcess
from celery_fenced.conf import FencedConfig


def test_a_process_outside_a_worker_runs_no_pool_and_interrupts_nothing() -> None:
    process = WorkerProcess()
    assert process.pool_kind is None
    assert process.interrupting is None and not process.interrupt_handler_installed
    assert process.cancelled_here == set()
    assert not process.runtimes_lock.locked()
    assert process.attempt_ids.next_id().startswith(f"{os.getpid()}/")
    assert isinstance(WORKER_PROCESS, WorkerProcess)


def test_after_a_fork_what_was_the_parents_is_forgotten_and_the_rest_kept() -> None:
    process = WorkerProcess()
    process.pool_kind = "prefork"
    process.interrupt_handler_installed = True
    process.interrupting = OwnedLease("t1", "proj.task", "host/1/a", 7, 1, 0, FencedConfig.from_mapping({}).policy)
    process.cancelled_here.add("t2")
    process.runtimes_lock.acquire()  # a thread of the parent held it at the fork
    attempt_ids = process.attempt_ids
    process.after_fork()
    assert process.interrupting is None
    assert process.cancelled_here == set()
    assert not process.runtimes_lock.locked()
    assert process.pool_kind == "prefork"  # a prefork child runs on its parent's pool
    assert process.interrupt_handler_installed  # a fork inherits the signal handler
    assert process.attempt_ids is attempt_ids  # they redraw themselves in the child


def test_the_stopping_flag_set_in_the_parent_is_seen_by_a_child_forked_before() -> None:
    process = WorkerProcess()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: waits for the parent to set it, then says what it sees
        os.close(write)
        os.read(read, 1)
        os._exit(0 if process.stopping.is_set() else 1)
    os.close(read)
    assert not process.stopping.is_set()
    process.stopping.set()  # a worker's main process, at worker_shutting_down
    os.write(write, b"x")
    os.close(write)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child did not see the flag its parent set"
    process.stopping.clear()
    assert not process.stopping.is_set()
