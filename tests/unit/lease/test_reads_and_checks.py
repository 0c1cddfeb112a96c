"""The store's reads, its argument checks, and an unknown script answer."""

from __future__ import annotations

import pytest

from celery_fenced._lease.store import LeaseStore
from celery_fenced.exceptions import LeaseScriptError
from tests.unit.lease.helpers import acquire


def test_read_many_and_index_listing(store: LeaseStore) -> None:
    taken = [acquire(store, task_id=f"r{i}").token for i in range(3)]
    assert sorted(store.indexed_task_ids()) == ["r0", "r1", "r2"]
    assert [s.task_id for s in store.read_many(["r0", "zz", "r2"])] == ["r0", "r2"]
    assert store.read("zz") is None
    assert store.owner_token("r1") == ("RUNNING", taken[1])


def test_arguments_are_checked(store: LeaseStore) -> None:
    with pytest.raises(ValueError, match="task_id"):
        acquire(store, task_id="")
    with pytest.raises(ValueError, match="token"):
        store.store("t1", 0, b"x", state="SUCCESS", kind="ready", expires_ms=0)
    with pytest.raises(ValueError, match="kind"):
        store.store("t1", 1, b"x", state="SUCCESS", kind="done", expires_ms=0)


def test_unknown_script_codes_raise_a_named_error(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store.scripts, "lapse", lambda keys, args: [b"surprise"])
    with pytest.raises(LeaseScriptError, match="surprise"):
        store.lapse("t1", "o", 1, mode="release")
