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
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the tracing is optional: everything below does nothing
    trace = None  # type: ignore[assignment]
    TraceContextTextMapPropagator = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from .owner import OwnedLease

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


def attempt_began(lease: OwnedLease, request: Any) -> str | None:
    """The body of ``lease``'s attempt begins inside the current span: describe the attempt on
    it, link it to a takeover's history, and keep it on the lease for the heartbeat's events.

    Returns:
        The span's ``traceparent`` (for the lease, so that a takeover can link to it), or
        ``None`` when nothing records.
    """
    if trace is None:
        return None
    span = trace.get_current_span()
    if not span.is_recording():
        return None
    lease.span = span
    attributes: dict[str, Any] = {TOKEN: lease.token, ATTEMPT: lease.attempt, TAKEOVERS: lease.takeovers}
    if lease.stage is not None:
        attributes[STAGE] = lease.stage
    span.set_attributes(attributes)
    for context, link_attributes in _links_of(request):
        span.add_link(context, link_attributes)
    return traceparent_of(span)


def stage_changed(span: Any, stage: str) -> None:
    """The body reported a new stage (from ``progress()``: the only span work on that path)."""
    if _recording(span):
        span.set_attribute(STAGE, stage)
        span.add_event("celery_fenced.progress", {"stage": stage})


def stalled(lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
    """The heartbeat found the attempt past its progress deadline."""
    if _recording(lease.span):
        lease.span.add_event(
            "celery_fenced.stalled",
            {"stage": lease.stage or "", "bound": bound, "allowed": allowed, "elapsed": elapsed},
        )


def lease_lost(lease: OwnedLease, reason: str) -> None:
    """The attempt lost its lease."""
    if _recording(lease.span):
        lease.span.add_event("celery_fenced.lease_lost", {"reason": reason})


def write_refused(lease: OwnedLease, state: str, current_token: int | None) -> None:
    """The attempt's result write was refused by the fence: a newer token owns the task."""
    if _recording(lease.span):
        attributes: dict[str, Any] = {"state": state, TOKEN: lease.token}
        if current_token is not None:
            attributes["celery_fenced.current_token"] = current_token
        lease.span.add_event("celery_fenced.write_refused", attributes)


@contextlib.contextmanager
def takeover_span(task_id: str, cause: str, replaced: Mapping[str, Any]) -> Iterator[dict[str, str]]:
    """The reaper's re-send of ``task_id``, as a span linked to the attempt it replaces.

    ``replaced`` is the claimed lease's fields (``ownerToken``, ``traceContext``). Yields
    the headers the re-sent message carries (empty when nothing records).
    """
    if trace is None:
        yield {}
        return
    replaced_traceparent = str(replaced.get("traceContext") or "")
    replaced_context = _context_of(replaced_traceparent)
    links = [trace.Link(replaced_context, {"celery_fenced.link": "replaced"})] if replaced_context else []
    attributes: dict[str, Any] = {"celery.task_id": task_id, "cause": cause}
    token = str(replaced.get("ownerToken") or "")
    if token.isdigit():
        attributes[TOKEN] = int(token)
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(TAKEOVER_SPAN, links=links, attributes=attributes) as span:
        if not span.is_recording():
            yield {}
            return
        yield {LINKS_HEADER: f"{replaced_traceparent if replaced_context else ''},{traceparent_of(span)}"}
