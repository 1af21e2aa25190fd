"""Synthetic trajectory batches for tests and benchmarks (NumPy, seeded).

`random_batch` draws arbitrary valid layouts (adjacent messages, one-token "empty" messages,
rows without messages, padding rows, groups missing a role). `multi_turn_batch` lays out
demo-like agent trajectories: a prompt, then per turn an ACT message followed by a REHEARSE
response wrapped in context glue, ending with a final ACT reply.
"""

from __future__ import annotations

import numpy as np

from envace_jax.rl.batch import TrajectoryBatch, from_numpy
from envace_jax.text.codes import Role


def random_batch(
    rng: np.random.Generator,
    *,
    batch_size: int,
    seq_len: int,
    num_groups: int,
    vocab_size: int = 64,
    padding_rows: int = 0,
    empty_prob: float = 0.15,
    no_message_prob: float = 0.1,
    single_role_groups: int = 1,
) -> TrajectoryBatch:
    """A valid batch with random message layout.

    Rows 0..batch_size-padding_rows-1 are trajectories of group `row % num_groups`; the last
    `padding_rows` rows are padding (length 0). The first `single_role_groups` groups only
    hold ACT messages, so their REHEARSE baseline has no outputs.
    """
    b, t = batch_size, seq_len
    tokens = rng.integers(1, vocab_size, (b, t))
    roles = np.zeros((b, t), np.int8)
    segs = np.zeros((b, t), np.int32)
    lengths = np.zeros(b, np.int32)
    group = np.zeros(b, np.int32)
    for i in range(b - padding_rows):
        group[i] = i % num_groups
        length = int(rng.integers(max(2, t // 2), t + 1))
        lengths[i] = length
        if rng.random() < no_message_prob:
            continue
        pos, seg = int(rng.integers(1, 6)), 0
        while pos < length:
            n = 1 if rng.random() < empty_prob else int(rng.integers(2, 9))
            n = min(n, length - pos)
            if group[i] < single_role_groups:
                role = Role.ACT
            else:
                role = Role.ACT if rng.random() < 0.5 else Role.REHEARSE
            seg += 1
            roles[i, pos : pos + n] = role
            segs[i, pos : pos + n] = seg
            pos += n + int(rng.integers(0, 5))  # a gap of 0 makes adjacent messages
    tokens[np.arange(t)[None, :] >= lengths[:, None]] = 0
    logprobs = np.where(segs > 0, -rng.exponential(1.0, (b, t)), 0.0)
    reward = np.round(rng.random(b), 2) * (lengths > 0)
    return from_numpy(
        tokens=tokens,
        roles=roles,
        segments=segs,
        logprobs=logprobs,
        lengths=lengths,
        group=group,
        reward=reward,
    )


def multi_turn_batch(
    rng: np.random.Generator,
    *,
    batch_size: int,
    group_size: int,
    turns: int,
    prompt_len: int,
    act_len: int,
    rehearse_len: int,
    glue_len: int = 4,
    vocab_size: int = 512,
) -> TrajectoryBatch:
    """Demo-like trajectories, all of the same layout, right-padded to their common length.

    Layout: prompt (context), then `turns` times [ACT act_len, glue, REHEARSE rehearse_len,
    glue], then a final ACT reply of act_len. Message lengths vary by +-25% per message.
    """
    if batch_size % group_size:
        raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}")

    def jitter(n):
        return max(2, int(round(n * rng.uniform(0.75, 1.25))))

    rows = []
    for _ in range(batch_size):
        layout = [(Role.CONTEXT, prompt_len)]
        for _ in range(turns):
            layout += [(Role.ACT, jitter(act_len)), (Role.CONTEXT, glue_len)]
            layout += [(Role.REHEARSE, jitter(rehearse_len)), (Role.CONTEXT, glue_len)]
        layout.append((Role.ACT, jitter(act_len)))
        rows.append(layout)
    seq_len = max(sum(n for _, n in layout) for layout in rows)
    roles = np.zeros((batch_size, seq_len), np.int8)
    segs = np.zeros((batch_size, seq_len), np.int32)
    lengths = np.zeros(batch_size, np.int32)
    for i, layout in enumerate(rows):
        pos, seg = 0, 0
        for role, n in layout:
            if role:
                seg += 1
                roles[i, pos : pos + n] = role
                segs[i, pos : pos + n] = seg
            pos += n
        lengths[i] = pos
    tokens = rng.integers(1, vocab_size, (batch_size, seq_len))
    tokens[np.arange(seq_len)[None, :] >= lengths[:, None]] = 0
    return from_numpy(
        tokens=tokens,
        roles=roles,
        segments=segs,
        lengths=lengths,
        logprobs=np.where(segs > 0, -rng.exponential(1.0, segs.shape), 0.0),
        group=np.arange(batch_size) // group_size,
        reward=rng.random(batch_size),
    )


def message_rows(batch: TrajectoryBatch) -> TrajectoryBatch:
    """The one-row-per-message layout of the reference: each generated message becomes a row
    holding its prefix (as context) and itself (its only segment), right-padded to T.

    Rows keep their trajectory's group and reward, so baselines and the message-mean loss are
    unchanged; only the tokens the model must process grow (quadratically in turns).
    """
    tokens, roles = np.asarray(batch.tokens), np.asarray(batch.roles)
    segs, logprobs = np.asarray(batch.segments), np.asarray(batch.logprobs)
    out = {
        k: []
        for k in ("tokens", "roles", "segments", "logprobs", "lengths", "group", "reward", "status")
    }
    t = tokens.shape[1]
    for i in range(tokens.shape[0]):
        for s in sorted(set(segs[i][segs[i] > 0].tolist())):
            pos = np.nonzero(segs[i] == s)[0]
            end = pos[-1] + 1
            mine = np.zeros(t, bool)
            mine[pos] = True
            out["tokens"].append(np.where(np.arange(t) < end, tokens[i], 0))
            out["roles"].append(np.where(mine, roles[i], 0))
            out["segments"].append(mine.astype(np.int32))
            out["logprobs"].append(np.where(mine, logprobs[i], 0.0))
            out["lengths"].append(end)
            for k in ("group", "reward", "status"):
                out[k].append(np.asarray(getattr(batch, k))[i])
    return from_numpy(**{k: np.stack(v) for k, v in out.items()})
