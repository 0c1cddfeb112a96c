"""The one gateway to Redis for the lease scripts: the connections they run on, and their runner.

:class:`ScriptSet` holds every script file (:mod:`celery_fenced._lease.scripts`) as a typed
:class:`LeaseScript` attribute, which runs it by SHA and loads it again after ``NoScriptError`` (a Redis
restart), on a connection of the calling thread's own (:class:`ThreadConnections`), or where the
process's threads are greenlets (gevent's patching, the gevent pool) on the client's pool
(:class:`PooledConnections`).

:data:`NEEDED_COMMANDS` are the commands the scripts cannot work without that a restricted Redis
user may lack; :func:`denied_redis_commands` finds those a user may not run, in one round trip,
for the worker's and beat's checks at start and the reaper's failure lines.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, ParamSpec, TypeVar

from redis.exceptions import ConnectionError, NoPermissionError, NoScriptError, RedisError, ResponseError, TimeoutError

from .._celery.compat import is_connected
from . import scripts

_pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _pack_command
except ImportError:  # redis-py without hiredis: its own packer
    _pack_command = None

__all__ = [
    "NEEDED_COMMANDS",
    "NO_RETRY",
    "Arg",
    "Code",
    "Key",
    "LeaseScript",
    "PooledConnections",
    "Retry",
    "ScriptSet",
    "Table",
    "ThreadConnections",
    "denied_commands_text",
    "denied_redis_commands",
    "threads_are_greenlets",
]


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


#: A key as a script takes it.
Key = str | bytes
#: An argument as a script takes it (Redis receives its text).
Arg = str | bytes | int | float
#: A code a script answers, as the client decodes it (``bytes`` unless ``decode_responses``).
Code = bytes | str
#: A script's table answer: a list of codes, counts and field lists.
Table = list[Any]

R = TypeVar("R")
_P = ParamSpec("_P")


class Retry:
    """The retry policy of the store's calls on a task's path: a call runs once; on one of
    ``errors`` (a connection error), ``again`` runs it until it answers or gives up.

    The fenced backend gives its store Celery's own loop (``backend.ensure``, with the
    backend's ``retry_policy``): a worker's task waits out a Redis blip as Celery's own
    result write does. The loop is set up only once a call has failed: ``ensure`` for
    every call would cost more than the script it runs. Without ``errors``, a call runs once.
    (A connection's own retry policy, in :class:`ThreadConnections`, comes first.)
    """

    __slots__ = ("again", "errors")

    def __init__(
        self, errors: tuple[type[BaseException], ...] = (), again: Callable[[Callable[[], Any]], Any] | None = None
    ) -> None:
        self.errors = errors
        self.again = again

    def __call__(self, operation: Callable[_P, R], /, *args: _P.args, **kwargs: _P.kwargs) -> R:
        """``operation(*args, **kwargs)``, run again under the policy after a connection error."""
        try:
            return operation(*args, **kwargs)
        except self.errors:
            if self.again is None:
                raise
            result: R = self.again(partial(operation, *args, **kwargs))
            return result


#: A call runs once.
NO_RETRY = Retry()


#: The commands the lease scripts cannot work without that a restricted Redis user (an ACL, a
#: managed service) may lack, each with a harmless call that tells whether the user may run it
#: (a denied one answers NOPERM), and what needs it.
NEEDED_COMMANDS = (
    (("INFO", "replication"), "INFO", "the scripts that hand out fencing tokens read the server's replication id"),
    (("TIME",), "TIME", "the scripts read the server's clock"),
    (("EVALSHA", "0" * 40, 0), "EVALSHA", "every lease change is a script run by its SHA"),
    (("SCRIPT", "LOAD", "return 0"), "SCRIPT|LOAD", "a script missing from the server's cache is loaded again"),
    (("WAIT", 0, 0), "WAIT", "a new token epoch waits for the replicas"),
)


def denied_redis_commands(client: Any) -> list[tuple[str, str]]:
    """The commands fenced tasks need that the Redis user of ``client`` may not run, each with
    what needs it; none when Redis cannot be reached (one round trip)."""
    try:
        pipe = client.pipeline(transaction=False)
        for call, _, _ in NEEDED_COMMANDS:
            pipe.execute_command(*call)
        replies = pipe.execute(raise_on_error=False)
    except RedisError:
        return []
    return [
        (command, why)
        for (_, command, why), reply in zip(NEEDED_COMMANDS, replies, strict=True)
        if isinstance(reply, NoPermissionError)
    ]


def denied_commands_text(denied: Sequence[tuple[str, str]]) -> str:
    """What :func:`denied_redis_commands` found, in words: the commands, what needs them, and
    the fix (``the lease Redis user may not run INFO (…): grant it (ACL SETUSER <user> +info)``)."""
    names = ", ".join(command for command, _ in denied)
    reasons = "; ".join(why for _, why in denied)
    grant = " ".join("+" + command.lower() for command, _ in denied)
    return f"the lease Redis user may not run {names} ({reasons}): grant it (ACL SETUSER <user> {grant})"


class LeaseScript(Generic[R]):
    """One script on one Redis client: run by SHA, loaded again after ``NoScriptError``;
    ``R`` is what it answers.

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

    def __call__(self, keys: Sequence[Key] = (), args: Sequence[Arg] = (), client: Any = None) -> R:
        """Run the script with ``keys`` and ``args``; on ``client`` (a pipeline, or one
        connection's client) when given."""
        if client is not None:
            return self._script(keys=keys, args=args, client=client)  # type: ignore[no-any-return]
        execute = self.connections.execute
        try:
            return execute("EVALSHA", self._script.sha, len(keys), *keys, *args)  # type: ignore[no-any-return]
        except NoScriptError:
            self._script.sha = self.client.script_load(self._script.script)
            return execute("EVALSHA", self._script.sha, len(keys), *keys, *args)  # type: ignore[no-any-return]


class ScriptSet:
    """The package's scripts on one Redis client: one typed attribute each, named as its file.

    Each is called as ``scripts.<name>(keys=[…], args=[…])``; the ``.lua`` file's header names
    its KEYS, ARGV and answers, and the outcome enum that maps its codes is named beside it
    (:data:`~celery_fenced._lease.state.SCRIPT_OUTCOMES`). A unit test holds this list against the
    files.
    """

    def __init__(self, client: Any) -> None:
        self.connections: ThreadConnections | PooledConnections = (
            PooledConnections(client) if threads_are_greenlets() else ThreadConnections(client)
        )

        def load(name: str) -> LeaseScript[Any]:
            return LeaseScript(client, scripts.script_source(name), self.connections)

        # -- the lease protocol (each answers codes of its outcome enum in celery_fenced._lease.state)
        #: The token, a first delivery's; "new-epoch"; or {code, previous, snapshot[, checkpoint]} (AcquireOutcome).
        self.acquire: LeaseScript[int | Code | Table] = load("acquire")
        #: One ReserveOutcome code per reservation.
        self.reserve: LeaseScript[list[Code]] = load("reserve")
        #: One RenewOutcome code per lease.
        self.renew: LeaseScript[list[Code]] = load("renew")
        #: {LapseOutcome}.
        self.lapse: LeaseScript[Table] = load("lapse")
        #: {ReleaseOutcome} (a hand-off too).
        self.release: LeaseScript[Table] = load("release")
        #: {ReleaseOutcome}: a hand-off taken back.
        self.hand_back: LeaseScript[Table] = load("hand_back")
        #: {ReleaseOutcome}: a hand-off's replacement sent.
        self.replacement_sent: LeaseScript[Table] = load("replacement_sent")
        #: 1 (stored, DONE: the common case), or {StoreOutcome, detail}.
        self.store: LeaseScript[int | Table] = load("store")
        #: {ClaimOutcome, cause, lease fields as a flat list}.
        self.claim: LeaseScript[Table] = load("claim")
        #: {CancelOutcome, previous status}.
        self.cancel: LeaseScript[Table] = load("cancel")
        #: {RedriveOutcome, previous status}.
        self.redrive: LeaseScript[Table] = load("redrive")
        #: {LapseNowOutcome}.
        self.lapse_now: LeaseScript[Table] = load("lapse_now")
        #: {RestoreOutcome}.
        self.restore: LeaseScript[Table] = load("restore")
        #: {ForgetOutcome}.
        self.forget: LeaseScript[Table] = load("forget")
        #: 1 when kept, 0 when the lease is not the owner's live lease any more.
        self.trace_context: LeaseScript[int] = load("trace_context")
        # -- the token counter and its epoch
        #: The last token reserved, or "new-epoch".
        self.take_tokens: LeaseScript[int | Code] = load("take_tokens")
        #: {BeginEpochOutcome, connected replicas}.
        self.begin_epoch: LeaseScript[Table] = load("begin_epoch")
        #: {ConfirmEpochOutcome}.
        self.confirm_epoch: LeaseScript[Table] = load("confirm_epoch")
        # -- a receiving worker's liveness and reservations
        #: The reservations made due.
        self.lapse_reserved: LeaseScript[int] = load("lapse_reserved")
        #: The entries removed from a worker's reservations.
        self.unreserve: LeaseScript[int] = load("unreserve")
        #: The time the record holds until, ms.
        self.worker_alive: LeaseScript[int] = load("worker_alive")
        #: The records removed (0 or 1).
        self.worker_left: LeaseScript[int] = load("worker_left")
        #: {LapseWorkerOutcome, reservations made due}.
        self.lapse_worker: LeaseScript[Table] = load("lapse_worker")
        # -- the cluster's metrics
        #: The fields changed.
        self.metrics: LeaseScript[int] = load("metrics")
        #: The fields changed.
        self.gaps: LeaseScript[int] = load("gaps")
        # -- the user's own fenced writes (celery_fenced.fencing)
        #: {1, token} when written, {0, newer token} when refused.
        self.fenced_write: LeaseScript[list[int]] = load("fenced_write")

    def script(self, name: str) -> LeaseScript[Any]:
        """The script of ``<name>.lua``.

        Raises:
            KeyError: no such script.
        """
        found = vars(self).get(name) if name in scripts.SCRIPT_NAMES else None
        if not isinstance(found, LeaseScript):
            raise KeyError(f"no lease script {name!r}")
        return found

    def close(self) -> None:
        """Close the scripts' own connections (the client's pool is its owner's to close)."""
        self.connections.close()
