"""What the decode loop (`sampling.loop`) carries and returns: `TurnSpec`, the static chat
layout it drives; `LoopState`, its per-row state; the row operations that let a caller decode
some rows on; and `Trajectories`, the host-side result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

LOOP_MODES = ("generate", "rehearse", "host")  # values of TurnSpec.mode


@dataclasses.dataclass(frozen=True)
class TurnSpec:
    """Static description of the chat layout the loop drives (hashable: a jit static argument).

    end_id: the id that ends every generated message (`<|im_end|>`).
    tool_call_id: the id that opens a tool call (`<tool_call>`); an ACT message containing it
      asked for tools.
    abort_ids: ids that end a row as INVALID when generated (e.g. `<|endoftext|>`).
    act_to_rehearse / rehearse_to_act: glue ids between an ACT message and the rehearsed
      response body, and between that body and the next ACT message (from the chat template).
    mode: 'generate', 'rehearse' or 'host' (see the `sampling.loop` docstring).
    max_turns: the most ACT messages a row may write.
    max_message_tokens: the most tokens one generated message may have.
    """

    end_id: int
    tool_call_id: int
    abort_ids: tuple[int, ...] = ()
    act_to_rehearse: tuple[int, ...] = ()
    rehearse_to_act: tuple[int, ...] = ()
    mode: str = "rehearse"
    max_turns: int = 8
    max_message_tokens: int = 512

    def __post_init__(self):
        if self.mode not in LOOP_MODES:
            raise ValueError(f"TurnSpec.mode must be one of {LOOP_MODES}, got {self.mode!r}")
        if self.mode == "rehearse" and not (self.act_to_rehearse and self.rehearse_to_act):
            raise ValueError("TurnSpec: mode 'rehearse' needs act_to_rehearse and rehearse_to_act")
        if self.max_turns < 1 or self.max_message_tokens < 1:
            raise ValueError("TurnSpec: max_turns and max_message_tokens must be >= 1")


@struct.dataclass
class LoopState:
    """Everything the loop carries. Arrays are [B, ...]; T is the buffer length."""

    tokens: jax.Array  # int32 [B, T]
    roles: jax.Array  # int8 [B, T]
    segments: jax.Array  # int32 [B, T]
    logprobs: jax.Array  # float32 [B, T]
    length: jax.Array  # int32 [B]: tokens written
    budget: jax.Array  # int32 [B]: the most tokens the row may hold (<= T)
    cache: Any  # the model's (`init_cache`): a models.decoder.KVCache or models.layered.LayerCache
    role: jax.Array  # int8 [B]: role of the message being generated (ACT / REHEARSE)
    segment: jax.Array  # int32 [B]: segments opened so far
    in_message: jax.Array  # bool [B]: a generated message is open
    message_tokens: jax.Array  # int32 [B]: tokens in the open message
    called_tool: jax.Array  # bool [B]: the open ACT message wrote tool_call_id
    act_turns: jax.Array  # int32 [B]: ACT messages completed
    user_turn: jax.Array  # int32 [B]: index of the user turn being answered (0 = prompt)
    queue: jax.Array  # int32 [B, Q]: forced tokens
    queue_len: jax.Array  # int32 [B]
    queue_pos: jax.Array  # int32 [B]
    status: jax.Array  # int8 [B]: Status
    user_turns: jax.Array  # int32 [B, U, Q]: later user turns (glue included), replayed
    user_turn_lens: jax.Array  # int32 [B, U]
    num_user_turns: jax.Array  # int32 [B]: how many later user turns each row has
    key: jax.Array  # PRNG key
    step: jax.Array  # int32 []: decode steps taken


# LoopState fields that are not per row: everything else is [B, ...]; the cache has its own
# row methods.
_SHARED_FIELDS = ("cache", "key", "step")


def take_rows(state: LoopState, rows: jax.Array) -> LoopState:
    """The state of rows `rows` [b] alone: a smaller batch that decodes as those rows would
    (with `decode(noise_rows=rows)`), for a host turn that resumes only some rows."""
    per_row = {
        f.name: getattr(state, f.name)[rows]
        for f in dataclasses.fields(state)
        if f.name not in _SHARED_FIELDS
    }
    return state.replace(cache=state.cache.take_rows(rows), **per_row)


def put_rows(state: LoopState, part: LoopState, rows: jax.Array) -> LoopState:
    """`state` with rows `rows` [b] replaced by `part` (a `take_rows` state decoded on), and
    its step counter."""
    per_row = {
        f.name: getattr(state, f.name).at[rows].set(getattr(part, f.name))
        for f in dataclasses.fields(state)
        if f.name not in _SHARED_FIELDS
    }
    cache = state.cache.put_rows(rows, part.cache)
    return state.replace(cache=cache, step=part.step, **per_row)


@struct.dataclass
class Trajectories:
    """Host-side result of a decode: numpy arrays in the trajectory layout of docs/design.md."""

    tokens: np.ndarray  # int32 [B, T] (right-padded with pad_id)
    roles: np.ndarray  # int8 [B, T]
    segments: np.ndarray  # int32 [B, T]
    logprobs: np.ndarray  # float32 [B, T]
    lengths: np.ndarray  # int32 [B]
    status: np.ndarray  # int8 [B]
    act_turns: np.ndarray  # int32 [B]


def to_trajectories(state: LoopState, pad_id: int) -> Trajectories:
    """Copies the finished state to the host, padding past each row's length with pad_id."""
    length = np.asarray(state.length)
    T = state.tokens.shape[1]
    past = np.arange(T)[None, :] >= length[:, None]
    return Trajectories(
        tokens=np.where(past, pad_id, np.asarray(state.tokens)).astype(np.int32),
        roles=np.where(past, 0, np.asarray(state.roles)).astype(np.int8),
        segments=np.where(past, 0, np.asarray(state.segments)).astype(np.int32),
        logprobs=np.where(past, 0.0, np.asarray(state.logprobs)).astype(np.float32),
        lengths=length.astype(np.int32),
        status=np.asarray(state.status).astype(np.int8),
        act_turns=np.asarray(state.act_turns).astype(np.int32),
    )
