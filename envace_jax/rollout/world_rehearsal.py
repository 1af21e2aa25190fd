"""EnvACE rollouts: K world-rehearsal trajectories per task, judged, as a training batch.

No environment is touched: the policy acts and rehearses inside one compiled decode loop
(`sampling.loop`, mode 'rehearse'), the judge (`rewards.judges`: the rule judge unless another
is given) scores each trajectory including its rehearsed observations, and the rows become a
`rl.batch.TrajectoryBatch` whose `group` is the task index (the K rollouts of one task share
it). An episode that became invalid (an action
or rehearsal that does not parse) keeps its tokens up to and including the offending message,
scored 0 for that turn as in the reference, and nothing after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from envace_jax import parallel
from envace_jax.rewards.judges import Judged, RuleJudge
from envace_jax.rl.batch import TrajectoryBatch, from_numpy, pad_to_bucket, smallest_fitting_bucket
from envace_jax.rollout.episodes import Episode, build_episodes
from envace_jax.sampling.chat_spec import later_user_turns
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.codes import Status
from envace_jax.text.role_pieces import prompt_ids


@dataclasses.dataclass
class RolloutBatch:
    """A judged rollout batch. `batch` is host NumPy, padded to a length bucket."""

    batch: TrajectoryBatch
    episodes: list[Episode]
    tasks: list[Any]  # per row
    stats: dict[str, float]


@dataclasses.dataclass(frozen=True)
class GroupSampling:
    """How the rollouts of a batch sample: `group_size` trajectories of every task, keyed by
    `key`, each of up to `max_new_tokens` tokens; rows padded to one of `length_buckets` (and
    to `batch_size` rows)."""

    group_size: int
    key: jax.Array
    sampling: SamplingParams
    max_new_tokens: int
    length_buckets: Sequence[int]
    batch_size: int | None = None


def task_prompts(tokenizer, tasks: Sequence[Any]) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Prompt ids (opening messages + generation prompt) and later user turns of each task."""
    prompts = [prompt_ids(tokenizer, t.messages, t.template_tools) for t in tasks]
    users = [later_user_turns(tokenizer, t.reference_messages) for t in tasks]
    return prompts, users


def rehearsal_rollouts(
    sampler: Sampler,
    tokenizer,
    tasks: Sequence[Any],
    group: GroupSampling,
    *,
    layout: parallel.RowLayout | None = None,
    judge=None,
) -> RolloutBatch:
    """Samples `group.group_size` world-rehearsal trajectories of every task and judges them
    (`judge(tasks, conversations) -> Judged`; None: the rule judge).

    Rows are task-major (row r is task r // group_size, its group). With a `layout` of those
    len(tasks) * group_size rows (multi-host), this process samples, judges and returns only
    its rows (`layout.rows`, global group ids, a length bucket agreed by all processes);
    `stats` cover every process's rows."""
    group_size, length_buckets = group.group_size, group.length_buckets
    all_rows = [t for t in tasks for _ in range(group_size)]
    index = np.arange(len(all_rows))
    if layout is not None:
        if layout.size != len(all_rows):
            raise ValueError(f"layout of {layout.size} rows for {len(all_rows)} rollouts")
        index = layout.rows
    rows = [all_rows[i] for i in index]
    prompts, users = task_prompts(tokenizer, rows)
    out = sampler.generate(
        prompts,
        key=group.key,
        sampling=group.sampling,
        max_new_tokens=group.max_new_tokens,
        user_turns=users,
        layout=layout,
    )
    episodes = build_episodes(tokenizer, rows, out)
    judged = judge_episodes(judge, rows, episodes)
    rewards = judged.rewards
    group_ids = index // group_size
    lengths = np.asarray([ep.end for ep in episodes], np.int32)
    if layout is not None:  # every process's rows padded to the same length
        longest = parallel.process_max(int(lengths.max(initial=1)))
        length_buckets = (smallest_fitting_bucket(longest, length_buckets),)
    batch = judged_batch(
        tokenizer, out, episodes, rewards, group_ids, length_buckets, batch_size=group.batch_size
    )
    stats = rollout_stats(episodes, rewards, lengths, everywhere=layout is not None)
    return RolloutBatch(batch, episodes, rows, {**stats, **judged.stats})


def judge_episodes(judge, tasks: Sequence[Any], episodes: Sequence[Episode]) -> Judged:
    """Each episode's reward by `judge` (None: the rule judge)."""
    return (judge or RuleJudge())(tasks, [ep.messages for ep in episodes])


def judged_batch(
    tokenizer,
    out,
    episodes: Sequence[Episode],
    rewards: np.ndarray,
    group: np.ndarray,
    length_buckets: Sequence[int],
    batch_size: int | None = None,
) -> TrajectoryBatch:
    """The training batch of sampled rows (`sampling.loop.Trajectories` [B, T]) and their
    episodes: each row cut at its episode's end (an invalid message is its last), with its
    reward [B] and group [B], padded to a length bucket (and to `batch_size` rows)."""
    lengths = np.asarray([ep.end for ep in episodes], np.int32)
    past = np.arange(out.tokens.shape[1])[None, :] >= lengths[:, None]
    batch = from_numpy(
        tokens=np.where(past, tokenizer.pad_token_id, out.tokens),
        roles=np.where(past, 0, out.roles),
        segments=np.where(past, 0, out.segments),
        logprobs=np.where(past, 0.0, out.logprobs),
        lengths=lengths,
        group=group,
        reward=rewards,
        status=[ep.status for ep in episodes],
    )
    return pad_to_bucket(
        batch, length_buckets, batch_size=batch_size, pad_id=tokenizer.pad_token_id
    )


def rollout_stats(
    episodes: Sequence[Episode],
    rewards: np.ndarray,
    lengths: np.ndarray,
    everywhere: bool = False,
) -> dict:
    """Means over the rows (over every process's rows when `everywhere`: a collective)."""
    status = np.asarray([ep.status for ep in episodes])
    per_row = {
        "reward": rewards,
        "reward_sq": np.square(rewards),
        "tokens_mean": lengths,
        "calls_mean": [len(ep.calls) for ep in episodes],
        "final_reply_rate": [ep.final_reply is not None for ep in episodes],
    }
    for code in Status.stopped():
        per_row[f"status_{code.label}"] = status == code
    sums = np.asarray([len(episodes)] + [np.sum(np.asarray(v, float)) for v in per_row.values()])
    if everywhere:
        sums = parallel.process_sum(sums)
    means = dict(zip(per_row, sums[1:] / max(sums[0], 1), strict=True))
    means["reward_std"] = float(np.sqrt(max(means.pop("reward_sq") - means["reward"] ** 2, 0.0)))
    return {k: float(v) for k, v in means.items()}
