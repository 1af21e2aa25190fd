"""The serving engine's batching window and length buckets, without HTTP."""

from __future__ import annotations

import threading
import time

import numpy as np

from envace_jax.sampling.distributions import SamplingParams
from envace_jax.serve.batch_state import half_octave_bucket
from envace_jax.serve.batcher import Engine
from envace_jax.serve.sequences import Done, Sequence, Tokens


def test_bucket_takes_two_sizes_per_octave():
    assert [half_octave_bucket(n) for n in (1, 16, 17, 24, 25, 33, 85, 96, 97, 129, 1000)] == [
        16,
        16,
        24,
        24,
        32,
        48,
        96,
        96,
        128,
        192,
        1024,
    ]


def _engine(**kw) -> Engine:
    """A started engine over the tiny Qwen3 (random weights) with the demo tokenizer."""
    from flax import nnx

    from envace_jax.models.config import get_preset
    from envace_jax.models.decoder import Decoder
    from envace_jax.sampling.chat_spec import turn_spec
    from envace_jax.text.tokenizer import load_tokenizer, special_ids

    tok = load_tokenizer("demo")
    model = Decoder(get_preset("tiny-qwen3", vocab_size=len(tok)), rngs=nnx.Rngs(0))
    spec = turn_spec(tok, mode="generate", max_message_tokens=1 << 30)
    return Engine(model, spec, pad_id=special_ids(tok).endoftext, **kw).start()


def test_requests_arriving_in_a_trickle_start_in_one_batch():
    """Arrivals closer together than the window stay in it even when, all together, they span
    longer than the window (a fixed window from the first arrival would split them)."""
    # Gaps of 1.2 s against a 2 s window: wide margins either way on a busy machine.
    engine = _engine(wait_s=2.0, max_wait_s=60.0)
    try:
        finished = []
        all_done = threading.Event()

        def on_event(ev):
            if isinstance(ev, Done):
                finished.append(ev)
                if len(finished) == 3:
                    all_done.set()

        for i in range(3):
            if i:
                time.sleep(1.2)
            engine.submit(Sequence((5 + i, 6, 7), 4, SamplingParams(greedy=True), on_event))
        assert all_done.wait(300)
        assert all(d.finish_reason in ("stop", "length") for d in finished)
        assert engine.stats["batches"] == 1 and engine.stats["admitted"] == 3
    finally:
        engine.stop()


def test_a_row_cancelled_while_its_tokens_are_handed_out_ends_as_cancelled():
    """The server cancels from another thread at any moment, also between the engine's look at
    a row and its decision to end it. Cancelling from the token callback hits that moment
    every time: the row must end as 'cancelled', never as a 'stop' it did not reach."""
    engine = _engine(wait_s=0.0, chunk_steps=8)
    try:
        events, done = [], threading.Event()

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, Tokens):
                engine.cancel(seq)  # a client hanging up as soon as it reads
            else:
                done.set()

        seq = Sequence((5, 6, 7), 200, SamplingParams(greedy=True), on_event)
        engine.submit(seq)
        assert done.wait(300)
        tokens, end = events[:-1], events[-1]
        # The row was running: its first token came (a fresh row decodes one step first).
        assert [len(t.ids) for t in tokens] == [1]
        assert (end.finish_reason, end.num_generated) == ("cancelled", 1)
        assert engine.stats["finished_cancelled"] == 1 and engine.stats["finished_stop"] == 0
    finally:
        engine.stop()


class _Budgets:
    """The tiny Qwen3 with no stop id (every row runs to its budget), the greedy tokens of one
    decode per prompt in a buffer sized to its whole budget, and collectors for an engine's."""

    def __init__(self, budgets: dict[tuple[int, ...], int]):
        from flax import nnx

        from envace_jax.models.config import get_preset
        from envace_jax.models.decoder import Decoder
        from envace_jax.sampling import loop
        from envace_jax.text.tokenizer import load_tokenizer

        tok = load_tokenizer("demo")
        self.model = Decoder(get_preset("tiny-qwen3", vocab_size=len(tok)), rngs=nnx.Rngs(0))
        self.spec = loop.TurnSpec(
            end_id=-1, tool_call_id=-1, mode="generate", max_message_tokens=1 << 30
        )
        self.budgets = budgets
        self.got = {p: [] for p in budgets}
        self.done = threading.Semaphore(0)

    def engine(self, **kw) -> Engine:
        return Engine(self.model, self.spec, pad_id=0, **{"wait_s": 0.0, **kw}).start()

    def submit(self, engine: Engine, prompt: tuple[int, ...], on_tokens=None) -> None:
        def on_event(ev):
            if isinstance(ev, Tokens):
                self.got[prompt] += ev.ids
                if on_tokens:
                    on_tokens()
            else:
                assert ev.finish_reason == "length", ev
                self.done.release()

        greedy = SamplingParams(greedy=True)
        engine.submit(Sequence(prompt, self.budgets[prompt], greedy, on_event))

    def wait_all(self) -> None:
        for _ in self.budgets:
            assert self.done.acquire(timeout=300)

    def reference(self, prompt: tuple[int, ...]) -> list[int]:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from envace_jax.sampling import loop

        new = self.budgets[prompt]
        graphdef, params = nnx.split(self.model)
        state = loop.init_state(
            graphdef,
            params,
            jnp.asarray([prompt]),
            jnp.asarray([len(prompt)]),
            key=jax.random.key(0),
            spec=self.spec,
            max_len=1024,
            max_new_tokens=new,
        )
        sampling = SamplingParams(greedy=True)
        state = loop.decode(
            graphdef, params, state, spec=self.spec, sampling=sampling, max_steps=new
        )
        return np.asarray(state.tokens[0, len(prompt) : len(prompt) + new]).tolist()

    def check_tokens(self) -> None:
        for prompt in self.budgets:
            assert self.got[prompt] == self.reference(prompt), prompt


def test_buffer_grows_as_rows_write_and_tokens_match_a_full_buffer():
    """Rows are admitted with a reserve, not their whole budget; the buffer grows before a chunk
    that needs room, and later arrivals grow it too. Greedy tokens equal those of one decode in
    a buffer sized to the whole budget from the start."""
    from envace_jax.serve.sequences import RESERVE_TOKENS

    # The long row must outgrow the reserve.
    run = _Budgets({(5, 6, 7): RESERVE_TOKENS + 300, (9, 10, 11, 12): 40})
    engine = run.engine(chunk_steps=16)
    try:
        first, second = run.budgets
        run.submit(engine, first)
        assert run.done.acquire(timeout=0) is False
        time.sleep(0.5)  # the second joins the running batch
        run.submit(engine, second)
        run.wait_all()
        assert engine.stats["grown"] >= 1
        run.check_tokens()
    finally:
        engine.stop()


def test_rows_left_by_a_burst_go_on_as_a_smaller_batch_and_a_burst_grows_it():
    """Four requests open a 4-row batch; once the three short ones stop, the long one decodes
    as a 1-row batch. Three more arriving then make it a 4-row batch again, which they join
    instead of waiting for it to drain, and after them it is one row again. Every row's greedy
    tokens are unchanged."""
    long, short = (9, 10, 11, 12), [(5 + i, 6, 7) for i in range(3)]
    late = [(20 + i, 21) for i in range(3)]
    run = _Budgets({long: 200, **dict.fromkeys(short, 4), **dict.fromkeys(late, 30)})
    # A window long enough that the first four open one batch.
    engine = run.engine(chunk_steps=8, row_buckets=(1, 4), max_batch=4, wait_s=1.0)
    seen = []

    def on_long_tokens():
        # On the engine thread, after a chunk: the first one decoded as a 1-row batch brings
        # the late requests.
        seen.append((engine.stats["regrouped"], engine._batch.size))
        if seen[-1] == (1, 1) and seen.count((1, 1)) == 1:
            for prompt in late:
                run.submit(engine, prompt)

    try:
        run.submit(engine, long, on_long_tokens)
        for prompt in short:
            run.submit(engine, prompt)
        run.wait_all()
        assert list(dict.fromkeys(seen)) == [(0, 4), (1, 1), (2, 4), (3, 1)], seen
        assert engine.stats["batches"] == 1
        run.check_tokens()
    finally:
        engine.stop()
