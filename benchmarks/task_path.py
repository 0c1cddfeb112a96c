"""The cost of one task's path through a worker process: fenced against plain Celery.

Runs Celery's own tracer (what a prefork child runs for each task: prerun, body, result
write, postrun) in this process, N times, for the plain task and for the fenced one, with
the body's 2 ms sleep left out. The Redis round trips are real (a private Redis).

With valgrind on the PATH the figure is CPU instructions per task (callgrind's count of the
traced process, run once with N tasks and once with none): the same for the same code
whatever else the machine does, so a change of a few percent shows. Without valgrind it
falls back to CPU seconds of the tracing thread (medians), which a busy machine blurs.

``--worker`` counts instead a real prefork worker (``-c 1``, events on, the package's default
lease settings) run under callgrind, fed real messages by a client that awaits each result
with ``get()``: the instructions of the task process's main thread per task, between two
dumps around N tasks (its heartbeat thread, whose ticks follow the wall clock, apart). This
is the whole path of a message in the process that runs it (the pool's receive and reply
too), with the message's real options in the recorded call.

    python benchmarks/task_path.py [--tasks 200] [--worker]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import Harness
from celery_fenced.harness import wait_until

WARM_UP = 20


def tracer_loop(which: str) -> Any:
    """One traced task of ``which`` ("plain" or "fenced") per call."""
    from celery.app.trace import build_tracer

    from benchmarks import bench_app, bench_plain
    from celery_fenced._telemetry import events
    from celery_fenced._worker import lifecycle

    time.sleep = lambda seconds: None  # type: ignore[assignment]  # the body's sleep is not measured
    # Logging as a worker run with "-l INFO" does it (Celery logs each task's success).
    handler = logging.FileHandler(os.devnull)
    handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    proxy = bench_plain.plain_short if which == "plain" else bench_app.fenced_short
    app = proxy.app
    app.finalize()
    task = app.tasks[proxy.name]
    events.configure(enabled=False, hostname="bench@host")  # as the worker's bootstep does
    trace = build_tracer(task.name, task, app=app, hostname="bench@host")

    def once() -> None:
        task_id = str(uuid.uuid4())
        request = {
            "id": task_id,
            "task": task.name,
            "hostname": "bench@host",
            "delivery_info": {"exchange": "", "routing_key": "celery", "priority": 0, "redelivered": False},
            "reply_to": "reply",
            "correlation_id": task_id,
            "root_id": task_id,
            "retries": 0,
            "is_eager": False,
        }
        outcome = trace(task_id, [0.002], {}, request)
        if outcome.info is not None:
            raise RuntimeError(f"{which} task failed: {outcome.info!r}")

    for _ in range(WARM_UP):
        once()
    lifecycle.stop_heartbeats()  # the heartbeat thread's ticks are not the task's path
    return once


def inner(which: str, tasks: int) -> None:
    """Run ``tasks`` traced tasks (the process callgrind counts)."""
    once = tracer_loop(which)
    for _ in range(tasks):
        once()


def count_instructions(which: str, tasks: int, env: dict[str, str]) -> int:
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--inner",
        which,
        "--tasks",
        str(tasks),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def instructions_per_task(tasks: int, env: dict[str, str]) -> dict[str, float]:
    from concurrent.futures import ThreadPoolExecutor

    runs = [(which, n) for which in ("plain", "fenced") for n in (0, tasks)]
    with ThreadPoolExecutor(2) as pool:  # instruction counts do not care what runs beside them
        counts = dict(zip(runs, pool.map(lambda run: count_instructions(*run, env), runs), strict=True))
    return {which: (counts[(which, tasks)] - counts[(which, 0)]) / tasks for which in ("plain", "fenced")}


def worker_instructions(harness: Harness, which: str, tasks: int) -> float:
    """Instructions per task of the main thread of a real prefork worker's task process."""
    import glob
    import tempfile

    import psutil

    from benchmarks.throughput import SIDES, tasks_of

    out = Path(tempfile.mkdtemp(prefix=f"fenced-bench-worker-{which}-", dir=harness.tmp))
    log = out / "worker.log"
    argv = ["valgrind", "--tool=callgrind", "--trace-children=yes", "--separate-threads=yes"]
    argv += [f"--callgrind-out-file={out}/cg.%p", sys.executable, "-m", "celery", "-A", SIDES[which], "worker"]
    argv += ["-P", "prefork", "-c", "1", "-n", f"{which}-cg@%h", "-l", "INFO", "--without-mingle"]
    argv += ["--without-gossip", "-E"]
    with log.open("wb") as output:
        worker = subprocess.Popen(
            argv, env=harness.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    harness.procs.append(worker)
    wait_until(lambda: b" ready." in log.read_bytes(), 600, f"the {which} worker under callgrind")
    task = tasks_of()[which]
    for _ in range(WARM_UP):
        task.delay(0.002).get(timeout=120)
    pids = [worker.pid] + [child.pid for child in psutil.Process(worker.pid).children(recursive=True)]

    def dump(label: str) -> None:
        for pid in pids:
            subprocess.run(["callgrind_control", "--dump=" + label, str(pid)], capture_output=True, check=False)

    dump("before")
    for result in [task.delay(0.002) for _ in range(tasks)]:
        result.get(timeout=600)
    dump("after")
    harness.stop(worker)
    counts = {}
    for path in glob.glob(f"{out}/cg.*-01"):  # the main thread of each process, one file per dump
        text = Path(path).read_text(errors="replace")
        found = re.search(r"^summary: (\d+)", text, re.MULTILINE)
        if "Trigger: dump after" in text and found is not None:
            counts[int(Path(path).name.split(".")[1])] = int(found.group(1))
    children = [pid for pid in counts if pid != worker.pid]
    if len(children) != 1:
        raise RuntimeError(f"expected the dump of one task process, found {sorted(counts)} (log: {log})")
    return counts[children[0]] / tasks


def cpu_seconds_per_task(tasks: int, rounds: int = 5) -> dict[str, float]:
    loops = {which: tracer_loop(which) for which in ("plain", "fenced")}
    measured: dict[str, list[float]] = {"plain": [], "fenced": []}
    for _ in range(rounds):
        for which, once in loops.items():
            start = time.thread_time()
            for _ in range(tasks):
                once()
            measured[which].append((time.thread_time() - start) / tasks)
    return {which: statistics.median(values) for which, values in measured.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description="one task's path: fenced vs plain Celery")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--worker", action="store_true", help="count a real prefork worker's task process")
    parser.add_argument("--inner", choices=("plain", "fenced"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.inner, args.tasks)
        return 0
    if args.worker:
        return worker_main(args.tasks)
    with Harness("benchmarks.bench_app") as harness:
        print(
            "one task's path through Celery's tracer (prerun, body, result write, postrun, "
            f"logging at INFO), {args.tasks} tasks"
        )
        if shutil.which("valgrind"):
            env = dict(harness.env, PYTHONHASHSEED="0")
            cost = instructions_per_task(args.tasks, env)
            unit, scale = "instructions", 1.0
        else:
            cost = cpu_seconds_per_task(args.tasks)
            unit, scale = "µs of CPU (no valgrind here: CPU time, noisier)", 1e6
        print(f"  plain Celery   {cost['plain'] * scale:12,.0f} {unit} per task")
        print(f"  celery-fenced  {cost['fenced'] * scale:12,.0f} {unit} per task")
        print(f"  ratio fenced/plain = {cost['fenced'] / cost['plain']:.3f}")
    return 0


def worker_main(tasks: int) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.throughput import DEFAULT_LEASE_SETTINGS
    from celery_fenced.conf import DEFAULTS

    if not shutil.which("valgrind"):
        print("a real worker's task process: needs valgrind on the PATH (not found)")
        return 0
    settings = {name: DEFAULTS[name] for name in DEFAULT_LEASE_SETTINGS}
    with Harness("benchmarks.bench_app", settings=settings) as harness:
        print(
            f"a real worker's task process (prefork -c 1, -E, get(), default lease settings), {tasks} tasks, "
            "its main thread"
        )
        with ThreadPoolExecutor(2) as pool:  # instruction counts do not care what runs beside them
            cost = dict(
                zip(
                    ("plain", "fenced"),
                    pool.map(lambda which: worker_instructions(harness, which, tasks), ("plain", "fenced")),
                    strict=True,
                )
            )
    print(f"  plain Celery   {cost['plain']:12,.0f} instructions per task")
    print(f"  celery-fenced  {cost['fenced']:12,.0f} instructions per task")
    print(f"  ratio fenced/plain = {cost['fenced'] / cost['plain']:.3f} (task process)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
