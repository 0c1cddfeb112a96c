"""Throughput and Redis round trips per task: fenced against plain Celery, side by side.

300+ tasks of 2 ms on a prefork worker (c=2) with a Redis broker: ``ProgressLeasedTask`` with
the fenced backend against a plain task with Celery's Redis backend, several rounds each,
medians; the rounds alternate between the two. Shows where the CPU time of a task goes (the
sending client, Redis, the worker's main process and its children). Also counts the Redis round trips per task
(``MONITOR``) and the commands the server ran (``INFO commandstats``, script-internal ones
included), and shows that the heartbeat renews 1, 10 or 100 leases of a process in one
round trip.

    python benchmarks/throughput.py [--tasks 300] [--rounds 5] [--task-ms 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from benchmarks._harness import Harness


def commands(client) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {k: v["calls"] for k, v in client.info("commandstats").items()}


class CpuMeter:
    """CPU seconds used by each side of a round: the client, Redis, the worker and its children."""

    def __init__(self, harness: Harness, worker_pid: int) -> None:
        worker = psutil.Process(worker_pid)
        self.processes = {
            "client": psutil.Process(),
            "redis": psutil.Process(harness.redis.process.pid),
            "worker": worker,
            "children": worker.children(),
        }

    def read(self) -> dict[str, float]:
        def used(process: psutil.Process) -> float:
            times = process.cpu_times()
            return float(times.user + times.system)

        return {
            name: sum(used(p) for p in (found if isinstance(found, list) else [found]))
            for name, found in self.processes.items()
        }


def send_and_wait(task, count: int, seconds: float) -> None:  # type: ignore[no-untyped-def]
    """Send ``count`` tasks that sleep ``seconds``, then wait for every result with ``get()``."""
    results = [task.delay(seconds) for _ in range(count)]
    for result in results:
        result.get(timeout=120)


def send_and_poll(task, count: int, seconds: float, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    """Send ``count`` tasks that sleep ``seconds``, then poll their result keys until all are stored.

    The timed rounds wait this way: ``AsyncResult.get()`` subscribes and unsubscribes for
    each result, which costs the client about as much CPU as the worker spends on the task,
    and on a small machine that CPU is taken from the worker being measured. One ``MGET``
    of the missing result keys every few milliseconds costs little, and the same for both
    backends (both write Celery's result key).
    """
    backend = task.app.backend
    pending = [backend.get_key_for_task(task.delay(seconds).id) for _ in range(count)]
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} of {count} results not stored within {timeout:g}s")
        found = backend.client.mget(pending)
        for value in found:
            if value is not None and b'"FAILURE"' in value:
                raise RuntimeError(f"a task failed: {value[:300]!r}")
        pending = [key for key, value in zip(pending, found, strict=True) if not value or b'"SUCCESS"' not in value]
        if pending:
            time.sleep(0.005)


def median_interval(values: list[float], confidence: float = 0.90, resamples: int = 5000) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values`` (a fixed seed: the same runs print the same)."""
    if len(values) < 3:
        return min(values), max(values)
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def run_round(  # type: ignore[no-untyped-def]
    harness: Harness, task, count: int, seconds: float = 0.002, cpu: CpuMeter | None = None
) -> tuple[float, int, dict[str, float]]:
    before = sum(commands(harness.client).values())
    cpu_before = cpu.read() if cpu else {}
    start = time.perf_counter()
    send_and_poll(task, count, seconds)
    elapsed = time.perf_counter() - start
    cpu_used = {name: value - cpu_before[name] for name, value in cpu.read().items()} if cpu else {}
    after = sum(commands(harness.client).values())
    return elapsed, after - before, cpu_used


def round_trips_per_task(harness: Harness, task, count: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Round trips per task, all processes together (client, worker, its children), by command.

    Read from ``MONITOR``: a command run inside a script is not a round trip (MONITOR shows
    it as coming from "lua"), and a MULTI … EXEC transaction is one (its commands are
    followed per connection). Monitoring slows Redis down, so this runs apart from the
    timed rounds.
    """
    entries: list[dict] = []  # type: ignore[type-arg]
    listening = threading.Event()
    stop = f"fenced-bench-stop-{time.monotonic_ns()}"

    def listen() -> None:
        with harness.client.monitor() as monitor:
            listening.set()
            for entry in monitor.listen():
                if stop in entry["command"]:
                    return
                entries.append(entry)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    listening.wait(10)
    send_and_wait(task, count, 0.002)
    harness.client.echo(stop)
    thread.join(30)
    trips = 0
    in_transaction: set[tuple[str, int]] = set()
    by_command: dict[str, int] = {}
    for entry in entries:
        if entry["client_type"] == "lua":
            continue
        client = (entry["client_address"], entry["client_port"])
        name = entry["command"].split(" ", 1)[0].upper()
        if client in in_transaction:
            if name == "EXEC":
                in_transaction.discard(client)
            continue
        if name == "MULTI":
            in_transaction.add(client)
            name = "MULTI…EXEC"
        trips += 1
        by_command[name] = by_command.get(name, 0) + 1
    return {"total": trips / count, **{name: n / count for name, n in sorted(by_command.items())}}


def renew_round_trips(harness: Harness) -> list[tuple[int, int]]:
    from benchmarks import bench_app
    from celery_fenced.state import ProgressReport, RenewRequest

    store = bench_app.app.backend.lease_store
    rows = []
    for leases in (1, 10, 100):
        states = [
            store.acquire(f"renew-{leases}-{i}", "bench/1/a", ttl_ms=30_000, task_name="bench", max_takeovers=3).state
            for i in range(leases)
        ]
        requests = [
            RenewRequest(s.task_id, "bench/1/a", s.owner_token, 30_000, ProgressReport("", 1, 0)) for s in states
        ]
        harness.client.config_resetstat()
        store.renew_many(requests)
        calls = sum(v for k, v in commands(harness.client).items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
        rows.append((leases, calls))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description="fenced vs plain Celery throughput")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--task-ms", type=float, default=2.0, help="how long each task's body sleeps")
    args = parser.parse_args()
    with Harness("benchmarks.bench_app") as harness:
        from benchmarks import bench_app, bench_plain

        tasks = {"plain": bench_plain.plain_short, "fenced": bench_app.fenced_short}
        meters: dict[str, CpuMeter] = {}
        for label, app_path in (("plain", "benchmarks.bench_plain"), ("fenced", "benchmarks.bench_app:app")):
            worker = harness.worker(label, concurrency=2, app=app_path)
            meters[label] = CpuMeter(harness, worker.pid)
            run_round(harness, tasks[label], 20)  # warm up
        # Rounds alternate (the order flips each round), so a drift in the machine's load
        # weighs on both sides alike; the idle worker waits on its own queue meanwhile.
        measured: dict[str, list[tuple[float, int, dict[str, float]]]] = {"plain": [], "fenced": []}
        for number in range(args.rounds):
            order = ("plain", "fenced") if number % 2 == 0 else ("fenced", "plain")
            for label in order:
                measured[label].append(run_round(harness, tasks[label], args.tasks, args.task_ms / 1000, meters[label]))
        rows = {
            label: (statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds))
            for label, rounds in measured.items()
        }
        ratios = [f[0] / p[0] for f, p in zip(measured["fenced"], measured["plain"], strict=True)]
        ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
        (fenced, fenced_cmds), (plain, plain_cmds) = rows["fenced"], rows["plain"]
        print(f"{args.tasks} tasks of {args.task_ms:g} ms, prefork c=2, Redis broker, {args.rounds} rounds each")
        print(f"  plain Celery      {args.tasks / plain:8.1f} tasks/s (median round)")
        print(f"  celery-fenced     {args.tasks / fenced:8.1f} tasks/s (median round)")
        print(
            f"  time ratio fenced/plain = {ratio:.3f}, 90% interval {low:.3f}-{high:.3f} "
            "(median of the round pairs' ratios; target <= 1.10)"
        )
        print(f"  ratio per round pair: {', '.join(f'{r:.3f}' for r in ratios)}")
        for label in ("plain", "fenced"):
            print(f"  {label} rounds, tasks/s: {', '.join(f'{args.tasks / r[0]:.0f}' for r in measured[label])}")
        print("  CPU time per task, ms (median of rounds): " + ", ".join(meters["plain"].processes))
        totals = {}
        for label in ("plain", "fenced"):
            per_task = {
                name: statistics.median(r[2][name] for r in measured[label]) / args.tasks * 1000
                for name in meters[label].processes
            }
            totals[label] = sum(per_task.values())
            shown = ", ".join(f"{value:.2f}" for value in per_task.values())
            print(f"    {label:<7} {shown}  (total {totals[label]:.2f})")
        print(f"  CPU ratio fenced/plain, all processes = {totals['fenced'] / totals['plain']:.3f}")
        print(
            f"  Redis commands per task: plain {plain_cmds / args.tasks:.1f}, "
            f"fenced {fenced_cmds / args.tasks:.1f} (heartbeat renewals included)"
        )
        trips = {label: round_trips_per_task(harness, tasks[label], min(args.tasks, 200)) for label in tasks}
        print(
            f"  Redis round trips per task (MONITOR; a transaction or a script is one): "
            f"plain {trips['plain']['total']:.2f}, fenced {trips['fenced']['total']:.2f}"
        )
        for label in tasks:
            detail = ", ".join(f"{name} {n:.2f}" for name, n in trips[label].items() if name != "total" and n >= 0.01)
            print(f"    {label}: {detail}")
        for leases, calls in renew_round_trips(harness):
            print(f"  renewing {leases:>3} leases of one process: {calls} script call(s), one round trip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
