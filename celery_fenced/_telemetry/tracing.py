"""OpenTelemetry: an attempt's story on its ``run/<task>`` span, and a takeover as one history.

With ``opentelemetry-instrumentation-celery`` active, each attempt runs inside the
instrumentation's ``run/<task>`` span. This module adds to that span, never making one of its
own for an attempt:

* at the body's start, the attempt's token, attempt number and takeovers (and, as the body
  goes, its last stage);
* span events: a stage change (``celery_fenced.progress``), a stall, a lost lease and a refused
  write;
* links: an attempt that runs after a takeover links to the attempt it replaced and to the
  reaper's re-send.

The reaper's re-send is a span of its own, ``celery_fenced.takeover``, linked to the replaced
attempt's span (whose context the lease holds, as ``traceContext``); it puts both contexts in
the re-sent message's :data:`LINKS_HEADER`, which the next attempt's span links to. One query
on the task id, or one walk over the links, finds a task's whole history.

Everything here is a no-op without ``opentelemetry-api`` (the extra ``otel`` brings it), and
without a recording span (no SDK configured, or the span not sampled). ``progress()`` does no
span work but on a stage change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the tracing is optional: everything below does nothing
    trace = None  # type: ignore[assignment]
    TraceContextTextMapPropagator = None  # type: ignore[assignment,misc]

__all__ = [
    "ATTEMPT",
    "LINKS_HEADER",
    "LINK_KINDS",
    "STAGE",
    "TAKEOVERS",
    "TAKEOVER_SPAN",
    "TOKEN",
    "attempt_began",
    "available",
    "lease_lost",
    "stage_changed",
    "stalled",
    "takeover_span",
    "traceparent_of",
    "write_refused",
]

#: The re-sent message's header: the W3C ``traceparent`` of the replaced attempt's span and of
#: the reaper's re-send span, comma-separated; the next attempt's span links to each.
LINKS_HEADER = "fenced_trace_links"

#: The name of the reaper's re-send span.
TAKEOVER_SPAN = "celery_fenced.takeover"

#: The span attributes of an attempt: its token, attempt number, last stage
#: and the takeovers before it.
TOKEN = "celery_fenced.token"
ATTEMPT = "celery_fenced.attempt"
STAGE = "celery_fenced.stage"
TAKEOVERS = "celery_fenced.takeovers"

#: What a link of an attempt's span points at (its ``celery_fenced.link`` attribute).
LINK_KINDS = ("replaced", "takeover")

_TRACER_NAME = "celery_fenced"


def available() -> bool:
    """True when ``opentelemetry-api`` is installed."""
    return trace is not None


def _recording(span: Any) -> bool:
    return span is not None and span.is_recording()


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` of ``span``'s context."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _context_of(traceparent: str) -> Any | None:
    """The remote span context a ``traceparent`` names, or ``None`` for a malformed one."""
    if trace is None or not traceparent:
        return None
    carried = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    context = trace.get_current_span(carried).get_span_context()
    return context if context.is_valid else None


def _links_of(request: Any) -> list[Any]:
    header = getattr(request, LINKS_HEADER, None)
    if not isinstance(header, str):
        return []
    links = []
    for kind, traceparent in zip(LINK_KINDS, header.split(","), strict=False):
        context = _context_of(traceparent.strip())
        if context is not None:
            links.append((context, {"celery_fenced.link": kind}))
    return links


def attempt_began(request: Any, *, token: int, attempt: int, takeovers: int, stage: str | None) -> Any | None:
    """The body of an attempt of ``request`` begins inside the current span: describe the
    attempt on it (its ``token``, ``attempt`` number, ``takeovers`` and ``stage``) and link it
    to a takeover's history.

    Returns:
        The span, recording (the caller keeps it for the attempt's later events, and its
        :func:`traceparent_of` so that a takeover can link to it), or ``None`` when nothing records.
    """
    if trace is None:
        return None
    span = trace.get_current_span()
    if not span.is_recording():
        return None
    attributes: dict[str, Any] = {TOKEN: token, ATTEMPT: attempt, TAKEOVERS: takeovers}
    if stage is not None:
        attributes[STAGE] = stage
    span.set_attributes(attributes)
    for context, link_attributes in _links_of(request):
        span.add_link(context, link_attributes)
    return span


def stage_changed(span: Any, stage: str) -> None:
    """The body reported a new stage (from ``progress()``: the only span work on that path)."""
    if _recording(span):
        span.set_attribute(STAGE, stage)
        span.add_event("celery_fenced.progress", {"stage": stage})


def stalled(span: Any, stage: str | None, bound: str, allowed: float, elapsed: float) -> None:
    """The heartbeat found the attempt of ``span`` past its progress deadline in ``stage``."""
    if _recording(span):
        span.add_event(
            "celery_fenced.stalled",
            {"stage": stage or "", "bound": bound, "allowed": allowed, "elapsed": elapsed},
        )


def lease_lost(span: Any, reason: str) -> None:
    """The attempt of ``span`` lost its lease."""
    if _recording(span):
        span.add_event("celery_fenced.lease_lost", {"reason": reason})


def write_refused(span: Any, token: int, state: str, current_token: int | None) -> None:
    """The result write of the attempt of ``span`` (with ``token``) was refused by the fence:
    a newer token owns the task."""
    if _recording(span):
        attributes: dict[str, Any] = {"state": state, TOKEN: token}
        if current_token is not None:
            attributes["celery_fenced.current_token"] = current_token
        span.add_event("celery_fenced.write_refused", attributes)


@contextlib.contextmanager
def takeover_span(task_id: str, cause: str, *, token: int, traceparent: str) -> Iterator[dict[str, str]]:
    """The reaper's re-send of ``task_id``, as a span linked to the attempt it replaces.

    ``token`` and ``traceparent`` are the claimed lease's (its owner's token, ``0`` when
    none, and the run span it kept, ``""`` when none). Yields the headers the re-sent
    message carries (empty when nothing records).
    """
    if trace is None:
        yield {}
        return
    replaced_traceparent = traceparent
    replaced_context = _context_of(replaced_traceparent)
    links = [trace.Link(replaced_context, {"celery_fenced.link": "replaced"})] if replaced_context else []
    attributes: dict[str, Any] = {"celery.task_id": task_id, "cause": cause}
    if token > 0:
        attributes[TOKEN] = token
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(TAKEOVER_SPAN, links=links, attributes=attributes) as span:
        if not span.is_recording():
            yield {}
            return
        yield {LINKS_HEADER: f"{replaced_traceparent if replaced_context else ''},{traceparent_of(span)}"}
