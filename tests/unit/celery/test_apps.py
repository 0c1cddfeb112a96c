"""What is kept per app lives beside the app, once per app, and goes with it."""

from __future__ import annotations

import gc
import weakref

from celery import Celery

from celery_fenced._celery import apps
from celery_fenced.conf import ensure_conf, reset_conf


def test_a_step_is_done_once_per_app() -> None:
    one, two = Celery("one", set_as_current=False), Celery("two", set_as_current=False)
    assert apps.first_time(one, "wiring") and not apps.first_time(one, "wiring")
    assert apps.first_time(two, "wiring")
    assert not [name for name in vars(one) if "fenced" in name]  # nothing is put on Celery's object


def test_the_configuration_is_built_once_and_forgotten_on_reset() -> None:
    app = Celery("conf", set_as_current=False)
    first = ensure_conf(app)
    assert ensure_conf(app) is first
    reset_conf(app)
    assert ensure_conf(app) is not first


def test_a_discarded_app_takes_its_record_with_it() -> None:
    app = Celery("gone", set_as_current=False)
    apps.first_time(app, "wiring")
    ensure_conf(app)
    gone = weakref.ref(app)
    assert gone in [weakref.ref(key) for key in apps._records]
    del app
    gc.collect()
    assert gone() is None  # the record did not keep the app alive
