"""Task domains by name: `config.data.env` picks the tasks, the environment and the oracle.

A domain registers a loader (its module is imported only when the domain is used):

    DOMAINS["demo"] = _demo
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from envace_jax.envs.base import Environment


@dataclasses.dataclass(frozen=True)
class Domain:
    """What the jobs need of a task domain.

    generate_tasks(seed, n, split) -> tasks: deterministic in (seed, split).
    make_env() -> a fresh executable environment (`envs.base.Environment`).
    demonstrations(tasks, tokenizer, failure_fraction, seed, unfinished_fraction=,
      default_fraction=) -> the warm start's encoded demonstrations, one per task
      (`text.trajectory.EncodedConversation`).
    response_tools(tasks) -> the tool of each response in each task's demonstration.
    corrupted_envs(kind, rate, seed) -> an environment factory over corrupted copies of the
      world (`envs.base.CORRUPTIONS`), for the sensitivity control; None if the domain has none.
    """

    name: str
    generate_tasks: Callable[[int, int, str], list[Any]]
    make_env: Callable[[], Environment]
    demonstrations: Callable[..., list[Any]]
    response_tools: Callable[[Sequence[Any]], list[list[str]]]
    corrupted_envs: Callable[[str, float, int], Callable[[], Environment]] | None = None

    def held_out_tasks(self, config) -> list[Any]:
        """The tasks the train job evaluates on: `data.eval_tasks` of `data.eval_split`."""
        return self.generate_tasks(config.seed, config.data.eval_tasks, config.data.eval_split)


def _demo() -> Domain:
    from envace_jax.envs import demo
    from envace_jax.envs.demo.corrupt import corrupted_envs

    return Domain(
        "demo",
        demo.generate_tasks,
        demo.DemoEnv,
        demo.demonstrations,
        demo.response_tools,
        corrupted_envs,
    )


DOMAINS: dict[str, Callable[[], Domain]] = {"demo": _demo}


def domain(name: str) -> Domain:
    """The domain registered as `name` (`config.data.env`)."""
    if name not in DOMAINS:
        raise ValueError(f"config.data.env = {name!r}: expected one of {tuple(DOMAINS)}")
    return DOMAINS[name]()
