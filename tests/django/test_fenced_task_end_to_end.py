"""A project's fenced task run by a worker against the database, as docs/testing.rst shows."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings as django_settings

from celery_fenced._telemetry.metrics import read_totals
from celery_fenced.exceptions import StaleOwnerError
from celery_fenced.fencing import fenced_update
from tests.djangoapp.models import Report
from tests.djangoapp.tasks import finish_report, write_with_token

DATABASES = ["default", *(["pg"] if getattr(django_settings, "POSTGRES_AVAILABLE", False) else [])]

# transaction=True: the worker's threads use their own connections, and Celery's Django fixup
# closes the connections when the worker starts; a test in one open transaction would fail.
ON_EACH_DATABASE = pytest.mark.parametrize(
    "db_alias",
    [
        pytest.param(alias, marks=pytest.mark.django_db(transaction=True, databases=["default", alias]))
        for alias in DATABASES
    ],
)


@ON_EACH_DATABASE
def test_a_shared_task_writes_its_row_through_the_fence(db_alias: str, fenced_worker: Any, fenced_helpers: Any) -> None:
    report = Report.objects.using(db_alias).create(name="end to end")
    first = finish_report.delay(report.pk, "first", db_alias)
    first_token = first.get(timeout=30)
    assert fenced_helpers.wait_for_lease(first.id, "DONE").owner_token == first_token
    second_token = finish_report.delay(report.pk, "second", db_alias).get(timeout=30)
    assert second_token > first_token
    stored = Report.objects.using(db_alias).get(pk=report.pk)
    assert (stored.status, stored.fence_token) == ("second", second_token)
    with pytest.raises(StaleOwnerError):  # the first owner, late
        fenced_update(Report.objects.using(db_alias).filter(pk=report.pk), first_token, status="late")
    assert Report.objects.using(db_alias).get(pk=report.pk).status == "second"


@pytest.mark.django_db(transaction=True)
def test_a_write_refused_in_a_task_is_counted_in_redis_at_once(fenced_worker: Any, fenced_helpers: Any) -> None:
    report = Report.objects.create(name="counted")
    first_token = finish_report.delay(report.pk, "first").get(timeout=30)
    finish_report.delay(report.pk, "current").get(timeout=30)
    assert write_with_token.delay(report.pk, first_token).get(timeout=30) == "refused"
    totals = read_totals(fenced_helpers.store)  # no wait: the task flushed the count itself
    assert sum(value for name, _, value in totals if name == "owner_fencing_rejected_total") == 1
    assert Report.objects.get(pk=report.pk).status == "current"


@pytest.mark.django_db(transaction=True)
def test_stall_at_makes_a_takeover_as_the_docs_show(fenced_worker: Any, fenced_helpers: Any) -> None:
    report = Report.objects.create(name="stalled")
    with fenced_helpers.stall_at("persist-result", 4):  # beyond the 2 s default stage timeout
        result = finish_report.delay(report.pk, "after a takeover")
        token = result.get(timeout=30)
    assert fenced_helpers.lease(result.id).takeovers == 1
    stored = Report.objects.get(pk=report.pk)
    assert (stored.status, stored.fence_token) == ("after a takeover", token)
