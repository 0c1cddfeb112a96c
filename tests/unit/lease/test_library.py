"""_lib.lua: what the loader puts in front of a script, and the server clock as text."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._lease.scripts import _library, script_source
from tests.unit.lease.helpers import server_ms


def defined(name: str) -> set[str]:
    source = script_source(name)
    return {fn for fn in _library() if f"local function {fn}(" in source}


def test_a_script_gets_only_the_library_functions_it_calls() -> None:
    assert defined("acquire") == {
        "now_ms_text",
        "now_us_text",
        "int_arg",
        "in_token_epoch",
        "next_tokens",
        "fence_of",
        "finished_fence",
        "write_result",
    }
    assert defined("store") == {
        "now_ms_text",
        "now_ms",
        "came_back",
        "this_primary",
        "int_arg",
        "write_result",
        "fence_of",
        "end_as_tombstone",
        "undo_hand_off",
    }
    assert "undo_hand_off" in defined("claim") and "undo_hand_off" in defined("hand_back")


def test_a_script_gets_what_its_library_functions_call_in_turn() -> None:
    # renew.lua calls publish_progress, which calls int_arg; now_ms calls now_ms_text.
    assert {"publish_progress", "int_arg", "now_ms", "now_ms_text"} <= defined("renew")
    assert "owner_refusal" not in defined("renew")


def test_the_library_functions_come_in_the_files_order() -> None:
    source = script_source("renew")
    positions = [source.index(f"local function {fn}(") for fn in _library() if fn in defined("renew")]
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    ("seconds", "micros", "expected"),
    [
        ("1733291234", "123456", "1733291234123"),
        ("1733291234", "40000", "1733291234040"),
        ("1733291234", "999", "1733291234000"),
        ("1733291234", "5", "1733291234000"),
        ("1733291234", "999999", "1733291234999"),
    ],
)
def test_now_ms_text_is_the_milliseconds_of_a_time_reply(
    redis_client: redis.Redis, seconds: str, micros: str, expected: str
) -> None:
    # The library's own function, run by the server with a TIME reply given as arguments.
    fake_time = "local redis = {call = function() return {ARGV[1], ARGV[2]} end}\n"
    source = fake_time + _library()["now_ms_text"] + "return now_ms_text()"
    assert redis_client.eval(source, 0, seconds, micros) == expected.encode()


def test_now_ms_is_the_servers_clock(redis_client: redis.Redis) -> None:
    before = server_ms(redis_client)
    library = _library()
    now = int(redis_client.eval(library["now_ms_text"] + library["now_ms"] + "return now_ms()", 0))
    assert before <= now <= server_ms(redis_client)
