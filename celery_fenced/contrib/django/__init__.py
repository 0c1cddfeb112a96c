"""Django integration: settings through Celery's Django namespace, a fenced model, cache writes.

Add ``"celery_fenced.contrib.django"`` to ``INSTALLED_APPS``. Settings are Celery's: with
``app.config_from_object("django.conf:settings", namespace="CELERY")`` the names are
``CELERY_FENCED_LEASE_TTL``, ``CELERY_FENCED_STAGE_TIMEOUTS`` and so on. Leases always live
with the results, in the result backend's Redis.
"""

from __future__ import annotations

from typing import Any

from ...fencing import fenced_set

__all__ = ["fenced_cache_set"]

default_app_config = "celery_fenced.contrib.django.apps.CeleryFencedConfig"


def fenced_cache_set(key: str, value: Any, token: int, *, alias: str = "default", timeout: float | None = None) -> None:
    """Write ``key`` of a django-redis cache only if no newer token wrote it.

    The key is written raw through ``get_redis_connection(alias)`` with the cache's key
    function applied, so ``cache.get(key)`` of a raw-string value reads it back.

    Raises:
        StaleOwnerError: a newer token wrote the key.
    """
    from django.core.cache import caches
    from django_redis import get_redis_connection

    cache = caches[alias]
    full_key = cache.make_key(key)
    client = get_redis_connection(alias)
    stored = cache.client.encode(value) if hasattr(cache, "client") else value
    fenced_set(client, str(full_key), stored, token, px=int(timeout * 1000) if timeout else None)
