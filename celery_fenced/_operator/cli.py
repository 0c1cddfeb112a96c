"""celery -A proj fenced …: look at leases, act on one task, serve metrics, tune deadlines.

The commands read, act and echo; what they print is made in :mod:`celery_fenced._operator.listing`.
Registered as a celery.commands entry point, so it is a subcommand of Celery's own CLI
and gets the app from -A.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from kombu.utils.url import maybe_sanitize_url
from redis.exceptions import RedisError

from .._celery.startup import flush_warnings
from .._lease.state import CancelOutcome, RedriveOutcome
from .._lease.store import LeaseStore, lease_store_of
from .._telemetry.metrics import ClusterCollector, read_false_takeovers, read_gaps
from ..conf import TaskPolicy, ensure_conf
from ..exceptions import ConfigurationError
from . import control
from .listing import (
    COUNTS_LEGEND,
    LEASE_HEADERS,
    WORKER_HEADERS,
    lease_cells,
    lease_row,
    render_lease,
    seconds,
    shown_fields,
    table,
    worker_cells,
    worker_row,
)
from .tuning import suggest

__all__ = ["LISTED_STATES", "LIVE_STATES", "fenced"]


def _app(ctx: click.Context) -> Any:
    obj = ctx.find_object(object)
    app = getattr(ctx.obj, "app", None) or getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj fenced …`")
    try:
        ensure_conf(app)
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    flush_warnings(configure=True)
    return app


def _store(app: Any) -> LeaseStore:
    try:
        return lease_store_of(app, "celery fenced")
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # Celery could not make the backend from its URL
        url = maybe_sanitize_url(str(app.conf.result_backend or ""))
        raise click.ClickException(f"result_backend {url} cannot be used: {exc}") from None


class _OneLineErrors(click.Group):
    """The fenced group: a lost or refused Redis connection is one Error: line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RedisError as exc:
            raise click.ClickException(f"the lease Redis cannot be reached: {exc}") from None


@click.group(name="fenced", cls=_OneLineErrors)
@click.pass_context
def fenced(ctx: click.Context) -> None:
    """Progress-aware leases: status, inspect, cancel, redrive, metrics, tune, flower, dashboards."""


#: The statuses status --state selects; live ones (RUNNING, STALLED, RESERVED) are listed by default.
LISTED_STATES = ("RUNNING", "STALLED", "RESERVED", "LAPSED", "REQUEUED", "RETRYING", "ABANDONED", "DONE")

#: What status lists without --state or --all.
LIVE_STATES = ("RUNNING", "STALLED", "RESERVED")


@fenced.command()
@click.option("--limit", default=200, show_default=True, help="Most leases listed.")
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON array instead of a table: an object per lease ([] for none)."
)
@click.option("--all", "show_all", is_flag=True, help="Every state below, not only the live ones.")
@click.option(
    "--state",
    "wanted",
    multiple=True,
    type=click.Choice(LISTED_STATES, case_sensitive=False),
    help="Only leases in this state (repeat for several); ABANDONED lists the dead letters, DONE the "
    "finished ones kept as tombstones (a task finished by its result keeps none: inspect reads it).",
)
@click.option(
    "--workers",
    "show_workers",
    is_flag=True,
    help="The workers' liveness records instead: worker, pid, reservations held, seconds left (--json: an "
    "array, an object per worker).",
)
@click.pass_context
def status(
    ctx: click.Context, limit: int, as_json: bool, show_all: bool, wanted: tuple[str, ...], show_workers: bool
) -> None:
    """A table of leases: task, owner, token, stage, seconds since progress, seconds left.

    By default the live ones (RUNNING, STALLED, and RESERVED: received by the worker named
    as owner, not started; LEFT is the time until it is sent again); --state or --all
    for the others, ABANDONED tasks (the dead letters, for redrive) included. --workers
    lists the workers' liveness records (a lapsed one is a worker gone without saying so).
    """
    app = _app(ctx)
    store = _store(app)
    if show_workers:
        _print_workers(store, as_json)
        return
    selected = {state.upper() for state in wanted} or set(LISTED_STATES if show_all else LIVE_STATES)
    now = store.server_time_ms()
    rows = [s for s in store.read_many(store.indexed_task_ids(limit)) if s.status in selected]
    if "ABANDONED" in selected:
        rows += control.abandoned(app, limit)
    if "DONE" in selected:  # finished leases are in no index: a scan finds them
        listed = {state.task_id for state in rows}
        rows += [
            s for s in store.read_many(store.lease_task_ids(limit)) if s.status == "DONE" and s.task_id not in listed
        ]
    rows = rows[:limit]
    if as_json:
        click.echo(json.dumps([lease_row(state, now) for state in rows]))
        return
    click.echo(table(LEASE_HEADERS, [lease_cells(lease_row(state, now)) for state in rows]))
    if rows:
        click.echo(COUNTS_LEGEND)
    click.echo(f"{len(rows)} lease(s)")


def _print_workers(store: LeaseStore, as_json: bool) -> None:
    now = store.server_time_ms()
    rows = [worker_row(worker_id, until, reserved, now) for worker_id, until, reserved in store.liveness.workers()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(table(WORKER_HEADERS, [worker_cells(row) for row in rows]))
    click.echo(f"{len(rows)} worker(s)")


@fenced.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="The lease as one JSON object, typed.")
@click.pass_context
def inspect(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """The whole lease of TASK_ID: typed fields, times as dates and ages, and the recorded call.

    After a cancel, ownerToken is the owner's token and cancelToken the cancel's.
    """
    app = _app(ctx)
    store = _store(app)
    state = control.inspect(app, task_id)
    if state is None:
        raise click.ClickException(f"task {task_id} has no lease (unknown, or its lease expired)")
    fields = shown_fields(state.typed_fields())
    if as_json:
        click.echo(json.dumps(fields, indent=2, sort_keys=True))
        return
    click.echo(render_lease(task_id, fields, store.server_time_ms()))


@fenced.command()
@click.argument("task_ids", nargs=-1, required=True)
@click.option("--reason", default="cancelled", show_default=True, help="Stored in the REVOKED result.")
@click.option(
    "--force",
    is_flag=True,
    help="Also cancel an id with neither lease nor result (a task still waiting in the queue).",
)
@click.pass_context
def cancel(ctx: click.Context, task_ids: tuple[str, ...], reason: str, force: bool) -> None:
    """End each TASK_ID for good (a fenced REVOKED; its owner is told at its next step).

    An id with neither lease nor result is an error and nothing is stored for it, unless
    --force: a task that waits in the queue has neither yet.
    """
    app = _app(ctx)
    _store(app)
    failed = 0
    for task_id in task_ids:
        code = control.cancel(app, task_id, reason, unknown_too=force)
        if code == CancelOutcome.UNKNOWN:
            failed += 1
            click.echo(
                f"Error: task {task_id} is unknown (no lease, no result): nothing stored; "
                "--force cancels a task still waiting in the queue",
                err=True,
            )
            continue
        click.echo(f"{task_id}: {code}")
    if failed:
        ctx.exit(1)


@fenced.command()
@click.argument("task_ids", nargs=-1)
@click.option("--all-abandoned", is_flag=True, help="Every ABANDONED task (see status --state ABANDONED).")
@click.pass_context
def redrive(ctx: click.Context, task_ids: tuple[str, ...], all_abandoned: bool) -> None:
    """Put ABANDONED tasks back for a fresh set of takeovers: TASK_IDS, or --all-abandoned."""
    app = _app(ctx)
    _store(app)
    ids = list(task_ids)
    if all_abandoned:
        ids += [state.task_id for state in control.abandoned(app, limit=100_000) if state.task_id not in ids]
    if not ids:
        if all_abandoned:
            click.echo("no abandoned task")
            return
        raise click.UsageError("give TASK_IDS or --all-abandoned")
    failed = 0
    for task_id, code in control.redrive_many(app, ids).items():
        if code == RedriveOutcome.REDRIVEN:
            click.echo(f"{task_id}: redriven")
            continue
        failed += 1
        why = "unknown (no lease)" if code == RedriveOutcome.MISSING else f"not abandoned ({code})"
        click.echo(f"Error: task {task_id} is {why}: nothing changed", err=True)
    if failed:
        ctx.exit(1)


@fenced.command()
@click.option("--port", default=9808, show_default=True, type=int, help="HTTP port of the exporter.")
@click.option("--addr", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.pass_context
def metrics(ctx: click.Context, port: int, addr: str) -> None:
    """Serve the cluster-wide metrics to Prometheus on http://ADDR:PORT/metrics."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY

    app = _app(ctx)
    REGISTRY.register(ClusterCollector(_store(app), due_within_ms=ensure_conf(app).due_horizon_ms))
    start_http_server(port, addr=addr)
    click.echo(f"celery-fenced metrics on http://{addr}:{port}/metrics", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


@fenced.command()
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write celery-fenced.json and celery-fenced-rules.yml into.",
)
def dashboards(out: Path) -> None:
    """Write the Prometheus alert rules, and the Grafana dashboard where it can be built, into OUT."""
    from . import dashboards as shipped

    written = shipped.write(out)
    for path in written:
        click.echo(str(path))
    if shipped.DASHBOARD_FILE not in {path.name for path in written}:
        click.echo(shipped.SDK_MISSING, err=True)


@fenced.command()
@click.option("--floor", default=1.0, show_default=True, type=float, help="Smallest deadline suggested, s.")
@click.option("--factor", default=3.0, show_default=True, type=float, help="Safety factor over the quantile.")
@click.option("--quantile", "q", default=0.99, show_default=True, type=float, help="Quantile of the gaps used.")
@click.option("--min-samples", default=30, show_default=True, type=int, help="Fewer samples: no suggestion.")
@click.pass_context
def tune(ctx: click.Context, floor: float, factor: float, q: float, min_samples: int) -> None:
    """Suggest stage deadlines: max(floor, quantile × factor) of the longest gaps between progress calls.

    A deadline bounds the longest gap between two progress calls of its stage, so that is
    what is sampled (one sample per visit of a stage, the newest ones kept), per task: each
    row shows the deadline in force for that task (its own stage_timeouts, else the app's).
    A stage with false takeovers (an old owner that ran on past its deadline and finished
    after it was taken over) is never cut.
    """
    for wrong, name, rule in (
        (floor <= 0, "--floor", "above 0"),
        (factor < 1, "--factor", "1 or more"),
        (not 0 < q <= 1, "--quantile", "in (0, 1]"),
        (min_samples < 1, "--min-samples", "1 or more"),
    ):
        if wrong:
            raise click.BadParameter(f"{name} must be {rule}", param_hint=name)
    app = _app(ctx)
    store = _store(app)
    false_takeovers = read_false_takeovers(store)
    gaps = read_gaps(store)
    keys = set(gaps) | {key for key, count in false_takeovers.items() if count}
    if not keys:
        click.echo("no stage samples yet: run some tasks first")
        return
    deadlines = _TaskDeadlines(app)
    current = {(task, stage): deadlines.policy(task).stage_timeout(stage or None) for task, stage in keys}
    suggestions = suggest(gaps, false_takeovers, current, floor=floor, factor=factor, q=q, min_samples=min_samples)
    rows = [
        (
            s.task or "-",
            s.stage or "(none)",
            str(s.samples),
            seconds(s.gap_quantile),
            seconds(s.longest_gap),
            str(s.false_takeovers),
            f"{s.current:g}s",
            "-" if s.suggested is None or not s.enough else f"{s.suggested:g}s",
            "; ".join(note for note in (s.note, deadlines.note(s.task)) if note),
        )
        for s in suggestions
    ]
    headers = (
        "TASK",
        "STAGE",
        "SAMPLES",
        f"P{q * 100:g} GAP",
        "LONGEST GAP",
        "FALSE TAKEOVERS",
        "CURRENT",
        "SUGGESTED",
        "NOTE",
    )
    click.echo(table(headers, rows))
    for s in suggestions:
        if s.samples and not s.enough:
            of = f" of {s.task}" if s.task else ""
            click.echo(
                f"warning: stage {s.stage!r}{of} has {s.samples} sample(s), fewer than {min_samples}: no suggestion "
                "(run more tasks, or lower --min-samples)",
                err=True,
            )
    chosen = [s for s in suggestions if s.stage and s.suggested is not None and s.enough]
    if not chosen:
        click.echo("no suggestion: no stage has enough samples yet (keep your fenced_stage_timeouts)")
        return
    # Each table whole, the stages not suggested for kept as they are: pasted, it removes no
    # deadline. A task with its own table gets its own line; the app's table comes last, each
    # stage at the most any task that uses it needs.
    for task in sorted({s.task for s in chosen if deadlines.own_table(s.task) is not None}):
        own = deadlines.own_table(task) or {}
        mine = {s.stage: s.suggested for s in chosen if s.task == task}
        click.echo(f"{task}: stage_timeouts = {json.dumps({**own, **mine}, sort_keys=True)}")
    shared: dict[str, float] = {}
    for s in chosen:
        if deadlines.own_table(s.task) is None:
            assert s.suggested is not None
            shared[s.stage] = max(shared.get(s.stage, 0.0), s.suggested)
    if shared:
        policy = ensure_conf(app).policy
        click.echo(f"fenced_stage_timeouts = {json.dumps({**policy.stage_timeouts, **shared}, sort_keys=True)}")


class _TaskDeadlines:
    """The deadlines each task runs under, as the app given to ``tune`` defines its tasks."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.conf = ensure_conf(app)
        with contextlib.suppress(Exception):  # the modules a worker imports (``imports``, ``include``)
            app.loader.import_default_modules()

    def task(self, name: str) -> Any:
        """The fenced task registered under ``name``, else ``None``."""
        task = self.app.tasks.get(name) if name else None
        return task if getattr(task, "fenced_task", False) else None

    def policy(self, name: str) -> TaskPolicy:
        """The policy of the task ``name``: its own options over the app's; the app's for a task
        this app does not define (or samples that name none)."""
        task = self.task(name)
        return self.conf.policy if task is None else self.conf.policy_for(task)

    def own_table(self, name: str) -> Mapping[str, float] | None:
        """The task's own ``stage_timeouts`` (which replace the app's for it), else ``None``."""
        task = self.task(name)
        return (
            None if task is None or getattr(task, "stage_timeouts", None) is None else self.policy(name).stage_timeouts
        )

    def note(self, name: str) -> str:
        """What the CURRENT column rests on, when it is not plain."""
        if name and self.task(name) is None:
            return "task not defined in this app: the app's deadline shown"
        if self.own_table(name) is not None:
            return "the task's own stage_timeouts"
        return ""


@fenced.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def flower(ctx: click.Context) -> None:
    """Start Flower with the lease fields, columns and token rule (other options go to Flower)."""
    conf = Path(__file__).parent.parent / "contrib" / "flower" / "flowerconfig.py"
    root = ctx.find_root()
    app_arg = root.params.get("app")
    argv = [sys.executable, "-m", "celery"]
    if app_arg:
        argv += ["-A", str(app_arg)]
    argv += ["flower", f"--conf={conf}", *ctx.args]
    os.execv(sys.executable, argv)
