"""What finished tasks cost Redis at scale, and the reaper's sweep among them.

On one private Redis, in the same run:

* **plain**: ``--finished`` results written as Celery's Redis backend writes them (``SET``
  with the result expiry, one day), each the meta of a task that returned a small dict;
* **fenced**: as many tasks taken and finished through the lease scripts, as a worker runs
  them (``acquire.lua``, then ``store.lua`` with the meta the fenced backend encodes: the
  same one, with ``fence_run`` and ``fence_token``), with the same expiry.

It prints ``used_memory``'s growth per finished task on each side and their ratio (target
≤ 1.25), then adds ``--live`` running leases (1 % of them lapsed) among the fenced side's
finished tasks and times one reaper pass: finding the due leases in the expiry index and
claiming them (target ≤ 100 ms with 1,000,000 finished and 10,000 live).

    python benchmarks/finished_leases.py [--finished 1000000] [--live 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kombu.utils.json import dumps

from benchmarks._harness import Harness
from celery_fenced._lease.finished import FENCE_RUN, run_text

BATCH = 2000
EXPIRES_MS = 86_400_000
OWNER = "celery@bench-host/4242/0a1b2c3d0"
#: The recorded call of the throughput benchmark's task.
CALL = dumps(
    {
        "task": "benchmarks.bench_app.fenced_short",
        "args": [0.002],
        "kwargs": {},
        "options": {"queue": "celery", "reply_to": str(uuid.uuid4()), "correlation_id": str(uuid.uuid4())},
    }
)


def meta(task_id: str, **fence: Any) -> str:
    """A SUCCESS meta as Celery encodes it for a task that returned a small dict."""
    fields = {
        "status": "SUCCESS",
        "result": {"rows": 1},
        "traceback": None,
        "children": [],
        "date_done": "2026-12-05T18:00:00.000000+00:00",
        "task_id": task_id,
        **fence,
    }
    return str(dumps(fields))


def used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def plain_results(client: Any, count: int) -> None:
    for start in range(0, count, BATCH):
        pipe = client.pipeline(transaction=False)
        for _ in range(start, min(count, start + BATCH)):
            task_id = str(uuid.uuid4())
            pipe.set(f"celery-task-meta-{task_id}", meta(task_id), px=EXPIRES_MS)
        pipe.execute()


def fenced_results(store: Any, count: int) -> None:
    client = store.client
    keys = store.keys
    store.tokens.begin_epoch()
    for start in range(0, count, BATCH):
        ids = [str(uuid.uuid4()) for _ in range(start, min(count, start + BATCH))]
        publishes = [secrets.token_hex(8) for _ in ids]
        pipe = client.pipeline(transaction=False)
        for task_id, publish in zip(ids, publishes, strict=True):
            acquire_keys = [keys.lease(task_id), keys.token, keys.index, keys.token_epoch, keys.result(task_id)]
            args = [OWNER, 15_000, "benchmarks.bench_app.fenced_short", CALL, 3, "", publish]
            store.scripts.acquire(keys=acquire_keys, args=args, client=pipe)
        tokens = pipe.execute()
        pipe = client.pipeline(transaction=False)
        for task_id, publish, token in zip(ids, publishes, tokens, strict=True):
            written = meta(task_id, **{FENCE_RUN: run_text(publish, 1, 0), "fence_token": token})
            store_keys = [keys.lease(task_id), keys.result(task_id), keys.index]
            store.scripts.store(
                keys=store_keys, args=[token, written, "SUCCESS", "ready", EXPIRES_MS, OWNER], client=pipe
            )
        if any(reply != 1 for reply in pipe.execute()):
            raise RuntimeError("a fenced write was not stored as a finished lease")


def live_leases(store: Any, count: int, lapsed: int) -> None:
    client = store.client
    keys = store.keys
    ids = [f"live-{i}" for i in range(count)]
    for start in range(0, count, BATCH):
        pipe = client.pipeline(transaction=False)
        for task_id in ids[start : start + BATCH]:
            acquire_keys = [keys.lease(task_id), keys.token, keys.index, keys.token_epoch, keys.result(task_id)]
            args = [OWNER, 600_000, "benchmarks.bench_app.fenced_short", CALL, 3, "", secrets.token_hex(8)]
            store.scripts.acquire(keys=acquire_keys, args=args, client=pipe)
        pipe.execute()
    pipe = client.pipeline(transaction=False)
    for task_id in ids[:: max(1, count // lapsed)]:
        token = int(client.hget(keys.lease(task_id), "ownerToken"))
        store.scripts.lapse(keys=[keys.lease(task_id), keys.index], args=[OWNER, token, "release"], client=pipe)
    pipe.execute()


def sweep_ms(store: Any, lapsed: int) -> tuple[float, int]:
    """One reaper pass: the due leases from the index, each claimed (re-sending is apart)."""
    start = time.perf_counter()
    ids = store.due_task_ids(lapsed + 10)
    results = store.claim_due(
        ids, grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda task_id, token: b"{}", expires_ms=0
    )
    return (time.perf_counter() - start) * 1000, sum(1 for r in results if r.code == "requeued")


def main() -> int:
    parser = argparse.ArgumentParser(description="finished tasks' memory and the reaper's sweep among them")
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--live", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3, help="reaper passes timed")
    args = parser.parse_args()
    with Harness("benchmarks.bench_app") as harness:
        from benchmarks import bench_app

        client = harness.client
        store = bench_app.app.backend.lease_store
        per_task = {}
        for side in ("plain", "fenced"):
            client.flushall()
            before = used_memory(client)
            if side == "plain":
                plain_results(client, args.finished)
            else:
                fenced_results(store, args.finished)
            per_task[side] = (used_memory(client) - before) / args.finished
        total_mb = per_task["fenced"] * args.finished / 2**20
        print(f"{args.finished:,} finished tasks, results kept one day (used_memory's growth):")
        print(
            f"  plain {per_task['plain']:.0f} B, fenced {per_task['fenced']:.0f} B per finished task: ratio "
            f"{per_task['fenced'] / per_task['plain']:.3f} (target <= 1.25); fenced total {total_mb:,.0f} MiB"
        )
        lapsed = max(1, args.live // 100)
        samples, claimed = [], 0
        for _ in range(args.rounds):
            client.delete(store.keys.index)
            live_leases(store, args.live, lapsed)
            took, claimed = sweep_ms(store, lapsed)
            samples.append(took)
        ms = statistics.median(samples)
        print(
            f"  reaper pass among them, {args.live:,} live leases, {lapsed} lapsed: found and claimed {claimed} "
            f"in {ms:.1f} ms (median of {args.rounds}; target <= 100 ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
