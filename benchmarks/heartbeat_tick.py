"""The heartbeat's tick, per lease: fenced against the timer renewal of a plain Redis lock.

One process holds 1, 10, 100 or 1000 leases, each making progress between ticks. A tick of
the fenced heartbeat checks every lease's progress against its stage deadline and renews all
of them in one script call (the process's metrics follow in one more call, whatever the
number of leases). The baseline is what a timer-based lock does for the same leases:
one ``PEXPIRE`` round trip per lease, with no progress check at all. Both run against the
same private Redis; the figures are medians of several ticks (wall time, the tick thread's
CPU time, and Redis's own time from ``INFO commandstats``).

    python benchmarks/heartbeat_tick.py [--leases 1 10 100 1000] [--ticks 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import Harness
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore
from celery_fenced._task.owner import OwnedLease
from celery_fenced._worker.heartbeat import Heartbeat
from celery_fenced.conf import FencedConfig


class QuietListener:
    """The heartbeat's listener with nothing to do: every lease here progresses in time."""

    def lost(self, lease: OwnedLease, reason: str) -> None:
        raise AssertionError(f"lease {lease.task_id} lost: {reason}")

    def stalled(self, lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
        raise AssertionError(f"lease {lease.task_id} stalled")

    def released(self, lease: OwnedLease) -> None:
        pass

    def duration_exceeded(self, lease: OwnedLease) -> None:
        pass

    def renewed(self, leases: list[OwnedLease]) -> None:
        pass


def server_usec(client: Any) -> float:
    """Redis's time in commands so far, µs (INFO's own left out)."""
    stats = client.info("commandstats")
    return float(sum(value["usec"] for name, value in stats.items() if name != "cmdstat_info"))


def measure(client: Any, tick: Any, ticks: int, between: Any) -> dict[str, float]:
    """Median wall, thread CPU and Redis server time of one tick, in µs."""
    walls, cpus, servers = [], [], []
    for _ in range(ticks):
        between()
        usec = server_usec(client)
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        tick()
        walls.append((time.perf_counter_ns() - wall) / 1000)
        cpus.append((time.thread_time_ns() - cpu) / 1000)
        servers.append(server_usec(client) - usec)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "redis": statistics.median(servers)}


def tick_costs(store: LeaseStore, policy: Any, count: int, ticks: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per-lease costs of a fenced tick and of a timer renewal, for ``count`` leases of one process."""
    client = store.client
    client.flushall()
    leases = []
    for i in range(count):
        owner = f"bench/1/{count}-{i}"
        acquired = store.acquire(
            f"tick-{count}-{i}", owner, ttl_ms=policy.lease_ttl_ms, task_name="bench", max_takeovers=3
        )
        leases.append(OwnedLease(f"tick-{count}-{i}", "bench", owner, acquired.token, 1, 0, policy))
    beat = Heartbeat(store_factory=lambda: store, listener=QuietListener(), default_interval=60)
    for lease in leases:
        beat.serve(lease)  # served without the thread: ticked by hand
    keys = [store.keys.lease(lease.task_id) for lease in leases]

    def progress() -> None:
        for lease in leases:
            lease.progress("load-data")

    def timer_renewal() -> None:
        for key in keys:
            client.pexpire(key, policy.lease_ttl_ms)

    fenced = measure(client, beat.tick, ticks, progress)
    timer = measure(client, timer_renewal, ticks, progress)
    if any(lease.lost_reason is not None for lease in leases):
        raise RuntimeError("a lease was lost during the benchmark")
    return {k: v / count for k, v in fenced.items()}, {k: v / count for k, v in timer.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description="heartbeat tick cost per lease")
    parser.add_argument("--leases", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--ticks", type=int, default=30)
    args = parser.parse_args()
    with Harness("benchmarks.bench_app") as harness:
        store = LeaseStore(harness.client, KeySpace.build("fenced", "celery-task-meta-"))
        policy = FencedConfig.from_mapping({"fenced_lease_ttl": 60}).policy
        print(f"heartbeat tick, median of {args.ticks} ticks; µs per lease (wall / tick CPU / Redis)")
        print(f"  {'leases':>6}  {'fenced: one script per tick':>30}  {'timer lock: PEXPIRE each':>28}  ratio (wall)")
        for count in args.leases:
            f, p = tick_costs(store, policy, count, args.ticks)
            print(
                f"  {count:>6}  {f['wall']:8.1f} / {f['cpu']:7.1f} / {f['redis']:6.1f}  "
                f"  {p['wall']:8.1f} / {p['cpu']:7.1f} / {p['redis']:6.1f}      {f['wall'] / p['wall']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
