"""The user's task files as a domain: the paper's setting, with no executable environment.

`config.data.env = 'files'` trains on `data.train_files` and evaluates on `data.eval_files`
(task files in the reference layout or ours, `envace_jax.data.sources`). Nothing here can
execute a call: rollouts are world rehearsal, the reward is the judge's checklist score
(`judge.kind`), and held-out evaluation is the checklist score of rehearsed episodes
(`eval.kind = 'checklist'`). The warm start, when there is one, imitates the tasks' reference
conversations: the assistant's messages as ACT targets and the logged tool responses as
REHEARSE targets.

Multi-host: each process reads only its share of the training rows (record i belongs to
process i mod count); the held-out files are small and every process reads them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envace_jax.envs.base import Domain

TRAIN_KEY, EVAL_KEY = "config.data.train_files", "config.data.eval_files"


class _First:
    """The first `n` tasks of a random-access source (file order), without copying them."""

    def __init__(self, source, n: int):
        self.source, self.n = source, min(n, len(source))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.source[i % self.n]

    def __iter__(self):
        return (self[i] for i in range(self.n))


def _no_env():
    raise RuntimeError("data.env = 'files': these tasks have no executable environment")


def reference_demonstrations(tasks: Sequence[Any], tokenizer, *args, **kwargs) -> list:
    """Warm-start sequences from the tasks' reference conversations: assistant messages as ACT
    targets, logged tool responses as REHEARSE targets (the demo domain's augmentations, which
    replay calls in a world, do not apply)."""
    del args, kwargs
    from envace_jax.text.trajectory import encode_conversation

    return [
        encode_conversation(tokenizer, t.reference_messages, t.template_tools, rehearse=True)
        for t in tasks
    ]


def response_tools(tasks: Sequence[Any]) -> list[list[str]]:
    """The tool of each logged response in each task's reference conversation, in order."""
    out = []
    for t in tasks:
        names = []
        for m in t.reference_messages:
            if m.get("role") == "assistant":
                names += [c["function"]["name"] for c in m.get("tool_calls") or []]
        out.append(names)
    return out


def files_domain(data, tokenizer=None, process: tuple[int, int] = (0, 1)) -> Domain:
    """The domain of `config.data`'s task files; `tokenizer` measures prompts for
    `data.max_prompt_tokens`; `process` is (index, count) of this host's training share."""
    from envace_jax.data.sources import open_tasks

    prompt_length = None
    if tokenizer is not None and data.max_prompt_tokens:
        from envace_jax.text.role_pieces import prompt_ids

        def prompt_length(task) -> int:
            return len(prompt_ids(tokenizer, task.messages, task.template_tools))

    opened: dict[str, Any] = {}

    def source(split: str):
        if split not in opened:
            train = split == "train"
            shard = process if train else (0, 1)
            opened[split] = open_tasks(
                data.train_files if train else data.eval_files,
                skip_invalid=data.skip_invalid,
                shard_index=shard[0],
                shard_count=shard[1],
                prompt_length=prompt_length,
                max_prompt_tokens=data.max_prompt_tokens,
                where=TRAIN_KEY if train else EVAL_KEY,
            )
            print(f"{TRAIN_KEY if train else EVAL_KEY}: {opened[split].report.summary()}")
        return opened[split]

    def tasks(seed: int, n: int, split: str):
        del seed  # the files fix the tasks; the RL stream's seed shuffles them
        return _First(source("train" if split == "train" else "eval"), n)

    return Domain(
        "files",
        tasks,
        _no_env,
        reference_demonstrations,
        response_tools,
        None,
        has_env=False,
    )
