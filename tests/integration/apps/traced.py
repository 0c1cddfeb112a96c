"""OpenTelemetry in the test workers: the Celery instrumentation, every span written as one JSON
line to the file ``FENCED_TEST_TRACE_FILE`` names (the SDK's console exporter, on a file).

Set up at import, before a prefork worker forks its children, which inherit it; the exporter
is synchronous, so no thread is lost across the fork and each span is in the file when it ends.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor


def _one_line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


def export_spans_to(path: str) -> None:
    """Trace this process (and the children it forks) into ``path``, one span per line."""
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the process's life)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=_one_line)))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()


if os.environ.get("FENCED_TEST_TRACE_FILE"):
    export_spans_to(os.environ["FENCED_TEST_TRACE_FILE"])
