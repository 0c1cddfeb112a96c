"""A takeover as one linked history in OpenTelemetry: real workers, Celery's own instrumentation,
the SDK exporting every span to a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster, zombie_scenario
from tests.support.processes import wait_until

pytest.importorskip("opentelemetry.sdk", reason="the tracing test needs the extra 'otel' and the SDK")
pytest.importorskip("opentelemetry.instrumentation.celery", reason="needs opentelemetry-instrumentation-celery")

pytestmark = pytest.mark.integration

RUN = "run/tests.integration.apps.fenced_app.zombie_once"


def spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def runs_of(path: Path, task_id: str) -> list[dict[str, Any]]:
    found = [s for s in spans(path) if s["name"] == RUN and s["attributes"].get("messaging.message.id") == task_id]
    return sorted(found, key=lambda s: s["attributes"]["celery_fenced.attempt"])


def takeovers_of(path: Path, task_id: str) -> list[dict[str, Any]]:
    return [
        s
        for s in spans(path)
        if s["name"] == "celery_fenced.takeover" and s["attributes"].get("celery.task_id") == task_id
    ]


def span_id(span: dict[str, Any]) -> str:
    return span["context"]["span_id"]


def linked(span: dict[str, Any]) -> dict[str, str]:
    """The span ids ``span`` links to, by the link's ``celery_fenced.link`` kind."""
    return {link["attributes"].get("celery_fenced.link", ""): link["context"]["span_id"] for link in span["links"]}


def test_a_takeover_is_one_linked_history_of_spans(cluster: Cluster, tmp_path: Path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    task_id, runs = zombie_scenario(cluster, environ={"FENCED_TEST_TRACE_FILE": str(trace_file)})

    wait_until(lambda: len(runs_of(trace_file, task_id)) == 2, 20, "both attempts' run spans")
    wait_until(lambda: takeovers_of(trace_file, task_id), 10, "the reaper's re-send span")
    first, second = runs_of(trace_file, task_id)
    [takeover] = takeovers_of(trace_file, task_id)

    # Each attempt's span tells which attempt it was.
    assert first["attributes"]["celery_fenced.token"] == runs[0]["token"]
    assert first["attributes"]["celery_fenced.attempt"] == 1
    assert first["attributes"]["celery_fenced.takeovers"] == 0
    assert second["attributes"]["celery_fenced.token"] == runs[1]["token"]
    assert second["attributes"]["celery_fenced.attempt"] == 2
    assert second["attributes"]["celery_fenced.takeovers"] == 1

    # The stalled attempt's story: its stage, the stall, the loss and its refused write.
    names = [event["name"] for event in first["events"]]
    progress = [e for e in first["events"] if e["name"] == "celery_fenced.progress"]
    assert progress, names
    assert first["attributes"]["celery_fenced.stage"] == progress[-1]["attributes"]["stage"]
    for expected in ("celery_fenced.stalled", "celery_fenced.lease_lost", "celery_fenced.write_refused"):
        assert expected in names, names
    assert names.index("celery_fenced.stalled") < names.index("celery_fenced.write_refused")
    [refused] = [e for e in first["events"] if e["name"] == "celery_fenced.write_refused"]
    assert refused["attributes"]["celery_fenced.current_token"] == runs[1]["token"]

    # The reaper's re-send links to the attempt it replaced; the next attempt links to both.
    assert takeover["attributes"]["cause"] == "stalled"
    assert takeover["attributes"]["celery_fenced.token"] == runs[0]["token"]
    assert linked(takeover) == {"replaced": span_id(first)}
    assert linked(second) == {"replaced": span_id(first), "takeover": span_id(takeover)}
