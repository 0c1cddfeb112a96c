"""The process's telemetry (_telemetry/process.py): a forked child forgets its parent's unflushed
metrics and locks, and keeps the event settings."""

from __future__ import annotations

from celery_fenced._telemetry.process import TELEMETRY, ProcessTelemetry


def test_a_process_starts_with_nothing_to_flush_and_the_event_settings_unread() -> None:
    telemetry = ProcessTelemetry()
    assert telemetry.metrics.take() == {}
    assert (telemetry.events_enabled, telemetry.events_hostname) == (None, None)
    assert not telemetry.events_lock.locked()
    assert isinstance(TELEMETRY, ProcessTelemetry)


def test_after_a_fork_the_parents_metrics_and_locks_are_forgotten_and_the_event_settings_kept() -> None:
    telemetry = ProcessTelemetry()
    telemetry.events_enabled, telemetry.events_hostname = True, "celery@web1"
    parents = telemetry.metrics
    parents.inc("owner_lease_renew_total")
    telemetry.events_lock.acquire()  # a thread of the parent held it at the fork
    telemetry.after_fork()
    assert telemetry.metrics.take() == {}  # the parent flushes its own
    assert parents.take() == {"owner_lease_renew_total|": 1}
    assert not telemetry.events_lock.locked()
    assert (telemetry.events_enabled, telemetry.events_hostname) == (True, "celery@web1")
