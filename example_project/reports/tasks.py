"""The article's AI report pipeline as one fenced task.

validate-request → load-data → build-prompt → call-ai (streamed) → parse-result → persist-result
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
from celery import shared_task
from django.conf import settings
from django.db.models import F

from celery_fenced import ProgressLeasedTask
from celery_fenced.fencing import fenced_update

from .models import Report


@shared_task(bind=True, base=ProgressLeasedTask, name="reports.build_report")
def build_report(self: Any, report_id: int) -> dict[str, Any]:
    """Build one report; every stage reports progress, the AI call is a streamed block."""
    self.progress("validate-request")
    report = Report.objects.get(pk=report_id)
    if not report.topic.strip():
        raise ValueError(f"report {report_id} has no topic")

    self.progress("load-data")
    rows = [f"{report.topic} fact {i}" for i in range(20)]
    time.sleep(0.2)  # stands in for a database query

    self.progress("build-prompt", rows=len(rows))
    prompt = f"Summarise {len(rows)} facts about {report.topic}"

    first, idle, total = settings.AI_STREAM_TIMEOUTS
    chunks: list[str] = []
    params = {"report": report_id, "inject": report.inject, "key": self.idempotency_key("call-ai"), "prompt": prompt}
    with (
        self.stream("call-ai", first_token_timeout=first, idle_timeout=idle, total_timeout=total) as stream,
        httpx.stream("GET", f"{settings.AI_URL}/v1/stream", params=params, timeout=None) as response,
    ):
        response.raise_for_status()
        for line in stream.wrap(response.iter_lines()):
            if line:
                chunks.append(line)

    self.progress("parse-result", chunks=len(chunks))
    summary = " ".join(chunks)
    digest = hashlib.sha256(summary.encode()).hexdigest()[:12]

    self.progress("persist-result")
    fenced_update(
        Report.objects.filter(pk=report_id),
        self.fencing_token,
        summary=summary,
        status="done",
        writes=F("writes") + 1,
    )
    return {"report": report_id, "chunks": len(chunks), "digest": digest, "token": self.fencing_token}
