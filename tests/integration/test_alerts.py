"""The shipped alert rules and dashboard on a real Prometheus, scraping ``celery fenced metrics``
while real workers go through a real takeover."""

from __future__ import annotations

import contextlib
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from celery_fenced._operator import dashboards
from celery_fenced.harness import free_port
from tests.integration.conftest import Cluster, zombie_scenario
from tests.monitoring.conftest import prometheus_tool
from tests.support.processes import wait_until

pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk needs Python 3.11 or newer")

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def prometheus(tmp_path: Path, rules: Path, target: str) -> Iterator[str]:
    """A Prometheus server scraping ``target`` every second with ``rules`` loaded; its URL."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        textwrap.dedent(
            f"""
            global:
              scrape_interval: 1s
              evaluation_interval: 1s
            rule_files:
              - {rules}
            scrape_configs:
              - job_name: celery-fenced
                static_configs:
                  - targets: ["{target}"]
            """
        )
    )
    binary = prometheus_tool("prometheus")  # skips (or fails, where CI requires it) without one
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
            return False

        wait_until(ready, 30, "Prometheus to be ready")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def firing(url: str, name: str) -> list[dict[str, Any]]:
    alerts = httpx.get(f"{url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_the_takeover_alert_fires_on_a_real_takeover_and_every_panel_queries(cluster: Cluster, tmp_path: Path) -> None:
    written = cluster.cli("dashboards", "--out", str(tmp_path / "monitoring"))
    assert written.returncode == 0, written.stderr
    rules = tmp_path / "monitoring" / dashboards.RULES_FILE

    exporter = free_port()
    cluster.command("metrics", ["fenced", "metrics", "--port", str(exporter)], "celery-fenced metrics on")
    with prometheus(tmp_path, rules, f"127.0.0.1:{exporter}") as url:
        # Before anything happens: scraped, takeovers at 0 for every cause, no alert.
        wait_until(lambda: len(query(url, "owner_takeover_total")) == 3, 20, "the takeover counters at 0 to be scraped")
        assert not firing(url, "FencedTakeoverRateHigh")

        zombie_scenario(cluster)

        [alert] = wait_until(lambda: firing(url, "FencedTakeoverRateHigh"), 60, "FencedTakeoverRateHigh to fire")
        assert alert["labels"]["severity"] == "warning"
        assert "takeovers in the last 10 minutes" in alert["annotations"]["description"]
        [stalled] = query(url, 'owner_takeover_total{cause="stalled"}')
        assert stalled["value"][1] == "1"

        # Every panel's query runs on this server (Grafana puts its rate window in the macro).
        for _, panels in dashboards.PANELS:
            for panel in panels:
                for expr, _ in panel.queries:
                    query(url, expr.replace("$__rate_interval", "1m"))
