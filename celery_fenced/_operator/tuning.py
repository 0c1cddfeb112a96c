"""Suggested stage deadlines, from what the deadlines bound: the gaps between progress calls.

A stage's deadline (``fenced_stage_timeouts``) bounds the longest time between two progress
calls while the stage is current, not the time spent in the stage. Each visit of a stage
gives one sample, its longest gap, counted in a fine histogram per task and stage (each task
may have its own deadlines; buckets 2 % wide, see
:func:`~celery_fenced._telemetry.metrics.gap_bucket`). A suggestion is
``max(floor, quantile × factor)`` of those samples, said with how many samples it rests on;
a stage whose old owner ran on past its deadline and finished after a takeover (a false
takeover) is never cut.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .._telemetry.metrics import gap_bucket_middle

__all__ = ["StageKey", "StageSuggestion", "quantile", "suggest"]

#: A stage of one task: ``(task name, stage)``; the task is ``""`` for samples that do not
#: name it.
StageKey = tuple[str, str]


def quantile(histogram: Mapping[int, int], q: float) -> float:
    """The ``q`` quantile of a fine gap histogram (``{bucket: count}``), in seconds.

    The nearest-rank rule over the counts; the value is the middle of the bucket that holds
    that rank, so it is within half a bucket (1 %) of the sample itself.
    """
    total = sum(histogram.values())
    if not total:
        raise ValueError("no samples")
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q!r}")
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(histogram):
        seen += histogram[index]
        if seen >= rank:
            return gap_bucket_middle(index)
    return gap_bucket_middle(max(histogram))


@dataclass(frozen=True)
class StageSuggestion:
    """What ``tune`` says of one stage of one task.

    Attributes:
        task: the task's name (``""`` when the samples do not name it).
        stage: the stage name (normalised).
        samples: how many gap samples the suggestion rests on.
        gap_quantile: the quantile of the longest gaps, seconds (``None`` without samples).
        longest_gap: the longest gap sampled, seconds (``None`` without samples).
        false_takeovers: takeovers of this stage whose old owner ran on past the deadline and
            finished soon after.
        current: the deadline in force now for this task, seconds.
        suggested: the suggested deadline, seconds (``None`` when there is nothing to go on).
        enough: True when ``samples`` reaches the minimum asked for.
    """

    task: str
    stage: str
    samples: int
    gap_quantile: float | None
    longest_gap: float | None
    false_takeovers: int
    current: float
    suggested: float | None
    enough: bool

    @property
    def note(self) -> str:
        """Why the suggestion is what it is, in a few words ("" when there is nothing to say)."""
        notes = []
        if not self.samples:
            notes.append("no samples")
        elif not self.enough:
            notes.append(f"only {self.samples} sample(s)")
        if self.false_takeovers:
            notes.append("not cut: false takeovers")
        return "; ".join(notes)


def suggest(
    gaps: Mapping[StageKey, Mapping[int, int]],
    false_takeovers: Mapping[StageKey, float],
    current: Mapping[StageKey, float],
    *,
    floor: float,
    factor: float,
    q: float = 0.99,
    min_samples: int = 30,
) -> list[StageSuggestion]:
    """Suggest a deadline for each stage of a task seen in ``gaps`` or ``false_takeovers``.

    Args:
        gaps: per ``(task, stage)``, the fine histogram of the longest gaps between progress calls.
        false_takeovers: per ``(task, stage)``, how many takeovers were false.
        current: per ``(task, stage)``, the deadline in force now for that task, seconds.
        floor: the smallest deadline suggested.
        factor: the safety factor over the quantile.
        q: the quantile of the gaps the suggestion starts from.
        min_samples: below this many samples, a suggestion is marked as resting on too few.
    """
    suggestions = []
    for key in sorted(set(gaps) | {k for k, n in false_takeovers.items() if n}):
        task, stage = key
        histogram = gaps.get(key) or {}
        samples = sum(histogram.values())
        false = int(false_takeovers.get(key, 0))
        now = current[key]
        gap_q = quantile(histogram, q) if samples else None
        suggested = None if gap_q is None else max(floor, gap_q * factor)
        if false:
            # The deadline was too tight for a run that then finished: never cut it.
            suggested = max(suggested or now, now)
        if suggested is not None:
            suggested = math.ceil(suggested * 10) / 10
        suggestions.append(
            StageSuggestion(
                task=task,
                stage=stage,
                samples=samples,
                gap_quantile=gap_q,
                longest_gap=gap_bucket_middle(max(histogram)) if samples else None,
                false_takeovers=false,
                current=now,
                suggested=suggested,
                enough=samples >= min_samples,
            )
        )
    return suggestions
