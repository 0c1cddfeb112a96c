"""``manage.py check`` of the ``CELERY_FENCED_*`` settings.

A bad or unknown setting is reported as a warning naming it, so ``check``, ``migrate`` and
the rest of ``manage.py`` keep working; the worker refuses to start with a bad value, in one
line naming it. ``manage.py check --fail-level WARNING`` makes a CI run fail on either.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from ...conf import check_django_settings, unknown_django_settings
from ...exceptions import ConfigurationError

__all__ = ["BAD_VALUE", "TAG", "UNKNOWN_NAME", "check_fenced_settings"]

#: The check tag: ``manage.py check --tag celery_fenced`` runs these checks alone.
TAG = "celery_fenced"
#: The id of a ``CELERY_FENCED_*`` name that is no setting.
UNKNOWN_NAME = "celery_fenced.W001"
#: The id of a setting whose value the worker refuses.
BAD_VALUE = "celery_fenced.W002"


def check_fenced_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report unknown ``CELERY_FENCED_*`` names and a bad value, each naming the setting."""
    from django.conf import settings

    messages: list[checks.CheckMessage] = []
    for name, meant in unknown_django_settings(settings):
        messages.append(
            checks.Warning(
                f"{name} is no celery-fenced setting: it is ignored",
                hint=f"did you mean {meant}?" if meant else "see the settings in celery-fenced's docs",
                id=UNKNOWN_NAME,
            )
        )
    try:
        check_django_settings(settings)
    except ConfigurationError as exc:
        messages.append(
            checks.Warning(str(exc), hint="the celery worker refuses to start with this value", id=BAD_VALUE)
        )
    return messages
