"""The article's AI report pipeline as one fenced task.

validate-request → load-data → process (in batches) → build-prompt → call-ai (streamed)
→ parse-result → persist-result

The ``process`` stage reports ``progress("process", done=n)`` after each batch: a takeover
resumes after the last batch its predecessor published (``self.checkpoint``), instead of
processing every batch again.
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

#: Rows per report, and rows per batch of the ``process`` stage.
ROWS = 20
BATCH = 2
#: What the demo counts: batches processed, and batches a checkpoint spared.
BATCHES_RUN = "example:batches-run"
BATCHES_SKIPPED = "example:batches-skipped"


def process_rows(task: Any, rows: list[str]) -> list[str]:
    """Enrich ``rows`` batch by batch, resuming after the last batch a previous owner published.

    Each batch's output is kept under a key stable across takeovers (``idempotency_key``), so
    the new owner reads what the old one did instead of doing it again; a batch done after the
    last published checkpoint (up to one heartbeat) is simply done again, and written again.
    """
    client = task.backend.client
    checkpoint = task.checkpoint
    done = int(checkpoint.details.get("done", 0)) if checkpoint is not None else 0
    batches = range(0, len(rows), BATCH)
    if done:
        client.incrby(BATCHES_SKIPPED, done)
    for number, start in enumerate(batches, start=1):
        if number <= done:
            continue
        time.sleep(settings.BATCH_SECONDS)  # stands in for an enrichment call per batch
        enriched = [f"{row} (enriched)" for row in rows[start : start + BATCH]]
        client.set(task.idempotency_key(f"batch-{number}"), "\n".join(enriched), ex=3600)
        client.incr(BATCHES_RUN)
        task.progress("process", done=number)
    keys = [task.idempotency_key(f"batch-{number}") for number in range(1, len(batches) + 1)]
    return [line for text in client.mget(keys) for line in (text or b"").decode().splitlines()]


@shared_task(bind=True, base=ProgressLeasedTask, name="reports.build_report")
def build_report(self: Any, report_id: int) -> dict[str, Any]:
    """Build one report; every stage reports progress, the AI call is a streamed block."""
    self.progress("validate-request")
    report = Report.objects.get(pk=report_id)
    if not report.topic.strip():
        raise ValueError(f"report {report_id} has no topic")

    self.progress("load-data")
    rows = [f"{report.topic} fact {i}" for i in range(ROWS)]
    time.sleep(0.2)  # stands in for a database query

    rows = process_rows(self, rows)

    # Each progress() call's details replace the last ones: the later stages give none, so
    # the published "done" stays the checkpoint of a takeover in the AI call too.
    self.progress("build-prompt")
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

    self.progress("parse-result")
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


@shared_task(bind=True, base=ProgressLeasedTask, name="reports.export_report", interrupt_on_loss=False)
def export_report(self: Any, report_id: int, first_upload_hangs: float = 0.0) -> dict[str, Any]:
    """Upload a finished report. Not interrupted when its lease is lost (``interrupt_on_loss``
    off): a first upload that hangs longer than its stage deadline is taken over, then wakes,
    returns, and its late result is refused by the fenced backend."""
    self.progress("upload")
    if first_upload_hangs and self.checkpoint is None:  # the first attempt only
        time.sleep(first_upload_hangs)  # stands in for an upload that hangs, then completes
    return {"report": report_id, "uploaded": True, "token": self.fencing_token}
