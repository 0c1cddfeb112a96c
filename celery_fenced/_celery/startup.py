"""A Celery process starting with the package's settings: warnings that wait for its logging,
and one-line exits on a bad setting.

A worker reads its settings while it imports the app, before Celery configures logging:
Python would print a warning made then bare, with no level. :func:`warn_once` holds such
warnings until Celery's ``after_setup_logger``, or until :func:`flush_warnings`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..exceptions import ConfigurationError

__all__ = ["exit_in_one_line", "flush_warnings", "warn_once"]

# The settings' logger: the warnings are about them.
logger = logging.getLogger("celery_fenced.conf")

# What this process warned about, and the warnings waiting for its logging. Global because a
# warning is the process's: said once per process whatever the app, on the process's logging.
_warned: set[str] = set()
_pending: list[tuple[str, tuple[Any, ...]]] = []


def warn_once(key: str, message: str, *args: Any) -> None:
    """Warn about ``key`` once per process; hold the warning until logging is set up."""
    if key in _warned:
        return
    _warned.add(key)
    if logger.hasHandlers():
        logger.warning(message, *args)
        return
    if not _pending:
        from celery.signals import after_setup_logger

        after_setup_logger.connect(_flush_after_setup, weak=False, dispatch_uid="celery_fenced.conf.flush")
    _pending.append((message, args))


def _flush_after_setup(**_: Any) -> None:
    flush_warnings()


def flush_warnings(*, configure: bool = False) -> None:
    """Log the warnings that waited for the process's logging.

    Args:
        configure: a command with no logging of its own (``celery fenced``): give the
            ``celery_fenced`` logger a stderr handler first, so each says its level and logger.
    """
    if not _pending:
        return
    if configure and not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger("celery_fenced").addHandler(handler)
    pending = list(_pending)
    _pending.clear()
    for message, args in pending:
        logger.warning(message, *args)


@contextlib.contextmanager
def exit_in_one_line() -> Iterator[None]:
    """End the process with one line naming what is wrong when the block raises
    :class:`ConfigurationError`.

    For long-running commands (beat, the worker), where Celery would otherwise print the
    error inside a long traceback, line by line through its log.
    """
    try:
        yield
    except ConfigurationError as exc:
        raise SystemExit(f"celery-fenced: {exc}") from None
