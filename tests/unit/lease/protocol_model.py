"""The reference model of the lease protocol (DESIGN.md §3–§4), for test_protocol_model.py.

The model keeps, per task id, what the contract says Redis must know (:class:`TaskModel`),
and per owner what that execution knows of its own lease (:class:`Owner`). Each step of the
state machine hands the model the real script's answer; the model says whether the contract
lets the step answer that, and follows what happened.

Every broken rule is a :class:`Violation` named by the invariant it breaks (its own exception
class, so hypothesis tells the rules apart and shrinks each on its own):

The model has two parts. :class:`TaskModel` is what the contract says Redis knows of a task;
FLUSHDB starts it afresh, and it says what each script may answer. :class:`TaskTruth` is what
happened, which no loss of the store's data takes back: the newest owner of each task, every
token handed out, and what each owner got through. The rules named ``(truth)`` below are
judged by it, also after data loss, and every invariant compares what Redis holds with it.

``token-not-increasing`` (truth)
    every token handed out (acquire, the reaper's claim, a cancel) is above every earlier one,
    also after FLUSHDB, a lost counter and a failover (§3).
``stale-write-landed``, ``stale-release-landed``, ``stale-handoff`` (truth)
    an effect (a result stored, an end, a hand-off) of an owner older than the task's newest
    owner gets through, whatever Redis still knows (§4.10: the higher token wins).
``effect-without-lease`` (truth)
    an owner whose lease was lost with the store's data (FLUSHDB, an evicted or expired key)
    stores, ends or hands off before it put its lease back (§4.10).
``stale-restore``, ``restore-of-expired-lease`` (truth)
    an owner puts back a lease although a newer owner exists, or although its own clock saw
    its lease run out (its last renewal a TTL or more ago).
``live-lease-not-newest`` (truth, invariant)
    Redis holds a live lease of an owner that is not the task's newest.
``stale-result-stored``, ``result-fence-went-back`` (truth, invariant)
    the result Redis holds became an owner's older than the newest, or a fenced result was
    replaced by one with a lower fence.

The rules below are judged by what Redis should know (not while a key of the task was lost
alone: the model then no longer knows exactly what Redis holds, until the next FLUSHDB).

``two-writers``
    a delivery runs while another owner holds a live lease of the task id (one writer at a time).
``stale-write-landed``, ``stale-release-landed``, ``stale-handoff``
    a write, an end or a hand-off by a token older than the newest handed out for the task lands.
``done-ran-again``, ``forgotten-done-ran-again``, ``abandoned-ran``
    a finished task is acquired again while its fence exists; ``forget()`` removes the result,
    not the fact that the task is done (§4.5).
``stale-hand-back``
    a hand-back (the replacement could not be sent) lands on a record that is not the owner's
    own hand-off, untouched since.
``copy-after-handoff-ran``
    a copy of the message a hand-off replaced runs (§4.5: the hand-off's record refuses it).
``write-after-final``, ``write-after-forget``, ``write-after-handoff``, ``final-undone``
    DONE, cancelled and ABANDONED are final (but for redrive of ABANDONED), and a finished
    hand-off refuses the handing token.
``missing-handoff-succeeded``
    a missing lease is never a successful hand-off (§4.5).
``foreign-send-said``
    an owner's word that it sent its replacement lands on a record that is not its own
    hand-off's (a hand-off whose replacement was never sent would then wait for ever).
``stale-restore``, ``restore-over-state``, ``restore-after-forget``
    an owner puts back a vanished lease only while it still held it live, with the newest token.
``model-mismatch``
    an answer the model does not allow that breaks none of the above (a lost task, a refused
    current owner): read the message, then fix the scripts or the model.

When a fix changes what a step may answer (a hand-off record, a forget that keeps the fence),
the rule to change is the one method of :class:`ProtocolModel` named after the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from celery_fenced._lease.state import ProgressReport, RenewRequest, as_text

__all__ = [
    "MAX_TAKEOVERS",
    "TASK_IDS",
    "WORKERS",
    "Owner",
    "ProtocolModel",
    "TaskModel",
    "TaskTruth",
    "Violation",
    "Violations",
]

#: The task ids the machine plays with: one task and another, whose tokens interleave.
TASK_IDS = ("t1", "t2")

#: The workers (one start of each: "<hostname>/<pid>/<start>") the owners' processes belong to.
WORKERS = ("wa/1/start", "wb/1/start")

#: ``max_takeovers`` of every delivery: small, so that abandons happen.
MAX_TAKEOVERS = 1

# The lease statuses the model tells apart (HANDED_OFF: a hand-off finished, its record kept).
NONE = "NONE"
RUNNING = "RUNNING"
LAPSED = "LAPSED"
REQUEUED = "REQUEUED"
RETRYING = "RETRYING"
DONE = "DONE"
ABANDONED = "ABANDONED"
HANDED_OFF = "HANDED_OFF"
#: A worker received the task's message and no process started it yet (reserve.lua).
RESERVED = "RESERVED"

#: Statuses with a lease that an owner's token still fences (a late write of its owner lands;
#: RESERVED: only one made of a REQUEUED lease keeps an owner, its holder).
HELD = (RUNNING, LAPSED, REQUEUED, RETRYING, RESERVED)

#: Final statuses (ABANDONED until a redrive).
FINAL = (DONE, ABANDONED)

#: The READY states an owner stores (each ends its lease; its meta carries the fence).
READY = ("SUCCESS", "FAILURE", "REVOKED")

#: Lease statuses an owner's token holds in Redis (what a loss of the hash takes from it).
HELD_IN_REDIS = ("RUNNING", "STALLED", "LAPSED", "REQUEUED", "RETRYING", "RESERVED")


class Violation(AssertionError):
    """A rule of the contract broken by the real scripts (or a gap in the model)."""

    name = "violation"


_CLASSES: dict[str, type[Violation]] = {}


def violation_class(name: str) -> type[Violation]:
    """One exception class per rule, so that hypothesis reports each rule's shortest case."""
    if name not in _CLASSES:
        title = "".join(part.capitalize() for part in name.split("-"))
        _CLASSES[name] = type(title, (Violation,), {"name": name})
    return _CLASSES[name]


class Violations:
    """Raises each broken rule, except those tolerated (``FENCED_MODEL_TOLERATE``: a run that
    goes on past known holes to find the next one); tolerated ones are kept in :attr:`seen`."""

    def __init__(self, tolerated: str = "") -> None:
        self.tolerated = {name.strip() for name in tolerated.split(",") if name.strip()}
        self.seen: list[str] = []
        #: The step is about a task whose Redis state the model no longer knows exactly (a key
        #: of it was evicted or expired): what the model expects Redis to answer is not judged
        #: until the next FLUSHDB makes it known again; the truth is judged all the same.
        self.muted = False

    def __call__(self, name: str, message: str) -> None:
        """A rule judged by what the model expects Redis to know."""
        if self.muted:
            self.seen.append(f"unjudged:{name}")
            return
        self.truth(name, message)

    def truth(self, name: str, message: str) -> None:
        """A rule judged by the truth (what happened, which the store may lose): always."""
        if name in self.tolerated or "token-not-increasing" in self.seen:
            # Once a token was handed out twice, owners share a token and every later
            # answer may follow from it: a run tolerating it checks nothing more.
            self.seen.append(name)
            return
        raise violation_class(name)(f"[{name}] {message}")


@dataclass(eq=False)
class Owner:
    """One execution that acquired a task's lease, and what it knows of it."""

    task_id: str
    owner_id: str
    process: str  # "<hostname>/<pid>/": the owner-id prefix of its process
    message: str  # the model's name of its message: the original, or the n-th replacement
    publish_id: str  # the publish id its message carries (a replacement keeps the replaced one's)
    handed_off_by: str = ""  # its message's fenced_handed_off_by header ("" for none)
    token: int = 0
    attempt: int = 0
    takeovers: int = 0
    worker: str = ""  # the worker (one start of it) its process belongs to
    believes_live: bool = True  # its heartbeat has not been told the lease is lost
    expired: bool = False  # its lease ran out (the owner's clock knows that too)
    #: its lease (held, given up or waiting) was lost with the store's data, and it has not
    #: put it back since (restore.lua): §4.10, it stores, sends and hands off nothing
    lease_gone: bool = False

    def __repr__(self) -> str:
        return f"Owner({self.owner_id} {self.task_id} token={self.token} message={self.message})"

    def renew_request(self, ttl_ms: int) -> RenewRequest:
        return RenewRequest(self.task_id, self.owner_id, self.token, ttl_ms, ProgressReport())

    def meta(self, state: str) -> str:
        """The meta the fenced backend writes: a READY one carries the finished lease's fence."""
        head = f'{{"status": "{state}", "result": null, "task_id": "{self.task_id}"'
        if state in READY:
            run = f"{self.publish_id}/{self.attempt}/{self.takeovers}"
            return f'{head}, "fence_run": "{run}", "fence_token": {self.token}}}'
        return f'{head}, "fence_token": {self.token}}}'


@dataclass
class TaskModel:
    """What the contract says Redis knows of one task id."""

    publishes: list[str]  # the messages sent for it: the original, then each replacement
    status: str = NONE
    fence: int = 0  # the newest token handed out for it that Redis must remember (0: none)
    holder: Owner | None = None  # the owner whose token is the fence
    expired: bool = False  # RUNNING past its expiry (the reaper may claim it)
    due: bool = False  # REQUEUED or RETRYING past its due time
    takeovers: int = 0
    result: bool = False  # a result key exists
    forgotten: bool = False  # finished, and its result deleted by forget()
    ended_by: Owner | None = None  # the owner whose SUCCESS finished it (it may ask again)
    handed_off: set[str] = field(default_factory=set)  # publishes a hand-off replaced
    headers: dict[str, str] = field(default_factory=dict)  # a replacement's publish: the token it names
    handoff_token: int = 0  # the handoffToken the lease keeps: its record's, or its replacement run's
    done_publish: str = ""  # DONE: the newest message whose copies do not run ("": every one)
    unrecorded: set[str] = field(default_factory=set)  # publishes sent before FLUSHDB
    #: HANDED_OFF: what the hand-off changed, for a hand-back (the replaced messages, the
    #: lease's hand-off token before it)
    before_handoff: tuple[set[str], int] = (set(), 0)
    #: HANDED_OFF: the process that handed off was lost (a WorkerLostError of it) before it
    #: said it sent the replacement: the replacement may never have been sent, and once due
    #: the reaper undoes the hand-off
    lost_handoff: bool = False
    #: HANDED_OFF: its owner said it sent the replacement: whatever becomes of the owner, the
    #: record waits for the replacement
    sent: bool = False
    #: its last hand-off is filed under its owner's worker, for that worker's lapse to find
    filed: bool = False
    #: HANDED_OFF: the owner that handed off (its id and token stay in the record: once the
    #: reaper undoes a lost hand-off, the lease is that owner's again, as a claimed one is)
    handed_off_owner: Owner | None = None
    #: the worker its last hand-off is filed under
    filed_worker: str = ""
    #: the owner that ended it with a READY result, and that result's state
    ended_state: str = ""
    #: its lease's expiry (or lapse) is past the reaper's takeover grace too
    past_grace: bool = False
    #: LAPSED by an owner's write-back of its vanished lease: due only once time passes
    waits_ttl: bool = False
    #: its hand-off recorded the replacement (handoffCall): the reaper sends it again
    recorded: bool = False
    #: HANDED_OFF and recorded: the reaper's re-sends of the replacement so far
    resends: int = 0
    #: DONE by a cancel (its lease keeps cancelledAt)
    cancelled: bool = False
    #: a key of it was evicted or expired: the model no longer knows exactly what Redis holds
    #: (until FLUSHDB); see :attr:`Violations.muted`
    uncertain: bool = False
    #: RESERVED: the worker (one start of it) that holds the reservation
    reserved_by: str = ""
    #: the workers whose set of reservations (for lapse_worker.lua) names its lease
    reservation_filed: set[str] = field(default_factory=set)

    def publish_of(self, message: str) -> str:
        """The publish id a message carries: a replacement keeps the replaced run's
        (``mark_replacement``), so every message of the model's task ids shares one."""
        return self.publishes[0]

    def runs_again(self, message: str) -> bool:
        """A DONE task's delivery of another publish than the one it finished: one sent after
        it (a replacement of a run that ended after FLUSHDB lost the hand-off's record), or
        one whose hand-off FLUSHDB forgot (to Redis, the task id applied again)."""
        if not self.done_publish or self.publish_of(message) == self.publish_of(self.done_publish):
            return False
        later = self.publishes.index(message) > self.publishes.index(self.done_publish)
        return later or message in self.unrecorded

    def fresh(self) -> TaskModel:
        """The task after FLUSHDB: Redis knows nothing of it; its messages still exist."""
        return TaskModel(publishes=list(self.publishes), headers=dict(self.headers), unrecorded=set(self.publishes))


@dataclass
class TaskTruth:
    """What happened to one task id, which no loss of the store's data takes back: the owner
    with the newest token that ran (acquired, or put its lease back), and what each owner
    got through (results stored, ends, hand-offs), in order."""

    newest: Owner | None = None
    sent: list[str] = field(default_factory=list)
    #: the last value of the result key the invariants saw, and its fence (0: none)
    seen_result: bytes | None = None
    seen_fence: int = 0


_FENCE_TOKEN = re.compile(rb'"fence_token": (\d+)')


def fence_token_of(result: bytes | None) -> int:
    """The ``fence_token`` a stored result carries (0: none, or no result)."""
    found = _FENCE_TOKEN.search(result) if result is not None else None
    return int(found.group(1)) if found else 0


class ProtocolModel:
    """The model of every task id, the tokens handed out and the owners.

    Two parts: :attr:`tasks`, what the contract says Redis knows (lost with its data: FLUSHDB
    starts it afresh), which says what each script may answer; and :attr:`truth`, what
    happened (never lost), which says whose effects may land at all and what Redis may hold.
    """

    def __init__(self, violated: Violations) -> None:
        self.violated = violated
        self.tasks = {task_id: TaskModel(publishes=[f"{task_id}-p0"]) for task_id in TASK_IDS}
        self.truth = {task_id: TaskTruth() for task_id in TASK_IDS}
        self.owners: list[Owner] = []
        self.max_token = 0  # the highest token handed out so far

    def task(self, task_id: str) -> TaskModel:
        """The task a step is about; what the model expects of it is judged only while the
        model knows its Redis state exactly."""
        task = self.tasks[task_id]
        self.violated.muted = task.uncertain
        return task

    # -- the truth -----------------------------------------------------------------------

    def landed(self, owner: Owner, what: str, stale_rule: str) -> None:
        """An effect of ``owner`` got through (a result stored, an end, a hand-off). Only the
        task's newest owner's may (the higher token wins), and only while it holds its lease:
        once the lease was lost with the store's data, not until it put it back (§4.10)."""
        truth = self.truth[owner.task_id]
        truth.sent.append(f"{owner.owner_id}/{owner.token}: {what}")
        newest = truth.newest
        if newest is not None and owner.token < newest.token:
            self.violated.truth(
                stale_rule,
                f"{owner!r}'s {what} got through, but {newest!r} is the task's newest owner "
                f"(what got through so far: {truth.sent})",
            )
        elif owner.lease_gone:
            self.violated.truth(
                "effect-without-lease",
                f"{owner!r}'s {what} got through after its lease was lost with the store's data, "
                f"before it put it back (what got through so far: {truth.sent})",
            )

    def lease_lost(self, task_id: str, fields: dict[str, str], whole: bool) -> None:
        """The lease hash of ``task_id`` (``fields``, read just before) was lost: with the
        whole database (``whole``: the model of Redis starts afresh) or alone (evicted,
        expired: the model no longer knows exactly what Redis holds of the task)."""
        if fields.get("status") in HELD_IN_REDIS:
            for owner in self.owners:
                held = (fields.get("ownerId"), fields.get("ownerToken")) == (owner.owner_id, str(owner.token))
                if owner.task_id == task_id and held:
                    owner.lease_gone = True
        if not whole:
            self.tasks[task_id].uncertain = True

    def result_lost(self, task_id: str) -> None:
        """The result key of ``task_id`` alone was lost (evicted, expired)."""
        self.tasks[task_id].uncertain = True

    # -- deliveries ---------------------------------------------------------------------

    def publish_to_deliver(self, task_id: str, replacement: bool) -> str:
        """A copy of the original message, or of the newest replacement."""
        publishes = self.tasks[task_id].publishes
        return publishes[-1] if replacement else publishes[0]

    def handed_off_by(self, task_id: str, message: str) -> str:
        """The header a message carries: the token of the hand-off that sent it ("": none)."""
        return self.tasks[task_id].headers.get(message, "")

    def new_owner(self, task_id: str, message: str, worker: str = WORKERS[0]) -> Owner:
        n = len(self.owners) + 1
        process = f"{worker.split('/')[0]}/{1000 + n}/"  # its own pid on its worker's host
        task = self.task(task_id)
        header = self.handed_off_by(task_id, message)
        owner = Owner(task_id, f"{process}a{n}", process, message, task.publish_of(message), header, worker=worker)
        self.owners.append(owner)
        return owner

    def hand_out(self, token: int, by: str) -> None:
        if token <= self.max_token:
            self.violated.truth("token-not-increasing", f"{by} handed out token {token}, not above {self.max_token}")
        self.max_token = max(self.max_token, token)

    def received(self, task_id: str, message: str, worker: str, code: str) -> None:
        """A worker received a copy of ``message`` and no process started it yet: a reservation
        stands for it where no lease does, or for a message the reaper re-sent (REQUEUED), or
        a copy received again (RESERVED); a replacement's after its hand-off (the message names
        the record's token). Anything else is left alone: a live or given-up owner's lease, a
        retry's, a finished task, a copy of a message a hand-off replaced."""
        task = self.task(task_id)
        header = self.handed_off_by(task_id, message)
        if task.handoff_token and task.status not in FINAL and header != str(task.handoff_token):
            expected = "left"  # a copy from before the hand-off
        elif task.status in (NONE, RESERVED, REQUEUED, HANDED_OFF):
            expected = "reserved"
        else:
            expected = "left"
        if code != expected:
            self.violated(
                "model-mismatch",
                f"{worker} received {message} of {task_id}: {code}, expected {expected} ({task.status})",
            )
        if code != "reserved":
            return
        if task.status == HANDED_OFF:
            # The replacement's reservation: the record's waiting for it ends (its hand-off
            # token stays on the lease, for the replacement's start and its copies).
            task.lost_handoff = task.sent = task.recorded = False
            task.resends, task.holder = 0, None
        task.status, task.reserved_by, task.due, task.expired = RESERVED, worker, False, False
        task.reservation_filed.add(worker)

    def acquired(self, owner: Owner, code: str, token: int, attempt: int, takeovers: int) -> None:
        task = self.task(owner.task_id)
        runs = code in ("new", "takeover")
        if task.status == RUNNING and not task.expired:
            expected = "duplicate"
        elif task.status in HELD or task.status == NONE:
            expected = "runs"
        elif task.status == DONE:
            expected = "runs" if task.runs_again(owner.message) else "done"
        elif task.status == ABANDONED:
            expected = "abandoned"
        else:  # HANDED_OFF: only the replacement's message (it names the record's token) runs
            expected = "runs" if owner.handed_off_by == str(task.handoff_token) else "handed-off"
        if task.handoff_token and task.status not in FINAL and owner.handed_off_by != str(task.handoff_token):
            # The lease keeps the hand-off's token (its record, or the replacement's run): a
            # message that does not name it is a copy from before the hand-off.
            expected = "handed-off"
        where = f"{owner!r} acquired {code} token {token} while the task was {task.status}"
        if runs:
            self.hand_out(token, f"acquire of {owner!r}")
            self.truth[owner.task_id].newest = owner
            if expected == "duplicate":
                self.violated("two-writers", f"{where}, held live by {task.holder!r}")
            elif expected == "done":
                if owner.message in task.handed_off:
                    rule = "copy-after-handoff-ran"
                else:
                    rule = "forgotten-done-ran-again" if task.forgotten else "done-ran-again"
                self.violated(rule, where)
            elif expected == "abandoned":
                self.violated("abandoned-ran", where)
            elif expected == "handed-off":
                self.violated("copy-after-handoff-ran", f"{where}: a copy of a message a hand-off replaced")
            owner.token, owner.attempt, owner.takeovers = token, attempt, takeovers
            task.status, task.fence, task.holder = RUNNING, token, owner
            task.expired = task.due = task.forgotten = task.past_grace = False
            task.takeovers, task.ended_by, task.done_publish = takeovers, None, ""
            task.cancelled = task.waits_ttl = False
            if task.status == NONE:  # a lease written anew: no hand-off's token on it
                task.handoff_token = 0
        else:
            if expected == "runs":
                self.violated("model-mismatch", f"{where}: the delivery should have run")
            elif code != expected:
                self.violated("model-mismatch", f"{where}: expected {expected}")

    # -- the owner's lease --------------------------------------------------------------

    def current(self, owner: Owner) -> bool:
        """The owner's token is the task's newest and fences the lease Redis holds."""
        task = self.task(owner.task_id)
        return task.holder is owner and task.fence == owner.token and task.status in HELD

    def renewed(self, owner: Owner, code: str) -> None:
        task = self.task(owner.task_id)
        may = self.current(owner) and task.status == RUNNING
        if code == "ok":
            if not may:
                self.violated("two-writers", f"{owner!r} renewed a lease it does not hold ({task.status})")
            task.status, task.expired, task.past_grace = RUNNING, False, False
            owner.expired, owner.believes_live = False, True
        else:
            if may:
                self.violated("model-mismatch", f"{owner!r}, the live owner, was refused a renewal: {code}")
            elif task.status in HELD and owner.token < task.fence and code != "stale-token":
                # A newer owner's lease: stale ("missing" would make it write its own back).
                self.violated("model-mismatch", f"{owner!r} renewal over a newer token's lease answered {code}")
            elif task.status in HELD and owner.token > task.fence and code != "missing":
                # An older token's lease, written back where this owner's was (the store lost
                # this one's): not this owner's refusal. "missing": it writes its own in place.
                self.violated("model-mismatch", f"{owner!r} renewal over an older token's lease answered {code}")
            elif task.status == DONE:
                # Ended by a cancel, by this owner, or by a newer one (its lease lives on in the
                # result, or as a tombstone): each its own answer.
                if task.cancelled:
                    expected = {"cancelled"}
                elif owner.token == task.fence:
                    expected = {"missing", "finished"}
                else:
                    expected = {"missing", "stale-token"}
                if code not in expected:
                    self.violated(
                        "model-mismatch", f"{owner!r} renewal of a DONE task answered {code}, expected {expected}"
                    )
            if code != "missing":  # a missing lease: the heartbeat puts it back (restore)
                owner.believes_live = False

    def stalled(self, owner: Owner, code: str, release: bool) -> None:
        task = self.task(owner.task_id)
        may = self.current(owner) and task.status == RUNNING
        if (code == "ok") != may:
            self.violated("model-mismatch", f"{owner!r} lapse answered {code} on {task.status}")
        if code == "ok" and release:
            task.status, task.past_grace = LAPSED, False
            owner.believes_live = False
        elif code not in ("ok", "missing"):
            owner.believes_live = False

    def process_lost(self, owner: Owner, code: str, retried: bool = False) -> None:
        """The worker's main process gives up the lease of a process it lost, whose message
        Celery puts back (``task_acks_late``, ``task_reject_on_worker_lost``): only a live
        lease that process owns. ``retried``: Celery sends a retry instead, and the lease waits
        for it (RETRYING, not due until its time passes)."""
        task = self.task(owner.task_id)
        if task.status == RUNNING and task.holder is owner:
            expected = {"retrying" if retried else "lapsed"}
        elif task.status == NONE:
            expected = {"missing", "not-live"}  # no lease (a finished one lives in its result)
        else:
            expected = {"not-live", "missing"} if task.status in FINAL else {"not-live"}
        if code not in expected:
            self.violated("model-mismatch", f"{owner!r}'s process lost: lapse answered {code} on {task.status}")
        if code == "lapsed":
            task.status, task.past_grace = LAPSED, False
            owner.believes_live = False
        elif code == "retrying":
            task.status, task.due = RETRYING, False
            owner.believes_live = False

    def time_passed(self, task_id: str, past_grace: bool = False) -> None:
        task = self.task(task_id)
        task.past_grace = past_grace  # the machine wrote the expiry back: past the grace or not
        task.waits_ttl = False
        if task.status == RUNNING:
            task.expired = True
        elif task.status in (REQUEUED, RETRYING, RESERVED) or (task.status == HANDED_OFF and task.lost_handoff):
            task.due = True
        elif task.status == HANDED_OFF and task.recorded and task.sent:
            task.due = True  # said sent: the reaper looks whether the replacement started
        for owner in self.owners:
            if owner.task_id == task_id and owner.believes_live:
                owner.expired = True

    def restored(self, owner: Owner, code: str, lapsed: bool = False) -> None:
        """An owner puts back its vanished lease: RUNNING only while it cannot have expired;
        ``lapsed`` (its own clock gave it up), LAPSED for the reaper, whatever its age."""
        task = self.task(owner.task_id)
        where = f"{owner!r} restored its lease (task {task.status}, newest token {task.fence})"
        if code == "restored" and task.holder is owner and task.status == RUNNING:
            # Its own lease is there (it asks again: a lost reply), or was written back after
            # the hash alone was lost (the model does not follow a lone eviction): its lease.
            owner.lease_gone = False
            return
        if code == "restored":
            newest = self.truth[owner.task_id].newest
            if newest is not None and owner.token < newest.token:
                self.violated.truth("stale-restore", f"{where}: {newest!r} is the task's newest owner")
            elif owner.expired and not lapsed:
                self.violated.truth("restore-of-expired-lease", f"{where} after it had expired")
            elif owner.token < task.fence:
                self.violated("stale-restore", where)
            elif task.status in FINAL and task.forgotten:
                self.violated("restore-after-forget", where)
            elif task.status != NONE and not (task.status in HELD and not lapsed and owner.token > task.fence):
                # An older token's lease, or a copy's reservation, where this owner's was
                # (written after the store lost this owner's): the newer token wins, and writes
                # its own in its place.
                self.violated("restore-over-state", where)
            elif owner.expired and not lapsed:
                self.violated("restore-of-expired-lease", f"{where} after it had expired")
            # Written back with its run's hand-off token (the one its message names, if any).
            task.status, task.fence, task.holder = RUNNING, owner.token, owner
            task.handoff_token = int(owner.handed_off_by or 0)
            task.takeovers = owner.takeovers  # written back with the owner's counts
            task.expired = task.due = owner.expired = task.past_grace = owner.lease_gone = False
            task.waits_ttl = False
            if lapsed:
                # Given up, due a TTL from now: a newer owner whose lease vanished with it
                # writes its own back first. A placeholder for the reaper, not the owner's
                # lease back: the owner stores, ends and hands off nothing on it (§4.10).
                task.status, owner.believes_live, task.waits_ttl = LAPSED, False, True
                owner.lease_gone = True
        elif code == "expired" and (lapsed or not owner.expired):
            self.violated("model-mismatch", f"{where}: expired, for an owner that renewed less than a TTL ago")
        elif task.status == NONE and (lapsed or not owner.expired) and owner.token >= task.fence and not task.result:
            self.violated("model-mismatch", f"{owner!r} restore answered {code} for a vanished lease")
        if code != "restored" and not (code == "expired" and not lapsed):
            # Refused: the owner is told it lost (its heartbeat, or its write's take-back); an
            # expired one writes its lease back given up next (the machine's tick asks that).
            owner.believes_live = False

    # -- writes and ends ----------------------------------------------------------------

    def wrote(self, owner: Owner, state: str, code: str) -> None:
        task = self.task(owner.task_id)
        stored = code == "stored"
        where = f"{owner!r} {state} write answered {code} (task {task.status}, newest token {task.fence})"
        asks_again = task.status == DONE and task.ended_by is owner and state == task.ended_state
        if stored and not asks_again:
            self.landed(owner, f"{state} write", "stale-write-landed")
        if stored:
            task.result = True
            if owner.token < task.fence:
                return self.violated("stale-write-landed", where)
            elif task.status in FINAL and task.forgotten and not asks_again:
                return self.violated("write-after-forget", where)
            elif task.status in FINAL and not asks_again:
                return self.violated("write-after-final", where)
            elif task.status == HANDED_OFF:
                return self.violated("write-after-handoff", where)
            elif task.handed_off_owner is owner and task.handoff_token == owner.token:
                # Its hand-off stands (the replacement's reservation or run took the record's
                # place): the owner that handed off owns nothing of the task any more.
                return self.violated("write-after-handoff", f"{where}, after its hand-off")
        elif self.current(owner) and code == "missing" and owner.lease_gone:
            pass  # its own lease written back given up after the store lost it: nothing stored
        elif self.current(owner) and code != "sticky":  # sticky: Celery's rule kept a stored SUCCESS
            self.violated("model-mismatch", f"{where}: the current owner's write was refused")
        elif task.status in HELD and owner.token > task.fence and code != "missing":
            # An older token's lease, or a copy's reservation, where this owner's was (the store
            # lost this one's): not this owner's refusal. "missing": it writes its own back first.
            self.violated("model-mismatch", f"{where}: expected missing (an older token's lease in its place)")
        elif task.status in FINAL and owner.token < task.fence and code != "stale":
            # A newer token ended it (its result's fence, its tombstone): an older owner's
            # write is stale, which the owner reads as taken over ("missing" would make it
            # write its lease back first).
            self.violated("model-mismatch", f"{where}: expected stale (a newer token finished it)")
        if code == "sticky" and state in READY and self.current(owner):
            # A SUCCESS already stored is kept (Celery's rule); the run's lease still ends.
            task.status, task.holder, task.ended_by, task.done_publish = DONE, None, None, owner.message
            owner.believes_live = False
        # A write the contract refuses leaves the model as it was (a run tolerating the
        # violation goes on from what should have been).
        if not stored or asks_again:
            return
        task.result = True
        if state in READY:
            task.status, task.fence, task.holder, task.ended_by = DONE, max(task.fence, owner.token), None, owner
            task.done_publish, task.ended_state = owner.message, state
            task.forgotten = False
            owner.believes_live = False
        elif state == "RETRY":
            owner.believes_live = False
            if task.status in HELD:
                task.status, task.due = RETRYING, False

    def wrote_tokenless(self, owner: Owner, worker_lost: bool, code: str) -> None:
        task = self.task(owner.task_id)
        what = "a WorkerLostError" if worker_lost else "a REVOKED"
        where = f"{what} of {owner!r}'s process answered {code} (task {task.status})"
        if task.status in FINAL:
            if code == "stored":
                self.violated("write-after-forget" if task.forgotten else "write-after-final", where)
            elif code != "finished":
                self.violated("model-mismatch", f"{where}: expected finished")
            return
        if task.status == HANDED_OFF:
            # Only the replacement's own message may write without a token (a replacement
            # that is not a fenced task); the run that handed off is refused. The process
            # that handed off, lost (a WorkerLostError), makes the record due: its replacement
            # may never have been sent.
            handing = owner.token == task.handoff_token and task.holder is None and not task.sent
            if handing and worker_lost:
                if code != "lapsed":
                    self.violated("model-mismatch", f"{where}: expected lapsed (the handing process lost)")
                else:
                    task.lost_handoff, task.due = True, False
                return
            if handing and owner.handed_off_by != str(task.handoff_token):
                # Its process ended by its worker before it said it sent (a terminate, a time
                # limit): the hand-off undone, the write that owner's end.
                if code != "stored":
                    self.violated("model-mismatch", f"{where}: expected stored (the handing process ended)")
                    return
                self.undo_handoff(task)
                task.status, task.holder, task.result, task.ended_by = DONE, None, True, None
                task.done_publish = owner.message
                return
            if owner.handed_off_by != str(task.handoff_token):
                if code == "stored":
                    self.violated("write-after-handoff", where)
                elif code != "foreign":
                    self.violated("model-mismatch", f"{where}: expected foreign")
                return
            if code not in ("stored", "sticky"):
                self.violated("model-mismatch", f"{where}: expected stored (the replacement's)")
            if code == "stored":
                task.status, task.holder, task.result, task.ended_by, task.done_publish = (
                    DONE,
                    None,
                    True,
                    None,
                    owner.message,
                )
            return
        if task.status not in HELD:  # no lease: a write as Celery's own (the contract is silent)
            task.result = task.result or code == "stored"
            return
        by_owner = task.holder is owner
        live = task.status == RUNNING
        if worker_lost:
            expected = "lapsed" if live and by_owner else "foreign"
        else:
            expected = "foreign" if live and not by_owner else "stored"
        if code == "sticky" and expected == "stored":
            code = "stored"  # the fence let it through; Celery's rule kept a stored SUCCESS
        if code != expected:
            self.violated("model-mismatch", f"{where}: expected {expected}")
        if code == "lapsed":
            task.status, task.past_grace = LAPSED, False
            owner.believes_live = False
        elif code == "retrying":
            task.status, task.due = RETRYING, False
            owner.believes_live = False
        elif code == "stored":  # the run holding the lease ends: copies of its publish do not run
            task.done_publish = task.holder.message if task.holder is not None else ""
            task.status, task.holder, task.result, task.ended_by = DONE, None, True, None

    def wrote_put_back(self, owner: Owner, code: str) -> None:
        """A hard time limit's FAILURE from the owner's process, after which Celery puts the
        message back (``task_acks_late``, ``acks_on_timeout`` off): the lease of that process,
        live or given up, is left REQUEUED for the message; otherwise as any tokenless write.
        A hand-off of that process not said sent is undone first."""
        task = self.task(owner.task_id)
        handing = (
            task.status == HANDED_OFF
            and owner.token == task.handoff_token
            and task.holder is None
            and not task.sent
            and owner.handed_off_by != str(task.handoff_token)
        )
        if handing:
            where = f"a put-back FAILURE of {owner!r}'s process answered {code} (task {task.status})"
            if code != "stored":
                self.violated("model-mismatch", f"{where}: expected stored (the handing process ended)")
                return
            self.undo_handoff(task)
            task.status, task.holder, task.expired, task.due, task.result = REQUEUED, owner, False, False, True
            owner.believes_live = False
            return
        if task.status not in (RUNNING, LAPSED) or task.holder is not owner:
            if task.status in HELD and task.holder is not owner:
                if code != "foreign":
                    self.violated(
                        "model-mismatch",
                        f"a put-back FAILURE of {owner!r}'s process answered {code} (task {task.status}): "
                        "expected foreign (another process's lease)",
                    )
                return
            self.wrote_tokenless(owner, False, code)
            return
        if code != "stored":
            self.violated(
                "model-mismatch",
                f"a put-back FAILURE of {owner!r}'s process answered {code} (task {task.status}): expected stored",
            )
            return
        task.status, task.expired, task.due, task.result = REQUEUED, False, False, True
        owner.believes_live = False

    def released(self, owner: Owner, status: str, code: str) -> None:
        task = self.task(owner.task_id)
        where = f"{owner!r} release {status} answered {code} (task {task.status}, newest token {task.fence})"
        if code == "ok":
            self.landed(owner, f"release {status}", "stale-release-landed")
            if owner.token < task.fence:
                return self.violated("stale-release-landed", where)
            elif not self.current(owner):
                return self.violated("write-after-final", where)
            task.status, task.due, task.ended_by = status, False, None
            if status == DONE:
                task.holder, task.done_publish = None, owner.message
            owner.believes_live = False
        elif self.current(owner) and not (code == "missing" and owner.lease_gone):
            self.violated("model-mismatch", f"{where}: the current owner's end was refused")

    def handed_off(self, owner: Owner, succeeded: bool, code: str, had_lease: bool, recorded: bool = False) -> None:
        """``Task.replace()``: fenced like a write; a finished hand-off sends the replacement
        (its message names the owner's token) and leaves a HANDED_OFF record that refuses
        older tokens and every message but the replacement's."""
        task = self.task(owner.task_id)
        where = f"{owner!r} hand-off answered {code} (task {task.status}, newest token {task.fence})"
        if succeeded:
            # A hand-off the contract refuses sends no replacement: the model stays as it was.
            self.landed(owner, "hand-off", "stale-handoff")
            if not had_lease:
                return self.violated("missing-handoff-succeeded", where)
            elif owner.token < task.fence:
                return self.violated("stale-handoff", where)
            elif task.status == HANDED_OFF and task.handoff_token == owner.token:
                return  # the owner that handed off asking again: the same answer, one replacement
            elif not self.current(owner):
                return self.violated("write-after-final", where)
            task.before_handoff = (set(task.handed_off), task.handoff_token)
            task.handed_off.update(task.publishes)
            replacement = f"{owner.task_id}-p{len(task.publishes)}"
            task.publishes.append(replacement)
            task.headers[replacement] = str(owner.token)
            task.status, task.holder, task.expired, task.due = HANDED_OFF, None, False, False
            task.handoff_token, task.lost_handoff, task.handed_off_owner = owner.token, False, owner
            task.sent, task.filed, task.filed_worker = False, True, owner.worker
            task.recorded, task.resends = recorded, 0
            owner.believes_live = False
        elif self.current(owner) and not (code == "missing" and owner.lease_gone):
            self.violated("model-mismatch", f"{where}: the current owner's hand-off was refused")

    def handed_back(self, owner: Owner, code: str) -> None:
        """The replacement could not be sent: the owner takes its hand-off back, as long as
        the record is its own hand-off's and nothing started the task id since. The lease is
        the owner's again, with the hand-off token it had; the replacement was never sent."""
        task = self.task(owner.task_id)
        where = f"{owner!r} hand-back answered {code} (task {task.status}, newest token {task.fence})"
        its_own = task.status == HANDED_OFF and task.handoff_token == owner.token == task.fence
        if code == "ok":
            task.filed = False
            if not its_own:
                return self.violated("stale-hand-back", where)
            replacement = task.publishes.pop()
            task.headers.pop(replacement, None)
            task.handed_off, task.handoff_token = task.before_handoff
            task.status, task.holder, task.expired, task.past_grace = RUNNING, owner, False, False
            owner.believes_live, owner.expired = True, False
        elif its_own:
            self.violated("model-mismatch", f"{where}: the owner's own hand-off was not taken back")

    def worker_lapsed(self, worker: str, made_due: int) -> None:
        """The liveness record of ``worker`` lapsed (a whole worker dead or frozen): each
        hand-off filed under it and not said sent may never have been sent, and is due now;
        every filing leaves the worker's set."""
        expected = 0
        self.violated.muted = any(task.uncertain for task in self.tasks.values())
        for task in self.tasks.values():
            if worker in task.reservation_filed:
                # Its reservation leaves the worker's set; one still RESERVED by that worker's
                # host (not started, not received by another since) is due now.
                task.reservation_filed.discard(worker)
                if task.status == RESERVED and task.reserved_by == worker:
                    task.due = True
                    expected += 1
            if task.filed_worker != worker:
                continue
            if task.filed and task.status == HANDED_OFF and not task.sent:
                task.lost_handoff, task.due = True, True
                expected += 1
            task.filed = False
        if made_due != expected:
            self.violated("model-mismatch", f"{worker}'s lapse made {made_due} due, expected {expected}")

    @staticmethod
    def undo_handoff(task: TaskModel) -> None:
        """A hand-off whose replacement may never have been sent is undone: the replaced
        messages and the lease's hand-off token as they were before it."""
        task.handed_off, task.handoff_token = task.before_handoff
        task.lost_handoff = False

    def said_sent(self, owner: Owner, code: str, filed: bool = True) -> None:
        """The owner that handed off sent its replacement and says so: its own record, as the
        hand-off left it, is no longer due; nothing else changes."""
        task = self.task(owner.task_id)
        where = f"{owner!r} said it sent its replacement: {code} (task {task.status}, newest token {task.fence})"
        its_own = task.status == HANDED_OFF and task.handoff_token == owner.token and task.handed_off_owner is owner
        if code == "ok":
            if not its_own:
                return self.violated("foreign-send-said", where)
            # Even after its process was taken for lost. Said without its worker (the worker's
            # id unknown), the filing stays, and the worker's lapse passes it by (said sent).
            # A recorded replacement is due a requeue timeout from the first saying.
            task.due = task.due and task.sent
            task.sent, task.filed = True, task.filed and not filed
        elif its_own:
            self.violated("model-mismatch", f"{where}: the owner's own hand-off was not marked sent")

    # -- the reaper and the operator ----------------------------------------------------

    def claimed(self, task_id: str, code: str, cause: str, reserved: int, grace: bool = False) -> None:
        """The reaper's claim; ``grace``: with a takeover grace, which a lease held or given up
        waits out after its expiry (or lapse) before it is due."""
        self.hand_out(reserved, f"the claim of {task_id}")
        task = self.task(task_id)
        # The replacement may never have been sent: its process was lost before it said so.
        lost = task.status == HANDED_OFF and task.lost_handoff and not task.sent
        graced = task.past_grace or not grace
        lapsed_due = task.status == LAPSED and graced and not task.waits_ttl
        counted = (task.status == RUNNING and task.expired and graced) or lapsed_due
        counted = counted or (lost and task.due and graced)
        # A recorded replacement said sent, or whose owner was lost before it said so: once
        # due, sent again (the record stays), at most max(MAX_TAKEOVERS, 1) times.
        resend = task.status == HANDED_OFF and task.recorded and (task.sent or task.lost_handoff)
        if resend:
            allowed = (
                {"not-due"} if not task.due else {"requeued" if task.resends < max(MAX_TAKEOVERS, 1) else "waiting"}
            )
            if reserved <= task.fence:
                allowed.add("retry-later")
            if code not in allowed:
                self.violated(
                    "model-mismatch", f"claim of {task_id} (a recorded hand-off) answered {code}, expected {allowed}"
                )
            if code in ("requeued", "waiting"):
                task.due = False
                task.resends += code == "requeued"
            return
        if task.status == NONE:
            allowed = {"missing"}
        elif lost and task.due and not graced:
            # Undone (a lease given up), then its grace waited out as any lapsed lease's.
            allowed = {"not-due"}
        elif lost and task.due:  # the replacement never started: the hand-off undone, a takeover
            allowed = {"abandoned"} if task.takeovers + 1 > MAX_TAKEOVERS else {"requeued"}
        elif lost:
            allowed = {"not-due"}
        elif task.status == HANDED_OFF:
            allowed = {"missing", "finished"}  # no lease, or the hand-off's record
        elif task.status == DONE:
            allowed = {"missing", "finished"}  # its fence in the result, or a tombstone
        elif task.status == ABANDONED:
            allowed = {"finished"}
        elif counted:
            allowed = {"abandoned"} if task.takeovers + 1 > MAX_TAKEOVERS else {"requeued"}
        elif task.status in (REQUEUED, RETRYING) and task.due:
            allowed = {"requeued", "waiting"}
        elif task.status == RESERVED and task.due:
            allowed = {"requeued"}  # "unstarted": sent again, never counted, never abandoned
        else:
            allowed = {"not-due"}
        if reserved <= task.fence:
            allowed.add("retry-later")  # the token's own violation is reported already
        if code not in allowed:
            self.violated("model-mismatch", f"claim of {task_id} answered {code} ({cause}), expected {allowed}")
        if lost and task.due and code == "not-due":
            self.undo_handoff(task)
            task.status, task.holder = LAPSED, task.handed_off_owner
        if lost and code in ("requeued", "abandoned"):
            # Undone as a hand-back undoes it; the replacement, if it was sent after all, is a
            # message like any other (a takeover of the claimed task, or a copy of its run).
            self.undo_handoff(task)
            task.holder = task.handed_off_owner
        if code == "requeued":
            task.status, task.expired, task.due = REQUEUED, False, False
            if counted:
                task.takeovers += 1
        elif code == "abandoned":
            task.status, task.fence, task.holder, task.result, task.forgotten = ABANDONED, reserved, None, True, False
        elif code == "waiting":
            task.due = False

    def cancelled(self, task_id: str, code: str, token: int, unknown_too: bool) -> None:
        """``celery fenced cancel``: a fresh token, a fenced REVOKED, the lease DONE."""
        self.hand_out(token, f"the cancel of {task_id}")
        task = self.task(task_id)
        if task.status in FINAL:
            allowed = {"finished"}  # forget() keeps its tombstone (§4.5)
        elif task.status in HELD:
            allowed = {"cancelled"}  # a task received and not started yet too: it never starts
        elif task.result:
            allowed = {"finished", "cancelled"}
        elif task.status == HANDED_OFF:
            allowed = {"cancelled", "unknown"}  # the replacement cancelled, or not yet known
        else:
            allowed = {"cancelled"} if unknown_too else {"unknown"}
        if token <= task.fence:
            allowed.add("retry-later")  # the token's own violation is reported already
        if code not in allowed:
            self.violated("model-mismatch", f"cancel of {task_id} answered {code} ({task.status}), expected {allowed}")
        if code == "cancelled":
            task.status, task.fence, task.holder, task.result, task.done_publish = DONE, token, None, True, ""
            task.forgotten, task.ended_by, task.cancelled = False, None, True

    def redriven(self, task_id: str, code: str) -> None:
        task = self.task(task_id)
        if (code == "redriven") != (task.status == ABANDONED):
            self.violated("model-mismatch", f"redrive of {task_id} answered {code} ({task.status})")
        if code == "redriven":
            task.status, task.takeovers, task.result, task.forgotten = LAPSED, 0, False, False
            task.past_grace = False

    def forgotten(self, task_id: str, code: str) -> None:
        """``forget()``: the result goes; a finished task's fence stays, as a tombstone that
        refuses a late copy and a late write (for the forget window, longer than a run)."""
        task = self.task(task_id)
        expected = "forgotten" if task.status in FINAL else "deleted"
        if code != expected:
            self.violated("model-mismatch", f"forget of {task_id} answered {code} ({task.status}), expected {expected}")
        task.result = False
        task.forgotten = task.status in FINAL

    # -- what happens to the Redis ------------------------------------------------------

    def flushed(self, leases: dict[str, dict[str, str]]) -> None:
        """Every key gone: what Redis knows of the tasks (``leases``: their lease hashes, read
        just before), their fences and records. Not the truth: the tokens handed out, the
        owners, what each got through."""
        for task_id, fields in leases.items():
            self.lease_lost(task_id, fields, whole=True)
        self.tasks = {task_id: task.fresh() for task_id, task in self.tasks.items()}

    def counter_lost(self) -> None:
        """The token counter and its epoch gone; nothing else."""

    def failed_over(self) -> None:
        """A promotion that lost the counter's last increments; nothing else."""

    # -- invariants ---------------------------------------------------------------------

    def check_redis(self, task_id: str, fields: dict[str, str], result: bytes | None) -> None:
        """What Redis holds, judged by the truth: a live lease only for the task's newest owner;
        a result that changed written by no owner older than the newest, and never to a lower
        fence than the result it replaced. And by what Redis should know: a finished task still
        finished (until FLUSHDB; after forget() as its tombstone)."""
        truth = self.truth[task_id]
        newest = truth.newest
        status = fields.get("status")
        if status in ("RUNNING", "STALLED"):
            holder = (fields.get("ownerToken"), fields.get("ownerId"))
            if newest is None or holder != (str(newest.token), newest.owner_id):
                self.violated.truth(
                    "live-lease-not-newest",
                    f"{task_id} is {status} for {holder}, the task's newest owner is {newest!r}",
                )
        if result != truth.seen_result:
            fence = fence_token_of(result)
            writer = next(
                (owner for owner in self.owners if fence and owner.task_id == task_id and owner.token == fence), None
            )
            if writer is not None and newest is not None and writer.token < newest.token:
                self.violated.truth(
                    "stale-result-stored",
                    f"{task_id}'s result is now {writer!r}'s, but {newest!r} is its newest owner "
                    f"(what got through: {truth.sent})",
                )
            if fence and truth.seen_result is not None and fence < truth.seen_fence:
                self.violated.truth(
                    "result-fence-went-back",
                    f"{task_id}'s result with fence {truth.seen_fence} was replaced by one with fence {fence}",
                )
            truth.seen_result, truth.seen_fence = result, fence
        task = self.task(task_id)
        if task.status in FINAL:
            finished = status in FINAL or (status is None and result is not None and "fence_token" in as_text(result))
            if not finished:
                self.violated(
                    "final-undone", f"{task_id} is {task.status} in the model, Redis has {fields or result!r}"
                )
