"""The fencing token counter: tokens that only grow, across restarts, flushes and failovers.

Every token comes from one counter in Redis (``<prefix>:token``), taken by a script together
with the change it fences (``acquire.lua``), or reserved ahead (``take_tokens.lua``: the
reaper's abandons, the cancel command). Replication is asynchronous, so a promoted replica or
a restarted server may hold a counter that moved back, or none at all, and a FLUSHDB deletes
it. Each server therefore hands out tokens in an *epoch* of its own (``<prefix>:token:epoch``
names the server by its replication id): a script that hands out tokens on a server whose
epoch has not begun (another server's id, or no key) answers ``"new-epoch"``, and
:meth:`TokenCounter.hand_out` begins it (``begin_epoch.lua``: the counter moves on to at least
the server's clock in microseconds, the replicas are waited for, ``confirm_epoch.lua``) and
asks again. Tokens are handed out far slower than one a microsecond, so the clock is past
every token handed out before, as long as it did not step back (``docs/guarantees.rst``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..exceptions import LeaseScriptError
from .gateway import ScriptSet
from .keys import KeySpace
from .state import BeginEpochOutcome, ConfirmEpochOutcome, outcome

__all__ = ["EPOCH_WAIT_MS", "TokenCounter"]

logger = logging.getLogger("celery_fenced.tokens")

#: How long a server beginning its token epoch waits for its replicas to take the move, ms.
EPOCH_WAIT_MS = 2000

#: How often a call that hands out tokens begins the epoch before it gives up (each a failover).
_EPOCH_TRIES = 3

#: What a script that hands out tokens answers on a server whose token epoch has not begun.
_NEW_EPOCH = b"new-epoch"


class TokenCounter:
    """The token counter of one key space, on the lease store's client and scripts."""

    def __init__(self, client: Any, scripts: ScriptSet, keys: KeySpace) -> None:
        self.client = client
        self.scripts = scripts
        self.keys = keys

    def hand_out(self, run_script: Callable[[], Any]) -> Any:
        """Run ``run_script`` (a script that hands out tokens); where it answers ``"new-epoch"``
        (a server that hands out tokens for the first time: a promoted replica, a restart),
        begin the epoch there and run it again."""
        for _ in range(_EPOCH_TRIES):
            reply = run_script()
            if reply != _NEW_EPOCH and reply != "new-epoch":
                return reply
            self.begin_epoch()
        raise LeaseScriptError(f"the token epoch changed {_EPOCH_TRIES} times in a row (failovers under way)")

    def begin_epoch(self) -> None:
        """Move the token counter past every token handed out before (to at least the server's
        clock, in microseconds), wait for the replicas to take the move, and confirm the epoch
        (``begin_epoch.lua``)."""
        # One connection: WAIT waits for the writes made on its own connection.
        with self.client.client() as one:
            code, replicas = self.scripts.begin_epoch(keys=[self.keys.token, self.keys.token_epoch], client=one)
            begun = outcome(BeginEpochOutcome, "begin_epoch", code)
            if begun == BeginEpochOutcome.CURRENT:
                return
            replicas = int(replicas)
            if replicas:
                acked = int(one.execute_command("WAIT", replicas, EPOCH_WAIT_MS))
                if acked < replicas:
                    logger.warning(
                        "a new token epoch reached %d of %d replicas within %d ms: were this server to fail "
                        "over before they catch up, tokens it hands out could be handed out again",
                        acked,
                        replicas,
                        EPOCH_WAIT_MS,
                    )
            (code,) = self.scripts.confirm_epoch(keys=[self.keys.token_epoch], client=one)
        if outcome(ConfirmEpochOutcome, "confirm_epoch", code) == ConfirmEpochOutcome.OTHER:
            return  # another failover: the caller's next call begins that server's epoch
        if begun == BeginEpochOutcome.MOVED:
            logger.warning(
                "a Redis server that did not hand out the last fencing tokens (a promoted replica, a restart) "
                "hands them out now: they moved on to its clock, past any the previous one handed out"
            )

    def reserve(self, count: int) -> int:
        """Reserve ``count`` fresh tokens; returns the first (they run up from it)."""
        if count <= 0:
            raise ValueError(f"count must be positive, got {count!r}")
        keys = [self.keys.token, self.keys.token_epoch]
        last = int(self.hand_out(lambda: self.scripts.take_tokens(keys=keys, args=[count])))
        return last - count + 1
