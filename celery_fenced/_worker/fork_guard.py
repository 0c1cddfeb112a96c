"""The lock a worker's main-process threads hold while they use shared state, and every fork takes first.

The prefork pool forks new children while the reaper and the reservation threads run. A
fork in the middle of their work would hand the child locks they hold (Python 3.11's
``cached_property`` lock, one per class, is one of them), and the child would wait for them
for good. So each of them holds :data:`FORK_GUARD` while it works, and a fork takes it first
(the fork handler of :mod:`~celery_fenced._worker.runtime`): it waits for the work under way
to end, and the child starts with none of it half done.
"""

from __future__ import annotations

import threading

__all__ = ["FORK_GUARD"]

#: Held by a main-process thread's unit of work, and by every fork.
FORK_GUARD = threading.Lock()
