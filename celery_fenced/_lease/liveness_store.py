"""A worker's liveness record: storage of ``fenced:workers`` and each worker's reservation set.

A worker's main process renews its record (:mod:`celery_fenced._worker.liveness`); the reaper
reads the record that lapses first and makes a dead worker's reservations due
(``lapse_worker.lua``), for the same pass to send them again. See "A worker's liveness" in
``docs/design.rst``. The lease protocol itself is :mod:`celery_fenced._lease.store`'s.
"""

from __future__ import annotations

from typing import Any

from .gateway import ScriptSet
from .keys import KeySpace
from .state import LapseWorkerOutcome, as_text, outcome

__all__ = ["LivenessStore", "hostname_of", "worker_id_of"]

#: How many lease keys of a dead worker's reservations one ``lapse_worker.lua`` call is given.
_LAPSE_WORKER_BATCH = 1000

#: How many times a dead worker's reservations are read and given to ``lapse_worker.lua`` in one
#: pass (a set that holds more than a batch, or grows meanwhile).
_LAPSE_WORKER_READS = 5


def worker_id_of(hostname: str, pid: int, start: str) -> str:
    """The id of one start of a worker: ``<hostname>/<pid>/<start>``. A worker restarted under
    the same name (a supervisor, a container restarted in its pod) is another start: the dead
    one's record still lapses, and its reservations are sent again."""
    return f"{hostname}/{pid}/{start}"


def hostname_of(worker_id: str) -> str:
    """The hostname part of a :func:`worker_id_of` (the ``reservedBy`` of its reservations)."""
    return worker_id.rsplit("/", 2)[0]


class LivenessStore:
    """The workers' liveness records on one Redis client (the lease store's, with its scripts).

    Args:
        client: a redis-py client (the result backend's own client).
        scripts: the scripts on that client.
        keys: the key space.
    """

    def __init__(self, client: Any, scripts: ScriptSet, keys: KeySpace) -> None:
        self.client = client
        self.scripts = scripts
        self.keys = keys

    def worker_alive(self, worker_id: str, ttl_ms: int) -> None:
        """Renew the liveness record of a worker's main process for ``ttl_ms``."""
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms!r}")
        self.scripts.worker_alive(keys=[self.keys.workers], args=[worker_id, ttl_ms])

    def worker_left(self, worker_id: str) -> None:
        """A worker stopped: remove its liveness record (its reservations wait for their start timeout)."""
        self.scripts.worker_left(keys=[self.keys.workers, self.keys.reserved_by(worker_id)], args=[worker_id])

    def workers(self) -> list[tuple[str, int, int]]:
        """Every worker's liveness record, ``(worker id, alive until ms, reservations held)``,
        the first to lapse first, in two round trips.

        A record past its time belongs to a worker gone without saying so: the reaper's next
        pass makes its reservations due and drops it.
        """
        records = self.client.zrange(self.keys.workers, 0, -1, withscores=True)
        pipe = self.client.pipeline(transaction=False)
        for member, _ in records:
            pipe.zcard(self.keys.reserved_by(as_text(member)))
        held = pipe.execute() if records else []
        return [(as_text(member), int(until), int(count)) for (member, until), count in zip(records, held, strict=True)]

    def lapse_dead_workers(self) -> dict[str, int]:
        """Make the reservations of every worker whose liveness record lapsed due now.

        Returns:
            ``{worker id: reservations made due}`` for each worker found dead.
        """
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(self.keys.workers, 0, 0, withscores=True)  # the record that lapses first
        (seconds, micros), first = pipe.execute()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        if not first or first[0][1] > now_ms:
            return {}
        lapsed = {}
        for member in self.client.zrangebyscore(self.keys.workers, "-inf", now_ms):
            dead = as_text(member)
            made_due = self._lapse_worker(dead)
            if made_due is not None:
                lapsed[dead] = made_due
        return lapsed

    def _lapse_worker(self, worker_id: str) -> int | None:
        """Make a lapsed worker's reservations due (``lapse_worker.lua``), passing the script
        the lease keys its reservations set holds; how many were made due, ``None`` when its
        record holds or is gone. A set that grows meanwhile is read again, a bounded number of
        times: what is left stays for the next pass (and is due at its own time anyway)."""
        reservations = self.keys.reserved_by(worker_id)
        made_due = 0
        for _ in range(_LAPSE_WORKER_READS):
            leases = self.client.zrange(reservations, 0, _LAPSE_WORKER_BATCH - 1)
            keys = [self.keys.workers, self.keys.index, reservations, *leases]
            code, count = self.scripts.lapse_worker(keys=keys, args=[worker_id, hostname_of(worker_id)])
            made_due += int(count)
            answer = outcome(LapseWorkerOutcome, "lapse_worker", code)
            if answer == LapseWorkerOutcome.LAPSED:
                return made_due
            if answer != LapseWorkerOutcome.MORE:
                return None
        return made_due
