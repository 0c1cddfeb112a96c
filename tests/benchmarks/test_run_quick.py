"""The benchmarks a user runs still run: ``benchmarks/run.py --quick``, every script, exit 0.

Only that they run and print their figures is checked here; the figures themselves are
measured, not asserted (see docs/performance.rst).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.processes import run_project_python

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1500)  # callgrind, takeovers and a worker per benchmark: minutes, not seconds
def test_every_benchmark_runs_and_prints_its_figures() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    output = run_project_python(["benchmarks/run.py", "--quick"], env, timeout=1200)
    for figure in (
        "ratio progress('load-data') / HSET",
        "timer lock: PEXPIRE each",
        "time ratio fenced/plain",
        "time ratio floor/plain",
        "Redis server CPU per task",
        "Redis publishes per task",
        "CPU per task, ms",
        "Redis round trips per task",
        "of one core: one Redis core carries about",
        "renewing 100 leases of one process: 1 script call(s)",
        "ratio fenced/plain",
        "found and claimed 100",
        "Redis memory per finished task",
        "per finished task: ratio",
        "reaper pass among them, 2,000 live leases, 20 lapsed: found and claimed 20",
        "server CPU ratio fenced/plain for a task's writes",
        "takeover after the deadline",
    ):
        assert figure in output, f"{figure!r} missing from:\n{output[-5000:]}"
    assert "Traceback" not in output, output[max(0, output.find("Traceback") - 2000) :][:5000]
    if shutil.which("valgrind"):  # callgrind counts a real worker's task process
        assert "ratio fenced/plain = " in output and "(task process)" in output, output[-5000:]
        assert "the floor (benchmarks/floor" in output, output[-5000:]
