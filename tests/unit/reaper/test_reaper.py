"""The reaper: ``install()`` on beat's schedule, and one pass, ``reap(app, now=…)``, on a real Redis."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import beat_init
from kombu.utils import json

from celery_fenced import install, reap
from celery_fenced._celery.headers import PASSED_ON_HEADER
from celery_fenced._reaper.reaper import REAP_TASK_NAME, SCHEDULE_NAME
from celery_fenced.exceptions import ConfigurationError
from tests.support.redis_server import RedisServer

CALL = {"task": "proj.report", "args": [7], "kwargs": {"fast": True}, "options": {"queue": "reports"}}


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    for db in (10, 11):
        redis_server.client(db).flushdb()
    app = Celery("reaping", set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url(10),
        result_backend="fenced+" + redis_server.url(11),
        fenced_requeue_timeout=60,
        fenced_takeover_grace=0,
    )
    yield app
    app.close()


def lapsed(app: Celery, task_id: str, max_takeovers: int = 3) -> Any:
    store = app.backend.lease_store
    state = store.acquire(
        task_id, "host/1/a", ttl_ms=60_000, task_name="proj.report", max_takeovers=max_takeovers, call=CALL
    ).state
    assert store.lapse(task_id, "host/1/a", state.owner_token, mode="release") == "ok"
    return store


def queued(app: Celery, queue: str) -> list[dict[str, Any]]:
    with app.connection_for_write() as connection:
        raw = connection.default_channel.client.lrange(queue, 0, -1)
    return [json.loads(message) for message in raw]


def test_a_pass_up_to_a_time_before_the_lapse_claims_nothing(app: Celery) -> None:
    store = lapsed(app, "r1")
    before = store.server_time_ms() / 1000 - 30
    report = reap(app, now=before)
    assert (report.claimed, report.left) == (0, 0)
    assert store.read("r1").status == "LAPSED"  # type: ignore[union-attr]
    assert queued(app, "reports") == []


def test_a_pass_claims_a_lapsed_lease_and_sends_its_recorded_call_again(app: Celery) -> None:
    store = lapsed(app, "r1")
    report = reap(app)
    assert report.requeued == ["r1"] and report.abandoned == []
    assert store.read("r1").status == "REQUEUED"  # type: ignore[union-attr]
    (message,) = queued(app, "reports")
    assert message["headers"]["id"] == "r1" and message["headers"]["task"] == "proj.report"
    assert reap(app).claimed == 0  # claimed once: the next pass finds nothing due


def test_the_limit_leaves_the_rest_for_the_next_pass(app: Celery) -> None:
    for task_id in ("r1", "r2", "r3"):
        lapsed(app, task_id)
    first = reap(app, limit=2)
    assert (first.claimed, first.left) == (2, 1)
    second = reap(app, limit=2)
    assert (second.claimed, second.left) == (1, 0)


def test_past_max_takeovers_a_pass_abandons_with_a_stored_failure(app: Celery) -> None:
    lapsed(app, "r1", max_takeovers=0)
    report = reap(app)
    assert report.abandoned == ["r1"] and report.requeued == []
    meta = app.backend.get_task_meta("r1")
    assert meta["status"] == "FAILURE" and "abandoned" in str(meta["result"])


def test_reap_needs_the_fenced_backend(redis_server: RedisServer) -> None:
    plain = Celery("plain", set_as_current=False)
    plain.conf.update(broker_url=redis_server.url(10), result_backend=redis_server.url(11))
    with pytest.raises(
        ConfigurationError, match=r"reap\(\) needs the fenced result backend, but result_backend is RedisBackend"
    ):
        reap(plain)
    plain.close()


# -- install() ---------------------------------------------------------------------------------


def test_install_puts_the_reaper_on_beat_and_twice_is_harmless() -> None:
    app = Celery("inst", set_as_current=False)
    app.conf.fenced_reaper_interval = 2
    install(app)
    install(app)
    app.conf.update(timezone="UTC")  # configures the app: the deferred schedule is added now
    entry = app.conf.beat_schedule[SCHEDULE_NAME]
    assert entry["task"] == REAP_TASK_NAME and entry["schedule"] == 2
    assert entry["options"]["expires"] < 2
    assert REAP_TASK_NAME in app.tasks
    assert app.tasks[REAP_TASK_NAME].ignore_result and not app.tasks[REAP_TASK_NAME].send_events


def test_a_later_config_from_object_cannot_wipe_it() -> None:
    class Config:
        beat_schedule: dict = {}
        timezone = "UTC"

    app = Celery("inst2", set_as_current=False)
    install(app)
    app.config_from_object(Config)
    assert SCHEDULE_NAME in app.conf.beat_schedule


def test_beat_start_warns_and_restores_a_wiped_schedule(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("inst3", set_as_current=False)
    install(app)
    app.conf.update(timezone="UTC")
    app.conf.beat_schedule["mine"] = {"task": "x", "schedule": 10}
    del app.conf.beat_schedule[SCHEDULE_NAME]  # a hand-written schedule that dropped it
    assert SCHEDULE_NAME not in app.conf.beat_schedule

    class FakeBeatService:  # beat_init's sender is beat's Service: only its .app is read
        pass

    sender = FakeBeatService()
    sender.app = app  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="celery_fenced.reaper"):
        beat_init.send(sender=sender)
    assert "beat_schedule has no 'celery_fenced.reap' entry" in caplog.text
    assert SCHEDULE_NAME in app.conf.beat_schedule and "mine" in app.conf.beat_schedule


def test_in_beats_process_the_reap_task_runs_the_pass_there_and_sends_no_message(app: Celery, tmp_path: Any) -> None:
    from celery.beat import Service

    install(app)
    app.conf.update(timezone="UTC")
    reap_task = app.tasks[REAP_TASK_NAME]
    reap_task.apply_async(expires=1)  # outside beat: a task message, for those who schedule it otherwise
    assert [m["headers"]["task"] for m in queued(app, "celery")] == [REAP_TASK_NAME]
    store = lapsed(app, "r1")
    beat_init.send(sender=Service(app, schedule_filename=str(tmp_path / "schedule")))
    result = reap_task.apply_async(expires=1)  # what beat's scheduler calls for the due entry
    assert result.get() == 1 and result.id
    assert store.read("r1").status == "REQUEUED"  # type: ignore[union-attr]
    assert [m["headers"]["id"] for m in queued(app, "reports")] == ["r1"]
    assert len(queued(app, "celery")) == 1  # beat's tick sent no reap message: it reaped here


def test_a_re_send_carries_no_earlier_pass_on(app: Celery) -> None:
    store = app.backend.lease_store
    call = {**CALL, "options": {**CALL["options"], "headers": {PASSED_ON_HEADER: "w1@host"}}}
    state = store.acquire("r1", "host/1/a", ttl_ms=60_000, task_name="proj.report", max_takeovers=3, call=call).state
    assert store.lapse("r1", "host/1/a", state.owner_token, mode="release") == "ok"
    assert reap(app).requeued == ["r1"]
    (message,) = queued(app, "reports")
    # The worker that passed the earlier copy on may pass this one on again.
    assert PASSED_ON_HEADER not in message["headers"]


def test_a_failed_pass_names_the_commands_the_lease_redis_user_may_not_run(
    app: Celery, redis_server: RedisServer
) -> None:
    """A script that runs a denied command fails naming only the script: the line adds which
    command, and the fix. An error Redis did not answer (a lost connection) is said as it is."""
    from redis.exceptions import ConnectionError, ResponseError

    from celery_fenced._reaper.reaper import failure_text

    user = "reaper-no-info"
    with redis_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "&*", "+@all", "-info")
    try:
        app.conf.result_backend = "fenced+" + redis_server.url(11).replace("redis://", f"redis://{user}:pw@", 1)
        text = failure_text(app, ResponseError("The user executing the script can't run this command script: ab"))
        assert text.startswith("ResponseError: The user executing the script can't run this command script: ab; ")
        assert text.endswith(
            "the lease Redis user may not run INFO (the scripts that hand out fencing tokens read "
            "the server's replication id): grant it (ACL SETUSER <user> +info)"
        )
        assert failure_text(app, ConnectionError("gone")) == "ConnectionError: gone"
        app.backend.client.close()
    finally:
        with redis_server.client() as admin:
            admin.execute_command("ACL", "DELUSER", user)


def test_a_retry_sent_again_is_logged_as_a_retry_not_a_takeover(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """A retry whose message did not start by its due time is sent again: still a retry."""
    store = app.backend.lease_store
    owner = store.acquire("r1", "host/1/a", ttl_ms=60_000, task_name="proj.report", max_takeovers=3, call=CALL).state
    stored = store.store("r1", owner.owner_token, b"r", state="RETRY", kind="retry", expires_ms=0, retry_due_ms=1)
    assert str(stored.code) == "stored"
    # Its due time passes on the server's clock (the claim re-checks it there): a due time 1 ms
    # ahead was still ahead when the claim ran within the same millisecond.
    store.client.hset(store.keys.lease("r1"), "leaseExpireAt", store.server_time_ms() - 1)
    with caplog.at_level(logging.WARNING, logger="celery_fenced.reaper"):
        report = reap(app, now=store.server_time_ms() / 1000 + 5)
    assert report.requeued == ["r1"]
    (line,) = [r.getMessage() for r in caplog.records if "re-sent" in r.getMessage()]
    assert line.startswith("retry: task proj.report[r1] re-sent (cause=retry:"), line
    assert "not a takeover" in line and "takeover:" not in line
