"""Continuous batching over the compiled decode loop (`sampling.loop`).

One engine thread owns the device state. Requests arrive from any thread as `Sequence`s (one
generated row each); the engine keeps one running batch of B rows, a bucket from `row_buckets`
(e.g. 1, 4, 16, 32), with a buffer of T tokens (bucketed, see below), and alternates:

1. admit: waiting sequences are prefilled into free rows of the running batch (a row is free
   once its sequence stopped or was cancelled). A sequence is admitted only if its prompt and
   reserve (below) fit the batch's buffer; the first one that does not blocks the ones behind
   it, so the batch drains and the next batch is formed around it (first come, first served;
   no request waits behind an endless stream). Growing the buffer to admit it instead would
   compile a program for every (rows, old length, new length) a mix of requests meets.
   Sampling parameters are per-row inputs of the compiled loop (`RowSampling`), so rows with
   any temperature, top-p and top-k share a batch, and no client can make the engine compile
   a program per setting.
   Before that, the batch moves to the row bucket its live rows and the waiting requests
   need: when most rows of a burst have stopped, the rest go on as a smaller batch (a decode
   step's cost grows with its rows, stopped ones included; with nobody waiting, a chunk ends
   as soon as the running rows fit a smaller bucket), and a burst that finds a small batch
   running makes it larger rather than waiting for it to drain.
2. decode `chunk_steps` tokens for every row (`loop.decode` with a step limit), or one token
   when the batch was just opened, so that its first tokens stream at once;
3. emit every row's new tokens to its sequence's callback, and free stopped rows.

The buffer (tokens and KV cache) holds what the rows have written plus a reserve, not every
row's whole budget: a request without `max_tokens` may use the rest of the context, and
reserving that for 16 rows of an 8k-context model would take gigabytes while most replies stop
after a few hundred tokens. A row is admitted with its prompt and `RESERVE_TOKENS` of room; the
buffer grows (to the next length bucket) before a chunk that a row could not otherwise finish.

Batch sizes, prompt widths and buffer lengths are all bucketed, so a server compiles a handful
of programs, not one per request count. Widths and lengths take two buckets per octave (16, 24,
32, 48, 64, 96, ...) rather than the sampler's powers of two: a decode step reads every layer's
KV buffer up to its attention window (the whole buffer up to 128 tokens, see
`loop.attention_windows`) and prefill pays for every padded position, so at 16 rows a 21-token
prompt with 64 new tokens decodes ~10% faster in a 96-token buffer than in a 128-token one and
prefills ~20% faster at width 24 than at 32, for at most twice as many programs.

When nothing runs, the first waiting request opens a window for others to arrive, so concurrent
requests start in one batch: it stays open while requests keep coming (each arrival extends it
by `wait_s`, up to `max_wait_s` after the first). A burst of clients reaches the engine spread
over several milliseconds (each request is parsed in turn on the HTTP thread); a fixed window
splits it, and the latecomers join the running batch later, each group with a prefill of its own
(a new shape may even compile on the spot), and keep it decoding after the first rows are done.

Structured output (`serve.structured`): a sequence with a `grammar` may only sample the tokens
its grammar allows next, which depend on the token it sampled last. While a batch holds such a
row, it decodes one token per step call, and before each call the host asks every constrained
row's grammar for its mask (packed bits, [B, ceil(V/32)] int32; every token allowed in the other
rows), an input of the compiled step (`loop.decode(token_mask=...)`); the sampled tokens are
handed back to the grammars when they are emitted. A batch without constrained rows runs the
program it ran before (no mask input, `chunk_steps` tokens a call): unconstrained requests pay
nothing unless they share a batch with constrained ones, and then lose the chunking (one host
round-trip per token) while they do. Mask widths are fixed per model, so the masked programs
are one more per (rows, buffer) bucket. A grammar that fails (an error computing its mask, or a
sampled token it refuses) fails its own sequence only.

The engine never blocks on a client: callbacks only enqueue (the HTTP layer buffers per
request), so a slow reader delays nobody. An error while decoding fails the sequences of the
batch concerned (their callbacks get a `Done` with `error` set); the engine goes on serving.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envace_jax.models.decoder import zero_pad
from envace_jax.sampling import loop
from envace_jax.sampling.distributions import RowSampling, SamplingParams
from envace_jax.sampling.sampler import pad_rows
from envace_jax.text.codes import Status

log = logging.getLogger(__name__)

DEFAULT_ROW_BUCKETS = (1, 4, 16, 32)
RESERVE_TOKENS = 128  # room for new tokens a row is admitted with (see the module docstring)
_IDLE_ROW = SamplingParams(greedy=True)  # free rows: no truncation work in the sampler


def half_octave_bucket(n: int, minimum: int = 16) -> int:
    """The smallest of minimum * (1, 1.5, 2, 3, 4, 6, ...) that is >= n (see the module
    docstring: padding waste at most a third instead of a half)."""
    b = minimum
    while True:
        for size in (b, b * 3 // 2):
            if size >= n:
                return size
        b *= 2


@dataclasses.dataclass(frozen=True)
class Tokens:
    """New tokens of one sequence (the terminal stop token is never included)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Done:
    """A sequence ended. finish_reason: 'stop' (stop or eos token), 'length' (token budget),
    'cancelled', or 'error' (then `error` says why). num_generated counts the stop token."""

    finish_reason: str
    num_generated: int
    error: str | None = None


Event = Tokens | Done


@dataclasses.dataclass(eq=False)
class Sequence:
    """One row to generate: prompt ids, a budget of new tokens, sampling, and a callback that
    receives `Tokens` and finally one `Done` (called on the engine thread: it must not block)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    on_event: Callable[[Event], None]
    cancelled: bool = False
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    # Structured output: an object with `words` (int32 words of a mask), `fill_mask(row)` (the
    # allowed next tokens, packed, into row: int32 [words]) and `advance(ids)` (the sampled
    # tokens; an error message if it refuses one), e.g. `serve.structured.TokenGrammar`; its
    # class may add `fill_masks(mask, [(row, grammar)])` -> [error or None], every row in one
    # call. Called on the engine thread only. None: free text.
    grammar: Any = None
    failed: str | None = None  # why the engine fails the sequence (its grammar broke)
    # Engine bookkeeping.
    slot: int = -1
    emitted: int = 0  # tokens of this row already handed out (prompt excluded)
    done: bool = False

    @property
    def budget(self) -> int:
        """The most tokens the row may hold: prompt plus new tokens."""
        return len(self.prompt) + self.max_new_tokens

    @property
    def need(self) -> int:
        """Buffer length the row is admitted with: prompt plus the reserve (or its budget)."""
        return min(self.budget, len(self.prompt) + RESERVE_TOKENS)


@dataclasses.dataclass
class _Batch:
    state: loop.LoopState
    rows: list[Sequence | None]  # slot -> sequence
    prompt_len: np.ndarray  # int [B]

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def max_len(self) -> int:
        return int(self.state.tokens.shape[1])


def _insert(big: loop.LoopState, small: loop.LoopState, slots: jax.Array) -> loop.LoopState:
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


def _grow(state: loop.LoopState, budget: jax.Array, *, max_len: int) -> loop.LoopState:
    """`state` with a buffer of `max_len` positions (>= its own), each row's budget [B] clipped
    to it. The new positions are empty: no row has written there."""
    fields = ("tokens", "roles", "segments", "logprobs")
    per_position = {k: zero_pad(getattr(state, k), 1, max_len) for k in fields}
    return state.replace(
        **per_position,
        cache=state.cache.grow(max_len),
        budget=jnp.minimum(budget, max_len).astype(state.budget.dtype),
    )


def _window(tokens: jax.Array, logprobs: jax.Array, start: jax.Array, width: int):
    """tokens / logprobs [B, T] -> the `width` entries of each row from start [B]: [B, width]."""
    T = tokens.shape[1]
    idx = jnp.minimum(start[:, None] + jnp.arange(width, dtype=jnp.int32)[None], T - 1)
    return (
        jnp.take_along_axis(tokens, idx, axis=1),
        jnp.take_along_axis(logprobs, idx, axis=1),
    )


def _release(state: loop.LoopState) -> None:
    """Frees a state's buffers now, not whenever a garbage collection finds them: the next
    state allocates its own, and two batches' KV caches at once would set the peak."""
    jax.tree.map(lambda a: a.delete(), state)


def _regroup(state: loop.LoopState, slots: jax.Array, live: jax.Array) -> loop.LoopState:
    """The rows `slots` [b] of `state` as a batch of b rows; rows where `live` [b] is False are
    stopped padding (free slots of the new batch)."""
    state = loop.take_rows(state, slots)
    status = jnp.where(live, state.status, Status.FINISHED)
    return state.replace(status=status.astype(state.status.dtype))


def _cancel_rows(state: loop.LoopState, rows: jax.Array) -> loop.LoopState:
    """Stops rows (bool [B]) that are still running; their slots can then be reused."""
    running = state.status == Status.RUNNING
    status = jnp.where(rows & running, Status.FINISHED, state.status)
    return state.replace(status=status.astype(state.status.dtype))


class Engine:
    """Dynamic batching of generation requests over one model (see the module docstring).

    spec: the `loop.TurnSpec` every row decodes under (mode 'generate': a row stops at
      `spec.end_id`, or INVALID at an abort id, both reported as finish_reason 'stop').
    max_batch: the most rows decoded together; row_buckets: batch sizes compiled (capped by
      max_batch, which is always one). chunk_steps: tokens decoded between two looks at the
      queue (latency of admission and of streamed tokens versus host overhead).
    wait_s / max_wait_s: the batching window when idle (see the module docstring): a batch
      opens once no request arrived for wait_s, max_wait_s after the first, or at max_batch.
    """

    def __init__(
        self,
        model: nnx.Module,
        spec: loop.TurnSpec,
        *,
        pad_id: int,
        max_batch: int = 32,
        row_buckets: Seq[int] = DEFAULT_ROW_BUCKETS,
        chunk_steps: int = 16,
        wait_s: float = 0.005,
        max_wait_s: float = 0.025,
        seed: int = 0,
    ):
        if spec.mode != "generate":
            raise ValueError(f"Engine needs a TurnSpec in mode 'generate', got {spec.mode!r}")
        if max_batch < 1 or chunk_steps < 1:
            raise ValueError("Engine: max_batch and chunk_steps must be >= 1")
        # The stacked decoder: a per-layer copy (`models.layered`) would hold both copies of
        # the weights while converting, above the server's memory budget.
        self.graphdef, self.params = nnx.split(model)
        # The logits' width (a token mask's bits), where the model says it.
        self.vocab_size = getattr(getattr(model, "cfg", None), "vocab_size", None)
        self.spec = spec
        self.pad_id = int(pad_id)
        self.max_batch = int(max_batch)
        self.row_buckets = tuple(sorted({b for b in row_buckets if b < max_batch} | {max_batch}))
        self.chunk_steps = int(chunk_steps)
        self.wait_s = float(wait_s)
        self.max_wait_s = max(float(max_wait_s), self.wait_s)
        self._key = jax.random.key(seed)
        self._init = jax.jit(
            loop.init_state, static_argnums=(0,), static_argnames=("spec", "max_len")
        )

        def decode(
            graphdef, params, state, *, spec, sampling, max_steps, min_running, token_mask=None
        ):
            self.stats["decode_programs"] += 1  # runs when jit traces: once per program
            return loop.decode(
                graphdef,
                params,
                state,
                spec=spec,
                sampling=sampling,
                max_steps=max_steps,
                min_running=min_running,
                token_mask=token_mask,
            )

        self._decode = jax.jit(
            decode, static_argnums=(0,), static_argnames=("spec",), donate_argnums=(2,)
        )
        self._insert = jax.jit(_insert, donate_argnums=(0,))
        self._grow = jax.jit(_grow, static_argnames=("max_len",))
        self._window = jax.jit(_window, static_argnames=("width",))
        self._cancel = jax.jit(_cancel_rows, donate_argnums=(0,))
        self._regroup = jax.jit(_regroup)
        self._pending: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._batch: _Batch | None = None
        self._joining: list[Sequence] = []  # popped from the queue, not yet in a batch
        # batches, admitted, chunks, grown, regrouped, errors, finished_<reason>, decode_programs,
        # masked_steps (steps under token masks), masks and mask_us (masks computed, host time)
        self.stats = collections.Counter()

    # ------------------------------------------------------------------ public API
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="envace-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; sequences still waiting or running end as 'cancelled'."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cv:
            leftover = list(self._pending)
            self._pending.clear()
        if self._batch is not None:
            leftover += [s for s in self._batch.rows if s is not None]
            self._batch = None
        for seq in leftover:
            self._finish(seq, "cancelled")

    def submit(self, seq: Sequence) -> Sequence:
        """Queues a sequence (thread-safe). Its budget must be >= 1 token."""
        if seq.max_new_tokens < 1 or not seq.prompt:
            raise ValueError("Engine.submit: needs a non-empty prompt and max_new_tokens >= 1")
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._pending.append(seq)
            self._cv.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Asks to stop a sequence (thread-safe); it then ends with finish_reason 'cancelled'."""
        seq.cancelled = True
        with self._cv:
            self._cv.notify_all()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while True:
            with self._cv:
                if self._stopping:
                    return
                if self._batch is None:
                    self._drop_cancelled_pending()
                    if not self._pending:
                        self._cv.wait(0.5)
                        continue
            try:
                if self._batch is None:
                    self._gather()
                    self._open_batch()
                else:
                    self._fit_rows()
                    self._admit()
                if self._batch is not None:
                    self._step()
            except Exception as e:  # never let one bad batch kill the server
                log.exception("engine error; failing the current batch")
                self.stats["errors"] += 1
                batch, self._batch = self._batch, None
                failed = [s for s in (batch.rows if batch else []) if s is not None]
                failed += self._joining
                for seq in failed:
                    self._finish(seq, "error", error=f"{type(e).__name__}: {e}")
            finally:
                self._joining = []

    def _gather(self) -> None:
        """The batching window: returns once no request arrived for `wait_s` (counted from the
        latest arrival), `max_wait_s` after the first one, at `max_batch` waiting, or on stop."""
        with self._cv:
            if not self._pending:
                return
            deadline = self._pending[0].arrived + self.max_wait_s
            while not self._stopping and len(self._pending) < self.max_batch:
                now = time.monotonic()
                until = min(self._pending[-1].arrived + self.wait_s, deadline)
                if now >= until:
                    return
                self._cv.wait(until - now)  # submit() notifies: the window is re-measured

    def _drop_cancelled_pending(self) -> None:
        for seq in [s for s in self._pending if s.cancelled]:
            self._pending.remove(seq)
            self._finish(seq, "cancelled")

    def _take_fitting(self, max_len, limit) -> list[Sequence]:
        """Pops waiting sequences in arrival order while they fit (see the module docstring)."""
        taken = []
        with self._cv:
            self._drop_cancelled_pending()
            while self._pending and len(taken) < limit:
                if self._pending[0].need > max_len:
                    break
                taken.append(self._pending.popleft())
        return taken

    def _rows_bucket(self, n: int) -> int:
        return next(b for b in self.row_buckets if b >= n)

    def _prefill(self, seqs: list[Sequence], rows: int, max_len: int) -> loop.LoopState:
        """A fresh state of `rows` rows (sequences first, then empty padding rows)."""
        prompts = [list(s.prompt) for s in seqs] + [[self.pad_id]] * (rows - len(seqs))
        budgets = [s.max_new_tokens for s in seqs] + [0] * (rows - len(seqs))
        width = half_octave_bucket(max(len(p) for p in prompts))
        self._key, key = jax.random.split(self._key)
        return self._init(
            self.graphdef,
            self.params,
            jnp.asarray(pad_rows(prompts, width, self.pad_id)),
            jnp.asarray([len(p) for p in prompts], jnp.int32),
            key=key,
            spec=self.spec,
            max_len=max_len,
            max_new_tokens=jnp.asarray(budgets, jnp.int32),
        )

    def _open_batch(self) -> None:
        with self._cv:
            self._drop_cancelled_pending()
            if not self._pending:
                return
            group = [
                self._pending.popleft() for _ in range(min(len(self._pending), self.max_batch))
            ]
            self._joining = group
        rows = self._rows_bucket(len(group))
        max_len = half_octave_bucket(max(s.need for s in group))
        state = self._prefill(group, rows, max_len)
        batch = _Batch(state, [None] * rows, np.zeros(rows, np.int64))
        for i, seq in enumerate(group):
            self._place(batch, seq, i)
        self._batch = batch
        self.stats["batches"] += 1

    def _place(self, batch: _Batch, seq: Sequence, slot: int) -> None:
        seq.slot, seq.emitted = slot, 0
        batch.rows[slot] = seq
        batch.prompt_len[slot] = len(seq.prompt)
        self.stats["admitted"] += 1

    def _fit_rows(self) -> None:
        """Moves the running batch to the row bucket that its rows and the waiting requests
        need (see the module docstring)."""
        batch = self._batch
        live = [i for i, s in enumerate(batch.rows) if s is not None]
        with self._cv:
            waiting = len(self._pending)
        rows = self._rows_bucket(min(len(live) + waiting, self.max_batch))
        if rows < batch.size:
            self._shrink(batch, live, rows)
        elif rows > batch.size:
            self._grow_rows(batch, live, rows)

    def _shrink(self, batch: _Batch, live: list[int], rows: int) -> None:
        """Moves the live rows, in order, to a batch of `rows` rows."""
        free = [i for i, s in enumerate(batch.rows) if s is None]
        slots = (live + free)[:rows]  # free rows as padding: `_regroup` stops them
        is_live = np.arange(rows) < len(live)
        old = batch.state
        batch.state = self._regroup(old, jnp.asarray(slots, jnp.int32), jnp.asarray(is_live))
        _release(old)
        batch.rows = [batch.rows[i] for i in live] + [None] * (rows - len(live))
        batch.prompt_len = np.where(is_live, batch.prompt_len[slots], 0)
        for slot, seq in enumerate(batch.rows[: len(live)]):
            seq.slot = slot
        self.stats["regrouped"] += 1

    def _grow_rows(self, batch: _Batch, live: list[int], rows: int) -> None:
        """Admits waiting sequences into a batch of more rows: they are prefilled at the new
        size and the live rows are copied in after them, so that only one state of the new
        size exists at a time (a larger copy of the old state, then the arrivals' prefill
        inserted into it, would be two)."""
        seqs = self._take_fitting(batch.max_len, rows - len(live))
        if not seqs:
            return
        self._joining = seqs
        rows = self._rows_bucket(len(live) + len(seqs))
        if rows <= batch.size:  # fewer fit the buffer than were waiting: the free rows do
            self._admit_into_free(batch, seqs)
            return
        moved = np.full(batch.size, rows, np.int32)  # free rows map past the end: dropped
        moved[live] = np.arange(len(seqs), len(seqs) + len(live))
        state = self._prefill(seqs, rows, batch.max_len)
        old = batch.state
        batch.state = self._insert(state, old, jnp.asarray(moved))
        _release(old)
        old_rows, old_prompt_len = batch.rows, batch.prompt_len
        batch.rows, batch.prompt_len = [None] * rows, np.zeros(rows, np.int64)
        for slot, seq in enumerate(seqs):
            self._place(batch, seq, slot)
        for i in live:
            slot = old_rows[i].slot = int(moved[i])
            batch.rows[slot], batch.prompt_len[slot] = old_rows[i], old_prompt_len[i]
        self.stats["regrouped"] += 1

    def _admit(self) -> None:
        batch = self._batch
        free = batch.rows.count(None)
        if not free:
            return
        seqs = self._take_fitting(batch.max_len, free)
        if not seqs:
            return
        self._joining = seqs
        self._admit_into_free(batch, seqs)

    def _admit_into_free(self, batch: _Batch, seqs: list[Sequence]) -> None:
        """Prefills `seqs` and writes them into free rows of `batch` (there are enough)."""
        free = [i for i, s in enumerate(batch.rows) if s is None]
        small = self._prefill(seqs, self._rows_bucket(len(seqs)), batch.max_len)
        slots = np.full(small.tokens.shape[0], batch.size, np.int32)  # padding rows: dropped
        slots[: len(seqs)] = free[: len(seqs)]
        batch.state = self._insert(batch.state, small, jnp.asarray(slots))
        for seq, slot in zip(seqs, free, strict=False):
            self._place(batch, seq, slot)

    def _grow_to(self, batch: _Batch, need: int) -> None:
        """Grows the batch's buffer to hold `need` positions, if it is shorter."""
        if need > batch.max_len:
            # Free slots get budget 0, as the padding rows of a prefill do.
            budget = jnp.asarray([0 if s is None else s.budget for s in batch.rows], jnp.int32)
            batch.state = self._grow(batch.state, budget, max_len=half_octave_bucket(need))
            self.stats["grown"] += 1

    def _step(self) -> None:
        batch = self._batch
        # Room for this chunk: a row writes at most one token per step, up to its budget.
        live = [
            min(batch.prompt_len[i] + s.emitted + self.chunk_steps, s.budget)
            for i, s in enumerate(batch.rows)
            if s is not None
        ]
        self._grow_to(batch, max(live, default=0))
        # A batch just opened streams its first tokens after one step, not after a whole chunk:
        # time to first token on an idle server is then one decode step (SmolLM2, 2 cores:
        # ~0.14 s, not ~0.9 s). Rows joining a running batch wait for the chunk as before: one
        # step at a time whenever any row is new cost a quarter of the throughput at 4 clients.
        fresh = all(s.emitted == 0 for s in batch.rows if s is not None)
        mask = self._masks(batch)  # rows under a grammar: one token per call, masked
        steps = 1 if fresh or mask is not None else self.chunk_steps
        cancel = np.array(
            [s is not None and (s.cancelled or s.failed is not None) for s in batch.rows]
        )
        if cancel.any():
            batch.state = self._cancel(batch.state, jnp.asarray(cancel))
        # With nobody waiting, the chunk ends once the running rows fit the next smaller
        # bucket, so that they go on as that batch (`_fit_rows`) instead of finishing the
        # chunk at this size.
        with self._cv:
            waiting = bool(self._pending)
        smaller = [b for b in self.row_buckets if b < batch.size]
        batch.state = self._decode(
            self.graphdef,
            self.params,
            batch.state,
            spec=self.spec,
            sampling=RowSampling.of([_IDLE_ROW if s is None else s.sampling for s in batch.rows]),
            max_steps=steps,
            min_running=1 if waiting or not smaller else smaller[-1] + 1,
            token_mask=None if mask is None else jnp.asarray(mask),
        )
        self.stats["chunks"] += 1
        self.stats["masked_steps"] += mask is not None
        emitted = np.array([s.emitted if s is not None else 0 for s in batch.rows], np.int32)
        start = jnp.asarray(batch.prompt_len.astype(np.int32) + emitted)
        toks, lps = self._window(
            batch.state.tokens, batch.state.logprobs, start, width=self.chunk_steps
        )
        length = np.asarray(batch.state.length)
        status = np.asarray(batch.state.status)
        toks, lps = np.asarray(toks), np.asarray(lps)
        broken = np.zeros(batch.size, bool)  # rows whose grammar refused their token
        for slot, seq in enumerate(batch.rows):
            if seq is None:
                continue
            n = int(length[slot] - batch.prompt_len[slot]) - seq.emitted
            st = int(status[slot])
            stopped = st not in (Status.RUNNING,)
            ids, logp = toks[slot, :n].tolist(), lps[slot, :n].tolist()
            total = seq.emitted + n
            # Read once: a callback or the server thread may cancel the row while this loop
            # runs, and the reason and the decision to finish must agree (read twice, a row
            # still running once ended as 'stop').
            cancelled = seq.cancelled
            if cancelled:
                reason = "cancelled"
            elif st in (Status.FINISHED, Status.INVALID):
                reason = "stop"
                ids, logp = ids[:-1], logp[:-1]  # the stop token itself is not text
            elif st == Status.TRUNCATED:
                reason = "length"
            else:
                reason = None
            seq.emitted += n
            if seq.grammar is not None and ids and not cancelled and seq.failed is None:
                seq.failed = seq.grammar.advance(ids)
                broken[slot] = seq.failed is not None and not stopped
            if seq.failed is not None:
                batch.rows[slot] = None
                self._finish(seq, "error", num_generated=total, error=seq.failed)
                continue
            if ids and not cancelled:
                seq.on_event(Tokens(tuple(ids), tuple(logp)))
            if stopped or cancelled:
                batch.rows[slot] = None
                self._finish(seq, reason or "stop", num_generated=total)
        if broken.any():  # their rows stop decoding now, as free rows
            batch.state = self._cancel(batch.state, jnp.asarray(broken))
        if all(s is None for s in batch.rows):
            self._batch = None
            _release(batch.state)

    def _masks(self, batch: _Batch) -> np.ndarray | None:
        """The token masks of a batch with rows under a grammar, int32 [B, words] (every
        token allowed in the other rows), or None when no row has one. A grammar that fails
        to give its mask fails its own sequence (`failed`; its row is cancelled)."""
        rows = [
            (slot, seq)
            for slot, seq in enumerate(batch.rows)
            if seq is not None and seq.grammar is not None and seq.failed is None
        ]
        if not rows:
            return None
        start = time.perf_counter()
        mask = np.full((batch.size, rows[0][1].grammar.words), -1, np.int32)
        kind = type(rows[0][1].grammar)
        errors = None
        if hasattr(kind, "fill_masks") and all(type(s.grammar) is kind for _, s in rows):
            try:  # every row in one call (the GIL released once, not once a row)
                errors = kind.fill_masks(mask, [(slot, seq.grammar) for slot, seq in rows])
            except Exception:
                log.exception("batched grammar masks failed; computing them row by row")
        if errors is None:
            errors = []
            for slot, seq in rows:
                try:
                    seq.grammar.fill_mask(mask[slot])
                    errors.append(None)
                except Exception as e:
                    log.exception("grammar failed; failing its sequence")
                    errors.append(f"{type(e).__name__}: {e}")
        for (_, seq), error in zip(rows, errors, strict=True):
            seq.failed = error
        self.stats["masks"] += len(rows)
        self.stats["mask_us"] += int((time.perf_counter() - start) * 1e6)
        return mask

    def _finish(self, seq: Sequence, reason: str, num_generated=None, error=None) -> None:
        if seq.done:
            return
        seq.done = True
        self.stats[f"finished_{reason}"] += 1
        n = seq.emitted if num_generated is None else num_generated
        try:
            seq.on_event(Done(reason, n, error))
        except Exception:  # a callback must not take the engine down
            log.exception("sequence callback failed")
