"""Fence your own writes with the task's token: a stale owner's write raises ``StaleOwnerError``.

Fencing tokens are globally monotonic, so the rule "write only if the stored token is not
newer than mine" is right even for a row or key written by several task ids::

    @app.task(bind=True, base=ProgressLeasedTask)
    def build_report(self, report_id):
        ...
        fenced_set(redis_client, f"report:{report_id}", body, self.fencing_token)
        fenced_update(Report.objects.filter(pk=report_id), self.fencing_token, status="done")

Django helpers (:class:`FencedModel`, :func:`fenced_update`) need Django; the Redis helper
works on any redis-py client, including django-redis's ``get_redis_connection(alias)``.
"""

from __future__ import annotations

from typing import Any

from .exceptions import StaleOwnerError
from .scripts import script_source

__all__ = ["fence_key", "fenced_set", "fenced_update"]


def fence_key(key: str) -> str:
    """The key holding the token of the last accepted write of ``key`` (same cluster slot)."""
    return f"fence:{{{key}}}" if "{" not in key else f"{key}:fence"


def _check_token(token: Any) -> int:
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        raise ValueError(f"a fencing token must be a positive int (self.fencing_token), got {token!r}")
    return token


def fenced_set(client: Any, key: str, value: Any, token: int, *, px: int | None = None) -> None:
    """Set ``key`` to ``value`` unless a newer token has written it (atomically, one script).

    Args:
        client: a redis-py client (``get_redis_connection(alias)`` for django-redis).
        key: the key to write.
        value: str, bytes or a number.
        token: the writer's fencing token (``self.fencing_token``).
        px: expiry in milliseconds for the key and its fence.

    Raises:
        StaleOwnerError: a newer token wrote the key.
    """
    _check_token(token)
    # Registered per call (a SHA1 of the source, microseconds): a cache per client would keep
    # every client alive, since redis-py's Script holds the client it was registered on.
    script = client.register_script(script_source("fenced_write"))
    written, current = script(keys=[key, fence_key(key)], args=[token, value, px or 0])
    if not int(written):
        raise StaleOwnerError(key, token, "a newer token wrote this key", int(current))


def fenced_update(queryset: Any, token: int, *, field: str = "fence_token", **values: Any) -> int:
    """``UPDATE`` the rows of ``queryset`` whose stored token is not newer than ``token``.

    The rows get ``token`` in ``field`` with the new ``values``, in one SQL statement
    (``… WHERE fence_token <= %s``), so no transaction or lock is needed.

    Returns:
        The number of rows updated.

    Raises:
        StaleOwnerError: some rows of ``queryset`` were written by a newer token.
    """
    _check_token(token)
    updated = int(queryset.filter(**{f"{field}__lte": token}).update(**{field: token}, **values))
    if updated < queryset.count():
        newest = queryset.order_by(f"-{field}").values_list(field, flat=True).first()
        raise StaleOwnerError(str(queryset.model.__name__), token, "a newer token wrote these rows", newest)
    return updated
