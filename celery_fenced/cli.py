"""``celery -A proj fenced …``: look at leases, act on one task, serve metrics, tune deadlines.

Registered as a ``celery.commands`` entry point, so it is a subcommand of Celery's own CLI
and gets the app from ``-A``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from . import control
from .conf import ensure_conf
from .metrics import BUCKETS, COUNTERS, HISTOGRAMS, read_totals

__all__ = ["fenced"]


def _app(ctx: click.Context) -> Any:
    obj = ctx.find_object(object)
    app = getattr(ctx.obj, "app", None) or getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj fenced …`")
    return app


def _store(app: Any) -> Any:
    store = getattr(app.backend, "lease_store", None)
    if store is None:
        raise click.ClickException(
            f"the result backend is {type(app.backend).__name__}: celery fenced needs "
            "result_backend = 'fenced+redis://…'"
        )
    return store


@click.group(name="fenced")
@click.pass_context
def fenced(ctx: click.Context) -> None:
    """Progress-aware leases: status, inspect, cancel, redrive, metrics, tune, flower."""


@fenced.command()
@click.option("--limit", default=200, show_default=True, help="Most leases listed.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per lease instead of a table.")
@click.option("--all", "show_all", is_flag=True, help="Also lapsed, requeued and retrying leases.")
@click.pass_context
def status(ctx: click.Context, limit: int, as_json: bool, show_all: bool) -> None:
    """A table of live leases: task, owner, token, stage, seconds since progress, seconds left."""
    store = _store(_app(ctx))
    now = store.server_time_ms()
    states = store.read_many(store.indexed_task_ids(limit))
    rows = [s for s in states if show_all or s.is_live]
    if as_json:
        for state in rows:
            click.echo(json.dumps(_row(state, now)))
        return
    headers = ("TASK ID", "NAME", "STATUS", "OWNER", "TOKEN", "STAGE", "SINCE PROGRESS", "LEFT", "ATTEMPT")
    table = [
        (
            r["task_id"],
            r["name"],
            r["status"],
            r["owner"],
            str(r["token"]),
            r["stage"] or "-",
            f"{r['seconds_since_progress']:.1f}s",
            f"{r['seconds_left']:.1f}s",
            str(r["attempt"]),
        )
        for r in (_row(state, now) for state in rows)
    ]
    _print_table(headers, table)
    click.echo(f"{len(table)} lease(s)")


def _row(state: Any, now: int) -> dict[str, Any]:
    return {
        "task_id": state.task_id,
        "name": state.task_name,
        "status": state.status,
        "owner": state.owner_id,
        "token": state.owner_token,
        "stage": state.current_stage,
        "seconds_since_progress": (now - (state.last_progress_at or now)) / 1000,
        "seconds_left": ((state.lease_expire_at or now) - now) / 1000,
        "attempt": state.attempt,
        "takeovers": state.takeovers,
    }


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


@fenced.command()
@click.argument("task_id")
@click.pass_context
def inspect(ctx: click.Context, task_id: str) -> None:
    """The whole lease of TASK_ID, as JSON."""
    state = control.inspect(_app(ctx), task_id)
    if state is None:
        raise click.ClickException(f"task {task_id} has no lease")
    click.echo(json.dumps(dict(state.raw), indent=2, sort_keys=True))


@fenced.command()
@click.argument("task_id")
@click.option("--reason", default="cancelled", show_default=True, help="Stored in the REVOKED result.")
@click.pass_context
def cancel(ctx: click.Context, task_id: str, reason: str) -> None:
    """End TASK_ID for good (a fenced REVOKED; its owner is told at its next step)."""
    click.echo(control.cancel(_app(ctx), task_id, reason))


@fenced.command()
@click.argument("task_id")
@click.pass_context
def redrive(ctx: click.Context, task_id: str) -> None:
    """Put an ABANDONED TASK_ID back for a fresh set of takeovers."""
    code = control.redrive(_app(ctx), task_id)
    click.echo(code)
    if code != "redriven":
        ctx.exit(1)


@fenced.command()
@click.option("--port", default=9808, show_default=True, type=int, help="HTTP port of the exporter.")
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.pass_context
def metrics(ctx: click.Context, port: int, addr: str) -> None:
    """Serve the cluster-wide metrics to Prometheus on http://ADDR:PORT/metrics."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY

    REGISTRY.register(ClusterCollector(_store(_app(ctx))))
    start_http_server(port, addr=addr)
    click.echo(f"celery-fenced metrics on http://{addr}:{port}/metrics", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


class ClusterCollector:
    """A Prometheus collector reading the cluster totals from Redis at each scrape."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        counters: dict[str, dict[str, float]] = defaultdict(dict)
        histograms: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        for name, rest, value in read_totals(self.store):
            if name in COUNTERS:
                counters[name][rest] = value
            elif name in HISTOGRAMS:
                labels, _, part = rest.partition("|")
                histograms[name][labels][part] = value
        for name, help_text in COUNTERS.items():
            label_names = sorted({k for labels in counters[name] for k in _parse_labels(labels)})
            family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=label_names)
            if not counters[name] and not label_names:
                family.add_metric([], 0.0)
            for labels, value in counters[name].items():
                parsed = _parse_labels(labels)
                family.add_metric([parsed.get(k, "") for k in label_names], value)
            yield family
        for name, help_text in HISTOGRAMS.items():
            label_names = sorted({k for labels in histograms[name] for k in _parse_labels(labels)})
            histogram = HistogramMetricFamily(name, help_text, labels=label_names)
            for labels, parts in histograms[name].items():
                parsed = _parse_labels(labels)
                buckets = [(str(b), parts.get(f"bucket|{b}", 0.0)) for b in BUCKETS]
                buckets.append(("+Inf", parts.get("bucket|+Inf", 0.0)))
                histogram.add_metric([parsed.get(k, "") for k in label_names], buckets, parts.get("sum", 0.0))
            yield histogram


def _parse_labels(text: str) -> dict[str, str]:
    if not text:
        return {}
    return dict(pair.split("=", 1) for pair in text.split(","))


@fenced.command()
@click.option("--floor", default=1.0, show_default=True, type=float, help="Smallest deadline suggested, s.")
@click.option("--factor", default=3.0, show_default=True, type=float, help="Safety factor over the P99.")
@click.pass_context
def tune(ctx: click.Context, floor: float, factor: float) -> None:
    """Suggest stage deadlines: max(floor, P99 × factor) of the observed stage durations."""
    if floor <= 0 or factor < 1:
        raise click.BadParameter("--floor must be > 0 and --factor >= 1")
    app = _app(ctx)
    store = _store(app)
    policy = ensure_conf(app).policy
    stages: dict[str, dict[str, float]] = defaultdict(dict)
    false_takeovers: dict[str, float] = defaultdict(float)
    for name, rest, value in read_totals(store):
        labels, _, part = rest.partition("|")
        parsed = _parse_labels(labels)
        if name == "owner_stage_duration_seconds" and "stage" in parsed:
            stages[parsed["stage"]][part] = value
        elif name == "owner_false_takeover_total":
            false_takeovers[parsed.get("stage", "")] += value
    if not stages:
        click.echo("no stage durations observed yet: run some tasks first")
        return
    suggestions: dict[str, float] = {}
    table = []
    for stage in sorted(stages):
        parts = stages[stage]
        count = parts.get("count", 0.0)
        p99 = _quantile(parts, 0.99)
        current = policy.stage_timeout(stage)
        suggested = max(floor, p99 * factor)
        if false_takeovers.get(stage):
            suggested = max(suggested, current * factor)  # false takeovers: the deadline was too tight
        suggested = math.ceil(suggested * 10) / 10
        suggestions[stage] = suggested
        table.append(
            (
                stage,
                f"{int(count)}",
                f"{p99:.3f}s",
                f"{int(false_takeovers.get(stage, 0))}",
                f"{current:g}s",
                f"{suggested:g}s",
            )
        )
    _print_table(("STAGE", "SAMPLES", "P99", "FALSE TAKEOVERS", "CURRENT", "SUGGESTED"), table)
    click.echo(f"fenced_stage_timeouts = {json.dumps(suggestions)}")


def _quantile(parts: dict[str, float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile ``q`` (a safe over-estimate)."""
    count = parts.get("count", 0.0)
    if not count:
        return 0.0
    target = q * count
    for bound in BUCKETS:
        if parts.get(f"bucket|{bound}", 0.0) >= target:
            return float(bound)
    return float(BUCKETS[-1]) * 2


@fenced.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def flower(ctx: click.Context) -> None:
    """Start Flower with the lease fields, columns and token rule (other options go to Flower)."""
    conf = Path(__file__).parent / "contrib" / "flower" / "flowerconfig.py"
    root = ctx.find_root()
    app_arg = root.params.get("app")
    argv = [sys.executable, "-m", "celery"]
    if app_arg:
        argv += ["-A", str(app_arg)]
    argv += ["flower", f"--conf={conf}", *ctx.args]
    os.execv(sys.executable, argv)
