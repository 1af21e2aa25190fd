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

Structured output: rows under a grammar decode one token per step call, under token masks
the host computes before each call (`decode_step`, which also hands the tokens out).

Modules: `sequences` (what a request hands the engine and gets back), `request_queue` (the
waiting sequences and the batching window), `batch_state` (the running batch's device state
and the compiled operations on its rows), `decode_step` (the host's work around each decode
call); this one holds the engine thread and the running batch's life.

The engine never blocks on a client: callbacks only enqueue (the HTTP layer buffers per
request), so a slow reader delays nobody. An error while decoding fails the sequences of the
batch concerned (their callbacks get a `Done` with `error` set); the engine goes on serving.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envace_jax.sampling import loop
from envace_jax.sampling.distributions import RowSampling, SamplingParams
from envace_jax.sampling.sampler import pad_rows
from envace_jax.serve.batch_state import (
    Batch,
    cancel_rows,
    grow_buffer,
    half_octave_bucket,
    insert_rows,
    regroup,
    release,
    token_window,
)
from envace_jax.serve.decode_step import Written, chunk_room, hand_out, token_masks
from envace_jax.serve.request_queue import RequestQueue

# The engine's interface, importable from here as before the split.
from envace_jax.serve.sequences import RESERVE_TOKENS, Done, Event, Sequence, Tokens

__all__ = [
    "DEFAULT_ROW_BUCKETS",
    "RESERVE_TOKENS",
    "Done",
    "Engine",
    "Event",
    "Sequence",
    "Tokens",
    "half_octave_bucket",
]

log = logging.getLogger(__name__)

DEFAULT_ROW_BUCKETS = (1, 4, 16, 32)
_IDLE_ROW = SamplingParams(greedy=True)  # free rows: no truncation work in the sampler
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's name


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
        self._insert = jax.jit(insert_rows, donate_argnums=(0,))
        self._grow = jax.jit(grow_buffer, static_argnames=("max_len",))
        self._window = jax.jit(token_window, static_argnames=("width",))
        self._cancel = jax.jit(cancel_rows, donate_argnums=(0,))
        self._regroup = jax.jit(regroup)
        self._queue = RequestQueue(
            wait_s=self.wait_s,
            max_wait_s=self.max_wait_s,
            max_batch=self.max_batch,
            finish=self._finish,
        )
        self._thread: threading.Thread | None = None
        self._batch: Batch | None = None
        self._joining: list[Sequence] = []  # popped from the queue, not yet in a batch
        # batches, admitted, chunks, grown, regrouped, errors, finished_<reason>, decode_programs,
        # masked_steps (steps under token masks), masks and mask_us (masks computed, host time),
        # compiled_programs (every program XLA compiled in the process since: resident memory
        # grows with them, so a soak tells a new program from a leak)
        self.stats = collections.Counter()
        jax.monitoring.register_event_duration_secs_listener(self._count_compile)
        self._counting = True  # until `stop`, which may be called more than once

    # ------------------------------------------------------------------ public API
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="envace-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; sequences still waiting or running end as 'cancelled'."""
        self._queue.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        leftover = self._queue.drain()
        if self._batch is not None:
            leftover += [s for s in self._batch.rows if s is not None]
            self._batch = None
        for seq in leftover:
            self._finish(seq, "cancelled")
        if self._counting:
            jax.monitoring.unregister_event_duration_listener(self._count_compile)
            self._counting = False

    def submit(self, seq: Sequence) -> Sequence:
        """Queues a sequence (thread-safe). Its budget must be >= 1 token."""
        if seq.max_new_tokens < 1 or not seq.prompt:
            raise ValueError("Engine.submit: needs a non-empty prompt and max_new_tokens >= 1")
        self._queue.put(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Asks to stop a sequence (thread-safe); it then ends with finish_reason 'cancelled'."""
        seq.cancelled = True
        self._queue.wake()

    def _count_compile(self, event: str, duration_secs: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.stats["compiled_programs"] += 1

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._queue.stopping:
            if self._batch is None and not self._queue.wait_for_work(0.5):
                continue
            try:
                if self._batch is None:
                    self._queue.gather()
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
        group = self._queue.take(self.max_batch)
        if not group:
            return
        self._joining = group
        rows = self._rows_bucket(len(group))
        max_len = half_octave_bucket(max(s.need for s in group))
        state = self._prefill(group, rows, max_len)
        batch = Batch(state, [None] * rows, np.zeros(rows, np.int64))
        for i, seq in enumerate(group):
            self._place(batch, seq, i)
        self._batch = batch
        self.stats["batches"] += 1

    def _place(self, batch: Batch, seq: Sequence, slot: int) -> None:
        seq.slot, seq.emitted = slot, 0
        batch.rows[slot] = seq
        batch.prompt_len[slot] = len(seq.prompt)
        self.stats["admitted"] += 1

    def _fit_rows(self) -> None:
        """Moves the running batch to the row bucket that its rows and the waiting requests
        need (see the module docstring)."""
        batch = self._batch
        live = [i for i, s in enumerate(batch.rows) if s is not None]
        waiting = self._queue.waiting()
        rows = self._rows_bucket(min(len(live) + waiting, self.max_batch))
        if rows < batch.size:
            self._shrink(batch, live, rows)
        elif rows > batch.size:
            self._grow_rows(batch, live, rows)

    def _shrink(self, batch: Batch, live: list[int], rows: int) -> None:
        """Moves the live rows, in order, to a batch of `rows` rows."""
        free = [i for i, s in enumerate(batch.rows) if s is None]
        slots = (live + free)[:rows]  # free rows as padding: `_regroup` stops them
        is_live = np.arange(rows) < len(live)
        old = batch.state
        batch.state = self._regroup(old, jnp.asarray(slots, jnp.int32), jnp.asarray(is_live))
        release(old)
        batch.rows = [batch.rows[i] for i in live] + [None] * (rows - len(live))
        batch.prompt_len = np.where(is_live, batch.prompt_len[slots], 0)
        for slot, seq in enumerate(batch.rows[: len(live)]):
            seq.slot = slot
        self.stats["regrouped"] += 1

    def _grow_rows(self, batch: Batch, live: list[int], rows: int) -> None:
        """Admits waiting sequences into a batch of more rows: they are prefilled at the new
        size and the live rows are copied in after them, so that only one state of the new
        size exists at a time (a larger copy of the old state, then the arrivals' prefill
        inserted into it, would be two)."""
        seqs = self._queue.take(rows - len(live), batch.max_len)
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
        release(old)
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
        seqs = self._queue.take(free, batch.max_len)
        if not seqs:
            return
        self._joining = seqs
        self._admit_into_free(batch, seqs)

    def _admit_into_free(self, batch: Batch, seqs: list[Sequence]) -> None:
        """Prefills `seqs` and writes them into free rows of `batch` (there are enough)."""
        free = [i for i, s in enumerate(batch.rows) if s is None]
        small = self._prefill(seqs, self._rows_bucket(len(seqs)), batch.max_len)
        slots = np.full(small.tokens.shape[0], batch.size, np.int32)  # padding rows: dropped
        slots[: len(seqs)] = free[: len(seqs)]
        batch.state = self._insert(batch.state, small, jnp.asarray(slots))
        for seq, slot in zip(seqs, free, strict=False):
            self._place(batch, seq, slot)

    def _grow_to(self, batch: Batch, need: int) -> None:
        """Grows the batch's buffer to hold `need` positions, if it is shorter."""
        if need > batch.max_len:
            # Free slots get budget 0, as the padding rows of a prefill do.
            budget = jnp.asarray([0 if s is None else s.budget for s in batch.rows], jnp.int32)
            batch.state = self._grow(batch.state, budget, max_len=half_octave_bucket(need))
            self.stats["grown"] += 1

    def _step(self) -> None:
        batch = self._batch
        self._grow_to(batch, chunk_room(batch, self.chunk_steps))
        # A batch just opened streams its first tokens after one step, not after a whole chunk:
        # time to first token on an idle server is then one decode step (SmolLM2, 2 cores:
        # ~0.14 s, not ~0.9 s). Rows joining a running batch wait for the chunk as before: one
        # step at a time whenever any row is new cost a quarter of the throughput at 4 clients.
        fresh = all(s.emitted == 0 for s in batch.rows if s is not None)
        mask = token_masks(batch, self.stats)  # rows under a grammar: one token per call
        steps = 1 if fresh or mask is not None else self.chunk_steps
        self._stop_rows(
            batch, [s is not None and (s.cancelled or s.failed is not None) for s in batch.rows]
        )
        self._decode_chunk(batch, steps, mask)
        broken = hand_out(batch, self._written(batch), self._finish)
        self._stop_rows(batch, broken)  # rows whose grammar broke stop now, as free rows
        if all(s is None for s in batch.rows):
            self._batch = None
            release(batch.state)

    def _stop_rows(self, batch: Batch, rows) -> None:
        """Stops the rows (bool [B]) on the device, if there are any."""
        rows = np.asarray(rows, bool)
        if rows.any():
            batch.state = self._cancel(batch.state, jnp.asarray(rows))

    def _decode_chunk(self, batch: Batch, steps: int, mask: np.ndarray | None) -> None:
        # With nobody waiting, the chunk ends once the running rows fit the next smaller
        # bucket, so that they go on as that batch (`_fit_rows`) instead of finishing the
        # chunk at this size.
        waiting = self._queue.waiting() > 0
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

    def _written(self, batch: Batch) -> Written:
        """The tokens each row wrote and has not handed out yet, on the host."""
        emitted = np.array([s.emitted if s is not None else 0 for s in batch.rows], np.int32)
        start = jnp.asarray(batch.prompt_len.astype(np.int32) + emitted)
        toks, lps = self._window(
            batch.state.tokens, batch.state.logprobs, start, width=self.chunk_steps
        )
        return Written(
            np.asarray(toks),
            np.asarray(lps),
            np.asarray(batch.state.length),
            np.asarray(batch.state.status),
        )

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
