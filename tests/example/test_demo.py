"""The README's first command: the demo, on a machine state without a Redis server on PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, run_project_python

pytestmark = pytest.mark.integration


def test_the_demo_runs_green_with_an_embedded_redis(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env["PATH"] = str(Path(sys.executable).parent)  # no redis-server on PATH: the demo embeds one
    env["HOME"] = str(tmp_path)
    output = run_project_python(["-m", "example_project.demo", "--reports", "4"], env, timeout=240)
    assert "reports done:            4/4" in output
    assert "OK: every report stored exactly once" in output
    assert "stalls detected:         2" in output  # the stream that stopped mid-way, the hung upload
    assert "stale writes refused:    1" in output  # the upload's zombie woke and returned
    assert re.search(r"export stored by: +token \d+", output), output
    assert "gone             a takeover of an owner that died" in output  # each summary word explained
    assert "SIGKILL worker2" in output
    # The killed report resumes after its published batches (4 or more), the report whose stream
    # stopped after all 10 of its batches: no takeover starts its batches again.
    found = re.search(r"batches processed: +(\d+) for (\d+) needed; checkpoints spared (\d+)", output)
    assert found, output
    processed, needed, spared = map(int, found.groups())
    assert spared >= 14, output
    assert needed <= processed <= needed + 4, output  # at most a heartbeat of batches per killed task
    assert "celery-fenced-demo" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_the_demo_file_runs_from_any_directory_and_names_a_missing_extra(tmp_path: Path) -> None:
    """``python -m example_project.demo`` needs the checkout's root as its directory; the file
    itself runs from anywhere. Without the demo extra it says in one line what to install, where."""
    demo = str(ROOT / "example_project" / "demo.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE")}
    shown = subprocess.run([sys.executable, demo, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "--reports" in shown.stdout, shown.stderr
    hidden = (
        "import runpy, sys; sys.modules['rich'] = None; sys.argv = ['demo.py']; "
        f"runpy.run_path({demo!r}, run_name='__main__')"
    )
    refused = subprocess.run([sys.executable, "-c", hidden], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f"the demo needs the 'demo' extra (rich missing): run  python -m pip install -e '.[demo]'  in {ROOT}"
    )
