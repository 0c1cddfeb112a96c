"""The root ``conftest.py`` that ``run.py`` puts beside Celery's ``t/`` (not collected here).

``FENCED_CELERY_SUITE`` picks the run:

* ``plain``: Celery's suite as Celery runs it (the baseline);
* ``backend``: Celery's ``redis`` backend alias mapped to ``FencedRedisBackend``, tasks unchanged;
* ``fenced``: the same backend, and every task of the suite a ``ProgressLeasedTask``.

The URL stays ``redis://`` so that the suite's chord tests, which skip unless
``result_backend`` starts with ``redis``, run.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from celery.loaders.app import AppLoader

MODE = os.environ.get("FENCED_CELERY_SUITE", "plain")
if MODE not in ("plain", "backend", "fenced"):
    raise RuntimeError(f"FENCED_CELERY_SUITE must be plain, backend or fenced, not {MODE!r}")
POOL = os.environ.get("FENCED_CELERY_SUITE_POOL", "prefork")


class FencedBackendLoader(AppLoader):
    """Celery's app loader, with the ``redis`` backend alias served by the fenced backend."""

    override_backends = {"redis": "celery_fenced._backend.backend:FencedRedisBackend"}


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, Any]:
    parameters: dict[str, Any] = {}
    if MODE in ("backend", "fenced"):
        parameters["loader"] = FencedBackendLoader
    if MODE == "fenced":
        parameters["task_cls"] = "celery_fenced:ProgressLeasedTask"
    return parameters


@pytest.fixture(scope="session", autouse=True)
def _fenced_suite_is_what_it_says(celery_session_app: Any, celery_worker_pool: Any) -> None:
    """Fail at once if the mode did not take: a run that silently tested plain Celery proves nothing."""
    from celery_fenced import FencedRedisBackend, ProgressLeasedTask

    fenced_backend = isinstance(celery_session_app.backend, FencedRedisBackend)
    assert fenced_backend == (MODE != "plain"), f"{MODE} run with {type(celery_session_app.backend).__name__}"
    fenced_tasks = issubclass(celery_session_app.Task, ProgressLeasedTask)
    assert fenced_tasks == (MODE == "fenced"), f"{MODE} run with tasks of {celery_session_app.Task.__mro__}"
    assert celery_worker_pool == POOL, f"a {POOL} run with a {celery_worker_pool} worker"
    if POOL == "gevent":
        from gevent import monkey

        assert monkey.is_module_patched("socket"), "a gevent run in a process gevent did not patch"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Cap every test's timeout (Celery's ``flaky`` tests carry 300 s): a hang costs one cap."""
    cap = float(os.environ.get("FENCED_CELERY_SUITE_TIMEOUT", "30"))
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(
            marker.args[0] if marker and marker.args else (marker.kwargs.get("timeout", cap) if marker else cap)
        )
        item.add_marker(pytest.mark.timeout(min(seconds, cap)), append=False)


if POOL == "gevent":

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Any:
        """The cap as a ``gevent.Timeout``: pytest-timeout's SIGALRM is not run while the hub waits
        in its event loop, so a test parked in a wait would hang the run; this raises at that wait.

        And the worker's app is the default app while the test runs, as in a ``celery worker -P
        gevent`` process: a gevent task runs in a greenlet of its own, whose current app is the
        default one (the thread-local current app is greenlet-local once threading is
        patched), and the suite makes each test's own app the default.
        """
        import gevent

        worker_app = item.funcargs.get("celery_session_app")  # type: ignore[attr-defined]
        if worker_app is not None:
            worker_app.set_default()

        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker and marker.args else None
        with gevent.Timeout(seconds, AssertionError(f"timed out after {seconds:g}s (gevent.Timeout)")):
            return (yield)
