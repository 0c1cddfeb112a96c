"""The Lua scripts that make every change to the shared state, and their loader.

Each script lives in its own ``<name>.lua`` file beside this module, headed by its KEYS,
ARGV and return codes. The functions several scripts share (the server clock, Celery's
result write) live once, in ``_lib.lua``; the loader puts in front of each script the ones it
calls.
:class:`ScriptSet` holds every script file as a :class:`LeaseScript`, which runs it by SHA and
loads it again after ``NoScriptError`` (a Redis restart), on a connection of the calling
thread's own (:class:`ThreadConnections`), or where the process's threads are greenlets (gevent's
patching, the gevent pool) on the client's pool (:class:`PooledConnections`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from ..compat import is_connected

_pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _pack_command
except ImportError:  # redis-py without hiredis: its own packer
    _pack_command = None

__all__ = [
    "SCRIPT_NAMES",
    "LeaseScript",
    "PooledConnections",
    "ScriptSet",
    "ThreadConnections",
    "script_header",
    "script_source",
    "threads_are_greenlets",
]

_LIBRARY = "_lib"


def _names() -> tuple[str, ...]:
    files = resources.files(__package__)
    return tuple(
        sorted(
            entry.name.removesuffix(".lua")
            for entry in files.iterdir()
            if entry.name.endswith(".lua") and not entry.name.startswith("_")
        )
    )


#: Every script the package runs: one ``<name>.lua`` file each, found beside this module.
SCRIPT_NAMES = _names()


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


def script_header(name: str) -> str:
    """The script file itself, without the shared library (its header is its contract)."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown lease script {name!r}")
    return _read(name)


_FUNCTION = re.compile(r"^local function (\w+)\(", re.MULTILINE)


@cache
def _library() -> dict[str, str]:
    """The functions of ``_lib.lua`` by name, each with its source, in the file's order."""
    text = _read(_LIBRARY)
    starts = list(_FUNCTION.finditer(text))
    ends = [match.start() for match in starts[1:]] + [len(text)]
    return {match.group(1): text[match.start() : end].rstrip() + "\n" for match, end in zip(starts, ends, strict=True)}


def _calls(source: str, name: str) -> bool:
    return re.search(rf"\b{name}\(", source) is not None


@cache
def script_source(name: str) -> str:
    """The Lua source run for a script: the functions of the shared library it calls (and
    those they call), then ``<name>.lua``.

    Every function defined costs each run of the script a closure, called or not.
    """
    body = script_header(name)
    library = _library()
    needed = {fn for fn in library if _calls(body, fn)}
    while True:  # what the needed functions call in turn
        more = {fn for fn in library if fn not in needed and any(_calls(library[n], fn) for n in needed)}
        if not more:
            break
        needed |= more
    used = "".join(source for fn, source in library.items() if fn in needed)
    return f"{used}\n{body}"


class ThreadConnections:
    """Each thread's own connection to a client's Redis, for the scripts every task runs.

    ``Redis.execute_command`` checks a connection out of the pool and back in for every
    command, records its observability figures and sets up its retry loop: about 20 µs of CPU
    per call, as much as the rest of the client's side of a script, twice on every task's
    path. A call here goes straight to a connection the thread keeps, made with the client's
    pool's settings (address, database, credentials, TLS, timeouts, retry): one connection
    per thread that runs scripts, besides the pool's.

    A connection error disconnects it and runs the call again under the connection's own
    retry policy, as the client does; an error that leaves the reply unread (an exception
    raised into the thread) disconnects it, so a later call never reads a stale reply.

    Every connection made is closed on purpose, never left to the garbage collector (a
    redis-py connection sits in a reference cycle, and a cycle's objects are finalized in no
    set order, so its socket could be collected first, unclosed): by :meth:`close`, when
    this object is collected, or, for a thread that ended or a parent process's, when a
    thread makes its connection.
    """

    def __init__(self, client: Any) -> None:
        self.pool = client.connection_pool
        self._local = threading.local()
        # serial number -> (its thread, the process that made it, the connection). Changed
        # only by single dict operations, which need no lock (a lock held by another thread
        # at a fork would stay held in the child).
        self._made: dict[int, tuple[weakref.ref[threading.Thread], int, Any]] = {}
        self._serials = itertools.count()
        weakref.finalize(self, _close_all, self._made)

    def connection(self) -> Any:
        """This thread's connection (made on first use, and again in a forked child)."""
        local = self._local
        pid = os.getpid()
        if getattr(local, "pid", None) != pid:  # a connection made before a fork is the parent's
            self._close_orphans(pid)
            # Made as the pool makes its own, but kept out of its count: the pool never sees it
            # back (a pool with ``max_connections`` would run out).
            connection = self.pool.connection_class(**self.pool.connection_kwargs)
            self._made[next(self._serials)] = (weakref.ref(threading.current_thread()), pid, connection)
            local.connection = connection
            local.pid = pid
        return local.connection

    def execute(self, *args: Any) -> Any:
        """Send one command and read its reply on this thread's connection."""
        connection = self.connection()
        try:
            return _send(connection, args)
        except (ConnectionError, TimeoutError):  # _send disconnected it
            return connection.retry.call_with_retry(lambda: _send(connection, args), lambda error: None)

    def close(self) -> None:
        """Close every thread's connection; a thread's next call connects again."""
        _close_all(self._made)

    def _close_orphans(self, pid: int) -> None:
        """Close the connections of threads that ended, and those a forked child inherited."""
        for key, (thread, made_by, connection) in list(self._made.items()):
            owner = thread()
            if made_by != pid or owner is None or not owner.is_alive():
                self._made.pop(key, None)
                _disconnect(connection)


def _close_all(made: dict[int, tuple[Any, int, Any]]) -> None:
    # The entries stay: a thread reconnects its connection on its next call, still tracked.
    for _, _, connection in list(made.values()):
        _disconnect(connection)


def _disconnect(connection: Any) -> None:
    # A parent's connection, in a forked child, is only closed (redis-py checks the pid).
    with contextlib.suppress(Exception):
        connection.disconnect()


def _packed(connection: Any, args: tuple[Any, ...]) -> list[bytes]:
    """The command in Redis's protocol.

    hiredis packs a script call's fifteen arguments in about 1 µs; redis-py's packer, though
    it hands the same work to hiredis, first runs each argument through its encoder in a
    generator: about 18 µs, twice on every task's path. The bytes are the same for the
    arguments scripts take (text, bytes, integers); anything else (a connection with another
    encoding, an argument hiredis does not take) goes through redis-py's packer as before.
    """
    encoder = connection.encoder
    if _pack_command is not None and encoder.encoding == "utf-8" and encoder.encoding_errors == "strict":
        try:
            return [_pack_command(args)]
        except TypeError:
            pass  # redis-py's packer names what is wrong with it
    packed: list[bytes] = connection.pack_command(*args)
    return packed


def _send(connection: Any, args: tuple[Any, ...]) -> Any:
    try:
        if not is_connected(connection):
            connection.connect()  # as the pool does: a Sentinel's connection asks for the master
        connection.send_packed_command(_packed(connection, args))
        return connection.read_response()
    except ResponseError:
        raise  # a reply, read: the connection is in step
    except BaseException:
        connection.disconnect()  # the reply may be unread
        raise


def threads_are_greenlets() -> bool:
    """True in a process whose ``threading`` gevent has patched (a gevent worker, a gevent web
    server): its "threads" are greenlets, most of them short-lived. Asked of ``sys.modules``, so
    that a process without gevent imports nothing."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))


class PooledConnections:
    """The client's own pool, for the scripts of a process whose threads are greenlets.

    On the gevent pool each task runs in a greenlet of its own: a connection kept per thread
    would be a connection made, and left, per task. The pool lends one for each call (and is
    cooperative under gevent's patching).
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    def execute(self, *args: Any) -> Any:
        """Send one command on a connection of the pool; its reply."""
        return self.client.execute_command(*args)

    def close(self) -> None:
        """Nothing to close: the pool is its client's."""


class LeaseScript:
    """One script on one Redis client: run by SHA, loaded again after ``NoScriptError``.

    It does what redis-py's ``Script`` does, on the calling thread's own connection
    (:class:`ThreadConnections`). A pipeline passed as ``client`` gets redis-py's own
    ``Script``, which loads the script into the pipeline first.
    """

    def __init__(
        self, client: Any, source: str, connections: ThreadConnections | PooledConnections | None = None
    ) -> None:
        self.client = client
        self.connections = connections or ThreadConnections(client)
        self._script = client.register_script(source)

    @property
    def sha(self) -> str:
        """The script's SHA1, as ``EVALSHA`` names it."""
        sha: str = self._script.sha
        return sha

    def __call__(self, keys: Sequence[Any] = (), args: Iterable[Any] = (), client: Any = None) -> Any:
        """Run the script with ``keys`` and ``args``; on ``client`` (a pipeline) when given."""
        if client is not None:
            return self._script(keys=keys, args=args, client=client)
        execute = self.connections.execute
        try:
            return execute("EVALSHA", self._script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._script.sha = self.client.script_load(self._script.script)
            return execute("EVALSHA", self._script.sha, len(keys), *keys, *args)


class ScriptSet:
    """The package's scripts on one Redis client, as attributes by name."""

    def __init__(self, client: Any) -> None:
        self.connections: ThreadConnections | PooledConnections = (
            PooledConnections(client) if threads_are_greenlets() else ThreadConnections(client)
        )
        # Plain instance attributes: a lookup on every call finds them at once.
        for name in SCRIPT_NAMES:
            setattr(self, name, LeaseScript(client, script_source(name), self.connections))

    def close(self) -> None:
        """Close the scripts' own connections (the client's pool is its owner's to close)."""
        self.connections.close()

    def __getattr__(self, name: str) -> LeaseScript:
        raise AttributeError(f"no lease script {name!r}")
