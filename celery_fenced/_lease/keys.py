"""Every Redis key the package writes, in one place.

The lease of a task is hash-tagged with the name of Celery's own result key, so the
lease and the result always share a Redis Cluster slot::

    celery-task-meta-<task_id>                       the result (Celery's key, unchanged)
    <prefix>:lease:{celery-task-meta-<task_id>}      the lease hash
    <prefix>:token                                   the global fencing-token counter
    <prefix>:token:epoch                             the replication id of the primary whose
                                                     token epoch it is (a failover begins another)
    <prefix>:leases                                  sorted set: lease key -> next due time (ms)
    <prefix>:metrics                                 hash: cluster-wide metric totals
    <prefix>:gaps                                    hash: task|stage|bucket -> longest-gap samples
    <prefix>:abandoned                               sorted set: abandoned lease key -> time (ms)
    <prefix>:workers                                 sorted set: worker id -> alive until (ms)
    <prefix>:reserved:<worker id>                    sorted set: a worker's reservations' lease
                                                     keys -> reservation due (ms)

Celery's ``result_backend_transport_options['global_keyprefix']`` is put in front of all
of them, as Celery puts it in front of the result key.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeySpace"]

_LEASE_MARK = ":lease:{"


@dataclass(frozen=True)
class KeySpace:
    """Builds the package's keys for one key prefix and one Celery result-key prefix.

    Attributes:
        prefix: the ``fenced_key_prefix`` setting, with any global key prefix in front.
        result_prefix: Celery's task key prefix (``celery-task-meta-``, with any global
            key prefix in front), exactly as the backend builds result keys.
    """

    prefix: str
    result_prefix: str

    @classmethod
    def build(cls, key_prefix: str, result_prefix: str, global_keyprefix: str = "") -> KeySpace:
        """Make a key space; ``result_prefix`` already carries the global prefix, as Celery's does."""
        return cls(prefix=f"{global_keyprefix}{key_prefix}", result_prefix=result_prefix)

    @property
    def token(self) -> str:
        """The global fencing-token counter."""
        return f"{self.prefix}:token"

    @property
    def token_epoch(self) -> str:
        """The replication id of the server that hands out tokens now (``begin_epoch.lua``)."""
        return f"{self.prefix}:token:epoch"

    @property
    def index(self) -> str:
        """The sorted set of leases by the time the reaper should look at them next."""
        return f"{self.prefix}:leases"

    @property
    def gaps(self) -> str:
        """Per task and stage, the samples of the longest gap between progress calls (for ``tune``)."""
        return f"{self.prefix}:gaps"

    @property
    def abandoned(self) -> str:
        """The dead letters: abandoned leases by the time they were abandoned."""
        return f"{self.prefix}:abandoned"

    @property
    def metrics(self) -> str:
        """The cluster-wide metric totals (a hash written by every process)."""
        return f"{self.prefix}:metrics"

    @property
    def workers(self) -> str:
        """The liveness records of the workers' main processes: worker id -> alive until (ms)."""
        return f"{self.prefix}:workers"

    def reserved_by(self, worker_id: str) -> str:
        """The lease keys of the reservations one worker (one start of it) made, not yet due."""
        return f"{self.prefix}:reserved:{worker_id}"

    def result(self, task_id: str) -> str:
        """Celery's result key for a task."""
        return f"{self.result_prefix}{task_id}"

    def lease(self, task_id: str) -> str:
        """The lease hash of a task, hash-tagged with its result key."""
        return f"{self.prefix}{_LEASE_MARK}{self.result(task_id)}}}"

    def task_id_of(self, lease_key: str | bytes) -> str:
        """Return the task id a lease key belongs to (the inverse of :meth:`lease`)."""
        key = lease_key.decode() if isinstance(lease_key, bytes) else lease_key
        head = f"{self.prefix}{_LEASE_MARK}{self.result_prefix}"
        if not key.startswith(head) or not key.endswith("}"):
            raise ValueError(f"{key!r} is not a lease key of prefix {self.prefix!r}")
        return key[len(head) : -1]
