"""Settings: one validated, cached configuration object per Celery app.

Every setting is read from ``app.conf`` under its lowercase ``fenced_*`` name; Django
projects that configure Celery with ``namespace="CELERY"`` write ``CELERY_FENCED_*``
and Celery's own lookup finds them. A bad value raises :class:`ConfigurationError`
naming the setting and the value.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from celery import Celery

from .apps import first_time, record_of
from .exceptions import ConfigurationError

__all__ = [
    "DEFAULTS",
    "ON_STALL_MODES",
    "TASK_OPTIONS",
    "FencedConfig",
    "TaskPolicy",
    "build_policy",
    "check_django_settings",
    "check_settings_before_beat",
    "ensure_conf",
    "exit_in_one_line",
    "exit_on_bad_settings",
    "flush_warnings",
    "nearest",
    "normalise_stage",
    "positive_seconds",
    "read_settings",
    "reset_conf",
    "unknown_settings",
]

logger = logging.getLogger("celery_fenced.conf")

#: What the heartbeat does once a lease made no progress for ``fenced_stall_checks`` ticks.
ON_STALL_MODES = ("release", "expire", "alert")

#: Every setting with its default. Times are seconds.
DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "fenced_key_prefix": "fenced",
        "fenced_lease_ttl": 30.0,
        "fenced_heartbeat_interval": 5.0,
        "fenced_stage_timeouts": {},
        "fenced_default_stage_timeout": 60.0,
        "fenced_stall_checks": 2,
        "fenced_on_stall": "release",
        "fenced_max_takeovers": 3,
        "fenced_max_task_duration": None,
        "fenced_interrupt_on_loss": True,
        "fenced_reaper_interval": 5.0,
        "fenced_takeover_grace": 0.0,
        "fenced_requeue_timeout": 60.0,
        "fenced_start_timeout": 60.0,
        "fenced_max_detail_bytes": 4096,
    }
)

#: Options a task may override as class or decorator attributes, and the setting each shadows.
TASK_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "lease_ttl": "fenced_lease_ttl",
        "heartbeat_interval": "fenced_heartbeat_interval",
        "stage_timeouts": "fenced_stage_timeouts",
        "default_stage_timeout": "fenced_default_stage_timeout",
        "stall_checks": "fenced_stall_checks",
        "on_stall": "fenced_on_stall",
        "max_takeovers": "fenced_max_takeovers",
        "max_task_duration": "fenced_max_task_duration",
        "interrupt_on_loss": "fenced_interrupt_on_loss",
    }
)


def normalise_stage(stage: str) -> str:
    """Return the canonical form of a stage name.

    Stage names are case-insensitive and ``-`` equals ``_``:
    ``"LOAD_DATA"``, ``"load-data"`` and ``"Load_Data"`` are one stage, ``"load-data"``.
    """
    if not isinstance(stage, str) or not stage.strip():
        raise ValueError(f"a stage name must be a non-empty string, not {stage!r}")
    return stage.strip().lower().replace("_", "-")


def positive_seconds(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as seconds, or :class:`ValueError` naming ``name`` unless it is a positive
    finite number (``None`` passes when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _positive_seconds(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    try:
        return positive_seconds(name, value, allow_none=allow_none)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


def _non_negative_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name} must be zero or more seconds, got {value!r}")
    return float(value)


def _positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def _stage_table(name: str, value: Any) -> Mapping[str, float]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{name} must be a mapping of stage names to seconds, got {value!r}")
    table: dict[str, float] = {}
    for stage, seconds in value.items():
        try:
            key = normalise_stage(stage)
        except ValueError:
            raise ConfigurationError(f"{name} has a stage name that is not a non-empty string, got {stage!r}") from None
        checked = _positive_seconds(f"{name}[{stage!r}]", seconds)
        assert checked is not None
        table[key] = checked
    return MappingProxyType(table)


def _on_stall(name: str, value: Any) -> str:
    if value not in ON_STALL_MODES:
        raise ConfigurationError(f"{name} must be one of {', '.join(ON_STALL_MODES)}; got {value!r}")
    return str(value)


@dataclass(frozen=True)
class TaskPolicy:
    """The lease options in force for one task type: the app's settings, then its overrides."""

    lease_ttl: float
    heartbeat_interval: float
    stage_timeouts: Mapping[str, float]
    default_stage_timeout: float
    stall_checks: int
    on_stall: str
    max_takeovers: int
    max_task_duration: float | None
    interrupt_on_loss: bool
    #: The largest JSON size of one ``progress()`` call's details (``fenced_max_detail_bytes``).
    max_detail_bytes: int = DEFAULTS["fenced_max_detail_bytes"]

    def stage_timeout(self, stage: str | None) -> float:
        """Return ``maxNoProgress`` for a (normalised) stage: its table entry or the default."""
        if stage is None:
            return self.default_stage_timeout
        return self.stage_timeouts.get(stage, self.default_stage_timeout)

    @property
    def lease_ttl_ms(self) -> int:
        """The lease length in whole milliseconds, as the scripts take it."""
        return max(1, int(self.lease_ttl * 1000))


@dataclass(frozen=True)
class FencedConfig:
    """All ``fenced_*`` settings of one app, validated. Build it with :func:`ensure_conf`."""

    key_prefix: str
    reaper_interval: float
    takeover_grace: float
    requeue_timeout: float
    start_timeout: float
    policy: TaskPolicy
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @property
    def due_horizon_ms(self) -> int:
        """How far ahead of now a lease the reaper watches counts as due: a held lease's expiry
        is at most one lease length ahead, and a waiting one's is its eta plus the requeue or
        start timeout, so a retry or a reservation counts once its eta has come."""
        return int(max(self.policy.lease_ttl, self.requeue_timeout, self.start_timeout) * 1000)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> FencedConfig:
        """Validate settings given by their ``fenced_*`` names (missing ones take defaults)."""
        merged = {key: values.get(key, default) for key, default in DEFAULTS.items()}
        prefix = merged["fenced_key_prefix"]
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \n"):
            raise ConfigurationError(
                f"fenced_key_prefix must be a non-empty string without spaces or braces, got {prefix!r}"
            )
        policy = build_policy(merged, source=lambda option: TASK_OPTIONS[option])
        reaper_interval = _positive_seconds("fenced_reaper_interval", merged["fenced_reaper_interval"])
        requeue_timeout = _positive_seconds("fenced_requeue_timeout", merged["fenced_requeue_timeout"])
        start_timeout = _positive_seconds("fenced_start_timeout", merged["fenced_start_timeout"])
        assert reaper_interval is not None and requeue_timeout is not None and start_timeout is not None
        return cls(
            key_prefix=prefix,
            reaper_interval=reaper_interval,
            takeover_grace=_non_negative_seconds("fenced_takeover_grace", merged["fenced_takeover_grace"]),
            requeue_timeout=requeue_timeout,
            start_timeout=start_timeout,
            policy=policy,
            raw=MappingProxyType(merged),
        )

    def policy_for(self, task: Any) -> TaskPolicy:
        """Return the policy for a task: the app's, with the task's own attributes over it.

        A task attribute left as ``None`` inherits the app's setting.
        """
        overrides = {
            option: getattr(task, option) for option in TASK_OPTIONS if getattr(task, option, None) is not None
        }
        if not overrides:
            return self.policy
        name = getattr(task, "name", None) or type(task).__name__
        merged = dict(self.raw)
        for option, value in overrides.items():
            merged[TASK_OPTIONS[option]] = value
        return build_policy(merged, source=lambda option: f"{name}.{option}")


def build_policy(values: Mapping[str, Any], source: Any) -> TaskPolicy:
    """Validate the lease options in ``values`` (keyed by setting name) into a policy.

    ``source(option)`` names the setting in error messages.
    """

    def get(option: str) -> Any:
        return values[TASK_OPTIONS[option]]

    ttl = _positive_seconds(source("lease_ttl"), get("lease_ttl"))
    interval = _positive_seconds(source("heartbeat_interval"), get("heartbeat_interval"))
    assert ttl is not None and interval is not None
    if interval >= ttl / 2:
        raise ConfigurationError(
            f"{source('heartbeat_interval')} must be less than half of "
            f"{source('lease_ttl')} ({ttl:g} s), got {interval:g}: "
            "a single late tick would let the lease expire"
        )
    default_timeout = _positive_seconds(source("default_stage_timeout"), get("default_stage_timeout"))
    assert default_timeout is not None
    interrupt = get("interrupt_on_loss")
    if not isinstance(interrupt, bool):
        raise ConfigurationError(f"{source('interrupt_on_loss')} must be True or False, got {interrupt!r}")
    return TaskPolicy(
        lease_ttl=ttl,
        heartbeat_interval=interval,
        stage_timeouts=_stage_table(source("stage_timeouts"), get("stage_timeouts")),
        default_stage_timeout=default_timeout,
        stall_checks=_positive_int(source("stall_checks"), get("stall_checks")),
        on_stall=_on_stall(source("on_stall"), get("on_stall")),
        max_takeovers=_positive_int(source("max_takeovers"), get("max_takeovers"), minimum=0),
        max_task_duration=_positive_seconds(source("max_task_duration"), get("max_task_duration"), allow_none=True),
        interrupt_on_loss=interrupt,
        max_detail_bytes=_positive_int(
            "fenced_max_detail_bytes", values.get("fenced_max_detail_bytes", DEFAULTS["fenced_max_detail_bytes"])
        ),
    )


def _read(lookup: Callable[[str], Any], spellings: Iterable[Callable[[str], str]]) -> dict[str, Any]:
    """Every setting of :data:`DEFAULTS` that ``lookup`` finds under one of its ``spellings``."""
    found: dict[str, Any] = {}
    for key in DEFAULTS:
        for spell in spellings:
            value = lookup(spell(key))
            if value is not _MISSING:
                found[key] = value
                break
    return found


def read_settings(app: Celery) -> dict[str, Any]:
    """Read every ``fenced_*`` setting of ``app`` (``FENCED_*`` found too)."""
    return _read(lambda name: app.conf.get(name, _MISSING), (str, str.upper))


def check_django_settings(settings: Any) -> FencedConfig:
    """Validate the ``CELERY_FENCED_*`` settings of a Django project (Celery's ``CELERY``
    namespace), so a bad one stops Django at start with its name."""
    return FencedConfig.from_mapping(
        _read(lambda name: getattr(settings, name, _MISSING), (lambda key: f"CELERY_{key.upper()}",))
    )


_MISSING = object()
_warned_unknown: set[str] = set()


def ensure_conf(app: Celery) -> FencedConfig:
    """Return the app's validated :class:`FencedConfig`, built once per app.

    The first build also warns about each ``fenced_*`` setting that is not one of
    :data:`DEFAULTS` (a misspelled key would otherwise be ignored without a word).
    """
    record = record_of(app)
    conf: FencedConfig | None = record.conf
    if conf is None:
        conf = record.conf = FencedConfig.from_mapping(read_settings(app))
        for key in unknown_settings(app):
            if key in _warned_unknown:
                continue
            _warned_unknown.add(key)
            hint = nearest(key.lower().removeprefix("celery_"), DEFAULTS)
            _warn(
                "unknown setting %s: celery-fenced has no such setting%s",
                key,
                f" (did you mean {hint}?)" if hint else "",
            )
    return conf


# Warnings made before the process set up its logging (a worker reads its settings while it
# imports the app, before Celery configures logging): Python would print them bare, with no
# level. They wait for Celery's ``after_setup_logger``, or for :func:`flush_warnings`.
_pending: list[tuple[str, tuple[Any, ...]]] = []


def _warn(message: str, *args: Any) -> None:
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


def exit_on_bad_settings(app: Celery) -> None:
    """Validate ``app``'s settings; a bad one ends the process with one line naming it."""
    with exit_in_one_line():
        ensure_conf(app)


def check_settings_before_beat(app: Celery) -> None:
    """Make ``celery beat`` stop with one line on a bad setting, before its scheduler starts.

    Beat builds the result backend while it sets up its schedule, before any signal of its
    own; the app's ``on_after_finalize`` comes earlier, and this receiver acts only under
    the ``beat`` command (idempotent).
    """
    if not first_time(app, "beat settings check"):
        return

    def check(sender: Any = None, **_: Any) -> None:
        import click

        context = click.get_current_context(silent=True)
        if context is not None and context.info_name == "beat":
            exit_on_bad_settings(app)

    app.on_after_finalize.connect(check, weak=False)


def unknown_settings(app: Celery) -> list[str]:
    """The keys of ``app.conf`` that look like fenced settings but are none of them."""
    unknown = []
    for key in list(app.conf.keys()):
        if not isinstance(key, str):
            continue
        name = key.lower().removeprefix("celery_")
        if name.startswith("fenced_") and name not in DEFAULTS:
            unknown.append(key)
    return sorted(unknown)


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to a misspelled ``name``, or ``None`` when none is close."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def reset_conf(app: Celery) -> None:
    """Forget the cached configuration (after changing ``app.conf`` in tests)."""
    record_of(app).conf = None
