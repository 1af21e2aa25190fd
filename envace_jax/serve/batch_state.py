"""The running batch's device state and the compiled operations on its rows.

A `Batch` pairs the decode loop's state (`loop.LoopState`, B rows, a buffer of T positions)
with the host's view of it: which `Sequence` each row serves and its prompt length. The
functions here move rows between states (insert, regroup), grow the buffer, stop rows, and read
back the tokens a chunk wrote; `batcher.Engine` jit-compiles them once. Sizes are bucketed
(`half_octave_bucket`, see `batcher`'s docstring), so they compile a handful of programs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.models.decoder import zero_pad
from envace_jax.sampling import loop
from envace_jax.serve.sequences import Sequence
from envace_jax.text.codes import Status


def half_octave_bucket(n: int, minimum: int = 16) -> int:
    """The smallest of minimum * (1, 1.5, 2, 3, 4, 6, ...) that is >= n (see `batcher`'s
    docstring: padding waste at most a third instead of a half)."""
    b = minimum
    while True:
        for size in (b, b * 3 // 2):
            if size >= n:
                return size
        b *= 2


@dataclasses.dataclass
class Batch:
    state: loop.LoopState
    rows: list[Sequence | None]  # slot -> sequence
    prompt_len: np.ndarray  # int [B]

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def max_len(self) -> int:
        return int(self.state.tokens.shape[1])


def insert_rows(big: loop.LoopState, small: loop.LoopState, slots: jax.Array) -> loop.LoopState:
    """Writes the rows of `small` [b, ...] into rows `slots` [b] of `big` [B, ...].

    Slots >= B are dropped (padding rows). The step counter and PRNG key stay the batch's.
    """
    updates = {}
    for field in dataclasses.fields(loop.LoopState):
        name = field.name
        if name in ("key", "step"):
            continue
        a, b = getattr(big, name), getattr(small, name)
        if name == "cache":
            updates[name] = a.put_rows(slots, b)
        else:
            updates[name] = a.at[slots].set(b.astype(a.dtype), mode="drop")
    return big.replace(**updates)


def grow_buffer(state: loop.LoopState, budget: jax.Array, *, max_len: int) -> loop.LoopState:
    """`state` with a buffer of `max_len` positions (>= its own), each row's budget [B] clipped
    to it. The new positions are empty: no row has written there."""
    fields = ("tokens", "roles", "segments", "logprobs")
    per_position = {k: zero_pad(getattr(state, k), 1, max_len) for k in fields}
    return state.replace(
        **per_position,
        cache=state.cache.grow(max_len),
        budget=jnp.minimum(budget, max_len).astype(state.budget.dtype),
    )


def token_window(tokens: jax.Array, logprobs: jax.Array, start: jax.Array, width: int):
    """tokens / logprobs [B, T] -> the `width` entries of each row from start [B]: [B, width]."""
    T = tokens.shape[1]
    idx = jnp.minimum(start[:, None] + jnp.arange(width, dtype=jnp.int32)[None], T - 1)
    return (
        jnp.take_along_axis(tokens, idx, axis=1),
        jnp.take_along_axis(logprobs, idx, axis=1),
    )


def release(state: loop.LoopState) -> None:
    """Frees a state's buffers now, not whenever a garbage collection finds them: the next
    state allocates its own, and two batches' KV caches at once would set the peak."""
    jax.tree.map(lambda a: a.delete(), state)


def regroup(state: loop.LoopState, slots: jax.Array, live: jax.Array) -> loop.LoopState:
    """The rows `slots` [b] of `state` as a batch of b rows; rows where `live` [b] is False are
    stopped padding (free slots of the new batch)."""
    state = loop.take_rows(state, slots)
    status = jnp.where(live, state.status, Status.FINISHED)
    return state.replace(status=status.astype(state.status.dtype))


def cancel_rows(state: loop.LoopState, rows: jax.Array) -> loop.LoopState:
    """Stops rows (bool [B]) that are still running; their slots can then be reused."""
    running = state.status == Status.RUNNING
    status = jnp.where(rows & running, Status.FINISHED, state.status)
    return state.replace(status=status.astype(state.status.dtype))
