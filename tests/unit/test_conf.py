"""Settings: defaults, Django-style names, per-task overrides and one clear error per bad value."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_fenced.conf import DEFAULTS, FencedConfig, ensure_conf, normalise_stage
from celery_fenced.exceptions import ConfigurationError


def make_app(**settings: Any) -> Celery:
    app = Celery("conf-test", set_as_current=False)
    app.conf.update(settings)
    return app


def test_defaults_match_the_contract() -> None:
    conf = ensure_conf(make_app())
    policy = conf.policy
    assert conf.key_prefix == "fenced"
    assert policy.lease_ttl == 30 and policy.heartbeat_interval == 5
    assert policy.stage_timeouts == {} and policy.default_stage_timeout == 60
    assert policy.stall_checks == 2 and policy.on_stall == "release"
    assert policy.max_takeovers == 3 and policy.max_task_duration is None
    assert policy.interrupt_on_loss is True
    assert conf.reaper_interval == 5 and conf.takeover_grace == 0 and conf.requeue_timeout == 60
    assert conf.start_timeout == 60
    assert policy.max_detail_bytes == 4096
    assert set(DEFAULTS) == {
        "fenced_key_prefix",
        "fenced_lease_ttl",
        "fenced_heartbeat_interval",
        "fenced_stage_timeouts",
        "fenced_default_stage_timeout",
        "fenced_stall_checks",
        "fenced_on_stall",
        "fenced_max_takeovers",
        "fenced_max_task_duration",
        "fenced_interrupt_on_loss",
        "fenced_reaper_interval",
        "fenced_takeover_grace",
        "fenced_requeue_timeout",
        "fenced_start_timeout",
        "fenced_max_detail_bytes",
    }


def test_config_is_built_once_and_cached_on_the_app() -> None:
    app = make_app(fenced_lease_ttl=12)
    assert ensure_conf(app) is ensure_conf(app)
    assert ensure_conf(app).policy.lease_ttl == 12


def test_django_namespace_settings_are_found() -> None:
    class Settings:
        CELERY_FENCED_LEASE_TTL = 40
        CELERY_FENCED_STAGE_TIMEOUTS = {"LOAD_DATA": 5}

    app = Celery("django-style", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    conf = ensure_conf(app)
    assert conf.policy.lease_ttl == 40
    assert conf.policy.stage_timeout("load-data") == 5


@pytest.mark.parametrize("name", ["LOAD_DATA", "load-data", "Load_Data", " load_DATA "])
def test_stage_names_are_normalised(name: str) -> None:
    assert normalise_stage(name) == "load-data"


def test_stage_table_lookup_and_default() -> None:
    policy = ensure_conf(make_app(fenced_stage_timeouts={"Call_AI": 90}, fenced_default_stage_timeout=7)).policy
    assert policy.stage_timeout("call-ai") == 90
    assert policy.stage_timeout("persist-result") == 7
    assert policy.stage_timeout(None) == 7


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"fenced_lease_ttl": 0}, "fenced_lease_ttl"),
        ({"fenced_lease_ttl": -1}, "fenced_lease_ttl"),
        ({"fenced_lease_ttl": "30"}, "fenced_lease_ttl"),
        ({"fenced_heartbeat_interval": 15}, "fenced_heartbeat_interval"),
        ({"fenced_heartbeat_interval": 0}, "fenced_heartbeat_interval"),
        ({"fenced_on_stall": "kill"}, "fenced_on_stall"),
        ({"fenced_stage_timeouts": [("a", 1)]}, "fenced_stage_timeouts"),
        ({"fenced_stage_timeouts": {"load": 0}}, "fenced_stage_timeouts['load']"),
        ({"fenced_stage_timeouts": {"": 3}}, "fenced_stage_timeouts"),
        ({"fenced_default_stage_timeout": -5}, "fenced_default_stage_timeout"),
        ({"fenced_stall_checks": 0}, "fenced_stall_checks"),
        ({"fenced_max_takeovers": -1}, "fenced_max_takeovers"),
        ({"fenced_max_task_duration": 0}, "fenced_max_task_duration"),
        ({"fenced_interrupt_on_loss": "yes"}, "fenced_interrupt_on_loss"),
        ({"fenced_reaper_interval": 0}, "fenced_reaper_interval"),
        ({"fenced_takeover_grace": -1}, "fenced_takeover_grace"),
        ({"fenced_requeue_timeout": 0}, "fenced_requeue_timeout"),
        ({"fenced_key_prefix": ""}, "fenced_key_prefix"),
        ({"fenced_max_detail_bytes": 0}, "fenced_max_detail_bytes"),
        ({"fenced_max_detail_bytes": "4k"}, "fenced_max_detail_bytes"),
    ],
)
def test_bad_values_raise_one_error_naming_the_setting(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        FencedConfig.from_mapping(settings)
    assert named in str(info.value)
    assert "got" in str(info.value)  # the message shows the value it refused


class _Task:
    name = "proj.build_report"
    lease_ttl = 10
    heartbeat_interval = 1
    stage_timeouts = {"CALL_AI": 120}
    on_stall = "alert"
    max_takeovers = None


def test_per_task_overrides_win_and_none_inherits() -> None:
    conf = ensure_conf(make_app(fenced_max_takeovers=7))
    policy = conf.policy_for(_Task())
    assert policy.lease_ttl == 10 and policy.heartbeat_interval == 1
    assert policy.stage_timeout("call-ai") == 120
    assert policy.on_stall == "alert"
    assert policy.max_takeovers == 7


def test_bad_per_task_override_names_the_task() -> None:
    class Bad(_Task):
        heartbeat_interval = 6

    with pytest.raises(ConfigurationError, match=r"proj\.build_report\.heartbeat_interval"):
        ensure_conf(make_app()).policy_for(Bad())


class _DjangoSettings:
    CELERY_FENCED_LEASE_TTL = 40
    CELERY_FENCED_HEARTBEAT_INTERVAL = 30


def test_an_error_names_the_settings_as_the_project_wrote_them() -> None:
    app = Celery("django-names", set_as_current=False)
    app.config_from_object(_DjangoSettings, namespace="CELERY")
    with pytest.raises(ConfigurationError) as info:
        ensure_conf(app)
    message = str(info.value)
    assert message.startswith("CELERY_FENCED_HEARTBEAT_INTERVAL must be less than half of CELERY_FENCED_LEASE_TTL")
    assert "\n" not in message and "fenced_heartbeat_interval" not in message


def test_an_error_names_a_setting_left_out_as_the_project_would_write_it() -> None:
    class Settings:
        CELERY_FENCED_HEARTBEAT_INTERVAL = 20

    app = Celery("django-names", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match=r"of CELERY_FENCED_LEASE_TTL \(30 s\)"):
        ensure_conf(app)
    with pytest.raises(ConfigurationError, match=r"^fenced_reaper_interval must be"):
        ensure_conf(make_app(fenced_reaper_interval=0))


def test_the_defaults_are_read_from_app_conf_once_a_fenced_task_is_bound() -> None:
    from celery_fenced import ProgressLeasedTask

    app = make_app(fenced_lease_ttl=12)

    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def work(self: Any) -> None: ...

    app.finalize()  # a worker's start, a send, app.tasks: the task is bound to the app
    assert app.conf.fenced_reaper_interval == 5
    assert app.conf.fenced_lease_ttl == 12
    assert app.conf.fenced_stage_timeouts == {}
    assert dict(app.conf.fenced_stage_timeouts) is not DEFAULTS["fenced_stage_timeouts"]


def test_the_project_s_settings_win_over_the_defaults_in_app_conf_in_any_order() -> None:
    from celery_fenced import install

    before = Celery("configured-after", set_as_current=False)
    install(before)
    before.config_from_object(_DjangoSettings, namespace="CELERY")
    assert before.conf.fenced_lease_ttl == 40 and before.conf.fenced_start_timeout == 60

    after = Celery("configured-before", set_as_current=False)
    after.config_from_object(_DjangoSettings, namespace="CELERY")
    assert after.conf.get("fenced_lease_ttl") == 40
    install(after)
    assert after.conf.fenced_lease_ttl == 40 and after.conf.fenced_reaper_interval == 5
    after.conf.fenced_reaper_interval = 2
    assert after.conf.fenced_reaper_interval == 2

    reconfigured = Celery("reconfigured", set_as_current=False)
    install(reconfigured)
    assert reconfigured.conf.fenced_requeue_timeout == 60
    reconfigured.config_from_object({"fenced_requeue_timeout": 90})
    assert reconfigured.conf.fenced_requeue_timeout == 90 and reconfigured.conf.fenced_takeover_grace == 0


def test_an_unknown_django_setting_is_warned_with_the_name_meant_spelled_alike(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Settings:
        CELERY_FENCED_STALL_CHEKS = 3

    app = Celery("django-unknown", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with caplog.at_level("WARNING", logger="celery_fenced.conf"):
        ensure_conf(app)
    [message] = [r.getMessage() for r in caplog.records if "CELERY_FENCED_STALL_CHEKS" in r.getMessage()]
    assert message.endswith("(did you mean CELERY_FENCED_STALL_CHECKS?)")
