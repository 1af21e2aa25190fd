"""The serving engine's batching window and length buckets, without HTTP."""

from __future__ import annotations

import threading
import time

from envace_jax.sampling.distributions import SamplingParams
from envace_jax.serve.batcher import Done, Engine, Sequence, Tokens, half_octave_bucket


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
        assert [len(t.ids) for t in tokens] == [8]  # the row was running: a whole chunk came
        assert (end.finish_reason, end.num_generated) == ("cancelled", 8)
        assert engine.stats["finished_cancelled"] == 1 and engine.stats["finished_stop"] == 0
    finally:
        engine.stop()
