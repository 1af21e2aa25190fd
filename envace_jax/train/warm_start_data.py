"""The warm start's data: the encoded demonstrations and the padded batch of a step's rows.

Each demonstration is one training task's oracle conversation (`text.trajectory.
EncodedConversation`): the agent's messages as ACT targets and the real environment's responses
as REHEARSE targets. A share `data.failure_demos` shows a failing call and its recovery (the
domain's `demonstrations`). A share `data.simulator_demos` also gives one simulator row per
tool turn: the grounded rehearsal view's prompt with the real response as the target
(`rollout.grounded`). A share `rehearsal.sft_memory_fraction` of the tasks also gives one more
row: the reference conversation with a rehearsal memory in its prompt (exact, wrong so that the
policy learns to check it, or empty; `testtime.demonstrations`), what test-time rehearsal
gives the committed run. Both are extra rows, so the plain demonstrations keep the shares of
their demonstrators (the imperfect one included).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from envace_jax import parallel
from envace_jax.envs.base import Domain
from envace_jax.rl.batch import from_numpy, pad_to_bucket, smallest_fitting_bucket
from envace_jax.rollout.grounded import simulator_demonstrations
from envace_jax.testtime.demonstrations import memory_demonstrations


def demonstrations(config, domain: Domain, tasks: Sequence, tokenizer) -> list:
    """One encoded demonstration per task (see the module docstring), then the simulator rows
    of a share `data.simulator_demos` of them (`rollout.grounded`), then the memory rows of a
    share `rehearsal.sft_memory_fraction` (`testtime.demonstrations`)."""
    d = config.data
    drawn = (d.failure_demos, config.seed, d.unfinished_demos, d.default_action_demos)
    demos = domain.demonstrations(tasks, tokenizer, *drawn)
    if config.data.simulator_demos > 0:
        share = config.data.simulator_demos
        chosen = [
            i
            for i in range(len(tasks))
            if random.Random(f"{config.seed}-{i}-simulator").random() < share
        ]
        demos += simulator_demonstrations(
            tokenizer, [tasks[i] for i in chosen], [demos[i] for i in chosen]
        )
    fraction = config.rehearsal.sft_memory_fraction
    if fraction > 0:  # extra rows: the plain demonstrations keep their demonstrators' shares
        # each memory row shows its task's demonstrator, with a memory of its calls
        shown = domain.demonstration_messages and domain.demonstration_messages(tasks, *drawn)
        with_memory = memory_demonstrations(
            tasks,
            tokenizer,
            domain.make_env,
            fraction=fraction,
            seed=config.seed,
            shown=shown,
            swaps=config.rehearsal.sft_memory_swaps,
        )
        demos += [with_memory[i] for i in sorted(with_memory)]
    return demos


def rows_batch(rows: Sequence, group: Sequence[int], pad_id: int):
    """The trajectory batch of encoded demonstrations `rows`, right-padded to the longest; `group`
    is each row's global row index (its own group: the warm start has no baselines)."""
    T = max(len(r.ids) for r in rows)
    tokens = np.full((len(rows), T), pad_id, np.int32)
    roles = np.zeros((len(rows), T), np.int8)
    segments = np.zeros((len(rows), T), np.int32)
    for b, r in enumerate(rows):
        n = len(r.ids)
        tokens[b, :n], roles[b, :n], segments[b, :n] = r.ids, r.roles, r.segments
    return from_numpy(
        tokens=tokens,
        roles=roles,
        segments=segments,
        lengths=[len(r.ids) for r in rows],
        group=group,
        reward=np.zeros(len(rows)),
    )


def bucketed_batch(rows: Sequence, group: Sequence[int], pad_id: int, buckets: Sequence[int]):
    """`rows_batch`, padded to the smallest length bucket that holds the longest row of any
    process (every process pads to the same bucket)."""
    batch = rows_batch(rows, group, pad_id)
    longest = parallel.process_max(batch.tokens.shape[1])
    bucket = smallest_fitting_bucket(longest, buckets)
    return pad_to_bucket(batch, (bucket,), pad_id=pad_id)
