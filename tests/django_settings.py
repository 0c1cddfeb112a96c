"""Django settings of the test suite: SQLite always, PostgreSQL on 127.0.0.1:5432 when reachable."""

from __future__ import annotations

import os
import socket
import tempfile

SECRET_KEY = "tests-only"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "celery_fenced.contrib.django", "tests.djangoapp"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    # A file, which several connections share: how SQLite's locks meet each other.
    "sqlite_file": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(tempfile.gettempdir(), f"celery_fenced_{os.getpid()}.sqlite3"),
        "TEST": {"NAME": os.path.join(tempfile.gettempdir(), f"test_celery_fenced_{os.getpid()}.sqlite3")},
    },
}


def _postgres_reachable() -> bool:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=0.5):
            return True
    except OSError:
        return False


POSTGRES_AVAILABLE = _postgres_reachable()
if POSTGRES_AVAILABLE:
    DATABASES["pg"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("FENCED_TEST_PG_NAME", "postgres"),
        "USER": os.environ.get("FENCED_TEST_PG_USER", "postgres"),
        "PASSWORD": os.environ.get("FENCED_TEST_PG_PASSWORD", ""),
        "HOST": "127.0.0.1",
        "PORT": "5432",
        # One test database per test run: the tox environments run side by side.
        "TEST": {"NAME": f"test_celery_fenced_{os.getpid()}"},
    }
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
