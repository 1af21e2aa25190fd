"""One token's change to the decode loop's state: writing each running row's next token
(`write_token`), then what a message that ended does to the row (`transition`: the table in
the `sampling.loop` module docstring).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from envace_jax.sampling.loop_state import LoopState, TurnSpec
from envace_jax.text.codes import Role, Status


def _padded(ids: tuple[int, ...], width: int) -> jax.Array:
    return jnp.asarray(list(ids) + [0] * (width - len(ids)), jnp.int32)


class Written(NamedTuple):
    """What one step wrote, per row [B]: the token, and which rows wrote / sampled / opened."""

    tok: jax.Array  # the token written: the next queued one, or the sampled one
    active: jax.Array  # the row was RUNNING, so it wrote a token
    generated: jax.Array  # the token was sampled (nothing was queued)
    opens: jax.Array  # the sampled token opens a new message (segment)


def write_token(s: LoopState, sampled: jax.Array, logprob: jax.Array):
    """Writes each running row's next token (queued, tagged CONTEXT; else sampled, tagged with
    the row's role) and its role, segment and log-prob. Returns the state and `Written`."""
    B, T = s.tokens.shape
    rows = jnp.arange(B)
    active = s.status == Status.RUNNING
    forced = s.queue_pos < s.queue_len
    generated = active & ~forced
    tok = jnp.where(forced, s.queue[rows, jnp.minimum(s.queue_pos, s.queue.shape[1] - 1)], sampled)
    opens = generated & ~s.in_message
    segment = s.segment + opens
    write_at = jnp.minimum(s.length, T - 1)

    def put(buf, value):
        return buf.at[rows, write_at].set(jnp.where(active, value, buf[rows, write_at]))

    written = s.replace(
        tokens=put(s.tokens, tok),
        roles=put(s.roles, jnp.where(forced, Role.CONTEXT, s.role).astype(jnp.int8)),
        segments=put(s.segments, jnp.where(forced, 0, segment)),
        logprobs=put(s.logprobs, jnp.where(forced, 0.0, logprob)),
        length=s.length + active,
        queue_pos=s.queue_pos + (active & forced),
        message_tokens=jnp.where(opens, 0, s.message_tokens) + generated,
        segment=segment,
    )
    return written, Written(tok, active, generated, opens)


def transition(spec: TurnSpec, s: LoopState, w: Written) -> LoopState:
    """The state change after the token `w` (the `sampling.loop` docstring's table): a message that
    ended queues its glue or the next user turn and switches role, or stops the row."""
    rows = jnp.arange(s.tokens.shape[0])
    is_act = s.role == Role.ACT
    ended = w.generated & (w.tok == spec.end_id)
    aborted = w.generated & jnp.isin(w.tok, jnp.asarray(spec.abort_ids or (-1,), jnp.int32))
    called_tool = s.called_tool | (w.generated & is_act & (w.tok == spec.tool_call_id))
    act_tool_end = ended & is_act & called_tool
    act_final_end = ended & is_act & ~called_tool
    rehearse_end = ended & ~is_act
    act_turns = s.act_turns + (ended & is_act)

    status = s.status
    role = s.role
    # A message can only end while the queue is drained; start every transition empty.
    queue = s.queue
    queue_len = jnp.where(ended, 0, s.queue_len)

    def enqueue(cond, ids_row, n):
        return jnp.where(cond[:, None], ids_row, queue), jnp.where(cond, n, queue_len)

    # ACT called tools.
    over_turns = act_tool_end & (act_turns >= spec.max_turns)
    if spec.mode == "rehearse":
        go = act_tool_end & ~over_turns
        queue, queue_len = enqueue(
            go, _padded(spec.act_to_rehearse, queue.shape[1])[None], len(spec.act_to_rehearse)
        )
        role = jnp.where(go, Role.REHEARSE, role)
        status = jnp.where(over_turns, Status.TURN_LIMIT, status)
    elif spec.mode == "host":
        status = jnp.where(over_turns, Status.TURN_LIMIT, status)
        status = jnp.where(act_tool_end & ~over_turns, Status.AWAITING_ENV, status)
    else:
        status = jnp.where(act_tool_end, Status.FINISHED, status)
    # REHEARSE finished its response.
    queue, queue_len = enqueue(
        rehearse_end,
        _padded(spec.rehearse_to_act, queue.shape[1])[None],
        len(spec.rehearse_to_act),
    )
    role = jnp.where(rehearse_end, Role.ACT, role)
    # A final reply: replay the next user turn, or finish.
    has_next = s.user_turn < s.num_user_turns
    next_turn = act_final_end & has_next
    U = s.user_turns.shape[1]
    if U:
        idx = jnp.minimum(s.user_turn, U - 1)
        queue, queue_len = enqueue(next_turn, s.user_turns[rows, idx], s.user_turn_lens[rows, idx])
    status = jnp.where(act_final_end & ~has_next, Status.FINISHED, status)
    status = jnp.where(aborted, Status.INVALID, status)
    # Budgets: a message too long, or no room for the next token.
    too_long = w.generated & ~ended & (s.message_tokens >= spec.max_message_tokens)
    full = w.active & (s.length >= s.budget)
    status = jnp.where((too_long | full) & (status == Status.RUNNING), Status.TRUNCATED, status)

    return s.replace(
        role=role.astype(jnp.int8),
        in_message=(s.in_message | w.opens) & ~ended,
        called_tool=called_tool & ~ended,
        act_turns=act_turns,
        user_turn=s.user_turn + next_turn,
        queue=queue,
        queue_len=queue_len,
        queue_pos=jnp.where(ended, 0, s.queue_pos),
        status=status.astype(jnp.int8),
    )
