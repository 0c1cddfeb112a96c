"""Real Celery worker, beat and Flower processes for integration tests, and a forked child for
the tests of what a fork keeps.

Each process runs in its own process group (so a SIGKILL or SIGSTOP reaches the whole
worker, children included), writes its log to a file the test can read, and is stopped at
the end of the test whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import psutil

from celery_fenced.harness import wait_until

__all__ = ["CeleryProcess", "in_a_forked_child", "run_project_python", "wait_until"]

ROOT = Path(__file__).resolve().parents[2]


def run_project_python(argv: list[str], env: dict[str, str], timeout: float) -> str:
    """Run ``python ARGV`` in the project's root to its end; its output, once it exited 0."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def in_a_forked_child(check: Callable[[], dict[str, object]], timeout: float = 10.0) -> dict[str, object]:
    """Fork this process: the child runs ``check``, sends its answer (JSON) through a pipe and
    leaves at once, running nothing of pytest's; the answer. Every wait is bounded by ``timeout``.

    Python 3.12+ warns (a ``DeprecationWarning``, an error under this suite's filters) when a
    process with threads forks; the fork is what is tested, so that warning is not raised.
    """
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        try:
            try:
                answer = json.dumps(check())
            except BaseException as exc:  # told to the parent, whatever it was
                answer = json.dumps({"the child raised": repr(exc)})
            os.write(write, answer.encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([read], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise AssertionError(f"the forked child did not answer within {timeout:g}s")
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, timeout, "the forked child to exit")
    except BaseException:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read)
    answer: dict[str, object] = json.loads(b"".join(chunks))
    return answer


class CeleryProcess:
    """One ``celery`` command (worker, beat, flower) running in its own process group."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        ready_text: str,
        launcher: tuple[str, ...] = ("-m", "celery"),
    ) -> None:
        """Start ``python LAUNCHER ARGV``: the celery command, unless ``launcher`` says otherwise."""
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ready_text = ready_text
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, *argv],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        """The main process id."""
        return self.proc.pid

    def log(self) -> str:
        """Everything the process logged so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> CeleryProcess:
        """Wait until the process logs its ready line."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            return self.ready_text in self.log()

        wait_until(ready, timeout, f"{self.name} to be ready")
        return self

    def children(self) -> list[int]:
        """Pids of the pool's child processes."""
        try:
            return [p.pid for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the whole process group (the worker and its children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the process group: SIGCONT (in case it was stopped), SIGTERM, then SIGKILL."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
