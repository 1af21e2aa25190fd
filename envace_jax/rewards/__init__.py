"""Checklist rewards: aggregation of item verdicts (`checklist`), the LLM judge over an
OpenAI-compatible endpoint (`llm_judge`) and the rule judge for machine-checkable items
(`rule_judge`)."""

from envace_jax.rewards.checklist import (
    EpisodeScore,
    TurnOutcome,
    aggregate,
    aggregate_checklists,
    score_turn,
)
from envace_jax.rewards.llm_judge import JudgeConfig, LLMJudge, TurnJudgement, parse_verdict

__all__ = [
    "EpisodeScore",
    "JudgeConfig",
    "LLMJudge",
    "TurnJudgement",
    "TurnOutcome",
    "aggregate",
    "aggregate_checklists",
    "parse_verdict",
    "score_turn",
]
