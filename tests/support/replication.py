"""Redis replication and Sentinel on loopback, for failover tests: a primary, its replica, three
Sentinels, and a proxy that holds the replica back.

Redis replicates asynchronously: a write the primary acknowledged may not have reached the
replica that is promoted. :class:`HoldingProxy` makes that happen at will. It stands in front of
the primary, and everyone (clients, the Sentinels, the replica) reaches the primary through it;
:meth:`HoldingProxy.hold` stops what passes on the replication links (a connection that sent
``REPLCONF``) while keeping them open, so the replica still looks healthy to Sentinel, which may
promote it. Sentinel re-points a replica that replicates from any other address than the one it
knows the primary by, so the replica cannot simply use a proxy of its own.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from celery_fenced.harness import RedisServer, free_port, wait_until

__all__ = ["MASTER_NAME", "HoldingProxy", "ReplicatedRedis", "Sentinel"]

#: The name the Sentinels monitor the primary by.
MASTER_NAME = "mymaster"


class _Link:
    """One proxied connection: the client's socket and the server's."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.replication = False  # the client sent REPLCONF: it is a replica's link


class HoldingProxy:
    """A TCP proxy on 127.0.0.1 to one port, which can hold the replication links that pass it.

    Args:
        target_port: the port of 127.0.0.1 it passes connections to.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._flowing = threading.Event()
        self._flowing.set()
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def start(self) -> HoldingProxy:
        """Listen, and pass each connection on in two threads of its own."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="holding-proxy", daemon=True).start()
        return self

    def hold(self) -> None:
        """Pass nothing more on the replication links, and keep them open."""
        self._flowing.clear()

    def release(self) -> None:
        """Pass the replication links' bytes again."""
        self._flowing.set()

    def stop(self) -> None:
        """Close the listener and every link."""
        self._flowing.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            _close(link.client, link.server)

    def _accept(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
                server.settimeout(None)
            except OSError:
                client.close()  # the server is down: refused, as it would be
                continue
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
            threading.Thread(target=self._pass, args=(link, True), daemon=True).start()
            threading.Thread(target=self._pass, args=(link, False), daemon=True).start()

    def _pass(self, link: _Link, upstream: bool) -> None:
        source, sink = (link.client, link.server) if upstream else (link.server, link.client)
        try:
            while True:
                data = source.recv(65536)
                if upstream and b"REPLCONF" in data.upper():
                    link.replication = True
                while link.replication and not self._flowing.wait(0.05):
                    pass  # held: neither the bytes read nor any after them go on
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        _close(link.client, link.server)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


class Sentinel:
    """One ``redis-server --sentinel`` process on a free port.

    Args:
        executable: the ``redis-server`` binary.
        datadir: where its configuration (which Sentinel rewrites) and log live.
        primary_port: the port of 127.0.0.1 the primary is known by.
        quorum: how many Sentinels must agree the primary is down.
        down_after_ms: how long the primary may not answer before it is taken as down.
    """

    def __init__(self, executable: str, datadir: Path, primary_port: int, quorum: int, down_after_ms: int) -> None:
        self.executable = executable
        self.datadir = Path(datadir)
        self.port = free_port()
        self.primary_port = primary_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Sentinel:
        self.datadir.mkdir(parents=True, exist_ok=True)
        conf = self.datadir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.datadir}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.primary_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        with (self.datadir / "sentinel.log").open("ab") as log:
            self.process = subprocess.Popen(
                [self.executable, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(self._answers, 15, f"the Sentinel on port {self.port}")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def primary(self) -> tuple[str, int] | None:
        """The primary's address as this Sentinel knows it."""
        with self.client() as client:
            address = client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
        return (address[0].decode(), int(address[1])) if address else None

    def _answers(self) -> bool:
        try:
            return self.primary() is not None
        except redis.RedisError:
            return False

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def log(self) -> str:
        path = self.datadir / "sentinel.log"
        return path.read_text(errors="replace") if path.exists() else ""


class ReplicatedRedis:
    """A primary (reached through a :class:`HoldingProxy`), one replica and three Sentinels.

    Args:
        executable: the ``redis-server`` binary.
        datadir: where the servers keep their files.
        down_after_ms: how long the Sentinels wait before they take the primary as down.
    """

    def __init__(self, executable: str, datadir: Path, down_after_ms: int = 1000) -> None:
        self.datadir = Path(datadir)
        self.primary = RedisServer(executable, self.datadir / "primary")
        self.proxy = HoldingProxy(self.primary.port)
        self.replica = RedisServer(
            executable, self.datadir / "replica", extra_args=["--replicaof", "127.0.0.1", str(self.proxy.port)]
        )
        self.sentinels = [
            Sentinel(executable, self.datadir / f"sentinel-{n}", self.proxy.port, quorum=2, down_after_ms=down_after_ms)
            for n in range(3)
        ]

    def start(self) -> ReplicatedRedis:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> ReplicatedRedis:
        self.primary.start()
        self.proxy.target_port = self.primary.port  # the primary may have moved to a free port
        self.proxy.start()
        self.replica.start()
        wait_until(self._replica_linked, 30, "the replica's first sync")
        for sentinel in self.sentinels:
            sentinel.start()
        wait_until(self._sentinels_see_everyone, 30, "each Sentinel to know the replica and the other two")
        return self

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", sentinel.port) for sentinel in self.sentinels]

    def sentinel_url(self, scheme: str, db: int) -> str:
        """``sentinel://…/db;sentinel://…/db`` (``scheme`` is put in front, e.g. ``fenced+``): Celery
        reads the database from the first address, kombu from the last."""
        return scheme + ";".join(f"sentinel://127.0.0.1:{sentinel.port}/{db}" for sentinel in self.sentinels)

    def primary_port(self) -> int:
        """The port of the primary as the Sentinels name it now."""
        address = self.sentinels[0].primary()
        assert address is not None
        return address[1]

    def primary_client(self, db: int = 0) -> redis.Redis:
        """A client of whichever server is the primary now, found through the Sentinels."""
        from redis.sentinel import Sentinel as SentinelClient

        return SentinelClient(self.sentinel_addresses, socket_timeout=2).master_for(MASTER_NAME, db=db)

    def wait_replicated(self, timeout: float = 20) -> None:
        """Wait until the replica has every write the primary made."""
        with self.primary.client() as primary, self.replica.client() as replica:

            def caught_up() -> bool:
                offset = int(primary.info("replication")["master_repl_offset"])
                return int(replica.info("replication").get("slave_repl_offset", -1)) >= offset

            wait_until(caught_up, timeout, "the replica to catch up")

    def kill_primary(self) -> None:
        """SIGKILL the primary: what it did not pass on is lost."""
        process = self.primary.process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        self.primary.process = None

    def wait_promoted(self, timeout: float = 30) -> int:
        """Wait until the Sentinels name the replica as the primary and it takes writes; its port."""

        def promoted() -> bool:
            try:
                if any(sentinel.primary() != ("127.0.0.1", self.replica.port) for sentinel in self.sentinels):
                    return False
                with self.replica.client() as replica:
                    return replica.info("replication")["role"] == "master"
            except redis.RedisError:
                return False

        wait_until(promoted, timeout, "Sentinel to promote the replica")
        return self.replica.port

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        self.proxy.stop()
        self.replica.stop()
        self.primary.stop()

    def logs(self) -> str:
        return "\n".join(f"===== sentinel {n} =====\n{s.log()[-3000:]}" for n, s in enumerate(self.sentinels))

    def _replica_linked(self) -> bool:
        with self.replica.client() as replica:
            info = replica.info("replication")
        return info.get("master_link_status") == "up"

    def _sentinels_see_everyone(self) -> bool:
        try:
            for sentinel in self.sentinels:
                with sentinel.client() as client:
                    # INFO, not SENTINEL MASTER: redis-py 6.0's parser of that reply fails.
                    master = client.info("sentinel")["master0"]
                    if int(master["slaves"]) < 1 or int(master["sentinels"]) < 3:
                        return False
            return True
        except redis.RedisError:
            return False


@contextlib.contextmanager
def replicated_redis(executable: str, datadir: Path, **kwargs: Any) -> Iterator[ReplicatedRedis]:
    """A started :class:`ReplicatedRedis`, stopped on exit."""
    group = ReplicatedRedis(executable, datadir, **kwargs)
    try:
        yield group.start()
    finally:
        group.stop()
