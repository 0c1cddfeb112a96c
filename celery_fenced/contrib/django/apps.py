"""The Django app config of celery-fenced."""

from __future__ import annotations

import logging

from django.apps import AppConfig

__all__ = ["CeleryFencedConfig"]

logger = logging.getLogger("celery_fenced.django")


class CeleryFencedConfig(AppConfig):
    """Wires celery-fenced's signals to Django's logging and registers the settings check.

    A bad ``CELERY_FENCED_*`` setting does not stop Django (``manage.py migrate`` and the
    rest work): ``manage.py check`` reports it by name, and the worker refuses to start.
    """

    name = "celery_fenced.contrib.django"
    label = "celery_fenced"
    verbose_name = "celery-fenced"

    def ready(self) -> None:
        from django.core import checks

        from ...signals import stale_write_rejected, task_taken_over
        from .checks import TAG, check_fenced_settings

        checks.register(check_fenced_settings, TAG)
        stale_write_rejected.connect(_log_stale_write, weak=False, dispatch_uid="celery_fenced.django.stale")
        task_taken_over.connect(_log_takeover, weak=False, dispatch_uid="celery_fenced.django.takeover")


def _log_stale_write(sender: object = None, task_id: str = "", token: object = None, **kwargs: object) -> None:
    logger.warning("stale write of task %s (token %s) refused", task_id, token)


def _log_takeover(sender: object = None, task_id: str = "", cause: str = "", **kwargs: object) -> None:
    logger.warning("task %s taken over (%s)", task_id, cause)
