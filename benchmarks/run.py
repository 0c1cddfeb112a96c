"""Run every benchmark and print its figures (each measured beside its baseline in the same run).

python benchmarks/run.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

BENCHMARKS = [
    ("progress() cost", ["progress_cost.py"], ["progress_cost.py", "--calls", "10000", "--rounds", "1"]),
    ("heartbeat tick per lease", ["heartbeat_tick.py"], ["heartbeat_tick.py", "--leases", "1", "100", "--ticks", "5"]),
    (
        "throughput, Redis CPU and round trips",
        ["throughput.py", "--configs", "users,events,quiet", "--floor"],
        ["throughput.py", "--configs", "users", "--tasks", "100", "--rounds", "1", "--floor"],
    ),
    (
        "the gevent pool: tasks waiting on a socket",
        ["throughput.py", "--configs", "gevent", "--rounds", "11", "--no-monitor"],
        ["throughput.py", "--configs", "gevent", "--tasks", "100", "--rounds", "1", "--no-monitor"],
    ),
    (
        "one Redis under 4 worker processes",
        ["throughput.py", "--scale"],
        ["throughput.py", "--scale", "--tasks", "150"],
    ),
    ("one task's path (instructions)", ["task_path.py"], ["task_path.py", "--tasks", "10"]),
    (
        "a real worker's task process (instructions)",
        ["task_path.py", "--worker"],
        ["task_path.py", "--worker", "--tasks", "5"],
    ),
    (
        "the server's time for one task's writes",
        ["script_cost.py"],
        ["script_cost.py", "--tasks", "50", "--rounds", "1"],
    ),
    ("reaper sweep", ["reaper_sweep.py"], ["reaper_sweep.py", "--sizes", "10000", "--rounds", "1"]),
    (
        "finished tasks' memory, and the reaper's sweep among them",
        ["finished_leases.py"],
        ["finished_leases.py", "--finished", "20000", "--live", "2000", "--rounds", "1"],
    ),
    ("takeover latency", ["takeover.py"], ["takeover.py", "--stalls", "3"]),
    ("failover recovery", ["failover.py"], ["failover.py", "--rounds", "1"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description="all benchmarks")
    parser.add_argument("--quick", action="store_true", help="smaller runs (for a smoke check)")
    args = parser.parse_args()
    failed = 0
    for title, full, quick in BENCHMARKS:
        argv = quick if args.quick else full
        print(f"== {title} ({' '.join(argv)})", flush=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, str(HERE / argv[0]), *argv[1:]], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        print("\n".join(lines) if lines else done.stderr[-2000:], flush=True)
        print(f"   (took {time.monotonic() - started:.0f} s)", flush=True)
        failed += done.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
