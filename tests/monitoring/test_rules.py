"""The shipped dashboard and alert rules: written by the command, checked by the real promtool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from celery_fenced._operator import dashboards
from celery_fenced._operator.cli import fenced
from tests.monitoring.conftest import prometheus_tool

try:
    import grafana_foundation_sdk  # noqa: F401
except ImportError:  # Python 3.10: the package has no release for it
    HAS_SDK = False
else:
    HAS_SDK = True

#: The tests that write the dashboard; the last one here runs everywhere.
needs_sdk = pytest.mark.skipif(not HAS_SDK, reason="grafana-foundation-sdk needs Python 3.11 or newer")

HERE = Path(__file__).parent


def write(out: Path) -> list[Path]:
    result = CliRunner().invoke(fenced, ["dashboards", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [Path(line) for line in result.output.split()]


@needs_sdk
def test_the_command_writes_the_dashboard_and_the_rules(tmp_path: Path) -> None:
    written = write(tmp_path / "out")
    assert written == [tmp_path / "out" / "celery-fenced.json", tmp_path / "out" / "celery-fenced-rules.yml"]
    board = json.loads(written[0].read_text())
    assert board["uid"] == "celery-fenced"
    titles = [panel["title"] for panel in board["panels"] if panel["type"] != "row"]
    for wanted in (
        "Takeovers by cause",
        "Stalls",
        "False takeovers by stage",
        "Fencing refusals",
        "Abandoned tasks",
        "Renewals rejected",
        "Stage duration by stage",
        "First-token latency",
        "Stream idle timeouts",
    ):
        assert wanted in titles
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets") or []]
    assert exprs == [expr for _, panels in dashboards.PANELS for panel in panels for expr, _ in panel.queries]
    assert written[1].read_text() == dashboards.rules_text()


def shipped_rules(directory: Path) -> Path:
    """The rules as the package ships them (the command writes this text; no SDK needed)."""
    rules = directory / dashboards.RULES_FILE
    rules.write_text(dashboards.rules_text())
    return rules


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    promtool = prometheus_tool("promtool")
    rules = shipped_rules(tmp_path)
    checked = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 4 rules found" in checked.stdout


def test_the_rules_pass_their_promtool_unit_tests(tmp_path: Path) -> None:
    promtool = prometheus_tool("promtool")
    shipped_rules(tmp_path)
    shutil.copy(HERE / "celery-fenced-rules.test.yml", tmp_path)
    tested = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "celery-fenced-rules.test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_without_the_sdk_the_command_writes_the_rules_and_says_how_to_get_the_dashboard(tmp_path: Path) -> None:
    """Python 3.10 has no grafana-foundation-sdk: the rules are still written (and promtool
    takes them), the dashboard is left out with one line saying what to do."""
    shadow = tmp_path / "shadow" / "grafana_foundation_sdk"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "celery", "fenced", "dashboards", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [str(out / dashboards.RULES_FILE)]
    assert done.stderr.splitlines() == [dashboards.SDK_MISSING]
    assert "Python 3.11" in dashboards.SDK_MISSING and "celery-fenced[dashboards]" in dashboards.SDK_MISSING
    assert not (out / dashboards.DASHBOARD_FILE).exists()
    assert (out / dashboards.RULES_FILE).read_text() == dashboards.rules_text()
    promtool = prometheus_tool("promtool")
    checked = subprocess.run(
        [promtool, "check", "rules", str(out / dashboards.RULES_FILE)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
