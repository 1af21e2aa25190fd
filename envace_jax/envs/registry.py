"""Task domains by name: `config.data.env` picks the tasks, the environment and the oracle.

A domain registers a loader of `config.data` (its module is imported only when the domain is
used):

    DOMAINS["demo"] = _demo      # the demo world: generated tasks, an executable environment
    DOMAINS["files"] = _files    # the user's task files, no environment (`envs.task_files`)
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
    make_env() -> a fresh executable environment (`envs.base.Environment`); a domain without
      one (`has_env` False) gives a factory that raises.
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
    has_env: bool = True

    def held_out_tasks(self, config) -> list[Any]:
        """The tasks the train job evaluates on: `data.eval_tasks` of `data.eval_split`."""
        return self.generate_tasks(config.seed, config.data.eval_tasks, config.data.eval_split)


def _demo(data=None, **unused) -> Domain:
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


def _files(data, **kwargs) -> Domain:
    from envace_jax.envs.task_files import files_domain

    return files_domain(data, **kwargs)


DOMAINS: dict[str, Callable[..., Domain]] = {"demo": _demo, "files": _files}


def domain(name: str, data=None, **kwargs) -> Domain:
    """The domain registered as `name` (`config.data.env`); `data` is `config.data`, which the
    'files' domain reads its task files from (`kwargs`: `envs.task_files.files_domain`'s)."""
    if name not in DOMAINS:
        raise ValueError(f"config.data.env = {name!r}: expected one of {tuple(DOMAINS)}")
    return DOMAINS[name](data, **kwargs)
