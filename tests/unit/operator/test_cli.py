"""``celery fenced`` (cli.py) on a real Redis: status, inspect, cancel, redrive, tune, and its errors."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_fenced import reap
from celery_fenced._lease.state import LeaseStatus, Reservation
from celery_fenced._operator.cli import fenced
from celery_fenced._telemetry.metrics import gap_bucket
from celery_fenced.harness import wait_until

CALL = {"task": "proj.report", "args": [7], "kwargs": {}, "options": {}}


def run(app: Celery | None, *args: str) -> Result:
    return CliRunner().invoke(fenced, list(args), obj=SimpleNamespace(app=app))


def running(app: Celery, task_id: str, max_takeovers: int = 3) -> Any:
    store = app.backend.lease_store
    return store.acquire(
        task_id, "host/1/a", ttl_ms=60_000, task_name="proj.report", max_takeovers=max_takeovers, call=CALL
    ).state


def test_status_lists_the_live_leases_and_the_chosen_states(fenced_app: Celery) -> None:
    running(fenced_app, "s1")
    owner = running(fenced_app, "s2", max_takeovers=0)
    fenced_app.backend.lease_store.lapse("s2", "host/1/a", owner.owner_token, mode="release")
    reap(fenced_app)  # s2 is ABANDONED
    listed = run(fenced_app, "status")
    assert listed.exit_code == 0, listed.output
    assert "s1" in listed.output and "RUNNING" in listed.output and "s2" not in listed.output
    assert listed.output.rstrip().endswith("1 lease(s)")
    rows = json.loads(run(fenced_app, "status", "--state", "abandoned", "--json").stdout)
    assert [(row["task_id"], row["status"]) for row in rows] == [("s2", "ABANDONED")]


def test_inspect_shows_the_typed_lease_and_says_when_there_is_none(fenced_app: Celery) -> None:
    owner = running(fenced_app, "i1")
    shown = run(fenced_app, "inspect", "i1", "--json")
    assert shown.exit_code == 0, shown.output
    fields = json.loads(shown.output)
    assert fields["ownerToken"] == owner.owner_token and fields["call"] == CALL and fields["status"] == "RUNNING"
    assert "leaseExpireAt" in run(fenced_app, "inspect", "i1").output
    missing = run(fenced_app, "inspect", "nothing")
    assert missing.exit_code == 1 and "task nothing has no lease" in missing.output


def test_inspect_after_a_cancel_shows_the_owners_token_and_the_cancels_as_the_cancels(fenced_app: Celery) -> None:
    owner = running(fenced_app, "x1")
    assert run(fenced_app, "cancel", "x1").output.strip() == "x1: cancelled"
    fields = json.loads(run(fenced_app, "inspect", "x1", "--json").output)
    assert fields["ownerToken"] == owner.owner_token  # the owner's, not the cancel's
    assert fields["cancelToken"] > owner.owner_token and "cancelledOwnerToken" not in fields
    assert fenced_app.backend.get_task_meta("x1")["fence_token"] == fields["cancelToken"]
    lines = run(fenced_app, "inspect", "x1").output.splitlines()
    (owner_line,) = [line for line in lines if line.split()[0] == "ownerToken"]
    (cancel_line,) = [line for line in lines if line.split()[0] == "cancelToken"]
    assert owner_line.split(None, 2)[1:] == [str(owner.owner_token), "(the owner's)"]
    assert cancel_line.split()[1] == str(fields["cancelToken"]) and "(the cancel's" in cancel_line
    assert run(fenced_app, "cancel", "--force", "q1").output.strip() == "q1: cancelled"
    never_ran = json.loads(run(fenced_app, "inspect", "q1", "--json").output)
    assert never_ran["ownerToken"] is None and never_ran["cancelToken"] > fields["cancelToken"]
    # status too: TOKEN is the owner's ("-": none ever held it), the cancel's token its own key.
    rows = {row["task_id"]: row for row in json.loads(run(fenced_app, "status", "--state", "DONE", "--json").output)}
    assert (rows["x1"]["token"], rows["x1"]["cancel_token"]) == (owner.owner_token, fields["cancelToken"])
    assert (rows["q1"]["token"], rows["q1"]["cancel_token"]) == (None, never_ran["cancelToken"])
    table = run(fenced_app, "status", "--state", "DONE").output.splitlines()
    (x1_line,) = [line for line in table if line.startswith("x1")]
    assert str(owner.owner_token) in x1_line.split() and str(fields["cancelToken"]) not in x1_line


def test_inspect_and_status_say_what_attempt_and_takeovers_count(fenced_app: Celery) -> None:
    running(fenced_app, "a1")
    shown = run(fenced_app, "inspect", "a1").output.splitlines()
    (attempt,) = [line for line in shown if line.split()[0] == "attempt"]
    (takeovers,) = [line for line in shown if line.split()[0] == "takeovers"]
    assert "each Celery retry, each takeover" in attempt and "retries are not counted" in takeovers
    listed = run(fenced_app, "status").output
    assert "ATTEMPT: runs that took the lease" in listed and "(a retry is not one)" in listed
    assert listed.rstrip().endswith("1 lease(s)")


def test_cancel_says_what_happened_to_each_id_and_fails_for_an_unknown_one(fenced_app: Celery) -> None:
    running(fenced_app, "c1")
    done = run(fenced_app, "cancel", "c1", "typo")
    assert done.exit_code == 1
    assert "c1: cancelled" in done.output and "task typo is unknown" in done.output
    assert run(fenced_app, "cancel", "c1").output.strip() == "c1: finished"
    assert run(fenced_app, "cancel", "--force", "queued").output.strip() == "queued: cancelled"


def test_cancel_and_redrive_say_each_action_once(fenced_app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """One line per action, on stdout: the package logs nothing at WARNING for it (with no
    logging set up, as in ``celery fenced``, Python prints such a record on stderr: a second
    line for the same action)."""
    running(fenced_app, "c2")
    owner = running(fenced_app, "r2", max_takeovers=0)
    fenced_app.backend.lease_store.lapse("r2", "host/1/a", owner.owner_token, mode="release")
    reap(fenced_app)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="celery_fenced"):
        cancelled = run(fenced_app, "cancel", "c2")
        redriven = run(fenced_app, "redrive", "r2")
    assert (cancelled.exit_code, cancelled.output) == (0, "c2: cancelled\n")
    assert (redriven.exit_code, redriven.output) == (0, "r2: redriven\n")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_redrive_needs_ids_or_all_abandoned(fenced_app: Celery) -> None:
    assert run(fenced_app, "redrive").exit_code == 2
    assert run(fenced_app, "redrive", "--all-abandoned").output.strip() == "no abandoned task"
    owner = running(fenced_app, "r1", max_takeovers=0)
    fenced_app.backend.lease_store.lapse("r1", "host/1/a", owner.owner_token, mode="release")
    reap(fenced_app)
    redriven = run(fenced_app, "redrive", "--all-abandoned")
    assert redriven.exit_code == 0 and redriven.output.strip() == "r1: redriven"
    again = run(fenced_app, "redrive", "r1")
    assert again.exit_code == 1 and "not abandoned" in again.output


def test_tune_with_no_samples_says_so_and_refuses_bad_options(fenced_app: Celery) -> None:
    assert run(fenced_app, "tune").output.strip() == "no stage samples yet: run some tasks first"
    refused = run(fenced_app, "tune", "--factor", "0.5")
    assert refused.exit_code == 2 and "--factor must be 1 or more" in refused.output
    assert "--floor" not in refused.output.split("Error:")[1]


def test_without_an_app_or_with_another_backend_it_says_so_in_one_line() -> None:
    bare = run(None, "status")
    assert bare.exit_code == 2 and "no Celery app" in bare.output
    plain = Celery("plain", set_as_current=False, backend="redis://127.0.0.1:1/0")
    other = run(plain, "status")
    assert other.exit_code == 1 and "Error:" in other.output and "RedisBackend" in other.output
    assert "Traceback" not in other.output


def tune_rows(output: str) -> dict[tuple[str, str], list[str]]:
    """The table's rows, by (task, stage)."""
    lines = output.splitlines()
    return {(line.split()[0], line.split()[1]): line.split() for line in lines[1:] if line[:1].isalpha()}


def test_tune_suggests_only_what_it_has_samples_for_and_keeps_every_other_deadline(fenced_app: Celery) -> None:
    fenced_app.conf.fenced_stage_timeouts = {"load-data": 5, "persist": 30, "call-ai": 20}
    store = fenced_app.backend.lease_store
    samples = {f"proj.report|load-data|{gap_bucket(0.5)}": 40, f"proj.report|call-ai|{gap_bucket(1.0)}": 2}
    store.metrics.add_gaps(samples, max_fields=1000)
    store.metrics.add_metrics({"owner_false_takeover_total|stage=call-ai,task=proj.report": 1}, max_fields=1000)
    tuned = run(fenced_app, "tune", "--floor", "0.1", "--factor", "2")
    assert tuned.exit_code == 0, tuned.output
    rows = tune_rows(tuned.stdout)
    assert rows["proj.report", "call-ai"][7] == "-", "two samples are no evidence for a value"
    assert rows["proj.report", "call-ai"][5] == "1"  # its false takeover
    assert rows["proj.report", "load-data"][7] == "1s"
    assert "warning: stage 'call-ai' of proj.report has 2 sample(s), fewer than 30: no suggestion" in tuned.stderr
    table = json.loads(tuned.stdout.strip().splitlines()[-1].split("=", 1)[1])
    assert table == {"call-ai": 20, "load-data": 1.0, "persist": 30}  # pasted, it removes no deadline


def test_tune_shows_the_deadline_each_task_runs_under_and_suggests_into_the_table_that_sets_it(
    fenced_app: Celery,
) -> None:
    from celery_fenced import ProgressLeasedTask

    fenced_app.conf.fenced_default_stage_timeout = 5  # the app-wide default
    fenced_app.conf.fenced_stage_timeouts = {"persist": 30}

    @fenced_app.task(base=ProgressLeasedTask, shared=False, name="proj.slow_api", stage_timeouts={"call-api": 120})
    def slow_api() -> None: ...

    @fenced_app.task(base=ProgressLeasedTask, shared=False, name="proj.quick")
    def quick() -> None: ...

    store = fenced_app.backend.lease_store
    samples = {
        f"proj.slow_api|call-api|{gap_bucket(20.0)}": 40,
        f"proj.quick|call-api|{gap_bucket(0.5)}": 40,
        f"proj.gone|call-api|{gap_bucket(0.5)}": 40,  # a task this app does not define
    }
    store.metrics.add_gaps(samples, max_fields=1000)
    tuned = run(fenced_app, "tune", "--floor", "0.1", "--factor", "2")
    assert tuned.exit_code == 0, tuned.output
    rows = tune_rows(tuned.stdout)
    assert rows["proj.slow_api", "call-api"][6] == "120s"  # its own stage_timeouts, not the app's 5 s
    assert "own stage_timeouts" in " ".join(rows["proj.slow_api", "call-api"])
    assert rows["proj.quick", "call-api"][6] == "5s"  # the app's default
    assert rows["proj.gone", "call-api"][6] == "5s" and "not defined in this app" in " ".join(
        rows["proj.gone", "call-api"]
    )
    *_, own, shared = tuned.stdout.strip().splitlines()
    task, _, table = own.partition(": stage_timeouts = ")
    assert task == "proj.slow_api"
    assert json.loads(table) == {"call-api": pytest.approx(2 * 20.0, rel=0.02)}  # its own table's line
    assert json.loads(shared.split("=", 1)[1]) == {"call-api": 1.0, "persist": 30}


def test_status_lists_finished_leases_by_state(fenced_app: Celery) -> None:
    store = fenced_app.backend.lease_store
    owner = running(fenced_app, "f1")
    store.release("f1", "host/1/a", owner.owner_token, status=LeaseStatus.DONE)
    running(fenced_app, "f2")
    done = json.loads(run(fenced_app, "status", "--state", "DONE", "--json").stdout)
    assert [(row["task_id"], row["status"]) for row in done] == [("f1", "DONE")]
    every = run(fenced_app, "status", "--all").output
    assert "f1" in every and "f2" in every and "DONE" in every


def test_help_is_plain_text() -> None:
    shown = CliRunner().invoke(fenced, ["status", "--help"]).output
    assert "--state" in shown and "``" not in shown


def test_a_url_with_two_database_numbers_says_what_to_write_instead() -> None:
    """``REDIS_URL`` with a database number, given another one, as the README's program does."""
    app = Celery("bad", set_as_current=False, backend="fenced+redis://:secret@127.0.0.1:6391/0/1")
    failed = run(app, "status")
    assert failed.exit_code == 1 and "Traceback" not in failed.output
    [line] = failed.output.splitlines()
    assert line == (
        "Error: result_backend fenced+redis://:**@127.0.0.1:6391/0/1 names the database as '/0/1': a Redis URL "
        "ends in one database number, as in fenced+redis://:**@127.0.0.1:6391/1 (a server URL that already "
        "ends in a database number must not be given another)"
    )
    assert "secret" not in line


@pytest.mark.parametrize("port", ["99999", "63x9"])
def test_a_url_with_a_bad_port_is_one_line_naming_it(port: str) -> None:
    app = Celery("bad", set_as_current=False, backend=f"fenced+redis://:secret@127.0.0.1:{port}/1")
    failed = run(app, "status")
    assert failed.exit_code == 1 and "Traceback" not in failed.output
    [line] = failed.output.splitlines()
    assert line.startswith(f"Error: result_backend fenced+redis://:**@127.0.0.1:{port}/1 has no valid port: ")
    assert "secret" not in line


def test_an_unreachable_lease_redis_is_one_line() -> None:
    app = Celery("down", set_as_current=False, backend="fenced+redis://127.0.0.1:1/0")
    for argv in (["status"], ["inspect", "t1"], ["cancel", "t1"]):
        failed = run(app, *argv)
        assert failed.exit_code == 1, failed.output
        [line] = failed.output.splitlines()
        assert line.startswith("Error: the lease Redis cannot be reached: "), line


def test_status_lists_the_workers_liveness_records(fenced_app: Celery) -> None:
    store = fenced_app.backend.lease_store
    store.liveness.worker_alive("w1@box/4242/abc", 30_000)
    received = [Reservation(task_id, 60_000, "proj.task", CALL, 3, publish_id="p1") for task_id in ("r1", "r2")]
    store.reserve_many(received, "w1@box", "w1@box/4242/abc")
    store.liveness.worker_alive("w2@box/77/def", 1)  # gone without saying so: lapsed at once
    lapses_at = {worker_id: until for worker_id, until, _ in store.liveness.workers()}["w2@box/77/def"]
    wait_until(lambda: store.server_time_ms() > lapses_at, 5, "the record to lapse")
    rows = json.loads(run(fenced_app, "status", "--workers", "--json").stdout)
    assert [(r["hostname"], r["pid"], r["reserved"], r["alive"]) for r in rows] == [
        ("w2@box", 77, 0, False),
        ("w1@box", 4242, 2, True),
    ]
    assert 25 < rows[1]["seconds_left"] <= 30
    table = run(fenced_app, "status", "--workers").output
    assert "lapsed: its reservations are sent again at the next reaper pass" in table
    assert table.rstrip().endswith("2 worker(s)")


def json_of(app: Celery, *args: str) -> Any:
    """What a ``--json`` command printed: its whole stdout, parsed as one JSON document."""
    shown = run(app, *args)
    assert shown.exit_code == 0, shown.output
    return json.loads(shown.stdout)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_status_json_is_one_array_whatever_it_lists(fenced_app: Celery, count: int) -> None:
    """No lease is ``[]`` (not an empty output), one or many an object each, in every selection."""
    store = fenced_app.backend.lease_store
    for index in range(count):
        running(fenced_app, f"live{index}")
        owner = running(fenced_app, f"done{index}")
        store.release(f"done{index}", "host/1/a", owner.owner_token, status=LeaseStatus.DONE)
        owner = running(fenced_app, f"dead{index}", max_takeovers=0)
        store.lapse(f"dead{index}", "host/1/a", owner.owner_token, mode="release")
    reap(fenced_app)  # dead<i> are ABANDONED
    selections = {
        ("status",): "live",
        ("status", "--state", "RUNNING"): "live",
        ("status", "--state", "DONE"): "done",
        ("status", "--state", "ABANDONED"): "dead",
        ("status", "--state", "LAPSED"): None,  # none in any case
    }
    for args, prefix in selections.items():
        rows = json_of(fenced_app, *args, "--json")
        assert isinstance(rows, list), args
        expected = [] if prefix is None else [f"{prefix}{index}" for index in range(count)]
        assert sorted(row["task_id"] for row in rows) == expected, args
    every = json_of(fenced_app, "status", "--all", "--json")
    assert len(every) == 3 * count


@pytest.mark.parametrize("count", [0, 1, 3])
def test_status_workers_json_is_one_array_whatever_it_lists(fenced_app: Celery, count: int) -> None:
    store = fenced_app.backend.lease_store
    for index in range(count):
        store.liveness.worker_alive(f"w{index}@box/{100 + index}/abc", 30_000)
    rows = json_of(fenced_app, "status", "--workers", "--json")
    assert isinstance(rows, list)
    assert sorted((row["hostname"], row["pid"], row["reserved"]) for row in rows) == [
        (f"w{index}@box", 100 + index, 0) for index in range(count)
    ]


def test_inspect_json_is_one_object_and_nothing_on_stdout_when_there_is_no_lease(fenced_app: Celery) -> None:
    missing = run(fenced_app, "inspect", "nothing", "--json")
    assert (missing.exit_code, missing.stdout) == (1, "")
    assert missing.stderr.strip() == "Error: task nothing has no lease (unknown, or its lease expired)"
    running(fenced_app, "one")
    shown = json_of(fenced_app, "inspect", "one", "--json")
    assert isinstance(shown, dict) and shown["status"] == "RUNNING" and shown["call"] == CALL
