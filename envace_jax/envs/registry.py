"""Task domains by name: `config.data.env` picks the tasks, the environment and the oracle.

A domain registers a loader of `config.data` (its module is imported only when the domain is
used):

    DOMAINS["demo"] = _demo      # the demo world: generated tasks, an executable environment
    DOMAINS["bfcl_multi_turn"] = _bfcl_multi_turn  # bfcl-eval's multi-turn entries and backends
    DOMAINS["tau2_telecom"] = _tau2("telecom")  # tau2-bench's solo tasks, envs and evaluator
    DOMAINS["files"] = _files    # the user's task files, no environment (`envs.task_files`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from envace_jax.envs.base import Domain
from envace_jax.text.memory_slot import slotted_task


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
        demonstration_messages=demo.demonstration_messages,
    )


def _bfcl_multi_turn(data=None, tokenizer=None, **unused) -> Domain:
    from envace_jax.envs import bfcl_multi_turn

    return bfcl_multi_turn.domain(data, tokenizer)


def _tau2(name: str) -> Callable[..., Domain]:
    def load(data=None, tokenizer=None, **unused) -> Domain:
        from envace_jax.envs import tau2_solo

        return tau2_solo.domain(name, data, tokenizer)

    return load


def _files(data, **kwargs) -> Domain:
    from envace_jax.envs.task_files import files_domain

    return files_domain(data, **kwargs)


DOMAINS: dict[str, Callable[..., Domain]] = {
    "demo": _demo,
    "bfcl_multi_turn": _bfcl_multi_turn,
    "tau2_mock": _tau2("mock"),
    "tau2_telecom": _tau2("telecom"),
    "files": _files,
}


def domain(name: str, data=None, **kwargs) -> Domain:
    """The domain registered as `name` (`config.data.env`); `data` is `config.data`, which the
    'files' domain reads its task files from (`kwargs`: `envs.task_files.files_domain`'s).
    With `data.memory_slot` other than 'off' every task's prompt carries the empty memory slot
    (`text.memory_slot`)."""
    if name not in DOMAINS:
        raise ValueError(f"config.data.env = {name!r}: expected one of {tuple(DOMAINS)}")
    found = DOMAINS[name](data, **kwargs)
    place = getattr(data, "memory_slot", "off")
    if place == "off":
        return found
    generate = found.generate_tasks

    def generate_slotted(seed: int, n: int, split: str) -> list:
        return [slotted_task(t, place) for t in generate(seed, n, split)]

    return dataclasses.replace(found, generate_tasks=generate_slotted)
