"""Fenced writes the user controls: the Django ORM helper (SQLite, PostgreSQL) and django-redis."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings as django_settings

from celery_fenced.contrib.django import fenced_cache_set
from celery_fenced.contrib.django.apps import CeleryFencedConfig
from celery_fenced.exceptions import ConfigurationError, StaleOwnerError
from celery_fenced.fencing import fenced_update
from tests.djangoapp.models import Report

DATABASES = ["default", *(["pg"] if getattr(django_settings, "POSTGRES_AVAILABLE", False) else [])]


# Each database a marked parameter, so pytest-django creates its test database at setup.
ON_EACH_DATABASE = pytest.mark.parametrize(
    "db_alias",
    [pytest.param(alias, marks=pytest.mark.django_db(databases=["default", alias])) for alias in DATABASES],
)


def test_postgres_is_tested_where_it_runs() -> None:
    import socket

    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=0.5).close()
    except OSError:
        pytest.skip("no PostgreSQL on 127.0.0.1:5432 here; SQLite is tested alone")
    assert "pg" in DATABASES, "PostgreSQL is reachable but the tests do not use it (is psycopg installed?)"


@ON_EACH_DATABASE
def test_newer_token_wins_and_older_is_refused(db_alias: str) -> None:
    report = Report.objects.using(db_alias).create(name="q3")
    rows = Report.objects.using(db_alias).filter(pk=report.pk)
    assert fenced_update(rows, 5, status="owner-5") == 1
    assert fenced_update(rows, 7, status="owner-7") == 1
    with pytest.raises(StaleOwnerError) as info:
        fenced_update(rows, 5, status="zombie")
    assert info.value.current_token == 7
    stored = rows.get()
    assert stored.status == "owner-7" and stored.fence_token == 7


@ON_EACH_DATABASE
def test_equal_token_may_write_again(db_alias: str) -> None:
    report = Report.objects.using(db_alias).create(name="same")
    rows = Report.objects.using(db_alias).filter(pk=report.pk)
    fenced_update(rows, 3, status="a")
    fenced_update(rows, 3, status="b")
    assert rows.get().status == "b"


@ON_EACH_DATABASE
def test_model_helper(db_alias: str) -> None:
    report = Report.objects.using(db_alias).create(name="m")
    report.fenced_save_fields(10, status="done")
    assert Report.objects.using(db_alias).get(pk=report.pk).fence_token == 10
    with pytest.raises(StaleOwnerError):
        report.fenced_save_fields(9, status="late")
    assert Report.objects.using(db_alias).get(pk=report.pk).status == "done"


@ON_EACH_DATABASE
def test_bad_tokens_are_refused(db_alias: str) -> None:
    rows = Report.objects.using(db_alias).all()
    for bad in (0, -1, "3", None, True):
        with pytest.raises(ValueError, match="fencing token"):
            fenced_update(rows, bad, status="x")  # type: ignore[arg-type]


def test_fenced_cache_set_on_a_django_redis_alias(settings: Any, redis_server: Any) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "redis": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": redis_server.url(5),
            "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
        },
    }
    from django.core.cache import caches

    fenced_cache_set("report:1", "v8", 8, alias="redis", timeout=60)
    assert caches["redis"].get("report:1") == "v8"
    fenced_cache_set("report:1", "v9", 9, alias="redis")
    with pytest.raises(StaleOwnerError):
        fenced_cache_set("report:1", "zombie", 8, alias="redis")
    assert caches["redis"].get("report:1") == "v9"
    with redis_server.client(5) as client:
        client.flushdb()


def test_the_app_config_refuses_bad_settings(settings: Any) -> None:
    settings.CELERY_FENCED_LEASE_TTL = -1
    from django.apps import apps

    config = apps.get_app_config("celery_fenced")
    assert isinstance(config, CeleryFencedConfig)
    with pytest.raises(ConfigurationError, match="fenced_lease_ttl"):
        config.ready()
