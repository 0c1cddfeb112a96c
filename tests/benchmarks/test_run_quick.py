"""The benchmarks a user runs still run: ``benchmarks/run.py --quick``, every script, exit 0.

Only that they run and print their figures is checked here; the figures themselves are
measured, not asserted (see docs/performance.rst).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_every_benchmark_runs_and_prints_its_figures() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    for figure in (
        "ratio progress('load-data') / HSET",
        "timer lock: PEXPIRE each",
        "time ratio fenced/plain",
        "CPU time per task",
        "Redis round trips per task",
        "renewing 100 leases of one process: 1 script call(s)",
        "ratio fenced/plain",
        "found and claimed 100",
        "takeover after the deadline",
    ):
        assert figure in output, f"{figure!r} missing from:\n{output[-5000:]}"
