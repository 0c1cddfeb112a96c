"""Fenced writes the user controls: the Django ORM helper (SQLite, PostgreSQL) and django-redis."""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connections

from celery_fenced._telemetry.process import TELEMETRY
from celery_fenced.contrib.django import fenced_cache_set
from celery_fenced.exceptions import StaleOwnerError
from celery_fenced.fencing import fenced_update
from tests.djangoapp.models import Article, Report

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
def test_rows_the_update_moves_out_of_the_queryset_do_not_hide_refused_ones(db_alias: str) -> None:
    reports = Report.objects.using(db_alias)
    newer = reports.create(name="written by 9", status="new", fence_token=9)
    older = reports.create(name="written by 2", status="new", fence_token=2)
    with pytest.raises(StaleOwnerError) as info:
        fenced_update(reports.filter(status="new"), 5, status="done")
    assert info.value.current_token == 9
    assert reports.get(pk=older.pk).status == "done" and reports.get(pk=older.pk).fence_token == 5
    assert reports.get(pk=newer.pk).status == "new" and reports.get(pk=newer.pk).fence_token == 9


@ON_EACH_DATABASE
def test_a_row_with_no_fence_yet_is_written_by_any_owner(db_alias: str) -> None:
    articles = Article.objects.using(db_alias)
    article = articles.create(title="a")
    assert article.fence is None
    rows = articles.filter(pk=article.pk)
    assert fenced_update(rows, 3, field="fence", status="published") == 1
    assert rows.get().fence == 3 and rows.get().status == "published"
    with pytest.raises(StaleOwnerError):
        fenced_update(rows, 2, field="fence", status="zombie")
    assert rows.get().status == "published"


@ON_EACH_DATABASE
def test_the_documented_row_creation_before_the_first_fenced_write(db_alias: str) -> None:
    articles = Article.objects.using(db_alias)
    for token in (4, 6):  # a first owner, then the owner that took over: the row is made once
        article, _ = articles.get_or_create(title="q4", defaults={"status": "draft"})
        fenced_update(articles.filter(pk=article.pk), token, field="fence", status=f"by {token}")
    with pytest.raises(StaleOwnerError):
        article, _ = articles.get_or_create(title="q4", defaults={"status": "draft"})
        fenced_update(articles.filter(pk=article.pk), 4, field="fence", status="by the zombie")
    assert articles.get(title="q4").status == "by 6" and articles.count() == 1


@ON_EACH_DATABASE
def test_a_refused_update_is_logged_and_counted(db_alias: str, caplog: pytest.LogCaptureFixture) -> None:
    report = Report.objects.using(db_alias).create(name="c", fence_token=8)
    rows = Report.objects.using(db_alias).filter(pk=report.pk)
    TELEMETRY.metrics.take()
    with caplog.at_level(logging.WARNING, logger="celery_fenced.fencing"), pytest.raises(StaleOwnerError):
        fenced_update(rows, 7, status="late")
    assert TELEMETRY.metrics.take().get("owner_fencing_rejected_total|") == 1
    [record] = [r for r in caplog.records if r.name == "celery_fenced.fencing"]
    assert "Report" in record.getMessage() and "token 7" in record.getMessage() and "token 8" in record.getMessage()


@ON_EACH_DATABASE
def test_an_empty_queryset_writes_nothing(db_alias: str) -> None:
    assert fenced_update(Report.objects.using(db_alias).filter(name="none"), 3, status="x") == 0


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


@ON_EACH_DATABASE
def test_an_ordered_or_sliced_queryset_is_fenced_by_its_own_rows(db_alias: str) -> None:
    reports = Report.objects.using(db_alias)
    for index in range(3):
        reports.create(name=f"r{index}", fence_token=index)
    first_two = reports.order_by("name")[:2]
    assert fenced_update(first_two, 5, status="batch") == 2
    assert sorted(reports.values_list("name", "status")) == [("r0", "batch"), ("r1", "batch"), ("r2", "new")]


@pytest.mark.django_db(transaction=True, databases=["default", "sqlite_file"])
def test_on_sqlite_a_fenced_update_waits_for_another_writer_instead_of_failing() -> None:
    """Two owners finishing at once on SQLite: the second waits for the first's commit (the
    database's busy timeout), it does not fail with "database is locked"."""
    reports = Report.objects.using("sqlite_file")
    row = reports.create(name="r", fence_token=1)
    other_writer = sqlite3.connect(connections["sqlite_file"].settings_dict["NAME"], isolation_level=None)
    other_writer.execute("BEGIN IMMEDIATE")  # another connection is writing: it holds the write lock
    outcome: dict[str, Any] = {}

    def write() -> None:
        try:
            outcome["updated"] = fenced_update(reports.filter(pk=row.pk), 2, status="done")
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(1.0)  # SQLite's busy timeout (5 s) is longer: it must still be waiting
    waited = writer.is_alive()
    other_writer.execute("COMMIT")
    other_writer.close()
    writer.join(10)
    assert outcome == {"updated": 1}
    assert waited
    assert reports.get(pk=row.pk).status == "done"
