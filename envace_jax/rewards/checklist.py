"""Checklist reward: from per-step item verdicts to a trajectory score in [0, 1].

The reference semantics, for a task with T user turns and C checklists (one by default):

* Item k of turn t passes if ANY assistant step of that turn satisfies it (OR over steps).
* Turn score (per checklist) = sum_k weight_k * passed_k; a turn's reward sums its checklists.
* A tool-call error in a turn (an unparseable action, or a tool response carrying
  `error_tool_call`, e.g. a rehearsal the environment could not parse) scores the turn 0 and
  ends the episode.
* After a judged turn the episode ends early when an item with `required_for_next_turn` failed
  (with several checklists: when a majority of them has such a failure), or when a judge
  request failed (no verdict; the item already counts as failed).
* Episode score = (sum over turns played of the turn rewards) / (C * T). The denominator is the
  number of user turns of the TASK, not of turns played: turns never reached (early end,
  length or turn limit) add 0. Item weights of a turn sum to 1, so the score lies in [0, 1]
  and 1 means every item of every turn passed.

Pure Python over verdict tables `verdicts[turn][step][item]` (bools), so rule judges, LLM judges
and tests all feed the same function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from envace_jax.data.checklists import ChecklistItem

# Why an episode stopped before all its user turns were completed normally.
TOOL_ERROR = "tool_error"
REQUIRED_ITEM_FAILED = "required_item_failed"
JUDGE_FAILURE = "judge_failure"
INCOMPLETE = "incomplete"  # the table stops early for another reason (length, turn limit)


@dataclasses.dataclass(frozen=True)
class TurnOutcome:
    """score: the turn's reward (sum over checklists); passed[c][k]: item k of checklist c
    passed in some step; end_episode/reason: whether the episode stops after this turn."""

    score: float
    passed: tuple[tuple[bool, ...], ...]
    end_episode: bool
    reason: str | None


@dataclasses.dataclass(frozen=True)
class EpisodeScore:
    """score in [0, 1]; per_turn: reward of each turn played; won: any turn scored (the
    reference's pass metric)."""

    score: float
    per_turn: tuple[float, ...]
    ended_early_reason: str | None
    num_turns: int
    num_checklists: int
    won: bool


def _passed_items(items: Sequence[ChecklistItem], steps: Sequence[Sequence], where: str):
    n = len(items)
    passed = [False] * n
    for s, row in enumerate(steps):
        if len(row) != n:
            raise ValueError(f"{where}[{s}]: expected {n} item verdicts, got {len(row)}")
        for k, v in enumerate(row):
            passed[k] = passed[k] or bool(v)
    return tuple(passed)


def score_turn(
    items_per_checklist: Sequence[Sequence[ChecklistItem]],
    verdicts_per_checklist: Sequence[Sequence[Sequence[bool]]],
    *,
    tool_error: bool = False,
    judge_failed: bool = False,
    last_turn: bool = False,
    end_on_judge_failure: bool = True,
) -> TurnOutcome:
    """One user turn. items_per_checklist[c][k]; verdicts_per_checklist[c][step][k].

    Call it as the turn ends to decide whether the rollout plays the next user turn.
    """
    if len(items_per_checklist) != len(verdicts_per_checklist):
        raise ValueError(
            f"{len(items_per_checklist)} checklists but verdicts for {len(verdicts_per_checklist)}"
        )
    if tool_error:
        empty = tuple(tuple(False for _ in items) for items in items_per_checklist)
        return TurnOutcome(0.0, empty, True, TOOL_ERROR)
    passed, score, votes = [], 0.0, 0
    for c, (items, steps) in enumerate(
        zip(items_per_checklist, verdicts_per_checklist, strict=True)
    ):
        p = _passed_items(items, steps, f"verdicts[checklist {c}]")
        passed.append(p)
        score += math.fsum(it.weight for it, ok in zip(items, p, strict=True) if ok)
        votes += any(it.required_for_next_turn and not ok for it, ok in zip(items, p, strict=True))
    reason = None
    if not last_turn:
        if votes > len(items_per_checklist) / 2:
            reason = REQUIRED_ITEM_FAILED
        elif judge_failed and end_on_judge_failure:
            reason = JUDGE_FAILURE
    return TurnOutcome(score, tuple(passed), last_turn or reason is not None, reason)


def aggregate_checklists(
    checklists: Sequence[Sequence[Sequence[ChecklistItem]]],
    verdicts: Sequence[Sequence[Sequence[Sequence[bool]]]],
    turn_errors: Sequence[bool] | None = None,
    *,
    judge_failures: Sequence[bool] | None = None,
    end_on_judge_failure: bool = True,
    stop_reason: str | None = None,
) -> EpisodeScore:
    """Episode score over C checklists.

    Args:
      checklists: [C][turn][item] (all with the same number of turns T).
      verdicts: [C][turn played][step][item]; a turn with a tool error may have no steps.
      turn_errors: [turn played] True where the turn hit a tool-call error.
      judge_failures: [turn played] True where some verdict of the turn is missing (failed
        judge request); ends the episode after the turn unless end_on_judge_failure=False.
      stop_reason: why the table stops before the last turn when no rule above says so
        (reported as ended_early_reason; default "incomplete").
    """
    C = len(checklists)
    if C == 0 or len(verdicts) != C:
        raise ValueError(f"need >= 1 checklist and verdicts for each, got {C} and {len(verdicts)}")
    T = len(checklists[0])
    if any(len(cl) != T for cl in checklists):
        turns = [len(c) for c in checklists]
        raise ValueError(f"checklists disagree on the number of turns {turns}")
    played = len(verdicts[0])
    if any(len(v) != played for v in verdicts) or played > T:
        raise ValueError(
            f"verdict tables must cover the same turns, at most {T}; "
            f"got {[len(v) for v in verdicts]}"
        )
    errors = list(turn_errors) if turn_errors is not None else [False] * played
    jfail = list(judge_failures) if judge_failures is not None else [False] * played
    if len(errors) != played or len(jfail) != played:
        raise ValueError(
            f"turn_errors/judge_failures need one entry per turn played ({played}), "
            f"got {len(errors)}/{len(jfail)}"
        )
    per_turn: list[float] = []
    reason = None
    for t in range(played):
        out = score_turn(
            [cl[t] for cl in checklists],
            [v[t] for v in verdicts] if not errors[t] else [[] for _ in range(C)],
            tool_error=errors[t],
            judge_failed=jfail[t],
            last_turn=t == T - 1,
            end_on_judge_failure=end_on_judge_failure,
        )
        per_turn.append(out.score)
        if out.end_episode:
            reason = out.reason
            if t < played - 1:
                raise ValueError(
                    f"verdicts continue after turn {t}, where the episode ended ({out.reason})"
                )
    if reason is None and played < T:
        reason = stop_reason or INCOMPLETE
    total = math.fsum(per_turn)
    return EpisodeScore(
        score=total / (C * T),
        per_turn=tuple(per_turn),
        ended_early_reason=reason,
        num_turns=T,
        num_checklists=C,
        won=total > 0,
    )


def aggregate(
    checklist: Sequence[Sequence[ChecklistItem]],
    verdicts: Sequence[Sequence[Sequence[bool]]],
    turn_errors: Sequence[bool] | None = None,
    **kwargs,
) -> EpisodeScore:
    """Episode score for one checklist [turn][item] and verdicts[turn played][step][item]."""
    return aggregate_checklists([checklist], [verdicts], turn_errors, **kwargs)
