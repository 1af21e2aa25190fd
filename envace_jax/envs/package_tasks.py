"""What the worlds a package serves (`bfcl_multi_turn`, `tau2_*`) share on our side: a split by
position, the reference conversation of calls executed in the world, and the `Domain` over a
fixed list of tasks (loaded once per process, split by `metadata["split"]`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envace_jax.envs.base import Domain, ToolResult, result_text

SPLITS = ("test", "validation", "train", "train", "train")  # a task's position mod 5
FINAL_REPLY = "Done."  # closes each user turn of a reference conversation


def executed_turn(calls: Sequence[Mapping[str, Any]], answers: Sequence[ToolResult]) -> list:
    """One user turn's reference steps: each call ({name, arguments}) in a step of its own with
    the world's answer, then the closing reply."""
    messages: list[dict] = []
    for call, answer in zip(calls, answers, strict=True):
        step = {"type": "function", "function": dict(call)}
        messages.append({"role": "assistant", "content": "", "tool_calls": [step]})
        messages.append({"role": "tool", "content": result_text(answer)})
    return messages + [{"role": "assistant", "content": FINAL_REPLY}]


class Loaded:
    """Tasks built once per process by `load()`, under a lock."""

    def __init__(self, load: Callable[[], list]):
        self._load, self._tasks, self._lock = load, None, threading.Lock()

    def __call__(self) -> list:
        with self._lock:
            if self._tasks is None:
                self._tasks = self._load()
            return self._tasks


def package_domain(name: str, all_tasks: Callable[[], list], make_env, data=None, tokenizer=None):
    """The `Domain` of a package's tasks: `generate_tasks(seed, n, split)` gives the first `n`
    of the split in the package's order (the seed does not change them; the RL stream's seed
    shuffles what it draws). With `data.max_prompt_tokens` and a tokenizer, a split keeps only
    the tasks whose opening prompt, tools rendered, is no longer."""
    from envace_jax.envs.task_files import reference_demonstrations, response_tools

    limit = getattr(data, "max_prompt_tokens", 0) if tokenizer is not None else 0
    if limit:
        from envace_jax.text.role_pieces import prompt_ids

    def fits(task) -> bool:
        return not limit or len(prompt_ids(tokenizer, task.messages, task.template_tools)) <= limit

    def generate_tasks(seed: int, n: int, split: str) -> list:
        del seed
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(set(SPLITS))}, got {split!r}")
        return [t for t in all_tasks() if t.metadata["split"] == split and fits(t)][:n]

    def demonstration_messages(tasks: Sequence[Any], *args, **kwargs) -> list[list[dict]]:
        del args, kwargs  # the reference conversation, which the demonstrations encode
        return [[dict(m) for m in t.reference_messages] for t in tasks]

    return Domain(
        name,
        generate_tasks,
        make_env,
        reference_demonstrations,
        response_tools,
        demonstration_messages=demonstration_messages,
    )
