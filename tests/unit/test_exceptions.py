"""The package's exceptions survive what Celery does to a task's error: pickle and its JSON form."""

from __future__ import annotations

import pickle

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_fenced.exceptions import (
    ConfigurationError,
    FencedError,
    LeaseLostError,
    LeaseScriptError,
    StaleOwnerError,
    TaskAbandonedError,
)

EXAMPLES = [
    LeaseLostError("t1", 4, "taken over"),
    StaleOwnerError("t1", 4, "stale token", current_token=9),
    TaskAbandonedError.of("t1"),
    ConfigurationError("fenced_lease_ttl must be a positive number of seconds, got -1"),
    LeaseScriptError("renew.lua answered an unknown code 'x'"),
]


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda error: type(error).__name__)
def test_pickling_rebuilds_the_same_exception(error: FencedError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error) and again.args == error.args
    assert vars(again) == vars(error)


@pytest.mark.parametrize("error", EXAMPLES[:3], ids=lambda error: type(error).__name__)
def test_celerys_json_exception_round_trip_rebuilds_it(error: FencedError) -> None:
    backend = Celery("json", set_as_current=False, result_serializer="json").backend
    stored = backend.prepare_exception(error, "json")
    again = backend.exception_to_python(stored)
    assert type(again).__name__ == type(error).__name__
    assert str(again) == str(error)


def test_the_tree_is_as_documented() -> None:
    assert issubclass(ConfigurationError, ImproperlyConfigured)
    assert issubclass(StaleOwnerError, LeaseLostError)
    for error in EXAMPLES:
        assert isinstance(error, FencedError)


def test_a_lost_lease_says_whose_and_why() -> None:
    assert str(LeaseLostError("t1", 4, "stalled")) == "lease of task t1 (token 4) lost: stalled"
    assert (
        str(StaleOwnerError("t1", 4, current_token=9))
        == "stale owner of t1 refused (token 4, current token 9): stale token"
    )
