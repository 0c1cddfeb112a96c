"""Prometheus's own tools for the monitoring tests: ``promtool`` and ``prometheus`` from PATH
(Debian's ``prometheus`` package brings both). Where they are missing the tests skip and say
so, unless ``FENCED_TEST_REQUIRE_PROMETHEUS=1`` (CI installs them and sets it): then they fail.
"""

from __future__ import annotations

import os
import shutil

import pytest


def prometheus_tool(name: str) -> str:
    """The path of ``name`` (``promtool`` or ``prometheus``), or skip (fail where required)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not on PATH (Debian: apt-get install prometheus)"
        if os.environ.get("FENCED_TEST_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path
