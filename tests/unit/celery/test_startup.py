"""A process starting with the package's settings (_celery/startup.py): warnings said once, held
until the process's logging is set up, and a bad setting ending the process in one line."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
from celery.signals import after_setup_logger

from celery_fenced._celery import startup
from celery_fenced.exceptions import ConfigurationError

#: The logger ``flush_warnings(configure=True)`` gives a handler: the package's own.
PACKAGE_LOGGER = logging.getLogger("celery_fenced")


class Collected(logging.Handler):
    """A handler that keeps what reaches it, formatted as ``LEVEL name: message``."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module's per-process memory, as a process that warned of nothing has it; and its
    logger saying warnings whatever an earlier test left on the root logger (an in-process
    worker sets the root's level to ERROR)."""
    monkeypatch.setattr(startup, "_warned", set())
    monkeypatch.setattr(startup, "_pending", [])
    level = startup.logger.level
    startup.logger.setLevel(logging.WARNING)
    yield
    startup.logger.setLevel(level)


@contextlib.contextmanager
def logging_not_set_up() -> Iterator[None]:
    """The package's loggers reach no handler, as in a process whose logging is not set up yet;
    the handlers a test adds to them are removed after.

    Entered in the test itself: pytest puts its own handlers on the root logger, and on every
    logger that does not propagate when a test's phase begins.
    """
    loggers = (PACKAGE_LOGGER, startup.logger)
    assert [logger.handlers for logger in loggers] == [[], []]
    PACKAGE_LOGGER.propagate = False
    try:
        assert not startup.logger.hasHandlers()
        yield
    finally:
        PACKAGE_LOGGER.propagate = True
        for logger in loggers:
            for handler in list(logger.handlers):
                logger.removeHandler(handler)


@pytest.fixture
def collected() -> Iterator[Collected]:
    """A handler on the settings' logger, as the process's logging would put there."""
    handler = Collected()
    startup.logger.addHandler(handler)
    yield handler
    startup.logger.removeHandler(handler)


def test_a_warning_made_before_logging_is_set_up_waits_for_flush_warnings() -> None:
    handler = Collected()
    with logging_not_set_up():
        startup.warn_once("fenced_x", "fenced_x %s is odd", 3)
        assert startup._pending == [("fenced_x %s is odd", (3,))]  # nowhere to go yet
        startup.logger.addHandler(handler)  # the process's logging is set up
        startup.flush_warnings()
        assert startup._pending == []
        startup.flush_warnings()  # flushed once: nothing is said twice
    assert handler.lines == ["WARNING celery_fenced.conf: fenced_x 3 is odd"]


def test_celerys_after_setup_logger_lets_the_waiting_warnings_out() -> None:
    handler = Collected()
    with logging_not_set_up():
        startup.warn_once("fenced_x", "fenced_x is odd")
        startup.logger.addHandler(handler)
        after_setup_logger.send(sender=None, logger=logging.getLogger(), loglevel=logging.INFO, logfile=None)
    assert handler.lines == ["WARNING celery_fenced.conf: fenced_x is odd"]
    assert startup._pending == []


def test_a_key_is_warned_about_once_per_process(collected: Collected) -> None:
    startup.warn_once("fenced_x", "first %s", 1)
    startup.warn_once("fenced_x", "second %s", 2)
    startup.warn_once("fenced_y", "third %s", 3)
    assert collected.lines == ["WARNING celery_fenced.conf: first 1", "WARNING celery_fenced.conf: third 3"]


def test_a_key_held_back_is_not_held_again() -> None:
    with logging_not_set_up():
        startup.warn_once("fenced_x", "first")
        startup.warn_once("fenced_x", "second")
        assert startup._pending == [("first", ())]


def test_a_warning_is_logged_at_once_when_the_logger_has_handlers(collected: Collected) -> None:
    startup.warn_once("fenced_x", "fenced_x is odd")
    assert collected.lines == ["WARNING celery_fenced.conf: fenced_x is odd"]
    assert startup._pending == []


def test_flush_warnings_with_configure_gives_the_package_logger_a_stderr_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with logging_not_set_up():
        startup.warn_once("fenced_x", "fenced_x %s is odd", 3)
        startup.flush_warnings(configure=True)
        (handler,) = PACKAGE_LOGGER.handlers
        assert type(handler) is logging.StreamHandler
    assert capsys.readouterr().err == "WARNING celery_fenced.conf: fenced_x 3 is odd\n"


def test_flush_warnings_with_nothing_waiting_configures_nothing() -> None:
    with logging_not_set_up():
        startup.flush_warnings(configure=True)
        assert PACKAGE_LOGGER.handlers == []


def test_a_configuration_error_ends_the_process_in_one_line() -> None:
    with pytest.raises(SystemExit) as ended, startup.exit_in_one_line():
        raise ConfigurationError("fenced_lease_ttl must be positive")
    assert ended.value.code == "celery-fenced: fenced_lease_ttl must be positive"
    assert ended.value.__cause__ is None and ended.value.__suppress_context__  # no traceback above it


def test_other_errors_go_through_as_they_are() -> None:
    with pytest.raises(ValueError, match="not a setting"), startup.exit_in_one_line():
        raise ValueError("not a setting")
