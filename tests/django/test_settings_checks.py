"""Bad or unknown ``CELERY_FENCED_*`` settings of a Django project: named as written, in one
line, reported by ``manage.py check``, refused by the worker alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.core import checks

from celery_fenced.contrib.django.apps import CeleryFencedConfig
from celery_fenced.contrib.django.checks import BAD_VALUE, TAG, UNKNOWN_NAME

ROOT = Path(__file__).resolve().parents[2]


def fenced_checks() -> list[checks.CheckMessage]:
    return list(checks.run_checks(tags=[TAG]))


def test_good_settings_pass_the_check(settings: Any) -> None:
    settings.CELERY_FENCED_LEASE_TTL = 40
    assert fenced_checks() == []


def test_a_bad_value_is_reported_by_the_name_written_in_settings(settings: Any) -> None:
    settings.CELERY_FENCED_HEARTBEAT_INTERVAL = 20
    [message] = fenced_checks()
    assert message.id == BAD_VALUE and message.level == checks.WARNING
    assert str(message.msg).startswith(
        "CELERY_FENCED_HEARTBEAT_INTERVAL must be less than half of CELERY_FENCED_LEASE_TTL"
    )
    assert "fenced_heartbeat_interval" not in str(message.msg)


def test_an_unknown_name_is_reported_with_the_setting_meant(settings: Any) -> None:
    settings.CELERY_FENCED_LEASE_TTLL = 40
    [message] = fenced_checks()
    assert message.id == UNKNOWN_NAME
    assert "CELERY_FENCED_LEASE_TTLL" in str(message.msg)
    assert message.hint == "did you mean CELERY_FENCED_LEASE_TTL?"


def test_the_app_config_does_not_stop_django_on_a_bad_setting(settings: Any) -> None:
    settings.CELERY_FENCED_LEASE_TTL = -1
    from django.apps import apps

    config = apps.get_app_config("celery_fenced")
    assert isinstance(config, CeleryFencedConfig)
    config.ready()  # no error: the check and the worker report it
    assert [message.id for message in fenced_checks()] == [BAD_VALUE]


def example_env(tmp_path: Path, redis_url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(
        PYTHONPATH=str(ROOT),
        REDIS_URL=redis_url,
        EXAMPLE_DB_PATH=str(tmp_path / "example.sqlite3"),
        EXAMPLE_HEARTBEAT_INTERVAL="20",  # not less than half of the 30 s lease
        **extra,
    )
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_manage_py_keeps_working_and_check_names_the_bad_setting(tmp_path: Path, redis_server: Any) -> None:
    env = example_env(tmp_path, redis_server.url().rsplit("/", 1)[0])
    manage = [sys.executable, "example_project/manage.py"]
    check = run([*manage, "check"], env)
    assert check.returncode == 0, check.stderr
    assert "Traceback" not in check.stderr
    assert "celery_fenced.W002" in check.stderr and "CELERY_FENCED_HEARTBEAT_INTERVAL must be" in check.stderr
    strict = run([*manage, "check", "--fail-level", "WARNING"], env)
    assert strict.returncode != 0 and "CELERY_FENCED_HEARTBEAT_INTERVAL" in strict.stderr
    migrate = run([*manage, "migrate", "--noinput"], env)
    assert migrate.returncode == 0, migrate.stderr
    assert "Traceback" not in migrate.stderr


def test_the_worker_refuses_a_bad_setting_in_one_line_naming_it(tmp_path: Path, redis_server: Any) -> None:
    env = example_env(tmp_path, redis_server.url().rsplit("/", 1)[0], DJANGO_SETTINGS_MODULE="example_project.settings")
    celery = [sys.executable, "-m", "celery", "-A", "example_project.celery_app"]
    worker = run([*celery, "worker", "-P", "solo", "-l", "WARNING"], env)
    assert worker.returncode != 0
    lines = [line for line in (worker.stdout + worker.stderr).splitlines() if line.strip()]
    assert "Traceback" not in worker.stderr, worker.stderr
    [line] = [line for line in lines if "CELERY_FENCED_HEARTBEAT_INTERVAL" in line]
    assert line.startswith("celery-fenced: CELERY_FENCED_HEARTBEAT_INTERVAL must be less than half")
