"""Fence your own writes with the task's token: a stale owner's write raises ``StaleOwnerError``.

Fencing tokens are globally monotonic, so the rule "write only if the stored token is not
newer than mine" is right even for a row or key written by several task ids::

    @app.task(bind=True, base=ProgressLeasedTask)
    def build_report(self, report_id):
        ...
        fenced_set(redis_client, f"report:{report_id}", body, self.fencing_token)
        fenced_update(Report.objects.filter(pk=report_id), self.fencing_token, status="done")

A row or key with no fence yet (a ``NULL`` fence column, a key never written through the
fence) can be written by any owner. A refused write raises :class:`StaleOwnerError`, is
logged by the ``celery_fenced.fencing`` logger and counted in ``owner_fencing_rejected_total``.

Django helpers (:class:`FencedModel`, :func:`fenced_update`) need Django; the Redis helper
works on any redis-py client, including django-redis's ``get_redis_connection(alias)``.
"""

from __future__ import annotations

import logging
from typing import Any

from ._lease.scripts import script_source
from ._telemetry.process import TELEMETRY
from .exceptions import StaleOwnerError

__all__ = ["fence_key", "fenced_set", "fenced_update"]

logger = logging.getLogger("celery_fenced.fencing")


def fence_key(key: str) -> str:
    """The key holding the token of the last accepted write of ``key`` (same cluster slot)."""
    return f"fence:{{{key}}}" if "{" not in key else f"{key}:fence"


def _check_token(token: Any) -> int:
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        raise ValueError(f"a fencing token must be a positive int (self.fencing_token), got {token!r}")
    return token


def _refused(target: str, token: int, current: int | None, what: str) -> StaleOwnerError:
    """Log and count a refused write of the user's; return the error to raise."""
    logger.warning(
        "fenced write of %s refused: token %s is stale, %s was written by token %s", target, token, what, current
    )
    TELEMETRY.metrics.inc("owner_fencing_rejected_total")
    _flush_metrics()
    return StaleOwnerError(target, token, f"a newer token wrote {what}", current)


def _flush_metrics() -> None:
    """Flush the count at once when a fenced task of a fenced app is running here (a refused
    write is rare); elsewhere it waits for the process's next flush."""
    from celery import current_task

    from ._lease.store import LeaseStore

    task = current_task
    if task is None or not getattr(task, "fenced_task", False):
        return
    try:
        store = getattr(task.app.backend, "lease_store", None)
    except Exception:  # a backend that cannot be built: keep the count for later
        return
    if isinstance(store, LeaseStore):
        TELEMETRY.metrics.flush(store)


def fenced_set(
    client: Any,
    key: str,
    value: Any,
    token: int,
    *,
    px: int | None = None,
    fence_px: int | None = None,
) -> None:
    """Set ``key`` to ``value`` unless a newer token has written it (atomically, one script).

    A key with no fence yet (never written through the fence, or its fence deleted) is
    written by any token.

    Args:
        client: a redis-py client (``get_redis_connection(alias)`` for django-redis).
        key: the key to write.
        value: str, bytes or a number.
        token: the writer's fencing token (``self.fencing_token``).
        px: expiry in milliseconds of the value (``None`` or ``0``: none). The fence (:func:`fence_key`) does not
            expire with it: a stale owner writing after the value expired is still refused.
        fence_px: expiry in milliseconds of the fence; none by default. Set it (at least
            ``px``) only as long as no stale owner of the key can still be running; a
            longer-lived fence is never shortened by a later write.

    Raises:
        StaleOwnerError: a newer token wrote the key.
        ValueError: a bad token, or ``fence_px`` shorter than ``px``.
    """
    _check_token(token)
    if px is not None and px < 0:
        raise ValueError(f"px must be a number of milliseconds (0: no expiry), got {px!r}")
    if fence_px is not None and (fence_px <= 0 or (px and fence_px < px)):
        raise ValueError(f"fence_px must be positive and not shorter than px ({px!r}), got {fence_px!r}")
    # Registered per call (a SHA1 of the source, microseconds): a cache per client would keep
    # every client alive, since redis-py's Script holds the client it was registered on.
    script = client.register_script(script_source("fenced_write"))
    written, current = script(keys=[key, fence_key(key)], args=[token, value, px or 0, fence_px or 0])
    if not int(written):
        raise _refused(key, token, int(current), "this key")


def fenced_update(queryset: Any, token: int, *, field: str = "fence_token", **values: Any) -> int:
    """``UPDATE`` the rows of ``queryset`` whose stored token is not newer than ``token``.

    The rows written get ``token`` in ``field`` with the new ``values``; a row whose
    ``field`` is ``NULL`` (no fence yet) is written by any token. The rows are the ones
    ``queryset`` matches when the call begins, locked (``SELECT … FOR UPDATE`` where the
    database has it) in a transaction of their own, so updating a field ``queryset``
    filters on changes nothing. Rows a newer token wrote are left as they are; the others
    are written (and committed) before :class:`StaleOwnerError` is raised.

    Create a row before its first fenced write with ``field`` left ``NULL`` (or ``0``)::

        Report.objects.get_or_create(pk=report_id)
        fenced_update(Report.objects.filter(pk=report_id), self.fencing_token, status="done")

    Returns:
        The number of rows updated.

    Raises:
        StaleOwnerError: some rows of ``queryset`` were written by a newer token (its
            ``current_token`` is the newest of them).
    """
    from django.db import connections, transaction
    from django.db.models import Count, F, Max, Q, QuerySet

    _check_token(token)
    database = queryset.db
    every_row = QuerySet(model=queryset.model, using=database)  # no filter, no manager's
    not_newer = Q(**{f"{field}__isnull": True}) | Q(**{f"{field}__lte": token})
    with transaction.atomic(using=database):
        matched = every_row.filter(pk__in=queryset.values("pk"))
        if not connections[database].features.has_select_for_update:
            # No row locks (SQLite): the transaction's first statement takes the database's
            # write lock, waiting for another writer. A read first would hold a lock SQLite
            # cannot upgrade while another connection writes ("database is locked", at once).
            # The statement changes nothing: it sets the refused rows' fence to itself.
            matched.filter(**{f"{field}__gt": token}).update(**{field: F(field)})
        # The rows matched now, locked until the end: the count of refused rows is of these.
        pks = list(matched.select_for_update().values_list("pk", flat=True))
        if not pks:
            return 0
        rows = every_row.filter(pk__in=pks)
        updated = int(rows.filter(not_newer).update(**{field: token}, **values))
        refused = rows.filter(**{f"{field}__gt": token}).aggregate(count=Count("pk"), newest=Max(field))
    if refused["count"]:
        what = f"{refused['count']} of its {len(pks)} rows"
        raise _refused(str(queryset.model.__name__), token, refused["newest"], what)
    return updated
