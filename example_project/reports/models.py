"""A report: what is asked, what the AI answered, and the token of the write that stored it."""

from __future__ import annotations

from django.db import models

from celery_fenced.contrib.django.models import FencedModel


class Report(FencedModel):
    topic = models.CharField(max_length=200)
    #: Fault injected by the AI stand-in for this report: "", "hang-once", "stop-once", "slow".
    inject = models.CharField(max_length=20, blank=True, default="")
    status = models.CharField(max_length=20, default="new")
    summary = models.TextField(blank=True, default="")
    #: How many writes of a result were accepted (must end at exactly 1).
    writes = models.IntegerField(default=0)

    class Meta:
        app_label = "reports"
