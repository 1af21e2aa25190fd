"""The trajectory reward as a config choice (`config.judge`): episodes in, scores in [0, 1] out.

    judge = build_judge(config.judge)          # RuleJudge or ChecklistLLMJudge
    judged = judge(tasks, conversations)       # Judged(rewards [B], stats)

Both score the same way (`rule_judge.judge_verdicts`, the reference's checklist semantics);
they differ in who gives the item verdicts: the items' machine-checkable rules, or an LLM over
an OpenAI-compatible endpoint (`llm_judge.LLMJudge`, every turn of every episode at once, under
one concurrency limit).

A judge that fails is loud. The LLM judge's stats carry `judge_error_share`, the share of the
verdicts it asked for that it could not get (no answer, HTTP errors, unparseable verdicts); a
batch whose share passes `judge.max_error_share` raises `JudgeFailed`, naming the endpoint and
the first error, and the job stops with that one line. `check()` asks for one verdict before a
job starts, so a server that is down or refuses every request stops the job at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envace_jax.data.checklists import ChecklistItem
from envace_jax.rewards import rule_judge
from envace_jax.rewards.llm_judge import METRIC_KEYS, JudgeConfig, LLMJudge


class JudgeFailed(RuntimeError):
    """The judge could not score: its endpoint failed, or the tasks lack what it needs."""


@dataclasses.dataclass
class Judged:
    """rewards [B] float64 in [0, 1], one per episode; stats: the judge's counters (floats)."""

    rewards: np.ndarray
    stats: dict[str, float]


class RuleJudge:
    """The items' machine-checkable rules (`rule_judge`); tasks whose items have none cannot be
    scored this way."""

    kind = "rule"

    def __call__(self, tasks: Sequence[Any], conversations: Sequence[Sequence[Mapping]]) -> Judged:
        try:
            pairs = zip(tasks, conversations, strict=True)
            scores = [rule_judge.judge(t, m).score for t, m in pairs]
        except ValueError as e:
            if "has no rule" not in str(e):
                raise
            raise JudgeFailed(f"judge.kind = 'rule': {e}; use judge.kind = 'llm'") from None
        return Judged(np.asarray(scores, np.float64), {})

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


def _turn_ends(messages: Sequence[Mapping]) -> list[int]:
    """For each user turn, the index one past its last message."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return [*users[1:], len(messages)]


class ChecklistLLMJudge:
    """Each played turn of each episode judged item by item by an LLM (`LLMJudge.ajudge_turn`),
    then scored as the rule judge scores its own verdicts."""

    kind = "llm"

    def __init__(self, config: JudgeConfig, max_error_share: float):
        self.judge = LLMJudge(config)
        self.max_error_share = max_error_share

    @property
    def endpoint(self) -> str:
        return self.judge.config.url

    async def _episode(self, task, messages, metrics):
        ends = _turn_ends(messages)[: len(task.checklist)]
        turns = await asyncio.gather(
            *(
                self.judge.ajudge_turn(messages[:end], task.checklist[t])
                for t, end in enumerate(ends)
            )
        )
        for turn in turns:
            for k, v in turn.metrics.items():
                metrics[k] += v
        verdicts = [t.verdicts for t in turns]
        failed = [t.judge_failed for t in turns]
        return rule_judge.judge_verdicts(task, messages, verdicts, failed).score

    async def _all(self, tasks, conversations):
        metrics = dict.fromkeys(METRIC_KEYS, 0)
        scores = await asyncio.gather(
            *(self._episode(t, m, metrics) for t, m in zip(tasks, conversations, strict=True))
        )
        return scores, metrics

    def __call__(self, tasks: Sequence[Any], conversations: Sequence[Sequence[Mapping]]) -> Judged:
        self.judge.first_error = None
        scores, metrics = asyncio.run(self._all(tasks, conversations))
        asked = metrics["judge_items"] - metrics["judge_short_circuit"]
        share = metrics["judge_failures"] / asked if asked else 0.0
        stats = {k: float(v) for k, v in metrics.items()}
        stats["judge_error_share"] = share
        if asked and share > self.max_error_share:
            raise JudgeFailed(
                f"the LLM judge at {self.endpoint} gave no verdict for {metrics['judge_failures']} "
                f"of {asked} checklist items ({share:.0%} > judge.max_error_share = "
                f"{self.max_error_share}); first error: {self.judge.first_error}"
            )
        return Judged(np.asarray(scores, np.float64), stats)

    def check(self) -> None:
        """One verdict before the job starts: raises JudgeFailed naming the endpoint and the
        error when the server is down or refuses the request."""
        item = ChecklistItem(
            question="Did the assistant greet the user?",
            focus_on="assistant.content.user_visible_reply",
            pass_condition="The reply contains a greeting.",
            failure_examples=(),
            evidence=(),
            weight=1.0,
            required_for_next_turn=False,
        )
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
        self.judge.first_error = None
        turn = self.judge.judge_turn(messages, [item])
        if turn.judge_failed:
            raise JudgeFailed(
                f"the LLM judge at {self.endpoint} gave no verdict for a probe item; "
                f"first error: {self.judge.first_error}"
            )

    def close(self) -> None:
        self.judge.close()


def build_judge(cfg) -> RuleJudge | ChecklistLLMJudge:
    """The judge `config.judge` describes. The API key is read from the environment variable
    `cfg.api_key_env` names (an unset variable is an error naming it)."""
    if cfg.kind == "rule":
        return RuleJudge()
    api_key = None
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env)
        if not api_key:
            raise JudgeFailed(
                f"config.judge.api_key_env = {cfg.api_key_env!r}: that environment variable "
                f"is not set"
            )
    config = JudgeConfig(
        base_url=cfg.base_url,
        model=cfg.model,
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
        api_key=api_key,
        concurrency=cfg.concurrency,
        response_format=cfg.structured_output != "text",
        fallback_to_text=cfg.structured_output == "auto",
    )
    return ChecklistLLMJudge(config, cfg.max_error_share)
