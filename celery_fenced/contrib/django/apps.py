"""The Django app config of celery-fenced."""

from __future__ import annotations

import logging

from django.apps import AppConfig

logger = logging.getLogger("celery_fenced.django")


class CeleryFencedConfig(AppConfig):
    """Wires celery-fenced's signals to Django's logging and checks the settings at start."""

    name = "celery_fenced.contrib.django"
    label = "celery_fenced"
    verbose_name = "celery-fenced"

    def ready(self) -> None:
        from django.conf import settings

        from ...conf import DEFAULTS, FencedConfig
        from ...signals import stale_write_rejected, task_taken_over

        # Refuse bad CELERY_FENCED_* settings when Django starts, with the setting's name.
        found = {
            key: getattr(settings, f"CELERY_{key.upper()}")
            for key in DEFAULTS
            if hasattr(settings, f"CELERY_{key.upper()}")
        }
        FencedConfig.from_mapping(found)
        stale_write_rejected.connect(_log_stale_write, weak=False, dispatch_uid="celery_fenced.django.stale")
        task_taken_over.connect(_log_takeover, weak=False, dispatch_uid="celery_fenced.django.takeover")


def _log_stale_write(sender: object = None, task_id: str = "", token: object = None, **kwargs: object) -> None:
    logger.warning("stale write of task %s (token %s) refused", task_id, token)


def _log_takeover(sender: object = None, task_id: str = "", cause: str = "", **kwargs: object) -> None:
    logger.warning("task %s taken over (%s)", task_id, cause)
