"""One reaper pass over 10 k and 100 k live leases with 1 % lapsed: find and claim them.

The sweep reads the expiry index (O(k log n), never a key scan) and claims each due lease with
one script call, all pipelined. Re-sending the claimed tasks is counted apart (not done here).
Target: at most 100 ms at 100 k leases.

    python benchmarks/reaper_sweep.py [--sizes 10000 100000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import Harness


def populate(store, size: int, lapsed: int) -> None:  # type: ignore[no-untyped-def]
    client = store.client
    store.tokens.begin_epoch()  # the pipelined acquires below hand out tokens on this server
    for start in range(0, size, 2000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(size, start + 2000)):
            task_id = f"t{i}"
            keys = [store.keys.lease(task_id), store.keys.token, store.keys.index, store.keys.token_epoch]
            keys.append(store.keys.result(task_id))
            store.scripts.acquire(keys=keys, args=["bench/1/a", 600_000, "bench", "", 3, "", ""], client=pipe)
        pipe.execute()
    pipe = client.pipeline(transaction=False)
    for i in range(0, size, size // lapsed):
        keys = [store.keys.lease(f"t{i}"), store.keys.index]
        token = int(client.hget(store.keys.lease(f"t{i}"), "ownerToken"))
        store.scripts.lapse(keys=keys, args=["bench/1/a", token, "release"], client=pipe)
    pipe.execute()


def main() -> int:
    parser = argparse.ArgumentParser(description="reaper sweep cost")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with Harness("benchmarks.bench_app") as harness:
        from benchmarks import bench_app

        store = bench_app.app.backend.lease_store
        for size in args.sizes:
            samples = []
            claimed = 0
            for _ in range(args.rounds):
                harness.client.flushall()
                populate(store, size, size // 100)
                start = time.perf_counter()
                ids = store.due_task_ids(size // 100 + 10)
                results = store.claim_due(
                    ids, grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda task_id, token: b"{}", expires_ms=0
                )
                samples.append((time.perf_counter() - start) * 1000)
                claimed = sum(1 for r in results if r.code == "requeued")
            ms = statistics.median(samples)
            verdict = "met" if size < 100_000 or ms <= 100 else "NOT met"
            print(
                f"{size:>7} live leases, {size // 100} lapsed: found and claimed {claimed} in {ms:.1f} ms "
                f"(median of {args.rounds}; target <= 100 ms at 100 k: {verdict})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
