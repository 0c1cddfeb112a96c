"""The Redis server's time for one task's writes: the two lease scripts against Celery's own.

A task's process makes two round trips on either side: the fenced task runs ``acquire.lua``
(before the body) and ``store.lua`` (the result, the end of the lease and Celery's PUBLISH),
where Celery's Redis backend runs a GET and then a SET/PUBLISH transaction. This runs each
side's commands ``--tasks`` times against an idle private Redis, as the worker sends them, and
prints the server's own time per command (``INFO commandstats``, microseconds per call) and
its CPU per task (``INFO cpu``). An idle server gives repeatable figures; under load each
figure grows about as much on both sides.

With valgrind on the PATH it also counts the server's CPU instructions per task on each
side (callgrind's count of a redis-server run for it, once with ``--tasks`` tasks and once
with a quarter of them, so start and shutdown drop out): a figure that is the same for the
same scripts whatever else the machine does, so a cut of a few per cent shows. It counts the
floor too (``benchmarks/floor``): the same two calls with the same arguments, scripts that
only take a token and write Celery's result; what is above it is the lease's own work.

    python benchmarks/script_cost.py [--tasks 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from benchmarks._harness import Harness
from benchmarks.floor import floor_scripts
from benchmarks.throughput import redis_counters
from celery_fenced._lease.finished import FENCE_RUN, run_text
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore
from celery_fenced.harness import default_binary, free_port, wait_until

#: A recorded call as the acquire of the throughput benchmark's task sends it.
CALL = {
    "task": "benchmarks.bench_app.fenced_short",
    "args": [0.002],
    "kwargs": {},
    "options": {
        "queue": "celery",
        "ignore_result": False,
        "reply_to": str(uuid.UUID(int=1)),
        "correlation_id": str(uuid.UUID(int=2)),
    },
}

#: A SUCCESS meta as Celery encodes it (the fenced side's carries ``fence_token`` too).
META = {
    "status": "SUCCESS",
    "result": None,
    "traceback": None,
    "children": [],
    "date_done": "2026-12-03T22:00:00.000000+00:00",
    "task_id": str(uuid.UUID(int=3)),
}


def cpu_seconds(client: Any) -> float:
    return redis_counters(client)["redis_cpu"]


def usec_per_call(client: Any) -> dict[str, float]:
    return {name.removeprefix("cmdstat_"): v["usec_per_call"] for name, v in client.info("commandstats").items()}


def fenced_round(client: Any, tasks: int) -> tuple[dict[str, float], float]:
    """The fenced writes of ``tasks`` tasks: ``{acquire, store}`` µs per call, and CPU µs per task."""
    store = LeaseStore(client, KeySpace("fenced", "celery-task-meta-"))
    owner = "bench@host/1234/0a1b2c3d0"
    ids = [str(uuid.uuid4()) for _ in range(tasks)]
    figures: dict[str, float] = {}
    cpu = 0.0
    tokens: dict[str, int] = {}
    publishes = {task_id: secrets.token_hex(8) for task_id in ids}
    metas: dict[str, str] = {}
    for name in ("acquire", "store"):
        client.config_resetstat()
        before = cpu_seconds(client)
        for task_id in ids:
            if name == "acquire":
                tokens[task_id] = store.acquire(
                    task_id,
                    owner,
                    ttl_ms=15_000,
                    task_name=CALL["task"],  # type: ignore[arg-type]
                    max_takeovers=3,
                    call=CALL,
                    publish_id=publishes[task_id],
                ).token
                # The meta as the fenced backend encodes it: the finished lease's fence last.
                run = run_text(publishes[task_id], 1, 0)
                metas[task_id] = json.dumps({**META, FENCE_RUN: run, "fence_token": tokens[task_id]})
            else:
                store.store(
                    task_id,
                    tokens[task_id],
                    metas[task_id],
                    state="SUCCESS",
                    kind="ready",
                    expires_ms=86_400_000,
                    owner_id=owner,
                )
        cpu += cpu_seconds(client) - before
        figures[name] = usec_per_call(client)["evalsha"]
    return figures, cpu / tasks * 1e6


def plain_round(client: Any, tasks: int) -> tuple[dict[str, float], float]:
    """Celery's writes of ``tasks`` results: GET, then SET and PUBLISH in one transaction."""
    meta = json.dumps(META)
    client.config_resetstat()
    before = cpu_seconds(client)
    for _ in range(tasks):
        key = f"celery-task-meta-{uuid.uuid4()}"
        client.get(key)
        pipe = client.pipeline()
        pipe.set(key, meta, ex=86_400)
        pipe.publish(key, meta)
        pipe.execute()
    cpu = (cpu_seconds(client) - before) / tasks * 1e6
    stats = usec_per_call(client)
    return {"get": stats["get"], "transaction": stats["multi"] + stats["set"] + stats["publish"] + stats["exec"]}, cpu


def counted_instructions(writes: Callable[[Any], object]) -> int:
    """The instructions a fresh redis-server under callgrind executes for ``writes(client)``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fenced-bench-cg-") as tmp:
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", default_binary()]
        argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        client = redis.Redis(port=port)
        try:
            wait_until(lambda: _answers(client), 60, "redis-server under callgrind")
            writes(client)
        finally:
            client.close()
            server.send_signal(signal.SIGTERM)
            _, err = server.communicate(timeout=120)
    found = re.search(r"Collected : (\d+)", err)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{err[-2000:]}")
    return int(found.group(1))


def _answers(client: Any) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def instructions_per_task(tasks: int) -> dict[str, float]:
    """Server instructions per task, fenced and plain: the count for ``tasks`` less the count
    for a quarter of them, over the difference."""
    few = max(1, tasks // 4)
    per_task = {}
    for side, run in (("fenced", fenced_round), ("floor", floor_round), ("plain", plain_round)):
        counts = [counted_instructions(partial(run, tasks=n)) for n in (few, tasks)]
        per_task[side] = (counts[1] - counts[0]) / (tasks - few)
    return per_task


def floor_round(client: Any, tasks: int) -> tuple[dict[str, float], float]:
    """:func:`fenced_round` with the floor's scripts (``benchmarks/floor``): the same calls,
    the same arguments, only a token taken and Celery's result written."""
    with floor_scripts():
        return fenced_round(client, tasks)


def main() -> int:
    parser = argparse.ArgumentParser(description="Redis server time per task: lease scripts vs Celery's writes")
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with Harness("benchmarks.bench_app") as harness:
        client = harness.client
        version = client.info("server")["redis_version"]
        fenced: dict[str, list[float]] = {"acquire": [], "store": [], "cpu": []}
        plain: dict[str, list[float]] = {"get": [], "transaction": [], "cpu": []}
        for _ in range(args.rounds):
            for side, run in ((fenced, fenced_round), (plain, plain_round)):
                figures, cpu = run(client, args.tasks)
                for name, value in figures.items():
                    side[name].append(value)
                side["cpu"].append(cpu)
            client.flushdb()
        median = statistics.median
        print(f"Redis {version}, idle, {args.tasks} tasks x {args.rounds} rounds (medians)")
        print(
            f"  fenced: acquire.lua {median(fenced['acquire']):.1f} us, store.lua {median(fenced['store']):.1f} us "
            f"per call; server CPU {median(fenced['cpu']):.0f} us per task"
        )
        print(
            f"  plain:  GET {median(plain['get']):.1f} us, SET+PUBLISH transaction {median(plain['transaction']):.1f} us;"
            f" server CPU {median(plain['cpu']):.0f} us per task"
        )
        print(
            f"  server CPU ratio fenced/plain for a task's writes = {median(fenced['cpu']) / median(plain['cpu']):.2f}"
        )
    if shutil.which("valgrind") is None:
        print("  (no valgrind on the PATH: server instructions not counted)")
        return 0
    counted = instructions_per_task(min(args.tasks, 1000))
    print(
        f"  server instructions per task (callgrind): fenced {counted['fenced']:,.0f}, plain {counted['plain']:,.0f}:"
        f" ratio {counted['fenced'] / counted['plain']:.2f}"
    )
    print(
        f"  the floor (benchmarks/floor: the same two script calls, only a token and Celery's result): "
        f"{counted['floor']:,.0f}, ratio {counted['floor'] / counted['plain']:.2f}; the lease's own work "
        f"{counted['fenced'] - counted['floor']:,.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
