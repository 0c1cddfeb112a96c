"""Throughput, Redis CPU and round trips per task: fenced against plain Celery, side by side.

Short tasks (2 ms) on a prefork worker (c=2) with a Redis broker: ``ProgressLeasedTask`` with
the fenced backend against a plain task with Celery's Redis backend (its own module), in
paired rounds whose order flips each round; the ratio is the median of the pairs' ratios,
with a bootstrap interval. Each configuration runs against plain Celery under the same
settings:

* ``users``: events on (``-E``, as Flower users run workers) and the client waiting for every
  result with ``AsyncResult.get()``: the figure that counts;
* ``events``: events on, the client polling the result keys (``MGET``: cheap for the client,
  so the worker's own cost shows);
* ``quiet``: events off, polling;
* ``gevent``: the gevent pool (c=100) running tasks that each wait 50 ms on a socket (a
  downstream HTTP or AI call), events on, results awaited with ``get()``.

Per task and side it prints the Redis server's CPU time (``INFO`` ``used_cpu_*`` over each
round: what decides how many tasks one Redis carries for a whole cluster), the commands it ran
and the broker publishes (events included, ``INFO commandstats``), and the CPU of the client,
the worker's main process and its children. Then the Redis round trips per task (``MONITOR``),
and that the heartbeat renews 1, 10 or 100 leases of a process in one round trip.

``--scale`` measures instead one worker of 4 processes fed by one client pushing 10,000 tasks
(events on, ``get()``): tasks per second and the share of one core the Redis server used.

    python benchmarks/throughput.py [--configs users,events,quiet,gevent] [--tasks 1000] [--rounds 5] [--track-started]
    python benchmarks/throughput.py --scale [--tasks 10000]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from benchmarks._harness import Harness
from celery_fenced.conf import DEFAULTS


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
    """Send ``count`` tasks that wait ``seconds``, then wait for every result with ``get()``."""
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


def redis_counters(client) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The server's CPU seconds, commands and publishes so far (``INFO``)."""
    cpu = client.info("cpu")
    stats = client.info("commandstats")
    memory = client.info("memory")
    return {
        "redis_cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        # Less the clients' buffers: Redis shrinks an idle connection's buffers, so the other
        # sides' idle workers would move them into a side's round.
        "used_memory": float(memory["used_memory"] - memory["mem_clients_normal"]),
        "commands": float(sum(v["calls"] for v in stats.values())),
        "publishes": float(stats.get("cmdstat_publish", {}).get("calls", 0)),
        **{name.removeprefix("cmdstat_"): float(v["calls"]) for name, v in stats.items()},
    }


@dataclass
class Round:
    """What one round of one side measured."""

    elapsed: float
    counters: dict[str, float]  # redis_cpu (s), commands, publishes: deltas over the round
    cpu: dict[str, float]  # CPU seconds of client, worker, children


def settle(client, bound: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Collect the client process's garbage and wait (bounded) until Redis has seen the
    connections it held close: a connection left in a reference cycle by one round, closed
    during the next, would move its buffers' memory from one side's round to another's."""
    gc.collect()
    deadline = time.monotonic() + bound
    seen = [client.info("clients")["connected_clients"]]
    while time.monotonic() < deadline and not (len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]):
        time.sleep(0.02)
        seen.append(client.info("clients")["connected_clients"])


def run_round(  # type: ignore[no-untyped-def]
    harness: Harness, task, count: int, seconds: float, wait: str, cpu: CpuMeter | None = None
) -> Round:
    settle(harness.client)
    before = redis_counters(harness.client)
    cpu_before = cpu.read() if cpu else {}
    start = time.perf_counter()
    (send_and_wait if wait == "get" else send_and_poll)(task, count, seconds)
    elapsed = time.perf_counter() - start
    cpu_used = {name: value - cpu_before[name] for name, value in cpu.read().items()} if cpu else {}
    settle(harness.client)
    after = redis_counters(harness.client)
    return Round(elapsed, {name: after[name] - before.get(name, 0.0) for name in after}, cpu_used)


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
    from celery_fenced._lease.scripts import SCRIPT_NAMES, script_source

    script_of = {hashlib.sha1(script_source(name).encode()).hexdigest(): name for name in SCRIPT_NAMES}
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
        elif name == "EVALSHA":
            parts = entry["command"].split(" ", 3)
            name = f"EVALSHA {script_of.get(parts[1], parts[1][:8])}"
            if name == "EVALSHA reserve":  # KEYS: the index, the worker's set, two per task reserved
                by_command["tasks reserved"] = by_command.get("tasks reserved", 0) + (int(parts[2]) - 2) // 2
        trips += 1
        by_command[name] = by_command.get(name, 0) + 1
    reserved = by_command.pop("tasks reserved", 0)
    return {
        "total": trips / count,
        **{name: n / count for name, n in sorted(by_command.items())},
        **({"(tasks reserved)": reserved / count} if reserved else {}),
    }


def renew_round_trips(harness: Harness) -> list[tuple[int, int]]:
    from benchmarks import bench_app
    from celery_fenced._lease.state import ProgressReport, RenewRequest

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


#: The settings of ``benchmarks.bench_app`` set back to the package's defaults here.
DEFAULT_LEASE_SETTINGS = ("fenced_lease_ttl", "fenced_heartbeat_interval", "fenced_reaper_interval")


@dataclass(frozen=True)
class Configuration:
    """One configuration compared: the worker, its task, how the client waits for results."""

    title: str
    events: bool  # workers send task events (-E)
    wait: str  # "get" (AsyncResult.get()) or "poll" (MGET of the result keys)
    pool: str = "prefork"
    concurrency: int = 2
    body: str = "sleep"  # "sleep", or "socket": a wait on a socket read
    task_ms: float | None = None  # the body's wait, when not --task-ms


CONFIGURATIONS = {
    "users": Configuration("events on (-E), results awaited with get()", True, "get"),
    "events": Configuration("events on (-E), results polled", True, "poll"),
    "quiet": Configuration("events off, results polled", False, "poll"),
    "gevent": Configuration(
        "gevent pool, tasks waiting on a socket, events on (-E), results awaited with get()",
        True,
        "get",
        pool="gevent",
        concurrency=100,
        body="socket",
        task_ms=50,
    ),
}
SIDES = {"plain": "benchmarks.bench_plain", "fenced": "benchmarks.bench_app:app"}
#: ``--floor``: a fenced worker whose acquire and store scripts do the least they can
#: (``benchmarks/floor``): what the two script calls cost, whatever the lease does.
FLOOR_SIDE = {"floor": "benchmarks.bench_floor:app"}


def tasks_of(body: str = "sleep") -> dict[str, object]:
    from benchmarks import bench_app, bench_floor, bench_plain

    if body == "socket":
        return {"plain": bench_plain.plain_socket_wait, "fenced": bench_app.fenced_socket_wait}
    return {"plain": bench_plain.plain_short, "fenced": bench_app.fenced_short, "floor": bench_floor.floor_short}


def compare(harness: Harness, name: str, args: argparse.Namespace) -> None:
    """Paired rounds of one configuration, plain against fenced, and the figures per task."""
    config = CONFIGURATIONS[name]
    wait, task_ms = config.wait, config.task_ms or args.task_ms
    tasks = tasks_of(config.body)
    sides = dict(SIDES, **(FLOOR_SIDE if args.floor and "floor" in tasks else {}))
    workers, meters = {}, {}
    for label, app_path in sides.items():
        workers[label] = harness.worker(
            f"{label}-{name}", pool=config.pool, concurrency=config.concurrency, app=app_path, events=config.events
        )
        meters[label] = CpuMeter(harness, workers[label].pid)
        run_round(harness, tasks[label], 50, task_ms / 1000, wait)  # warm up
    # Rounds alternate (the order turns each round), so a drift in the machine's load weighs
    # on every side alike; the idle workers wait on their own queues meanwhile.
    labels = list(sides)
    measured: dict[str, list[Round]] = {label: [] for label in labels}
    for number in range(args.rounds):
        turn = number % len(labels)
        for label in labels[turn:] + labels[:turn]:
            measured[label].append(run_round(harness, tasks[label], args.tasks, task_ms / 1000, wait, meters[label]))
    for worker in workers.values():
        harness.stop(worker)
    print(
        f"{config.title}: {args.tasks} tasks of {task_ms:g} ms, {config.pool} c={config.concurrency}, "
        f"{args.rounds} rounds of each side"
    )
    for label in labels:
        rate = args.tasks / statistics.median(r.elapsed for r in measured[label])
        print(
            f"  {label:<7} {rate:7.1f} tasks/s (median round); rounds: "
            + ", ".join(f"{args.tasks / r.elapsed:.0f}" for r in measured[label])
        )
    for label in labels[1:]:
        ratios = [f.elapsed / p.elapsed for f, p in zip(measured[label], measured["plain"], strict=True)]
        ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
        print(f"  time ratio {label}/plain = {ratio:.3f}, 90% interval {low:.3f}-{high:.3f} (target <= 1.05)")
        print(f"  ratio per round pair: {', '.join(f'{r:.3f}' for r in ratios)}")

    def per_task(label: str, value) -> float:  # type: ignore[no-untyped-def]
        return statistics.median(value(r) for r in measured[label]) / args.tasks

    def against_plain(what: str, figures: dict[str, float], unit: str, target: float) -> None:
        shown = ", ".join(f"{label} {figures[label]:.0f} {unit}" for label in labels)
        ratios = ", ".join(f"{label} {figures[label] / figures['plain']:.3f}" for label in labels[1:])
        print(f"  {what}: {shown}: ratio {ratios} (target <= {target:.2f})")

    redis_cpu = {label: per_task(label, lambda r: r.counters["redis_cpu"]) * 1e6 for label in measured}
    against_plain("Redis server CPU per task", redis_cpu, "us", 1.10)
    # Memory: each side's growth over all its rounds, not a median round's: a side's result
    # keys live in databases of its own, and the rounds where their tables double belong to it.
    memory = {
        label: sum(r.counters["used_memory"] for r in measured[label]) / (args.tasks * args.rounds) for label in labels
    }
    against_plain(
        "Redis memory per finished task (used_memory's growth over its rounds, results kept)", memory, "B", 1.25
    )
    counted = sorted(
        {name for r in measured["fenced"] + measured["plain"] for name in r.counters} - {"redis_cpu", "used_memory"}
    )
    by_command = {
        label: {name: per_task(label, lambda r, n=name: r.counters.get(n, 0.0)) for name in counted}
        for label in measured
    }
    shown = [
        f"{name} " + "/".join(f"{by_command[label][name]:.2f}" for label in labels)
        for name in counted
        if name not in ("commands", "publishes") and max(by_command[label][name] for label in labels) >= 0.05
    ]
    print(f"  Redis commands per task by name, {'/'.join(labels)}: " + ", ".join(shown))
    for what in ("commands", "publishes"):
        shown = ", ".join(f"{label} {per_task(label, lambda r, w=what: r.counters[w]):.2f}" for label in measured)
        print(f"  Redis {what} per task (script-internal included): {shown}")
    print("  CPU per task, ms: " + ", ".join(meters["plain"].processes))
    for label in measured:
        shown = ", ".join(f"{per_task(label, lambda r, n=n: r.cpu[n]) * 1000:.2f}" for n in meters[label].processes)
        print(f"    {label:<7} {shown}")


def scale(harness: Harness, args: argparse.Namespace) -> None:
    """One worker of 4 processes, one client pushing ``--tasks`` tasks: the rate, and Redis's share."""
    tasks = tasks_of()
    print(f"scale: {args.tasks} tasks of {args.task_ms:g} ms, one worker of 4 processes (-E), one client, get()")
    for label, app_path in SIDES.items():
        worker = harness.worker(f"{label}-scale", concurrency=4, app=app_path, events=True)
        run_round(harness, tasks[label], 100, args.task_ms / 1000, "get")  # warm up
        done = run_round(harness, tasks[label], args.tasks, args.task_ms / 1000, "get")
        harness.stop(worker)
        per_task = done.counters["redis_cpu"] / args.tasks
        print(
            f"  {label:<7} {args.tasks / done.elapsed:7.1f} tasks/s; Redis CPU {per_task * 1e6:.0f} us per task, "
            f"{done.counters['redis_cpu'] / done.elapsed:.0%} of one core: one Redis core carries about "
            f"{1 / per_task:,.0f} tasks/s"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description="fenced vs plain Celery throughput")
    parser.add_argument("--configs", default="users,events,quiet,gevent", help="of: " + ", ".join(CONFIGURATIONS))
    parser.add_argument("--tasks", type=int, default=None, help="tasks per round (1000; 10000 with --scale)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--task-ms", type=float, default=2.0, help="how long each task's body sleeps (not gevent's)")
    parser.add_argument("--scale", action="store_true", help="4 worker processes, one client, 10,000 tasks")
    parser.add_argument("--no-monitor", action="store_true", help="skip the MONITOR count of round trips")
    parser.add_argument(
        "--floor", action="store_true", help="a third side: fenced with the floor's scripts (benchmarks/floor)"
    )
    parser.add_argument(
        "--track-started", action="store_true", help="task_track_started on, on every side (Flower users turn it on)"
    )
    args = parser.parse_args()
    if args.tasks is None:
        args.tasks = 10_000 if args.scale else 1000
    # The fenced side runs with the package's default lease settings, as users run it (the
    # benchmark app's short ones are for the takeover benchmark).
    settings: dict[str, object] = {name: DEFAULTS[name] for name in DEFAULT_LEASE_SETTINGS}
    if args.track_started:
        settings["task_track_started"] = True
    with Harness("benchmarks.bench_app", settings=settings) as harness:
        if args.scale:
            scale(harness, args)
            return 0
        for name in args.configs.split(","):
            if name not in CONFIGURATIONS:
                parser.error(f"unknown configuration {name!r}; known: {', '.join(CONFIGURATIONS)}")
            compare(harness, name, args)
        if args.no_monitor:
            return 0
        tasks = tasks_of()
        trips = {}
        for label, app_path in SIDES.items():
            worker = harness.worker(f"{label}-monitor", concurrency=2, app=app_path, events=True)
            trips[label] = round_trips_per_task(harness, tasks[label], min(args.tasks, 200))
            harness.stop(worker)
        print(
            "Redis round trips per task, events on, get() (MONITOR; a transaction or a script is one): "
            f"plain {trips['plain']['total']:.2f}, fenced {trips['fenced']['total']:.2f}"
        )
        for label in SIDES:
            detail = ", ".join(f"{name} {n:.2f}" for name, n in trips[label].items() if name != "total" and n >= 0.01)
            print(f"    {label}: {detail}")
        for leases, calls in renew_round_trips(harness):
            print(f"  renewing {leases:>3} leases of one process: {calls} script call(s), one round trip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
