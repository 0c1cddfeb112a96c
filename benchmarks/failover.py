"""Recovery after a Sentinel failover that lost writes: fenced against plain Celery, same harness.

Each round starts a primary, one replica and three Sentinels on loopback
(``tests/support/replication.py``), and one worker on ``sentinel://`` (plain: Celery's own
Sentinel backend; fenced: ``fenced+sentinel://``). 20 tasks run and replicate; the replica is
held back while 20 more run; the primary is killed. The recovery is the time from the kill
until the first task sent after it has its result (the client's publish retries meanwhile).
Rounds alternate plain and fenced; the report gives each one's median and the difference,
which the fenced worker keeps within the lease TTL (3 s here).

    python benchmarks/failover.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_fenced.harness import default_binary, wait_until  # noqa: E402
from tests.support.replication import ReplicatedRedis  # noqa: E402

#: The client's publish keeps trying while Sentinel promotes the replica.
THROUGH_A_FAILOVER = {"max_retries": 100, "interval_start": 0.1, "interval_step": 0.1, "interval_max": 0.25}


def one_round(fenced: bool) -> float:
    """One failover; seconds from the kill until a task sent after it has its result."""
    tmp = Path(tempfile.mkdtemp(prefix="fenced-failover-"))
    group = ReplicatedRedis(default_binary(), tmp / "redis").start()
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        FENCED_BENCH_SENTINELS=",".join(f"{host}:{port}" for host, port in group.sentinel_addresses),
        FENCED_BENCH_FENCED="1" if fenced else "0",
    )
    log = tmp / "worker.log"
    argv = [sys.executable, "-m", "celery", "-A", "benchmarks.failover_app", "worker", "-c", "2", "-E"]
    argv += ["-l", "INFO", "--without-mingle", "--without-gossip"]
    worker = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: " ready." in log.read_text(errors="replace"), 60, "the worker")
        code = (
            "import sys, time, json\n"
            "from benchmarks.failover_app import add\n"
            "assert [add.delay(n, 1).get(timeout=30) for n in range(20)] == list(range(1, 21))\n"
            "print('replicated', flush=True); sys.stdin.readline()\n"
            "assert [add.delay(n, 2).get(timeout=30) for n in range(20)] == list(range(2, 22))\n"
            "print('held', flush=True); sys.stdin.readline()\n"
            "killed = time.monotonic()\n"
            f"assert add.apply_async((100, 1), retry_policy={THROUGH_A_FAILOVER!r}).get(timeout=120) == 101\n"
            "print(time.monotonic() - killed, flush=True)\n"
        )
        client = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert client.stdin is not None and client.stdout is not None
        assert client.stdout.readline().strip() == "replicated"
        group.wait_replicated()
        group.proxy.hold()
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "held"
        group.kill_primary()
        client.stdin.write("\n")
        client.stdin.flush()
        recovery = float(client.stdout.readline())
        client.wait(30)
        return recovery
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        group.stop()
        if not os.environ.get("FENCED_BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="recovery after a Sentinel failover, fenced against plain")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    plain, fenced = [], []
    for n in range(args.rounds):
        plain.append(one_round(fenced=False))
        fenced.append(one_round(fenced=True))
        print(f"round {n + 1}: plain {plain[-1]:.1f} s, fenced {fenced[-1]:.1f} s", flush=True)
    plain_median, fenced_median = statistics.median(plain), statistics.median(fenced)
    print(
        f"recovery after a failover that lost writes (median of {args.rounds}): plain Celery {plain_median:.1f} s, "
        f"fenced {fenced_median:.1f} s; fenced - plain = {fenced_median - plain_median:+.1f} s (target: ≤ the lease "
        f"TTL, 3 s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
