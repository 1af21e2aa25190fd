"""The trajectory batch the train steps consume, and host-side helpers to check and pad it.

One row is one whole trajectory rendered as one token sequence. Every token carries a role
(CONTEXT / ACT / REHEARSE) and every generated message a segment id 1..S, numbered in order, so
the loss can weight messages the way a one-row-per-message trainer would while encoding each
token once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from envace_jax.text.codes import Role, Status

_DTYPES = {
    "tokens": np.int32,
    "roles": np.int8,
    "segments": np.int32,
    "logprobs": np.float32,
    "lengths": np.int32,
    "group": np.int32,
    "reward": np.float32,
    "status": np.int8,
}
_PER_TOKEN = ("tokens", "roles", "segments", "logprobs")
_PER_ROW = ("lengths", "group", "reward", "status")


@struct.dataclass
class TrajectoryBatch:
    """A batch of B trajectories, each right-padded to T tokens.

    Attributes:
      tokens: [B, T] int32, the sequence; padding holds the pad id.
      roles: [B, T] int8, a `Role` per token.
      segments: [B, T] int32, 0 on context, 1..S numbering the row's generated messages in order.
      logprobs: [B, T] float32, log-prob of each generated token under the sampling policy (0
        elsewhere).
      lengths: [B] int32, tokens used; a padding row has length 0.
      group: [B] int32, instruction index in [0, B): the K rollouts of one instruction share it.
      reward: [B] float32, trajectory reward (in [0, 1] from the judges).
      status: [B] int8, a `Status.stopped()` code.
    """

    tokens: jax.Array
    roles: jax.Array
    segments: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    group: jax.Array
    reward: jax.Array
    status: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T)."""
        return tuple(self.tokens.shape)


def from_numpy(**fields) -> TrajectoryBatch:
    """Builds a batch from array-likes, casting each field to its documented dtype.

    `logprobs` defaults to zeros, `status` to Status.FINISHED and `lengths` to T.
    """
    tokens = np.asarray(fields["tokens"])
    if tokens.ndim != 2:
        raise ValueError(f"TrajectoryBatch.tokens: expected [B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    fields.setdefault("logprobs", np.zeros((b, t), np.float32))
    fields.setdefault("status", np.full((b,), Status.FINISHED))
    fields.setdefault("lengths", np.full((b,), t))
    unknown = sorted(set(fields) - set(_DTYPES))
    if unknown:
        raise ValueError(f"TrajectoryBatch: unknown field(s) {unknown}; known: {list(_DTYPES)}")
    missing = sorted(set(_DTYPES) - set(fields))
    if missing:
        raise ValueError(f"TrajectoryBatch: missing field(s) {missing}")
    return TrajectoryBatch(**{k: np.asarray(v).astype(_DTYPES[k]) for k, v in fields.items()})


def validate(batch: TrajectoryBatch) -> None:
    """Checks shapes, dtypes and the role/segment layout on the host; raises naming field and row.

    Rules: roles in {0, 1, 2}; position 0 is context; segment 0 exactly on context tokens; each
    segment one contiguous run of a single role; segments numbered 1, 2, ... in order; nothing
    generated past `lengths`; 0 <= group < B; finite reward and generated-token logprobs.
    """
    arrays = {k: np.asarray(getattr(batch, k)) for k in _DTYPES}
    b, t = arrays["tokens"].shape if arrays["tokens"].ndim == 2 else (None, None)
    if b is None:
        raise ValueError(f"TrajectoryBatch.tokens: expected [B, T], got {arrays['tokens'].shape}")
    for k in _DTYPES:
        want = (b, t) if k in _PER_TOKEN else (b,)
        if arrays[k].shape != want:
            raise ValueError(f"TrajectoryBatch.{k}: expected shape {want}, got {arrays[k].shape}")
        integer = np.issubdtype(_DTYPES[k], np.integer)
        if integer and not np.issubdtype(arrays[k].dtype, np.integer):
            raise ValueError(f"TrajectoryBatch.{k}: expected integers, got {arrays[k].dtype}")
    roles, segs, lengths = arrays["roles"], arrays["segments"], arrays["lengths"]

    def fail(field: str, rows: np.ndarray, what: str):
        row = int(np.nonzero(rows)[0][0])
        raise ValueError(f"TrajectoryBatch.{field}: row {row}: {what}")

    fail_rows = ((roles < 0) | (roles >= len(Role))).any(1)
    if fail_rows.any():
        fail("roles", fail_rows, f"role outside [0, {len(Role)})")
    if ((lengths < 0) | (lengths > t)).any():
        fail("lengths", (lengths < 0) | (lengths > t), f"length outside [0, {t}]")
    gen = roles != Role.CONTEXT
    if ((segs > 0) != gen).any():
        fail(
            "segments",
            ((segs > 0) != gen).any(1),
            "segment id must be > 0 exactly on ACT and REHEARSE tokens and 0 on context tokens",
        )
    if gen[:, 0].any():
        fail("roles", gen[:, 0], "position 0 must be context (no prefix predicts it)")
    past_end = gen & (np.arange(t)[None, :] >= lengths[:, None])
    if past_end.any():
        fail("roles", past_end.any(1), "generated token at or after lengths[row]")
    # Segment layout: between consecutive generated tokens of a row the id either stays (same
    # message: adjacent, same role) or grows by one (next message); the first id is 1.
    for i in np.nonzero(gen.any(1))[0]:
        pos = np.nonzero(gen[i])[0]
        s, r = segs[i, pos], roles[i, pos]
        if s[0] != 1:
            raise ValueError(
                f"TrajectoryBatch.segments: row {i}: first message has id {s[0]}, expected 1"
            )
        ds, dp = np.diff(s), np.diff(pos)
        same = ds == 0
        bad = ~(same | (ds == 1)) | (same & (dp != 1)) | (same & (np.diff(r) != 0))
        if bad.any():
            j = int(pos[1:][bad][0])
            raise ValueError(
                f"TrajectoryBatch.segments: row {i}, position {j}: messages must be contiguous "
                "runs of one role numbered 1, 2, ... in order"
            )
    group = arrays["group"]
    if ((group < 0) | (group >= b)).any():
        fail(
            "group", (group < 0) | (group >= b), f"group id outside [0, {b}) (use renumber_groups)"
        )
    if not np.isfinite(arrays["reward"]).all():
        fail("reward", ~np.isfinite(arrays["reward"]), "reward is not finite")
    bad_lp = gen & ~np.isfinite(arrays["logprobs"])
    if bad_lp.any():
        fail("logprobs", bad_lp.any(1), "non-finite logprob on a generated token")


def renumber_groups(instruction_ids: Sequence) -> np.ndarray:
    """Maps arbitrary instruction keys to dense group ids 0..G-1 in order of first appearance."""
    index: dict = {}
    return np.asarray([index.setdefault(k, len(index)) for k in instruction_ids], np.int32)


def smallest_fitting_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n; buckets keep the step from recompiling for every length."""
    fitting = [x for x in sorted(buckets) if x >= n]
    if not fitting:
        raise ValueError(f"length {n} exceeds the largest bucket {max(buckets)}")
    return fitting[0]


def pad(
    batch: TrajectoryBatch,
    *,
    seq_len: int | None = None,
    batch_size: int | None = None,
    pad_id: int = 0,
) -> TrajectoryBatch:
    """Right-pads to [batch_size, seq_len] on the host (NumPy).

    Padded tokens are context with the pad id; padded rows have length 0 and no messages, so they
    change neither baselines nor losses. Their group is 0 (any valid id works, they carry no
    outputs) and their status Status.FINISHED.
    """
    b, t = batch.shape
    seq_len = t if seq_len is None else seq_len
    batch_size = b if batch_size is None else batch_size
    if seq_len < t or batch_size < b:
        raise ValueError(f"cannot pad a [{b}, {t}] batch down to [{batch_size}, {seq_len}]")
    fill = {"tokens": pad_id, "status": int(Status.FINISHED)}
    out = {}
    for k in _DTYPES:
        x = np.asarray(getattr(batch, k))
        widths = [(0, batch_size - b)] + ([(0, seq_len - t)] if k in _PER_TOKEN else [])
        out[k] = np.pad(x, widths, constant_values=fill.get(k, 0)).astype(_DTYPES[k])
    return TrajectoryBatch(**out)


def pad_to_bucket(
    batch: TrajectoryBatch,
    buckets: Sequence[int],
    *,
    batch_size: int | None = None,
    pad_id: int = 0,
) -> TrajectoryBatch:
    """Fits the sequence axis to the smallest bucket holding the longest row, cutting columns
    past every row's length or padding; pads rows up to `batch_size`.
    """
    longest = int(np.max(np.asarray(batch.lengths), initial=1))
    seq_len = smallest_fitting_bucket(longest, buckets)
    if seq_len < batch.shape[1]:
        batch = TrajectoryBatch(
            **{
                k: np.asarray(getattr(batch, k))[:, :seq_len]
                if k in _PER_TOKEN
                else getattr(batch, k)
                for k in _DTYPES
            }
        )
    return pad(batch, seq_len=seq_len, batch_size=batch_size, pad_id=pad_id)
