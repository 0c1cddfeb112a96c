"""A model the Django tests write through the fence."""

from __future__ import annotations

from django.db import models

from celery_fenced.contrib.django.models import FencedModel


class Report(FencedModel):
    name = models.CharField(max_length=100)
    status = models.CharField(max_length=20, default="new")

    class Meta:
        app_label = "djangoapp"


class Article(models.Model):
    """A model of the project's own, with a fence column that is NULL until the first fenced write."""

    title = models.CharField(max_length=100)
    status = models.CharField(max_length=20, default="draft")
    fence = models.BigIntegerField(null=True, blank=True)

    class Meta:
        app_label = "djangoapp"
