"""The compiled decode loop: plain generation, world rehearsal, and host turns in one state machine.

Every row of the batch is one trajectory, written token by token into a preallocated buffer
[B, T] together with its role tag and segment id (the trajectory format of docs/design.md).
Each loop step feeds every row's last written token through the decoder (one KV-cache slot per
position, see `models.decoder`) and chooses the row's next token:

* if the row has *forced* tokens queued (chat-template glue, or the next user turn), the next
  queued token is written, tagged CONTEXT, with log-prob 0;
* otherwise a token is sampled and tagged with the row's current role (ACT or REHEARSE); the
  first generated token after glue opens a new segment.

When a generated message ends (`end_id`, i.e. `<|im_end|>`), the row changes state:

==================  ===========================================================================
ACT, called a tool  mode 'rehearse': queue `act_to_rehearse` glue, role := REHEARSE.
                    mode 'host': pause the row (status AWAITING_ENV); the host executes the
                    calls and appends the observation with `append_tokens`, then decodes on.
                    mode 'generate': the row is finished.
ACT, no tool call   a final reply: queue the row's next user turn if it has one (replayed from
                    the task, as the reference does), else the row is finished.
REHEARSE            queue `rehearse_to_act` glue, role := ACT.
==================  ===========================================================================

A row also stops on a turn limit (ACT messages), on its token budget (TRUNCATED), on a message
longer than `max_message_tokens` (TRUNCATED), or on an `abort_ids` token such as
`<|endoftext|>` (INVALID: not a chat-template message end). Nothing returns to the host until
every row has stopped or paused; whether a finished ACT message parses as valid tool calls is
judged afterwards on the host, where it cannot crash the loop.

Feeding the last written token (instead of carrying logits from the previous step) lets the
prefill, a resumed loop and appended host tokens share one code path: re-feeding a token
rewrites its cache slot with the same values.

The loop's data (`TurnSpec`, `LoopState`, `Trajectories`) lives in `sampling.loop_state`, the
per-token state change in `sampling.transitions`; this module runs them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from envace_jax.models.protocols import Prefills
from envace_jax.sampling.distributions import RowSampling, SamplingParams, sample_next
from envace_jax.sampling.loop_state import (
    LOOP_MODES,
    LoopState,
    Trajectories,
    TurnSpec,
    put_rows,
    take_rows,
    to_trajectories,
)
from envace_jax.sampling.transitions import transition, write_token
from envace_jax.text.codes import Role, Status

# The loop's API, part of it defined with the loop's data (`loop_state`).
__all__ = [
    "LOOP_MODES",
    "LoopState",
    "Trajectories",
    "TurnSpec",
    "append_tokens",
    "apply_token_mask",
    "attention_windows",
    "decode",
    "init_state",
    "prefill",
    "put_rows",
    "take_rows",
    "to_trajectories",
]


def prefill(
    model,
    tokens: jax.Array,
    positions: jax.Array,
    cache: Any,
    kv_window: int | None = None,
    fresh: bool = False,
) -> Any:
    """Writes tokens into the cache; a model that `Prefills` (`models.protocols`) skips the LM
    head (and with `fresh`, positions 0..T-1 in every row, attends in causal blocks:
    `Decoder.prefill`); any other `CausalLM` runs its `__call__` and drops the logits."""
    if isinstance(model, Prefills):
        return model.prefill(tokens, positions, cache, kv_window, fresh)
    return model(tokens, positions, cache=cache, kv_window=kv_window)[1]


def attention_windows(max_len: int, smallest: int = 128) -> tuple[int, ...]:
    """The cache windows `decode` widens through: multiples of max(smallest, max_len / 8) up
    to max_len. A decode step reads every cached key and value in its window, and that read
    is most of its cost (demo policy, 64 rows: 17 ms at 128 slots, 60 ms at 1,024), so rows
    pay for about their own length rather than the whole buffer; eight windows at most keep
    the compiled loop to eight copies of the step."""
    step = max(smallest, max_len // 8)
    return (*range(step, max_len, step), max_len)


def _queue_width(spec: TurnSpec, user_turns_width: int) -> int:
    return max(len(spec.act_to_rehearse), len(spec.rehearse_to_act), user_turns_width, 1)


def init_state(
    graphdef: nnx.GraphDef,
    params: Any,
    prompts: jax.Array,
    prompt_lens: jax.Array,
    *,
    key: jax.Array,
    spec: TurnSpec,
    max_len: int,
    max_new_tokens: int | jax.Array,
    user_turns: jax.Array | None = None,
    user_turn_lens: jax.Array | None = None,
) -> LoopState:
    """Builds the state and prefills the cache with right-padded prompts [B, P].

    prompt_lens [B] >= 1. max_len: the buffer length T (static). max_new_tokens: per-row budget
    on top of the prompt (scalar or [B]). user_turns [B, U, W] / user_turn_lens [B, U]: the
    later user turns of multi-turn tasks, each already wrapped in its chat glue (final reply end
    -> user text -> assistant start); rows with fewer turns have length-0 entries.
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    B, P = prompts.shape
    if P > max_len:
        raise ValueError(f"prompts are {P} tokens long but max_len is {max_len}")
    model = nnx.merge(graphdef, params)
    if user_turns is None:
        user_turns = jnp.zeros((B, 0, 1), jnp.int32)
        user_turn_lens = jnp.zeros((B, 0), jnp.int32)
    user_turns = jnp.asarray(user_turns, jnp.int32)
    user_turn_lens = jnp.asarray(user_turn_lens, jnp.int32)
    width = _queue_width(spec, user_turns.shape[2])
    if user_turns.shape[2] < width:
        user_turns = jnp.pad(user_turns, ((0, 0), (0, 0), (0, width - user_turns.shape[2])))
    prompt_lens = jnp.asarray(prompt_lens, jnp.int32)

    tokens = jnp.zeros((B, max_len), jnp.int32).at[:, :P].set(prompts)
    # Under a mesh (a sampler row layout), the cache is split over devices like the rows.
    cache = model.init_cache(B, max_len).constrained()
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = prefill(model, prompts, positions, cache, kv_window=P, fresh=True)
    budget = jnp.minimum(prompt_lens + jnp.asarray(max_new_tokens, jnp.int32), max_len)
    zeros_b = jnp.zeros((B,), jnp.int32)
    return LoopState(
        tokens=tokens,
        roles=jnp.zeros((B, max_len), jnp.int8),
        segments=jnp.zeros((B, max_len), jnp.int32),
        logprobs=jnp.zeros((B, max_len), jnp.float32),
        length=prompt_lens,
        budget=budget.astype(jnp.int32),
        cache=cache,
        role=jnp.full((B,), Role.ACT, jnp.int8),
        segment=zeros_b,
        in_message=jnp.zeros((B,), bool),
        message_tokens=zeros_b,
        called_tool=jnp.zeros((B,), bool),
        act_turns=zeros_b,
        user_turn=zeros_b,
        queue=jnp.zeros((B, width), jnp.int32),
        queue_len=zeros_b,
        queue_pos=zeros_b,
        status=jnp.where(prompt_lens >= budget, Status.TRUNCATED, Status.RUNNING).astype(jnp.int8),
        user_turns=user_turns,
        user_turn_lens=user_turn_lens,
        num_user_turns=jnp.sum(user_turn_lens > 0, axis=1).astype(jnp.int32),
        key=key,
        step=jnp.zeros((), jnp.int32),
    )


def apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens a packed mask [B, ceil(V/32)] int32 does not allow set to
    -1e30: bit j of word i allows token 32 i + j (llguidance's and xgrammar's bitmask layout)."""
    V = logits.shape[-1]
    bits = jnp.arange(32, dtype=jnp.uint32)
    words = token_mask.astype(jnp.uint32)[:, :, None]
    allowed = ((words >> bits) & 1).astype(bool).reshape(token_mask.shape[0], -1)[:, :V]
    return jnp.where(allowed, logits, jnp.asarray(-1e30, logits.dtype))


def _step(
    graphdef,
    params,
    spec: TurnSpec,
    sampling: SamplingParams | RowSampling,
    window: int,
    s: LoopState,
    noise_rows: jax.Array | None = None,
    noise_batch: int | None = None,
    token_mask: jax.Array | None = None,
) -> LoopState:
    """One token for every running row; every row's length must be <= `window`."""
    rows = jnp.arange(s.tokens.shape[0])
    model = nnx.merge(graphdef, params)
    last = s.length - 1
    inp = s.tokens[rows, last][:, None]
    logits, cache = model(inp, last[:, None], cache=s.cache, kv_window=window)
    logits = logits[:, 0]
    if token_mask is not None:
        logits = apply_token_mask(logits, token_mask)
    key = jax.random.fold_in(s.key, s.step)
    sampled, logprob = sample_next(logits, key, sampling, noise_rows, noise_batch, s.length)
    written, w = write_token(s, sampled, logprob)
    return transition(spec, written, w).replace(cache=cache, step=s.step + 1)


def decode(
    graphdef: nnx.GraphDef,
    params: Any,
    state: LoopState,
    *,
    spec: TurnSpec,
    sampling: SamplingParams | RowSampling,
    max_steps: int | jax.Array,
    windows: tuple[int, ...] | None = None,
    noise_rows: jax.Array | None = None,
    noise_batch: int | None = None,
    min_running: int | jax.Array = 1,
    token_mask: jax.Array | None = None,
) -> LoopState:
    """Runs `_step` until fewer than `min_running` rows (at least one) are RUNNING or
    `max_steps` more steps were taken.

    The steps run in phases, one per cache window (default `attention_windows(T)`, ending with
    T): a phase attends over its window's slots and lasts while every row (running or not:
    a stopped row is still fed) fits in it. Rows only grow, so each phase starts where the
    previous one ended; the result is that of attending over the whole buffer.

    sampling: `SamplingParams` (static: jit with it in static_argnames) or `RowSampling`
    (arrays [B]: a traced argument).
    noise_rows [B] / noise_batch (static): the state holds rows `noise_rows` of a
    `noise_batch`-row state (`take_rows`), and samples the tokens that state would.
    min_running: stop early, for a caller that goes on with the running rows alone.
    token_mask [B, ceil(V/32)] int32: the tokens each row may sample, packed
      (`apply_token_mask`; structured output, `serve.structured`). It holds for every step of
      the call, so a caller whose masks change per token decodes one step per call. None: no
      mask, and the program has no such input.
    """
    stop_at = state.step + jnp.asarray(max_steps, jnp.int32)
    least = jnp.maximum(jnp.asarray(min_running, jnp.int32), 1)
    T = state.tokens.shape[1]
    windows = attention_windows(T) if windows is None else windows
    if windows[-1] != T or list(windows) != sorted(set(windows)):
        raise ValueError(f"decode: windows {windows} must increase and end at the buffer {T}")

    for window in windows:

        def cond(s, window=window):
            running = (jnp.sum(s.status == Status.RUNNING) >= least) & (s.step < stop_at)
            return running & (jnp.max(s.length) <= window)

        def body(s, window=window):
            return _step(
                graphdef, params, spec, sampling, window, s, noise_rows, noise_batch, token_mask
            )

        state = jax.lax.while_loop(cond, body, state)
    return state


def append_tokens(
    graphdef: nnx.GraphDef,
    params: Any,
    state: LoopState,
    chunk: jax.Array,
    chunk_lens: jax.Array,
    kv_window: int | None = None,
) -> LoopState:
    """Host turns: appends CONTEXT tokens [B, C] (right-padded, chunk_lens [B]) to paused rows.

    The chunk is prefilled on top of the existing cache (positions continue each row's length;
    the history is never re-prefilled) and rows that received tokens resume as ACT. A chunk that
    does not fit the row's budget truncates the row instead. kv_window (static): attend over
    the cache's first slots only, for a caller that knows every row's length + C + 1 fits.
    """
    chunk = jnp.asarray(chunk, jnp.int32)
    chunk_lens = jnp.asarray(chunk_lens, jnp.int32)
    B, C = chunk.shape
    T = state.tokens.shape[1]
    receives = (chunk_lens > 0) & (state.status == Status.AWAITING_ENV)
    fits = state.length + chunk_lens < state.budget
    take = receives & fits
    positions = state.length[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    valid = take[:, None] & (jnp.arange(C)[None] < chunk_lens[:, None])
    cols = jnp.where(valid, positions, T)  # T is out of bounds: dropped
    rows = jnp.arange(B)[:, None]
    tokens = state.tokens.at[rows, cols].set(chunk, mode="drop")
    roles = state.roles.at[rows, cols].set(Role.CONTEXT, mode="drop")
    segments = state.segments.at[rows, cols].set(0, mode="drop")
    logprobs = state.logprobs.at[rows, cols].set(0.0, mode="drop")
    model = nnx.merge(graphdef, params)
    # The last written token has no cache entry yet (a step feeds it before sampling the next),
    # so it is prefilled together with the chunk. Rows that take nothing re-feed only it, at
    # its own position: an idempotent write.
    last_pos = state.length - 1
    last_tok = state.tokens[jnp.arange(B), last_pos]
    feed_tok = jnp.concatenate([last_tok[:, None], chunk], axis=1)
    steps = jnp.arange(C + 1, dtype=jnp.int32)[None]
    feed_pos = jnp.where(take[:, None], last_pos[:, None] + steps, last_pos[:, None])
    feed_tok = jnp.where(take[:, None], feed_tok, last_tok[:, None])
    cache = prefill(model, feed_tok, jnp.minimum(feed_pos, T), state.cache, kv_window)
    status = jnp.where(take, Status.RUNNING, state.status)
    status = jnp.where(receives & ~fits, Status.TRUNCATED, status)
    return state.replace(
        tokens=tokens,
        roles=roles,
        segments=segments,
        logprobs=logprobs,
        length=state.length + jnp.where(take, chunk_lens, 0),
        cache=cache,
        role=jnp.where(take, Role.ACT, state.role).astype(jnp.int8),
        status=status.astype(jnp.int8),
    )
