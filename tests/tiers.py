"""Which tests run on every supported combination, and which once.

Every tox test environment installs one Python x Celery x kombu x redis-py combination. The
newest (``py313-celery57-redis8``) runs every test; the others run the tests marked
``every_combination``: those whose outcome can depend on the line installed. The conftest
marks them from :data:`EVERY_COMBINATION`, and ``.ci/report.py`` fails a CI run in which a
test module ran in no environment.
"""

from __future__ import annotations

from pathlib import Path

#: Test folders and modules (paths from the project root) that run on every combination, each
#: with what in it depends on the Python, Celery, kombu or redis-py line.
EVERY_COMBINATION: dict[str, str] = {
    "tests/unit": "the compat layer, the request, pool and backend hooks and the model, at unit level",
    "tests/django": "the Django integration (django-redis, the ORM's fenced writes)",
    "tests/plugin": "the pytest plugin's in-process worker, which Celery's own fixtures start",
    "tests/integration/test_celery_surface.py": "Celery's surface: retries, chains, chords, groups, errbacks",
    "tests/integration/test_hand_off_and_forget.py": "the hand-off: Task.replace() and forget()",
    "tests/integration/test_hand_off_faults.py": "the hand-off under faults: the owner frozen or killed at the send",
    "tests/integration/test_late_sends.py": "the hand-off's late sends, and what Celery publishes before it stores",
    "tests/integration/test_gevent_pool.py": "the gevent pool, whose prefetch and timers differ by Celery line",
    "tests/integration/test_unfinished_bodies.py": "the pools' time limits, revoke and cold shutdown",
    "tests/integration/test_warm_shutdown.py": "the pools' warm shutdown",
    "tests/integration/test_worker_lost.py": "the main process's tokenless writes: the fenced backend's write path",
    "tests/integration/test_reservations.py": "the consumer's reserve, prefetch and connection-loss paths",
    "tests/integration/test_worker_checks.py": "the start checks, which differ by Celery line",
    "tests/integration/test_restricted_redis.py": "redis-py's errors for a restricted Redis user",
    "tests/integration/test_tls.py": "redis-py's TLS connections",
    "tests/integration/test_redis_cost.py": "Celery's trace writes STARTED itself; the acquire takes it over",
}

#: Test modules inside a folder of :data:`EVERY_COMBINATION` that run once all the same (on the
#: newest combination), each with why the installed line cannot change its outcome.
ONLY_ON_THE_NEWEST: dict[str, str] = {
    "tests/unit/lease/test_model_mutants.py": "it tests the model test (that each disabled guard of the "
    "Lua scripts is caught), not the installed line",
}

ROOT = Path(__file__).resolve().parent.parent


def _within(relative: str, entries: dict[str, str]) -> bool:
    return any(relative == entry or relative.startswith(entry + "/") for entry in entries)


def runs_on_every_combination(path: Path) -> bool:
    """Whether the test module at ``path`` is in :data:`EVERY_COMBINATION` (and not in
    :data:`ONLY_ON_THE_NEWEST`)."""
    relative = path.resolve().relative_to(ROOT).as_posix()
    return _within(relative, EVERY_COMBINATION) and not _within(relative, ONLY_ON_THE_NEWEST)
