"""A worker on which fenced tasks cannot work refuses to start, with one clear message."""

from __future__ import annotations

import pytest

from celery_fenced._celery.compat import GEVENT_POOL_CANNOT_DISABLE_PREFETCH
from tests.integration.conftest import Cluster
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def start_and_fail(cluster: Cluster, *, pool: str = "prefork", patched: bool = True, **settings: object) -> str:
    """Start a worker that must refuse to start; its log.

    ``patched=False`` starts it through ``app.worker_main()`` instead of the celery command.
    """
    cluster.app()
    if pool == "gevent" and GEVENT_POOL_CANNOT_DISABLE_PREFETCH:  # refused for that first (see below)
        settings = {"worker_disable_prefetch": False, **settings}
    env = cluster.env(**settings)
    from tests.support.processes import CeleryProcess

    argv = ["worker", "-P", pool, "-c", "1", "--without-mingle"]
    if patched:
        argv, launcher = ["-A", "tests.integration.apps.fenced_app", *argv], ("-m", "celery")
    else:
        argv, launcher = [], ("-c", f"from tests.integration.apps.fenced_app import app; app.worker_main({argv!r})")
    proc = CeleryProcess("refused", argv, env, cluster.tmp_path / "refused.log", " ready.", launcher)
    cluster.processes.append(proc)
    wait_until(lambda: proc.proc.poll() is not None, 60, "the worker to refuse to start")
    assert proc.proc.returncode != 0
    return proc.log()


def test_a_bad_setting_stops_the_worker_naming_the_setting(cluster: Cluster) -> None:
    log = start_and_fail(cluster, fenced_heartbeat_interval=2)
    assert "fenced_heartbeat_interval must be less than half of fenced_lease_ttl" in log


def test_an_unknown_on_stall_mode_stops_the_worker(cluster: Cluster) -> None:
    log = start_and_fail(cluster, fenced_on_stall="kill")
    assert "fenced_on_stall must be one of release, expire, alert; got 'kill'" in log


def test_another_result_backend_is_refused(cluster: Cluster) -> None:
    log = start_and_fail(cluster, result_backend=cluster.server.url(1))
    assert "ProgressLeasedTask needs the fenced result backend" in log


def test_a_gevent_worker_that_gevent_did_not_patch_is_refused(cluster: Cluster) -> None:
    # Celery's worker_main() starts the gevent pool without the celery command's monkey patching.
    log = start_and_fail(cluster, pool="gevent", patched=False)
    assert "the gevent pool needs gevent's monkey patching, and socket, select, threading, time are not patched" in log


@pytest.mark.skipif(not GEVENT_POOL_CANNOT_DISABLE_PREFETCH, reason="only Celery 5.6's gevent pool has this fault")
def test_disabled_prefetch_on_celery_56s_gevent_pool_stops_the_worker_saying_why(cluster: Cluster) -> None:
    log = start_and_fail(cluster, pool="gevent", worker_disable_prefetch=True)
    assert "worker_disable_prefetch on Celery 5.6's gevent pool takes no message at all" in log
