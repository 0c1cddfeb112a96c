"""The Grafana dashboard and the Prometheus alert rules that ship with the package.

``celery -A proj fenced dashboards --out DIR`` writes both: :data:`DASHBOARD_FILE`, built here
with ``grafana-foundation-sdk`` (the extra ``dashboards``) over the metrics that ``celery
fenced metrics`` serves, and :data:`RULES_FILE`, the alert rules kept beside this module as
the YAML Prometheus reads. :data:`PANELS` is the dashboard's content as data: its tests run
every query against a real Prometheus.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..exceptions import ConfigurationError

__all__ = [
    "DASHBOARD_FILE",
    "DASHBOARD_UID",
    "PANELS",
    "RULES_FILE",
    "RULES_GROUP",
    "SDK_MISSING",
    "Panel",
    "build_dashboard",
    "rules_text",
    "sdk_available",
    "write",
]

#: The dashboard's file name, and its uid in Grafana.
DASHBOARD_FILE = "celery-fenced.json"
DASHBOARD_UID = "celery-fenced"

#: The alert rules' file name, and the name of their group.
RULES_FILE = "celery-fenced-rules.yml"
RULES_GROUP = "celery-fenced"

_RATE = "$__rate_interval"  # Grafana's own rate window: at least four scrape intervals


@dataclass(frozen=True)
class Panel:
    """One panel: a title, what it shows, and its queries as ``(PromQL, legend)`` pairs."""

    title: str
    description: str
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"
    stat: bool = False


def _quantiles(histogram: str, by: str = "") -> tuple[tuple[str, str], ...]:
    group = f"le, {by}" if by else "le"
    label = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket[{_RATE}])))",
            f"{label}p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


#: The dashboard's rows and their panels, in order.
PANELS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Takeovers",
        (
            Panel(
                "Takeovers by cause",
                "Tasks the reaper took over from an owner: stalled (owner alive, not progressing) "
                "or gone (lease expired). What FencedTakeoverRateHigh counts.",
                ((f'sum by (cause) (rate(owner_takeover_total{{cause!="unstarted"}}[{_RATE}]))', "{{cause}}"),),
                unit="ops",
            ),
            Panel(
                "Unstarted re-sends",
                "Received messages sent again because no process started them within "
                "fenced_start_timeout (a dropped connection, a long backlog): no takeover.",
                ((f'sum(rate(owner_takeover_total{{cause="unstarted"}}[{_RATE}]))', "unstarted"),),
                unit="ops",
            ),
            Panel(
                "Stalls",
                "Leases that made no progress within their stage's deadline.",
                ((f"sum(rate(owner_no_progress_timeout_total[{_RATE}]))", "stalls"),),
                unit="ops",
            ),
            Panel(
                "False takeovers by stage",
                "Old owners of a takeover that later tried to store a SUCCESS: that stage's deadline "
                "is too tight (run `celery fenced tune`).",
                ((f"sum by (stage) (increase(owner_false_takeover_total[{_RATE}]))", "{{stage}}"),),
            ),
            Panel(
                "Abandoned tasks",
                "Tasks taken over max_takeovers times and not redriven (`celery fenced redrive`).",
                (("sum(owner_abandoned_tasks)", "abandoned"),),
                stat=True,
            ),
        ),
    ),
    (
        "Fencing and leases",
        (
            Panel(
                "Fencing refusals",
                "Writes refused because a newer token owned the task (zombies stopped).",
                ((f"sum(rate(owner_fencing_rejected_total[{_RATE}]))", "refused"),),
                unit="ops",
            ),
            Panel(
                "Renewals rejected",
                "Lease renewals refused (taken over, claimed, ended), beside those accepted.",
                (
                    (f"sum(rate(owner_lease_renew_rejected_total[{_RATE}]))", "rejected"),
                    (f"sum(rate(owner_lease_renew_total[{_RATE}]))", "accepted"),
                ),
                unit="ops",
            ),
            Panel(
                "Live leases and heartbeats",
                "Leases the reaper watches, those held or due now, and the heartbeat checks that keep them.",
                (
                    ("sum(owner_live_leases)", "live leases"),
                    ("sum(owner_due_leases)", "held or due"),
                    (f"sum(rate(owner_heartbeat_total[{_RATE}]))", "heartbeat checks/s"),
                ),
            ),
        ),
    ),
    (
        "Stages and streams",
        (
            Panel(
                "Stage duration by stage",
                "How long each stage takes (p50, p90, p99): the basis of its deadline.",
                _quantiles("owner_stage_duration_seconds", by="stage"),
                unit="s",
            ),
            Panel(
                "Task duration",
                "Run time of attempts that stored their result.",
                _quantiles("owner_task_total_duration_seconds"),
                unit="s",
            ),
            Panel(
                "First-token latency",
                "Time from the start of a stream to its first chunk.",
                _quantiles("owner_ai_first_token_duration_seconds"),
                unit="s",
            ),
            Panel(
                "Stream idle timeouts",
                "Streams that went quiet for longer than their idle timeout.",
                ((f"sum(rate(owner_stream_idle_timeout_total[{_RATE}]))", "idle timeouts"),),
                unit="ops",
            ),
        ),
    ),
)


#: Why the dashboard is not written where its builder cannot be installed, and what to do.
SDK_MISSING = (
    "celery-fenced.json not written: it is built by grafana-foundation-sdk, which is not installed "
    "(it has no release for Python 3.10); on Python 3.11 or newer, "
    "pip install 'celery-fenced[dashboards]' and run this command again. "
    "The alert rules need nothing and were written."
)


def _sdk() -> Any:
    try:
        from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models.dashboard import DataSourceRef
    except ImportError as exc:
        raise ConfigurationError(
            "the Grafana dashboard needs grafana-foundation-sdk (Python 3.11 or newer): "
            "pip install 'celery-fenced[dashboards]'"
        ) from exc
    return dashboard, prometheus, stat, timeseries, JSONEncoder, DataSourceRef


def sdk_available() -> bool:
    """Whether ``grafana-foundation-sdk`` (the ``dashboards`` extra) can be imported here."""
    try:
        _sdk()
    except ConfigurationError:
        return False
    return True


def build_dashboard() -> dict[str, Any]:
    """The Grafana dashboard, as the JSON object Grafana imports.

    Raises:
        ConfigurationError: ``grafana-foundation-sdk`` is not installed.
    """
    dashboard, prometheus, stat, timeseries, encoder, source_ref = _sdk()
    source = source_ref(type_val="prometheus", uid="${datasource}")
    board = (
        dashboard.Dashboard("celery-fenced: leases, stalls and takeovers")
        .uid(DASHBOARD_UID)
        .tags(["celery", "celery-fenced"])
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for row, panels in PANELS:
        board = board.with_row(dashboard.Row(row))
        for panel in panels:
            view = (stat.Panel() if panel.stat else timeseries.Panel()).title(panel.title)
            view = view.description(panel.description).unit(panel.unit).datasource(source).span(12).height(8)
            for ref, (expr, legend) in zip("ABCDEFGH", panel.queries, strict=False):
                view = view.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref))
            board = board.with_panel(view)
    built: dict[str, Any] = json.loads(json.dumps(board.build(), cls=encoder))
    return built


def rules_text() -> str:
    """The Prometheus alert rules, as the YAML file Prometheus reads."""
    return resources.files(__package__).joinpath(RULES_FILE).read_text(encoding="utf-8")


def write(out: Path) -> list[Path]:
    """Write the rules, and the dashboard where it can be built, into ``out`` (made if missing).

    The rules are the package's own file and are written on every supported Python; the
    dashboard is built with ``grafana-foundation-sdk`` (the extra ``dashboards``, Python 3.11
    or newer) and is left out where that is not installed (:data:`SDK_MISSING` says so).

    Returns:
        The files written: the dashboard (where built), then the rules.
    """
    board = build_dashboard() if sdk_available() else None
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if board is not None:
        dashboard_path = out / DASHBOARD_FILE
        dashboard_path.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(dashboard_path)
    rules_path = out / RULES_FILE
    rules_path.write_text(rules_text(), encoding="utf-8")
    written.append(rules_path)
    return written
