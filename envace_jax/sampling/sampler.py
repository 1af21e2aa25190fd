"""Host-facing sampler: bucketing, compiled-program caching, and the three decode modes.

    sampler = Sampler(model, spec, pad_id=tok.pad_token_id)
    out = sampler.generate(prompts, key=key, sampling=SamplingParams(temperature=1.0),
                           max_new_tokens=256)            # world rehearsal (spec.mode)
    state = sampler.start(prompts, ...); state = sampler.resume(state, observations)  # host turns

Prompt lengths and buffer lengths are rounded up to power-of-two buckets so that a run compiles
a handful of programs, not one per batch. The decode state (with its KV cache) is donated to
each compiled call, so the cache is updated in place.

Multi-host (`layout=parallel.row_layout(mesh, B)`): the batch is global, its rows split over
processes like the train step's. Each process passes only its rows (`layout.rows`) and gets
only those back (`trajectories`); the compiled calls run on the global mesh (the train step's)
under its logical-axis rules, and bucket sizes are agreed between processes so every process
compiles and runs the same program.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envace_jax import parallel
from envace_jax.models.layered import DecodingWeights
from envace_jax.sampling import loop
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.text.codes import Status


def pow2_bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    b = minimum
    while b < n:
        b *= 2
    return b


def pad_rows(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> np.ndarray:
    """Right-pads token lists into an int32 [len(rows), width] array."""
    out = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"row {i} has {len(r)} tokens, more than the width {width}")
        out[i, : len(r)] = r
    return out


class Sampler:
    """Compiled decoding for one model and one chat layout (`loop.TurnSpec`).

    compact_rows: rows still going decode on as a smaller batch (see `_decode_all`), on one
    device; off for a model whose output depends on a row's place in the batch."""

    def __init__(
        self, model: nnx.Module, spec: loop.TurnSpec, *, pad_id: int, compact_rows: bool = True
    ):
        self._weights = DecodingWeights(model)
        self.graphdef = self._weights.graphdef
        self.spec = spec
        self.pad_id = int(pad_id)
        self.compact_rows = compact_rows
        self._init = jax.jit(
            loop.init_state, static_argnums=(0,), static_argnames=("spec", "max_len")
        )
        self._decode = jax.jit(
            loop.decode,
            static_argnums=(0,),
            static_argnames=("spec", "sampling", "noise_batch"),
            donate_argnums=(2,),
        )
        self._take = jax.jit(loop.take_rows)
        self._put_rows = jax.jit(loop.put_rows, donate_argnums=(0,))
        self._append = jax.jit(
            loop.append_tokens,
            static_argnums=(0,),
            static_argnames=("kv_window",),
            donate_argnums=(2,),
        )

    def with_params(self, params) -> Sampler:
        """A sampler over `params` (the model's tree, e.g. a train step's) that shares this one's
        compiled calls; this one keeps its own parameters, so no caller changes what another
        samples with."""
        view = copy.copy(self)
        view._weights = self._weights.bound(params)
        return view

    @property
    def params(self):
        """The parameters the compiled calls read (`models.layered.DecodingWeights`)."""
        return self._weights.params

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        user_turns: Sequence[Sequence[Sequence[int]]] | None = None,
        max_len: int | None = None,
        layout: parallel.RowLayout | None = None,
    ) -> loop.LoopState:
        """The state with `prompts` prefilled, before any decoding (arguments as `start`'s).
        `start(prefilled=state)` decodes a copy of it, so the decodes of one batch of prompts
        (an evaluation's greedy and sampled runs) share one prefill."""
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("Sampler.start: every prompt needs at least one token")
        budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (len(prompts),))
        longest = _agreed(max(len(p) for p in prompts), layout)
        P = pow2_bucket(longest)
        T = max_len or pow2_bucket(longest + _agreed(int(budget.max()), layout))
        if T < longest + 1:
            raise ValueError(f"max_len {T} leaves no room after a {longest}-token prompt")
        ut, ut_lens = self._user_turns(user_turns, len(prompts), layout)
        put = lambda x: _put(x, layout)
        with _on_mesh(layout):
            return self._init(
                self.graphdef,
                self.params,
                put(pad_rows(prompts, P, self.pad_id)),
                put(np.asarray([len(p) for p in prompts], np.int32)),
                key=jax.random.key(0),  # replaced by `start`'s
                spec=self.spec,
                max_len=T,
                max_new_tokens=put(np.asarray(budget)),
                user_turns=None if ut is None else put(ut),
                user_turn_lens=None if ut is None else put(ut_lens),
            )

    def start(
        self,
        prompts: Sequence[Sequence[int]] | None = None,
        *,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int | Sequence[int] = 0,
        user_turns: Sequence[Sequence[Sequence[int]]] | None = None,
        max_len: int | None = None,
        layout: parallel.RowLayout | None = None,
        prefilled: loop.LoopState | None = None,
    ) -> loop.LoopState:
        """Prefills `prompts` and decodes until every row stops or pauses.

        max_new_tokens: the token budget on top of each prompt (one for all rows, or per row).
        max_len: the buffer length (default: a bucket that fits the longest prompt + budget).
        layout: the global batch's row layout; `prompts` are then this process's rows.
        prefilled: a `prefill` state to decode (left as it is) instead of `prompts`.
        """
        if prefilled is None:
            state = self.prefill(
                prompts,
                max_new_tokens=max_new_tokens,
                user_turns=user_turns,
                max_len=max_len,
                layout=layout,
            )
        else:
            state = jax.tree.map(jnp.copy, prefilled)  # `_decode` donates its state
        with _on_mesh(layout):
            state = state.replace(key=jnp.copy(key))  # a copy: the state is donated
        return self._decode_all(state, sampling, layout)

    def resume(
        self,
        state: loop.LoopState,
        observations: Sequence[Sequence[int] | None],
        *,
        sampling: SamplingParams,
        layout: parallel.RowLayout | None = None,
    ) -> loop.LoopState:
        """Host turns: appends each paused row's observation ids (None/empty: nothing) and
        decodes on. The observation ids include the chat glue around the tool responses.
        With a `layout`, `observations` are this process's rows (every process calls this)."""
        C = pow2_bucket(_agreed(max((len(o) for o in observations if o), default=1), layout))
        chunk = pad_rows([o or [] for o in observations], C, self.pad_id)
        lens = np.asarray([len(o or []) for o in observations], np.int32)
        status = np.asarray(state.status) if self._compacts(layout) else None
        going = None if status is None else (lens > 0) & (status == Status.AWAITING_ENV)
        rows = None if going is None else self._rows_bucket(going)
        if rows is None:
            return self._continue(state, chunk, lens, sampling, layout)
        # Only these rows go on: append and decode them as a smaller batch.
        part = self._take(state, jnp.asarray(rows))
        part = self._continue(part, chunk[rows], lens[rows], sampling, None, (rows, len(status)))
        return self._put_rows(state, part, jnp.asarray(rows))

    def _continue(self, state, chunk, lens, sampling, layout, noise=None):
        """Appends `chunk` [B, C] (lens [B]) and decodes (`_decode_all`)."""
        T = state.tokens.shape[1]
        # The chunk attends over the slots its rows can reach, not the whole buffer.
        lengths = state.length if layout is None else layout.to_local(state.length)
        reach = _agreed(int(np.max(np.asarray(lengths))) + chunk.shape[1] + 1, layout)
        window = next((w for w in loop.attention_windows(T) if w >= reach), T)
        with _on_mesh(layout):
            state = self._append(
                self.graphdef,
                self.params,
                state,
                _put(chunk, layout),
                _put(lens, layout),
                kv_window=window,
            )
        return self._decode_all(state, sampling, layout, noise)

    def _decode_all(self, state, sampling, layout, noise=None, shrink=True):
        """Decodes until every row stops or pauses. Once fewer than half of the rows run, the
        running ones go on as a smaller batch (`loop.take_rows`), so that the steps after most
        rows stopped cost about the rows still running (an evaluation's decode calls ran 61%
        of their row-steps on stopped rows). noise: (rows, batch) of a state that
        `take_rows` made: it samples as those rows of the whole batch would."""
        B, T = state.tokens.shape
        noise_rows, noise_batch = (None, None) if noise is None else noise
        shrinks = shrink and self._compacts(layout) and B > _row_step(noise_batch or B)
        with _on_mesh(layout):
            state = self._decode(
                self.graphdef,
                self.params,
                state,
                spec=self.spec,
                sampling=sampling,
                max_steps=T,
                noise_rows=None if noise_rows is None else jnp.asarray(noise_rows, jnp.int32),
                noise_batch=noise_batch,
                min_running=jnp.asarray(B // 2 if shrinks else 1, jnp.int32),
            )
        if not shrinks:
            return state
        running = np.asarray(state.status) == Status.RUNNING
        if not running.any():
            return state
        rows = self._rows_bucket(running, noise_batch or B)
        if rows is None:
            return self._decode_all(state, sampling, layout, noise, shrink=False)
        part = self._take(state, jnp.asarray(rows))
        inner = (rows, B) if noise_rows is None else (np.asarray(noise_rows)[rows], noise_batch)
        part = self._decode_all(part, sampling, None, inner)
        return self._put_rows(state, part, jnp.asarray(rows))

    def _compacts(self, layout: parallel.RowLayout | None) -> bool:
        return self.compact_rows and _one_device(layout)

    @staticmethod
    def _rows_bucket(going: np.ndarray, batch: int | None = None) -> np.ndarray | None:
        """The rows `going` [B] marks, padded with others to `_row_step(batch)` times a power
        of two (batch: the whole batch's rows, default B), when that is fewer than B; else
        None."""
        B, n = len(going), int(going.sum())
        b = _row_step(batch or B)
        while b < n:
            b *= 2
        if b >= B:
            return None
        others = np.flatnonzero(~going)
        return np.sort(np.concatenate([np.flatnonzero(going), others[: b - n]]))

    def generate(
        self,
        prompts,
        *,
        key,
        sampling,
        max_new_tokens,
        user_turns=None,
        max_len=None,
        layout: parallel.RowLayout | None = None,
    ) -> loop.Trajectories:
        """`start` then copy (this process's rows) to the host: a `loop.Trajectories`."""
        state = self.start(
            prompts,
            key=key,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            user_turns=user_turns,
            max_len=max_len,
            layout=layout,
        )
        return self.trajectories(state, layout)

    def trajectories(
        self, state: loop.LoopState, layout: parallel.RowLayout | None = None
    ) -> loop.Trajectories:
        """The state's rows on the host (with a layout: this process's rows only)."""
        if layout is None:
            return loop.to_trajectories(state, self.pad_id)
        fields = ("tokens", "roles", "segments", "logprobs", "length", "status", "act_turns")
        local = {k: layout.to_local(getattr(state, k)) for k in fields}
        return loop.to_trajectories(types.SimpleNamespace(**local), self.pad_id)

    def set_status(
        self,
        state: loop.LoopState,
        status: np.ndarray,
        layout: parallel.RowLayout | None = None,
    ) -> loop.LoopState:
        """Replaces the rows' status (host int8 [B], or this process's rows with a layout)."""
        status = np.asarray(status, np.int8)
        with _on_mesh(layout):
            return state.replace(status=_put(status, layout))

    def _user_turns(self, user_turns, batch, layout=None):
        if layout is None and (not user_turns or not any(user_turns)):
            return None, None
        user_turns = user_turns or [[] for _ in range(batch)]
        if len(user_turns) != batch:
            raise ValueError(f"user_turns has {len(user_turns)} rows for {batch} prompts")
        U = _agreed(max(len(t) for t in user_turns), layout)
        if U == 0:  # no process has later user turns
            return None, None
        W = pow2_bucket(
            _agreed(max((len(x) for t in user_turns for x in t), default=1), layout), minimum=8
        )
        ids = np.zeros((batch, U, W), np.int32)
        lens = np.zeros((batch, U), np.int32)
        for b, turns in enumerate(user_turns):
            for u, x in enumerate(turns):
                ids[b, u, : len(x)] = x
                lens[b, u] = len(x)
        return ids, lens


# A smaller batch has at least this many rows: a part of fewer saves a few rows' decode steps
# and costs a program of its own (2-4 s to compile on a CPU).
MIN_PART_ROWS = 8


def _row_step(batch: int) -> int:
    """The smallest batch taken from a `batch`-row state; the others are it times a power of
    two, so a batch size compiles three smaller programs at most (an evaluation's first pass
    compiled 12 decode sizes when they were multiples of an eighth, 4-7 s each)."""
    return max(batch // 8, MIN_PART_ROWS)


def _one_device(layout: parallel.RowLayout | None) -> bool:
    """The rows all live on one device, where a smaller batch is taken from them (a batch
    split over devices keeps its rows, so that its shards stay even)."""
    return layout is None or layout.mesh is None or layout.mesh.size == 1


def _agreed(value: int, layout: parallel.RowLayout | None) -> int:
    """The largest value over processes: every process must compile the same shapes."""
    return int(value) if layout is None else parallel.process_max(value)


def _put(x: np.ndarray, layout: parallel.RowLayout | None) -> jax.Array:
    return jnp.asarray(x) if layout is None else layout.to_global(x)


def _on_mesh(layout: parallel.RowLayout | None):
    """The layout's mesh and rules, which the model's activation constraints read at trace time."""
    if layout is None or layout.mesh is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(layout.mesh))
    stack.enter_context(parallel.axis_rules(layout.rules))
    return stack
