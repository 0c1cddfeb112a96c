"""The example project's Celery app: configured from Django's settings, reaper on beat."""

from __future__ import annotations

import os

from celery import Celery

from celery_fenced import install

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["example_project.reports"])
install(app)
