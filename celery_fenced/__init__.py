"""celery-fenced: progress-aware leases, fencing tokens and a fenced result backend for Celery.

Opt in per task with ``base=ProgressLeasedTask`` and ``result_backend = "fenced+redis://…"``;
put the reaper on beat's schedule with ``install(app)``.

This module is the public face: every name a user needs is here. The package's parts live in
private folders (``_lease``, ``_task``, ``_worker``, ``_backend``, ``_reaper``, ``_operator``,
``_telemetry``, ``_celery``; :doc:`design` maps them); the public modules beside this one are
the settings (:mod:`celery_fenced.conf`), the exceptions, the signals, fenced writes to your
own stores (:mod:`celery_fenced.fencing`), the pytest plugin and its Redis
(:mod:`celery_fenced.testing`, :mod:`celery_fenced.harness`), the integrations
(:mod:`celery_fenced.contrib`) and the request class a task's own ``Request`` derives from
(:mod:`celery_fenced.worker.request`, loaded only where asked for: a process that only sends
tasks loads nothing of the worker side). ``celery_fenced.backend``, ``.task``, ``.state`` and
``.metrics`` are kept import paths of names this module has.
"""

from __future__ import annotations

from ._backend.backend import FencedRedisBackend
from ._lease.state import Checkpoint, LeaseState
from ._reaper.reaper import install, reap
from ._task.task import ProgressLeasedTask, StageBlock
from .exceptions import (
    LeaseInterrupted,
    LeaseLostError,
    LeaseUnavailableError,
    StaleOwnerError,
    TaskAbandonedError,
)

__all__ = [
    "Checkpoint",
    "FencedRedisBackend",
    "LeaseInterrupted",
    "LeaseLostError",
    "LeaseState",
    "LeaseUnavailableError",
    "ProgressLeasedTask",
    "StageBlock",
    "StaleOwnerError",
    "TaskAbandonedError",
    "install",
    "reap",
]

__version__ = "0.1.0"

# The public names say they are the package's (as ``repr``, tracebacks and the docs show
# them), not the private module that defines them. The exceptions keep theirs: a result
# stores an exception by its module, and one stored by an earlier version names
# ``celery_fenced.exceptions``.
for _name in __all__:
    _value = globals()[_name]
    if not (isinstance(_value, type) and issubclass(_value, BaseException)):
        _value.__module__ = __name__
del _name, _value
