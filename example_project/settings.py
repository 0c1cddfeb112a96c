"""Django settings of the example project (everything that varies comes from the environment)."""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-for-production")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "celery_fenced.contrib.django",
    "example_project.reports",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB_PATH", str(BASE_DIR / "example.sqlite3")),
        "OPTIONS": {"timeout": 20},
    }
}

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
#: The local stand-in for the AI provider (see ai_server.py).
AI_URL = os.environ.get("EXAMPLE_AI_URL", "http://127.0.0.1:8765")

# Celery, through Django's settings (namespace "CELERY").
CELERY_BROKER_URL = f"{REDIS_URL}/0"
CELERY_RESULT_BACKEND = f"fenced+{REDIS_URL}/1"
CELERY_TASK_TRACK_STARTED = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_DISABLE_PREFETCH = True  # a stuck process must not hold a re-sent report
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# The article's stage table: maxNoProgress per stage, seconds.
CELERY_FENCED_STAGE_TIMEOUTS = {
    "validate-request": 1,
    "load-data": 5,
    "process": 5,
    "build-prompt": 2,
    "call-ai": 90,
    "parse-result": 5,
    "persist-result": 10,
    "upload": 2,
}
CELERY_FENCED_LEASE_TTL = float(os.environ.get("EXAMPLE_LEASE_TTL", "30"))
CELERY_FENCED_HEARTBEAT_INTERVAL = float(os.environ.get("EXAMPLE_HEARTBEAT_INTERVAL", "5"))
CELERY_FENCED_REAPER_INTERVAL = float(os.environ.get("EXAMPLE_REAPER_INTERVAL", "5"))
CELERY_FENCED_INTERRUPT_ON_LOSS = True
CELERY_FENCED_MAX_TAKEOVERS = 5

#: Seconds one batch of the ``process`` stage takes.
BATCH_SECONDS = float(os.environ.get("EXAMPLE_BATCH_SECONDS", "0.3"))

#: Deadlines of the streamed AI call: first token, between chunks, whole call (seconds).
AI_STREAM_TIMEOUTS = tuple(float(x) for x in os.environ.get("EXAMPLE_AI_TIMEOUTS", "10,5,120").split(","))
