"""Settings: one validated, cached configuration object per Celery app.

Every setting is read from ``app.conf`` under its lowercase ``fenced_*`` name; Django
projects that configure Celery with ``namespace="CELERY"`` write ``CELERY_FENCED_*``
and Celery's own lookup finds them. A bad value raises :class:`ConfigurationError`
naming the setting and the value.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from celery import Celery

from ._celery.apps import first_time, record_of
from ._celery.startup import warn_once
from .exceptions import ConfigurationError

__all__ = [
    "DEFAULTS",
    "DEFAULT_VISIBILITY_TIMEOUT",
    "ON_STALL_MODES",
    "TASK_OPTIONS",
    "FencedConfig",
    "TaskPolicy",
    "add_defaults",
    "build_policy",
    "check_django_settings",
    "ensure_conf",
    "forget_window",
    "nearest",
    "normalise_stage",
    "positive_seconds",
    "read_settings",
    "reset_conf",
    "unknown_django_settings",
    "unknown_settings",
]

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

#: The broker's visibility timeout where ``broker_transport_options`` names none: kombu's
#: Redis transport's default, seconds.
DEFAULT_VISIBILITY_TIMEOUT = 3600.0

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
    def from_mapping(cls, values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> FencedConfig:
        """Validate settings given by their ``fenced_*`` names (missing ones take defaults).

        ``names`` gives, for a setting, the name its value was written under
        (``CELERY_FENCED_LEASE_TTL``): an error names the setting that way.
        """
        written = names or {}

        def name(key: str) -> str:
            return written.get(key, key)

        merged = {key: values.get(key, default) for key, default in DEFAULTS.items()}
        prefix = merged["fenced_key_prefix"]
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \n"):
            raise ConfigurationError(
                f"{name('fenced_key_prefix')} must be a non-empty string without spaces or braces, got {prefix!r}"
            )
        policy = build_policy(merged, source=lambda option: name(TASK_OPTIONS[option]), names=written)
        reaper_interval = _positive_seconds(name("fenced_reaper_interval"), merged["fenced_reaper_interval"])
        requeue_timeout = _positive_seconds(name("fenced_requeue_timeout"), merged["fenced_requeue_timeout"])
        start_timeout = _positive_seconds(name("fenced_start_timeout"), merged["fenced_start_timeout"])
        assert reaper_interval is not None and requeue_timeout is not None and start_timeout is not None
        return cls(
            key_prefix=prefix,
            reaper_interval=reaper_interval,
            takeover_grace=_non_negative_seconds(name("fenced_takeover_grace"), merged["fenced_takeover_grace"]),
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


def build_policy(values: Mapping[str, Any], source: Any, names: Mapping[str, str] | None = None) -> TaskPolicy:
    """Validate the lease options in ``values`` (keyed by setting name) into a policy.

    ``source(option)`` names the setting in error messages; ``names`` the settings that
    are no task option, by the name they were written under.
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
            (names or {}).get("fenced_max_detail_bytes", "fenced_max_detail_bytes"),
            values.get("fenced_max_detail_bytes", DEFAULTS["fenced_max_detail_bytes"]),
        ),
    )


def read_settings(app: Celery) -> dict[str, Any]:
    """Read every ``fenced_*`` setting of ``app`` set by the project (``FENCED_*`` and, with a
    namespace, ``CELERY_FENCED_*`` found too); the defaults are not in it."""
    return _read_app(app)[0]


def _spellings(key: str, prefix: str | None) -> tuple[str, ...]:
    """The names ``key`` may be written under in ``app.conf``, in Celery's order."""
    plain = (key, key.upper())
    if not prefix:
        return plain
    namespaced = prefix + key
    return (namespaced.upper() if prefix.isupper() else namespaced, *plain)


def _read_app(app: Celery) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings the project set on ``app``, and the name each was written under.

    Read from ``app.conf``'s own mappings, before celery-fenced's defaults there
    (:func:`add_defaults`) and in Celery's order: the first mapping holding a spelling wins.
    """
    conf = app.conf
    conf.finalize()
    prefix = getattr(conf, "prefix", None)
    mappings = [mapping for mapping in conf.maps if not isinstance(mapping, _ConfDefaults)]
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key in DEFAULTS:
        spellings = _spellings(key, prefix)
        names[key] = spellings[0]  # a setting left out is named as the project would write it
        for mapping in mappings:
            found = next((name for name in spellings if name in mapping), None)
            if found is not None:
                values[key], names[key] = mapping[found], found
                break
    return values, names


class _ConfDefaults(dict):  # type: ignore[type-arg]
    """celery-fenced's defaults, as a mapping of ``app.conf`` behind the project's settings."""


def add_defaults(app: Celery) -> None:
    """Make every ``fenced_*`` default readable from ``app.conf`` (``app.conf.fenced_lease_ttl``).

    The defaults go behind the project's settings, just before Celery's own defaults (not
    with ``app.add_defaults``, whose mapping would shadow ``config_from_object``), now if
    the app is configured and again whenever it is configured anew (idempotent).
    """
    if not first_time(app, "conf defaults"):
        return

    def place(source: Any = None, **_: Any) -> None:
        maps = source.maps
        if any(isinstance(mapping, _ConfDefaults) for mapping in maps):
            return
        defaults = _ConfDefaults(
            {key: dict(value) if isinstance(value, dict) else value for key, value in DEFAULTS.items()}
        )
        at = max(1, len(maps) - 1)  # Celery's own defaults are the last mapping
        maps.insert(at, defaults)
        source.defaults.insert(at - 1, defaults)

    app.on_after_configure.connect(place, weak=False)
    if app.configured:
        place(app.conf)


def check_django_settings(settings: Any) -> FencedConfig:
    """Validate the ``CELERY_FENCED_*`` settings of a Django project (Celery's ``CELERY``
    namespace); a :class:`ConfigurationError` names the setting as written there."""
    names = {key: f"CELERY_{key.upper()}" for key in DEFAULTS}
    values = {key: getattr(settings, name) for key, name in names.items() if hasattr(settings, name)}
    return FencedConfig.from_mapping(values, names)


def unknown_django_settings(settings: Any) -> list[tuple[str, str | None]]:
    """The ``CELERY_FENCED_*`` names of a Django project that are no setting, each with the
    setting it was probably meant to be (``None`` when none is close)."""
    known = {f"CELERY_{key.upper()}" for key in DEFAULTS}
    unknown = []
    for name in sorted(dir(settings)):
        if name.startswith("CELERY_FENCED_") and name not in known:
            unknown.append((name, nearest(name, known)))
    return unknown


def ensure_conf(app: Celery) -> FencedConfig:
    """Return the app's validated :class:`FencedConfig`, built once per app.

    The first build also warns about each ``fenced_*`` setting that is not one of
    :data:`DEFAULTS` (a misspelled key would otherwise be ignored without a word).
    """
    record = record_of(app)
    conf: FencedConfig | None = record.conf
    if conf is None:
        add_defaults(app)
        conf = record.conf = FencedConfig.from_mapping(*_read_app(app))
        for key in unknown_settings(app):
            hint = nearest(key.lower().removeprefix("celery_"), DEFAULTS)
            if hint and key.isupper():  # spelled as the project spells its settings
                hint = f"CELERY_{hint.upper()}" if key.startswith("CELERY_") else hint.upper()
            warn_once(
                key,
                "unknown setting %s: celery-fenced has no such setting%s",
                key,
                f" (did you mean {hint}?)" if hint else "",
            )
    return conf


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


def forget_window(app: Celery) -> float:
    """Seconds a copy of a finished task's message can still arrive: how long the DONE
    tombstone that ``AsyncResult.forget()`` leaves is kept.

    The larger of the broker's ``visibility_timeout`` (a message delivered and not
    acknowledged comes back after it; ``broker_transport_options``, else kombu's default of
    an hour) and the package's own re-sends: ``fenced_start_timeout``, then up to
    ``max(fenced_max_takeovers, 1)`` re-sends ``fenced_requeue_timeout`` apart, and a reaper
    pass.
    """
    conf = ensure_conf(app)
    options = app.conf.get("broker_transport_options") or {}
    try:
        visibility = float(options.get("visibility_timeout") or DEFAULT_VISIBILITY_TIMEOUT)
    except (TypeError, ValueError):
        visibility = DEFAULT_VISIBILITY_TIMEOUT
    resends = conf.start_timeout + max(conf.policy.max_takeovers, 1) * conf.requeue_timeout + conf.reaper_interval
    return max(visibility, resends)
