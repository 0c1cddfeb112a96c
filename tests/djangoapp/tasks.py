"""A project's fenced task, defined with ``shared_task`` as Django projects do."""

from __future__ import annotations

from celery import shared_task

from celery_fenced import ProgressLeasedTask, StaleOwnerError
from celery_fenced.fencing import fenced_update

from .models import Report


@shared_task(bind=True, base=ProgressLeasedTask)
def finish_report(self: ProgressLeasedTask, report_pk: int, status: str, database: str = "default") -> int:
    """Write the report's status through the fence; return the token that wrote it."""
    self.progress("persist-result")
    fenced_update(Report.objects.using(database).filter(pk=report_pk), self.fencing_token, status=status)
    return self.fencing_token


@shared_task(bind=True, base=ProgressLeasedTask)
def write_with_token(self: ProgressLeasedTask, report_pk: int, token: int, database: str = "default") -> str:
    """Write the report's status with a given (old) token; say whether it was refused."""
    self.progress("persist-result")
    try:
        fenced_update(Report.objects.using(database).filter(pk=report_pk), token, status="late")
    except StaleOwnerError:
        return "refused"
    return "written"
