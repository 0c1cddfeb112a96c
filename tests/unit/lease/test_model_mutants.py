"""A test of the model test: each guard of the lease scripts, disabled, is caught.

Each mutant below disables one guard of one script (a token comparison, a due check, a
status check) by a text substitution of the script's source, as the store loads it
(:func:`celery_fenced._lease.scripts.script_source`). Each names the shortest sequence of the
protocol machine's steps (test_protocol_model.py) that reaches its guard: replayed on the real
scripts, the model finds nothing wrong; replayed on the mutated one, the model must break a
rule. A mutant the model does not catch there is a path the model does not judge.

The sequences were found by the machine itself (a mutant, then a shrunk failing run) or written
by hand where its bounded runs do not reach the guard; replaying them makes each check exact
and fast, where a bounded random run caught some mutants only in some runs.

A script that gains a guard comparing tokens gets its mutant, or a listed reason why none
can be told apart (:data:`UNMUTATED`): :func:`test_every_token_guard_is_listed` fails until then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from celery_fenced._lease import scripts
from celery_fenced._lease.state import LeaseStatus
from tests.unit.lease.protocol_model import Violation
from tests.unit.lease.test_protocol_model import OWNER, ProtocolMachine, ThroughTheHoles, run_sequence
from tests.unit.lease.test_protocol_model import model_client as model_client  # the fixture

Steps = tuple[tuple[str, dict[str, Any]], ...]


@dataclass(frozen=True)
class Mutant:
    """``script``'s source with ``guard`` (found exactly once) replaced by ``disabled``; ``steps``
    reach the guard (``OWNER + "n"``: the n-th delivery that ran), on ``machine``:
    :class:`ThroughTheHoles` where no heartbeat may tick before a loss, going on past the
    ``tolerate``d rules of a known hole (test_protocol_model.py's HOLES)."""

    name: str
    script: str
    guard: str
    disabled: str
    steps: Steps
    machine: type[ProtocolMachine] = ProtocolMachine
    tolerate: str = ""


MUTANTS = [
    # -- token comparisons
    Mutant(
        "store-no-lease-older-token",
        "store",
        "elseif token ~= '' and tonumber(token) < tonumber(fence) then",
        "elseif false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
            ("write", {"owner": OWNER + "1", "state": "FAILURE"}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ),
    ),
    Mutant(
        "store-no-lease-same-token",
        "store",
        "elseif token == '' or token == fence then",
        "elseif false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("write", {"owner": OWNER + "0", "state": "FAILURE"}),
            ("main_process_write", {"kind": "worker-lost", "owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "store-token-not-current",
        "store",
        "if cur[2] ~= token or (owner_id ~= '' and cur[3] ~= owner_id and cur[3] ~= '') then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("deliver", {"task_id": "t2"}),
            ("runs_out_and_claim", {"task_id": "t2"}),
            ("write", {"owner": OWNER + "1", "state": "SUCCESS"}),
        ),
    ),
    Mutant(
        "store-handoff-token",
        "store",
        "if (ARGV[10] or '') ~= h[1] then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("main_process_write", {"kind": "worker-lost", "owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "acquire-handed-off-record",
        "acquire",
        "    if handed_by ~= cur[2] then",
        "    if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("deliver", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "acquire-copy-from-before-handoff",
        "acquire",
        "elseif handed_by ~= cur[2] and (publish_id == '' or not cur[3] or cur[3] == publish_id) then",
        "elseif false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("deliver", {"replacement": True, "task_id": "t1"}),
            ("deliver", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "renew-finished-by-another",
        "renew",
        "elseif status == 'DONE' and cur[2] ~= token",
        "elseif false",
        (
            ("deliver", {"task_id": "t2"}),
            ("runs_out_and_claim", {"task_id": "t2"}),
            ("deliver", {"task_id": "t1"}),
            ("main_process_write", {"kind": "revoked", "owner": OWNER + "1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
            ("renew", {"owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "renew-newer-token-lease",
        "renew",
        "elseif cur[2] ~= token and (status == 'HANDED_OFF' or tonumber(cur[2] or '0') > tonumber(token)) then",
        "elseif cur[2] ~= token and status == 'HANDED_OFF' then",
        (
            ("deliver", {"task_id": "t1"}),
            ("main_process_write", {"kind": "worker-lost", "owner": OWNER + "0"}),
            ("deliver", {"task_id": "t1"}),
            ("renew", {"owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "renew-older-token-lease",
        "renew",
        "elseif cur[2] ~= token and (status == 'HANDED_OFF' or tonumber(cur[2] or '0') > tonumber(token)) then",
        "elseif cur[2] ~= token then",
        (
            ("deliver", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
            ("flushdb", {}),
            ("restore", {"owner": OWNER + "0", "lapsed": True}),
            ("renew", {"owner": OWNER + "1"}),
        ),
        machine=ThroughTheHoles,
        tolerate="stale-restore,live-lease-not-newest",
    ),
    Mutant(
        "restore-finished-fence",
        "restore",
        "if fence then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("operator", {"task_id": "t1", "action": "cancel"}),
            ("evict_lease", {"task_id": "t1"}),
            ("restore", {"owner": OWNER + "0", "age": 0}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ),
        machine=ThroughTheHoles,
    ),
    Mutant(
        "store-data-lost-write-back",
        "store",
        "if cur[6] == 'data-lost' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("flushdb", {}),
            ("time_passes", {"task_id": "t1"}),
            ("restore", {"owner": OWNER + "0", "lapsed": True}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ),
    ),
    Mutant(
        "store-older-token-lease",
        "store",
        "if cur[2] ~= token and status ~= 'DONE' and status ~= 'ABANDONED' and status ~= 'HANDED_OFF'",
        "if false and status ~= 'DONE' and status ~= 'ABANDONED' and status ~= 'HANDED_OFF'",
        (
            ("deliver", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
            ("flushdb", {}),
            ("restore", {"owner": OWNER + "0", "lapsed": True}),
            ("write", {"owner": OWNER + "1", "state": "SUCCESS"}),
        ),
        machine=ThroughTheHoles,
        tolerate="stale-restore,live-lease-not-newest",
    ),
    Mutant(
        "reserve-copy-from-before-handoff",
        "reserve",
        "if cur[2] and cur[2] ~= ARGV[at + 5] then",
        "if false then",
        (("deliver", {"task_id": "t1"}), ("hand_off", {"owner": OWNER + "0"}), ("receive", {"task_id": "t1"})),
    ),
    Mutant(
        "reserve-finished",
        "reserve",
        "elseif not status and finished_fence(KEYS[i + 1]) then",
        "elseif false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
            ("receive", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "reserve-handed-off-owner",
        "reserve",
        "redis.call('HDEL', key, 'ownerId')",
        "",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("receive", {"task_id": "t1", "replacement": True}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ),
    ),
    # -- due checks
    Mutant(
        "acquire-live-lease",
        "acquire",
        "if expire_at > now then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("deliver", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "claim-not-due",
        "claim",
        "if due > now then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("claim", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "claim-grace",
        "claim",
        "due = due + tonumber(ARGV[1])",
        "due = due",
        (
            ("deliver", {"task_id": "t1"}),
            ("claim", {"task_id": "t1"}),
            ("main_process_write", {"kind": "worker-lost", "owner": OWNER + "0"}),
            ("claim", {"grace": True, "task_id": "t1"}),
        ),
    ),
    Mutant(
        "claim-lost-handoff-not-due",
        "claim",
        "if tonumber(h[2] or '0') > now then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("main_process_write", {"owner": OWNER + "0", "kind": "worker-lost"}),
            ("claim", {"task_id": "t1"}),
            ("deliver", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "restore-renewed-a-ttl-ago",
        "restore",
        "if not lapsed and tonumber(ARGV[10]) >= tonumber(ARGV[3]) then",
        "if not lapsed and tonumber(ARGV[10]) > tonumber(ARGV[3]) then",
        (
            ("deliver", {"task_id": "t1"}),
            ("flushdb", {}),
            ("time_passes", {"task_id": "t1"}),
            ("restore", {"owner": OWNER + "0", "age": 0}),
            ("write", {"owner": OWNER + "0", "state": "SUCCESS"}),
        ),
    ),
    Mutant(
        "claim-max-takeovers",
        "claim",
        "if takeovers > max_takeovers then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
        ),
    ),
    # -- status checks
    Mutant(
        "renew-running",
        "renew",
        "elseif status == 'RUNNING' or status == 'STALLED' then",
        "elseif true then",
        (
            ("deliver", {"task_id": "t1"}),
            ("main_process_write", {"kind": "worker-lost", "owner": OWNER + "0"}),
            ("renew", {"owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "lapse-running",
        "lapse",
        "if status ~= 'RUNNING' and status ~= 'STALLED' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("stall", {"mode": "release", "owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "lapse-now-live",
        "lapse_now",
        "if status ~= 'RUNNING' and status ~= 'STALLED' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("process_lost", {"owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "lapse-now-retry",
        "lapse_now",
        "if ARGV[2] then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("process_lost", {"owner": OWNER + "0", "retried": True}),
        ),
    ),
    Mutant(
        "release-finished",
        "release",
        "if status == 'DONE' or status == 'ABANDONED' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("main_process_write", {"kind": "revoked", "owner": OWNER + "0"}),
            ("hand_off", {"owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "hand-back-record",
        "hand_back",
        "if status ~= 'HANDED_OFF' or record[1] ~= ARGV[2] then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_back", {"owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "replacement-sent-record",
        "replacement_sent",
        "local mine = not refusal and status == 'HANDED_OFF' and r[2] == ARGV[2]",
        "local mine = not refusal",
        (
            ("deliver", {"task_id": "t1"}),
            ("replacement_sent", {"filed": False, "owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "claim-handoff-sent",
        "claim",
        "if h[1] ~= 'worker-lost' or h[4] == '1' then",
        "if h[1] ~= 'worker-lost' then",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("main_process_write", {"owner": OWNER + "0", "kind": "worker-lost"}),
            ("replacement_sent", {"owner": OWNER + "0"}),
            ("time_passes", {"task_id": "t1"}),
            ("claim", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "lapse-worker-sent",
        "lapse_worker",
        "f[3] == ARGV[1] and f[4] ~= '1'",
        "f[3] == ARGV[1]",
        (
            ("deliver", {"task_id": "t1"}),
            ("hand_off", {"owner": OWNER + "0"}),
            ("replacement_sent", {"filed": False, "owner": OWNER + "0"}),
            ("worker_lapses", {}),
        ),
    ),
    Mutant(
        "store-finished",
        "store",
        "  if status == 'DONE' or status == 'ABANDONED' then\n    return {'finished'",
        "  if false then\n    return {'finished'",
        (
            ("deliver", {"task_id": "t1"}),
            ("main_process_write", {"kind": "revoked", "owner": OWNER + "0"}),
            ("main_process_write", {"kind": "worker-lost", "owner": OWNER + "0"}),
        ),
    ),
    Mutant(
        "cancel-finished",
        "cancel",
        "if status == 'DONE' or status == 'ABANDONED' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("deliver", {"task_id": "t2"}),
            ("release", {"owner": OWNER + "1", "status": LeaseStatus.DONE}),
            ("hand_back", {"owner": OWNER + "1"}),
            ("hand_back", {"owner": OWNER + "1"}),
            ("hand_back", {"owner": OWNER + "1"}),
            ("operator", {"action": "cancel", "task_id": "t2"}),
        ),
    ),
    Mutant(
        "redrive-abandoned",
        "redrive",
        "if status ~= 'ABANDONED' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("operator", {"action": "redrive", "task_id": "t1"}),
        ),
    ),
    Mutant(
        "forget-in-use",
        "forget",
        "if status ~= 'DONE' and status ~= 'ABANDONED' then",
        "if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("operator", {"action": "forget", "task_id": "t1"}),
        ),
    ),
    Mutant(
        "store-reserved-failure-put-back",
        "store",
        "if status == 'RESERVED' and state == 'FAILURE' and not by_owner and ARGV[9] ~= '2' then",
        "if status == 'RESERVED' and state == 'FAILURE' and not by_owner then",
        (
            ("deliver", {"task_id": "t1"}),
            ("flushdb", {}),
            ("receive", {"task_id": "t1"}),
            ("main_process_write", {"owner": OWNER + "0", "kind": "put-back"}),
        ),
    ),
    Mutant(
        "replacement-sent-keeps-reservation",
        "replacement_sent",
        "local reserved_here = r[1] == 'RESERVED' and host and",
        "local reserved_here = false and",
        (
            ("deliver", {"task_id": "t1"}),
            ("flushdb", {}),
            ("receive", {"task_id": "t1"}),
            ("replacement_sent", {"owner": OWNER + "0"}),
            ("worker_lapses", {}),
        ),
    ),
    Mutant(
        "reserve-live-lease",
        "reserve",
        "  elseif status == 'RESERVED' or status == 'REQUEUED' then",
        "  elseif true then",
        (("deliver", {"task_id": "t1"}), ("receive", {"task_id": "t1"})),
    ),
    Mutant(
        "lapse-worker-reserved-by",
        "lapse_worker",
        "if f[1] == 'RESERVED' and f[2] == ARGV[2] then",
        "if f[1] == 'RESERVED' then",
        (
            ("receive", {"task_id": "t1", "worker": "wa/1/start"}),
            ("receive", {"task_id": "t1", "worker": "wb/1/start"}),
            ("worker_lapses", {"worker": "wa/1/start"}),
        ),
    ),
    Mutant(
        "acquire-done",
        "acquire",
        "    if publish_id == '' or not run[1] or run[1] == publish_id or run[2] then",
        "    if false then",
        (
            ("deliver", {"task_id": "t1"}),
            ("main_process_write", {"kind": "revoked", "owner": OWNER + "0"}),
            ("deliver", {"task_id": "t1"}),
        ),
    ),
    Mutant(
        "acquire-abandoned",
        "acquire",
        "  elseif status == 'ABANDONED' then\n    return",
        "  elseif false then\n    return",
        (
            ("deliver", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
            ("runs_out_and_claim", {"task_id": "t1"}),
        ),
    ),
]


#: Guards that compare tokens and have no mutant, each with the reason none can be caught.
UNMUTATED = {
    (
        "_lib",
        "elseif cur[2] ~= token and cur[1] ~= 'DONE' and cur[1] ~= 'ABANDONED' and cur[1] ~= 'HANDED_OFF'",
    ): "owner_refusal's older-token case, the rule of store-older-token-lease for an owner's other ends "
    "(lapse, release, hand-off); the shared library is not mutated: test_restore.py holds each script to it",
    # Unreachable while tokens never go back: the token epoch (begin_epoch.lua) moves the counter
    # to the clock after every loss, so a fresh token is always above a lease's. Reaching them
    # takes a counter moved back within its epoch, which the model refuses as such (every token
    # above every earlier one): test_tokens.py checks the epoch itself.
    ("cancel", "if tonumber(ARGV[1]) <= tonumber(cur[2] or '0') then"): "a cancel's fresh token is never at or "
    "below the lease's (the token epoch)",
    ("claim", "if token <= tonumber(f[2] or '0') then"): "a claim's fresh token is never at or below the "
    "lease's (the token epoch)",
    ("acquire", "if token <= held then"): "the counter never falls below a lease's token within its epoch",
    ("restore", "elseif tonumber(counter) < token then"): "a counter below the restored token is moved to the "
    "clock by the next epoch check before any token is taken",
    # Not a guard of a write: matched by the pattern only.
    ("cancel", "if cur[2] then"): "keeps the owner's token as cancelledOwnerToken for inspect: it decides "
    "no write and no answer",
    ("_lib", "elseif cur[2] ~= token then"): "owner_refusal: the ownerId check after it refuses every other "
    "token too (an owner id is one execution's, with one token)",
    ("_lib", "if not token then"): "fence_of: no fence in the meta (a parse, not a guard)",
    ("acquire", "if fence then"): "a finished result written back as its DONE lease: without it, the "
    "delivery runs as a first one (caught as done-ran-again by acquire-done's paths; kept for the inventory)",
    (
        "acquire",
        "if cur[2] and status ~= 'DONE' and status ~= 'ABANDONED' then  -- a finished run: as below",
    ): "the enclosing condition of acquire-handed-off-record and acquire-copy-from-before-handoff",
    ("cancel", "if status == 'DONE' and cur[2] == ARGV[1] and cur[3] then"): "a cancel asked again "
    "(a lost reply): the machine never repeats a call (test_lost_replies.py)",
    ("fenced_write", "if current > token then"): "the user's own fenced writes, not the lease protocol "
    "(tests/unit/test_fencing.py)",
    ("forget", "if not token then"): "a result without a fence: a parse, not a guard",
    ("release", "if target == 'RETRYING' and (ARGV[10] or '') ~= '' then"): "an optional argument, not a token",
    ("renew", "elseif status == 'HANDED_OFF' and cur[2] == token then"): "which refusal code: 'finished' or "
    "'stale-token', both refusals",
    ("renew", "elseif status == 'DONE' and cur[2] ~= token and not cur[5] then"): "mutated as "
    "renew-finished-by-another",
    ("fenced_write", "if fence_px == 0 or fence_ttl == -1 then"): "the user's own fenced writes",
    ("fenced_write", "elseif fence_ttl > fence_px then"): "the user's own fenced writes",
    ("renew", "elseif cur[2] ~= token then"): "the ownerId check after it refuses every other token too",
    ("restore", "if cur[1] == ARGV[1] and cur[2] == ARGV[2] and cur[3] == 'RUNNING' then"): "a restore asked "
    "again (a lost reply): the machine never repeats a call (test_lost_replies.py)",
    ("restore", "if fence == ARGV[2] then"): "which refusal code: 'finished' or 'stale-token', both refusals",
    ("restore", "if (ARGV[13] or '') ~= '' then"): "an optional argument, not a comparison",
    ("store", "if status == 'DONE' and token ~= '' and cur[2] == token"): "a write asked again (a lost "
    "reply): the same meta, so the same token (test_lost_replies.py)",
    ("release", "if (ARGV[10] or '') ~= '' then"): "an optional argument (the recorded replacement), not a token",
    ("store", "if fence then"): "the enclosing condition of the no-lease fence checks (mutated one by one)",
    ("store", "if token ~= '' and fence == token and old == meta then"): "a write asked again: the same meta",
    ("store", "if token ~= '' then"): "tokenless or not: the two kinds of write",
    (
        "store",
        "if token == '' and ARGV[9] == '2' and kind == 'ready' and (status == 'RUNNING' or status == "
        "'STALLED' or status == 'LAPSED') then",
    ): "a tokenless put-back write",
    (
        "store",
        "if token ~= '' and string.sub(meta, -#tail) == tail and string.find(meta, '\"fence_run\": "
        "\"', -(#tail + 100), true) then",
    ): "compact result or tombstone: both refuse a late write",
    ("take_tokens", "if not in_token_epoch(KEYS[2]) then"): "the epoch check: test_tokens.py",
    (
        "trace_context",
        "if held[1] ~= ARGV[1] or (held[2] ~= 'RUNNING' and held[2] ~= 'STALLED') then",
    ): "the trace context, not the protocol",
    ("claim", "if h[1] ~= 'worker-lost' or h[4] == '1' then"): "mutated as claim-handoff-sent",
    (
        "replacement_sent",
        "local mine = not refusal and status == 'HANDED_OFF' and r[2] == ARGV[2]",
    ): "mutated as replacement-sent-record",
    ("hand_back", "if status ~= 'HANDED_OFF' or record[1] ~= ARGV[2] then"): "mutated as hand-back-record",
    ("replacement_sent", "if refusal == 'not-owner' and r[1] == 'RESERVED' and r[2] == ARGV[2] then"): "which "
    "answer: 'finished' or 'not-owner', both tell the owner no hand-off of its token waits (it only logs it)",
}

#: A guard that compares tokens: an ``if``/``elseif`` (or a ``local mine``) naming a token,
#: a fence, or a field or argument that holds one.
_TOKEN_GUARD = re.compile(
    r"^\s*(if|elseif|local mine)\b.*(token|fence|held\b|handed_by|cur\[2\]|h\[1\]|record\[1\]|r\[2\]|"
    r"ARGV\[2\]|ARGV\[10\]|ARGV\[13\]|ARGV\[at \+ 5\])"
)


def token_guards() -> set[tuple[str, str]]:
    """Every token guard of every script (and of the shared library), as (script, line)."""
    found = set()
    for name in (*scripts.SCRIPT_NAMES, "_lib"):
        source = scripts._read(name) if name == "_lib" else scripts.script_header(name)
        for line in source.splitlines():
            if _TOKEN_GUARD.match(line) and not line.lstrip().startswith("--"):
                found.add((name, line.strip()))
    return found


def test_every_token_guard_is_listed() -> None:
    mutated = {(m.script, line.strip()) for m in MUTANTS for line in m.guard.splitlines()[:1]}
    unlisted = sorted(guard for guard in token_guards() if guard not in mutated and guard not in UNMUTATED)
    assert not unlisted, f"token guards with neither a mutant nor a reason: {unlisted}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_mutant_is_found_in_the_source(mutant: Mutant) -> None:
    assert scripts.script_header(mutant.script).count(mutant.guard) == 1, mutant.guard


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_real_scripts_keep_the_contract_on_the_mutants_path(mutant: Mutant, model_client: redis.Redis) -> None:
    """Without this, a sequence that breaks a rule on the real scripts would "catch" anything."""
    run_sequence(mutant.machine, model_client, list(mutant.steps), tolerate=mutant.tolerate)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_model_catches_the_mutant(
    mutant: Mutant, model_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = scripts.script_source

    def mutated(name: str) -> str:
        source = original(name)
        return source.replace(mutant.guard, mutant.disabled) if name == mutant.script else source

    monkeypatch.setattr(scripts, "script_source", mutated)
    with pytest.raises(Violation):
        run_sequence(mutant.machine, model_client, list(mutant.steps), tolerate=mutant.tolerate)
