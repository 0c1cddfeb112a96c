"""Tracing is a no-op without ``opentelemetry-api``, and without a recording span."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from celery_fenced._telemetry import tracing


def test_without_opentelemetry_every_call_is_a_no_op() -> None:
    program = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if opentelemetry-api were not installed
        from types import SimpleNamespace
        from celery_fenced._telemetry import tracing
        assert not tracing.available()
        assert tracing.attempt_began(SimpleNamespace(), token=3, attempt=1, takeovers=0, stage="load") is None
        tracing.stage_changed(None, "load")
        tracing.stalled(None, "load", "stage", 1.0, 2.0)
        tracing.lease_lost(None, "taken over")
        tracing.write_refused(None, 3, "SUCCESS", 4)
        with tracing.takeover_span("t1", "stalled", token=3, traceparent="x") as headers:
            assert headers == {}
        print("no-op")
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no-op"


def test_without_a_recording_span_nothing_is_kept_or_sent() -> None:
    # The API alone (no SDK provider): spans do not record, so no context goes to Redis
    # and the re-send carries no links.
    from types import SimpleNamespace

    assert tracing.attempt_began(SimpleNamespace(), token=3, attempt=1, takeovers=0, stage=None) is None
    with tracing.takeover_span("t1", "stalled", token=3, traceparent="") as headers:
        assert headers == {}


def test_a_malformed_links_header_links_nothing() -> None:
    request = type("Request", (), {tracing.LINKS_HEADER: "garbage,00-zz-yy-01"})()
    assert tracing._links_of(request) == []
