"""Checklist aggregation against hand-computed scores."""

from __future__ import annotations

import pytest

from envace_jax.data import ChecklistItem
from envace_jax.rewards.checklist import (
    INCOMPLETE,
    JUDGE_FAILURE,
    REQUIRED_ITEM_FAILED,
    TOOL_ERROR,
    aggregate,
    aggregate_checklists,
    score_turn,
)

T, F = True, False


def it(weight: float, required: bool = False) -> ChecklistItem:
    return ChecklistItem(
        question="q",
        focus_on="assistant.content.user_visible_reply",
        pass_condition="p",
        failure_examples=(),
        evidence=(),
        weight=weight,
        required_for_next_turn=required,
    )


# Turn 0: items 0.5 (required), 0.3, 0.2; turn 1: 0.6, 0.4 (required); turn 2: 1.0.
CHECKLIST = [[it(0.5, True), it(0.3), it(0.2)], [it(0.6), it(0.4, True)], [it(1.0)]]
TURN0 = [[T, F, F], [F, F, T]]  # OR over steps: items 0 and 2 -> 0.5 + 0.2 = 0.7
TURN1 = [[F, T]]  # item 1 -> 0.4
TURN2 = [[F], [T]]  # -> 1.0


def test_all_turns_played():
    s = aggregate(CHECKLIST, [TURN0, TURN1, TURN2])
    assert s.per_turn == pytest.approx((0.7, 0.4, 1.0))
    assert s.score == pytest.approx((0.7 + 0.4 + 1.0) / 3)  # 0.7
    assert s.ended_early_reason is None and s.won
    assert (s.num_turns, s.num_checklists) == (3, 1)


def test_item_passes_if_any_step_passes_it():
    s = aggregate([[it(0.25), it(0.25), it(0.5)]], [[[T, F, F], [F, T, F], [T, F, F]]])
    assert s.score == pytest.approx(0.5)


def test_required_item_failure_ends_the_episode_after_the_turn():
    s = aggregate(CHECKLIST, [[[F, T, T]]])  # required item 0 failed: 0.3 + 0.2
    assert s.per_turn == pytest.approx((0.5,))
    assert s.score == pytest.approx(0.5 / 3)  # the denominator is the task's 3 turns
    assert s.ended_early_reason == REQUIRED_ITEM_FAILED
    with pytest.raises(ValueError, match="continue after turn 0"):
        aggregate(CHECKLIST, [[[F, T, T]], TURN1])


def test_required_failure_on_the_last_turn_is_not_an_early_end():
    s = aggregate(CHECKLIST[:2], [TURN0, [[T, F]]])
    assert s.score == pytest.approx((0.7 + 0.6) / 2)
    assert s.ended_early_reason is None


def test_tool_error_zeroes_the_turn_and_ends_the_episode():
    s = aggregate(CHECKLIST, [TURN0, []], turn_errors=[F, T])
    assert s.per_turn == pytest.approx((0.7, 0.0))
    assert s.score == pytest.approx(0.7 / 3)
    assert s.ended_early_reason == TOOL_ERROR
    # Even when every item of that turn had passed.
    s = aggregate(CHECKLIST, [TURN0, [[T, T]]], turn_errors=[F, T])
    assert s.score == pytest.approx(0.7 / 3)
    s = aggregate(CHECKLIST, [[]], turn_errors=[T])
    assert s.score == 0.0 and not s.won


def test_judge_failure_ends_the_episode_unless_disabled():
    s = aggregate(CHECKLIST, [TURN0], judge_failures=[T])
    assert s.ended_early_reason == JUDGE_FAILURE and s.score == pytest.approx(0.7 / 3)
    s = aggregate(
        CHECKLIST,
        [TURN0, TURN1, TURN2],
        judge_failures=[T, F, F],
        end_on_judge_failure=False,
    )
    assert s.score == pytest.approx(0.7)


def test_table_ending_before_the_last_turn():
    s = aggregate(CHECKLIST, [TURN0, TURN1])
    assert s.score == pytest.approx(1.1 / 3) and s.ended_early_reason == INCOMPLETE
    s = aggregate(CHECKLIST, [TURN0], stop_reason="length")
    assert s.ended_early_reason == "length"
    s = aggregate(CHECKLIST, [])
    assert s.score == 0.0 and s.ended_early_reason == INCOMPLETE


def test_two_checklists_sum_and_vote():
    a = [[it(0.5, True), it(0.5)], [it(1.0)]]
    b = [[it(0.2), it(0.8, True)], [it(1.0)]]
    # Turn 0: checklist a fails its required item (0.5), b passes all (1.0): one vote of two
    # is no majority, so the episode goes on. Turn 1: a passes (1.0), b fails (0).
    s = aggregate_checklists([a, b], [[[[F, T]], [[T]]], [[[T, T]], [[F]]]])
    assert s.per_turn == pytest.approx((1.5, 1.0))
    assert s.score == pytest.approx(2.5 / (2 * 2))
    assert s.ended_early_reason is None
    # Both fail a required item: a majority, the episode ends after turn 0.
    s = aggregate_checklists([a, b], [[[[F, T]]], [[[T, F]]]])
    assert s.score == pytest.approx((0.5 + 0.2) / 4)
    assert s.ended_early_reason == REQUIRED_ITEM_FAILED


def test_score_turn_for_online_use():
    out = score_turn([CHECKLIST[0]], [TURN0])
    assert out.score == pytest.approx(0.7)
    assert out.passed == ((T, F, T),)
    assert not out.end_episode
    out = score_turn([CHECKLIST[0]], [[[F, T, F]]])
    assert out.end_episode and out.reason == REQUIRED_ITEM_FAILED
    out = score_turn([CHECKLIST[2]], [TURN2], last_turn=True)
    assert out.end_episode and out.reason is None and out.score == 1.0


def test_shape_errors_name_the_place():
    with pytest.raises(ValueError, match=r"verdicts\[checklist 0\]\[1\]: expected 3 item verdicts"):
        aggregate(CHECKLIST, [[[T, F, F], [T, F]]])
    with pytest.raises(ValueError, match="one entry per turn played"):
        aggregate(CHECKLIST, [TURN0], turn_errors=[F, F])
    with pytest.raises(ValueError, match="at most 3"):
        aggregate(CHECKLIST, [TURN0, TURN1, TURN2, TURN2])
