"""``FencedModel``: an abstract model keeping the fencing token of the last accepted write."""

from __future__ import annotations

from typing import Any

from django.db import models

from ...fencing import fenced_update

__all__ = ["FencedModel"]


class FencedModel(models.Model):
    """Add ``fence_token`` to a model; write through :meth:`fenced_save_fields` or ``fenced_update``."""

    fence_token = models.BigIntegerField(default=0, db_index=True)

    class Meta:
        abstract = True

    def fenced_save_fields(self, token: int, **values: Any) -> None:
        """Update this row's ``values`` unless a newer token wrote it (raises ``StaleOwnerError``)."""
        fenced_update(type(self)._default_manager.using(self._state.db).filter(pk=self.pk), token, **values)
        for name, value in values.items():
            setattr(self, name, value)
        self.fence_token = token
