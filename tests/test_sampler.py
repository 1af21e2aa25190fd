"""The compiled sampler against naive references: greedy tokens, log-probs, sampling supports,
reproducibility, and host-turn continuation versus a fresh prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envace_jax.models.config import get_preset
from envace_jax.models.decoder import Decoder
from envace_jax.sampling import loop
from envace_jax.sampling.distributions import (
    SamplingParams,
    categorical,
    sample_next,
    truncate_logits,
)
from envace_jax.sampling.loop import TurnSpec
from envace_jax.sampling.sampler import Sampler, pad_rows
from envace_jax.text.codes import Role, Status

END, CALL = 5, 6
GENERATE = TurnSpec(end_id=END, tool_call_id=CALL, mode="generate", max_message_tokens=10_000)


@pytest.fixture(scope="module")
def model():
    with jax.default_matmul_precision("float32"):
        yield Decoder(get_preset("tiny-qwen3"), rngs=nnx.Rngs(3))


def _prompts(seed=0, lengths=(3, 9, 14, 6)):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, 500, size=n)] for n in lengths]


@nnx.jit
def _forward(model, x):
    return model(x, jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape))[0]


def _full_logits(model, seq, width=64):
    """Cache-less logits for `seq` [len(seq), V]; causal, so right padding changes nothing."""
    x = np.zeros((1, width), np.int32)
    x[0, : len(seq)] = seq
    return np.asarray(_forward(model, jnp.asarray(x))[0, : len(seq)])


def test_greedy_equals_naive_full_forward(model):
    prompts = _prompts()
    sampler = Sampler(model, GENERATE, pad_id=0)
    out = sampler.generate(
        prompts, key=jax.random.key(0), sampling=SamplingParams(greedy=True), max_new_tokens=12
    )
    for b, prompt in enumerate(prompts):
        seq = list(prompt)
        while len(seq) < len(prompt) + 12:
            seq.append(int(np.argmax(_full_logits(model, seq)[-1])))
            if seq[-1] == END:
                break
        assert out.tokens[b, : out.lengths[b]].tolist() == seq
        assert (out.tokens[b, out.lengths[b] :] == 0).all()
        assert out.roles[b, : len(prompt)].tolist() == [Role.CONTEXT] * len(prompt)
        assert (out.roles[b, len(prompt) : out.lengths[b]] == 1).all()
        assert (out.segments[b, len(prompt) : out.lengths[b]] == 1).all()


def test_logprobs_are_full_forward_log_softmax(model):
    prompts = _prompts(1)
    sampler = Sampler(model, GENERATE, pad_id=0)
    sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    out = sampler.generate(prompts, key=jax.random.key(5), sampling=sampling, max_new_tokens=9)
    for b, prompt in enumerate(prompts):
        n = int(out.lengths[b])
        seq = out.tokens[b, :n].tolist()
        logits = _full_logits(model, seq) / 0.7  # untruncated, temperature-scaled
        ref = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
        for t in range(len(prompt), n):
            np.testing.assert_allclose(out.logprobs[b, t], ref[t - 1, seq[t]], atol=1e-5)
        assert (out.logprobs[b, : len(prompt)] == 0).all()


def test_sampling_is_reproducible_for_a_key(model):
    sampler = Sampler(model, GENERATE, pad_id=0)
    kw = dict(sampling=SamplingParams(temperature=1.3), max_new_tokens=16)
    a = sampler.generate(_prompts(), key=jax.random.key(7), **kw)
    b = sampler.generate(_prompts(), key=jax.random.key(7), **kw)
    c = sampler.generate(_prompts(), key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.5)])
def test_truncated_sampling_stays_in_support(top_k, top_p):
    logits = jax.random.normal(jax.random.key(0), (4, 64)) * 2.0
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    keys = jax.random.split(jax.random.key(1), 2000)
    draws = jax.vmap(lambda k: sample_next(logits, k, params)[0])(keys)  # [N, 4]
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for row in range(4):
        # Reference: top-k first, then top-p over the renormalised top-k distribution.
        order = np.argsort(-probs[row])[: top_k or 64]
        p_k = probs[row][order] / probs[row][order].sum()
        mass_before = np.cumsum(p_k) - p_k
        support = set(order[mass_before < top_p].tolist())
        seen = set(np.asarray(draws[:, row]).tolist())
        assert seen <= support
        # Every token of a small support is reachable; frequencies follow the renormalised
        # distribution (chi-square-like bound, loose enough to be deterministic-safe).
        kept = np.array(sorted(support))
        p = probs[row][kept] / probs[row][kept].sum()
        freq = np.array([(np.asarray(draws[:, row]) == t).mean() for t in kept])
        assert np.abs(freq - p).max() < 0.05


def test_top_p_keeps_the_most_likely_token_even_when_it_alone_exceeds_p():
    logits = jnp.asarray([[10.0, 0.0, -1.0, -2.0]])
    kept = np.asarray(truncate_logits(logits, 0, 0.1)) > -1e29
    assert kept.tolist() == [[True, False, False, False]]


def test_decode_phases_match_attending_the_whole_buffer(model):
    """The loop widens its attention window as rows grow (16, 32, 64 here): rows of different
    lengths crossing every boundary sample what attending all 64 slots samples."""
    spec = TurnSpec(end_id=-1, tool_call_id=CALL, mode="generate", max_message_tokens=10_000)
    prompts = _prompts(4, (3, 14, 9, 20))
    key, sampling = jax.random.key(2), SamplingParams(temperature=1.0)
    init = jax.jit(loop.init_state, static_argnums=0, static_argnames=("spec", "max_len"))
    decode = jax.jit(loop.decode, static_argnums=0, static_argnames=("spec", "sampling", "windows"))
    graphdef, params = nnx.split(model)
    out = {}
    for windows in [(16, 32, 64), (64,)]:
        state = init(
            graphdef,
            params,
            jnp.asarray(pad_rows(prompts, 32, 0)),
            jnp.asarray([len(p) for p in prompts], jnp.int32),
            key=key,
            spec=spec,
            max_len=64,
            max_new_tokens=jnp.asarray([60, 20, 40, 44], jnp.int32),
        )
        state = decode(
            graphdef, params, state, spec=spec, sampling=sampling, max_steps=64, windows=windows
        )
        out[windows] = loop.to_trajectories(state, pad_id=0)
    phased, whole = out[(16, 32, 64)], out[(64,)]
    np.testing.assert_array_equal(phased.lengths, [63, 34, 49, 64])  # budgets reached
    np.testing.assert_array_equal(phased.tokens, whole.tokens)
    np.testing.assert_allclose(phased.logprobs, whole.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="must increase and end at the buffer 64"):
        decode(graphdef, params, state, spec=spec, sampling=sampling, max_steps=1, windows=(32,))


@pytest.mark.parametrize("windowed", [False, True])
def test_host_continuation_matches_fresh_prefill(model, windowed):
    """Appending observation tokens on top of the cache gives the logits of a fresh prefill,
    also when the appended chunk attends over the slots its rows reach only (`kv_window`)."""
    spec = TurnSpec(end_id=END, tool_call_id=CALL, mode="host", max_message_tokens=10_000)
    sampler = Sampler(model, spec, pad_id=0)
    prompts = _prompts(2, (4, 11))
    state = sampler.start(
        prompts, key=jax.random.key(0), sampling=SamplingParams(greedy=True), max_new_tokens=6
    )
    # Pretend both rows paused for the environment after some generated tokens.
    T = state.tokens.shape[1]
    state = state.replace(
        status=jnp.full_like(state.status, Status.AWAITING_ENV),
        budget=jnp.full_like(state.budget, T),
    )
    obs = [[31, 32, 33], [41, 42, 43, 44, 45, 46, 47]]
    chunk, lens = _chunk(obs)
    window = int(np.max(np.asarray(state.length))) + chunk.shape[1] + 1 if windowed else None
    assert window is None or window < T
    appended = sampler._append(
        sampler.graphdef, sampler.params, state, chunk, lens, kv_window=window
    )
    lengths = np.asarray(appended.length)
    decoding = nnx.merge(sampler.graphdef, sampler.params)  # the model the sampler runs
    for b in range(2):
        seq = np.asarray(appended.tokens[b, : lengths[b]]).tolist()
        assert seq[-len(obs[b]) :] == obs[b]
        # Next-token logits through the cache: feed the last token at its position.
        last = jnp.asarray([[seq[-1]]], jnp.int32)
        cache_b = appended.cache.take_rows(jnp.asarray([b]))
        got, _ = decoding(last, jnp.asarray([[len(seq) - 1]], jnp.int32), cache=cache_b)
        ref = _full_logits(model, seq)[-1]
        np.testing.assert_allclose(np.asarray(got[0, 0]), ref, atol=1e-4)
        assert (np.asarray(appended.roles[b, lengths[b] - len(obs[b]) : lengths[b]]) == 0).all()
    assert (np.asarray(appended.status) == Status.RUNNING).all()


def test_decodes_from_one_prefill_match_separate_starts(model):
    """Decoding copies of one `prefill` state (an evaluation's greedy and sampled runs) gives
    what separate starts give, and leaves the prefilled state usable."""
    sampler = Sampler(model, GENERATE, pad_id=0)
    prompts = _prompts(4)
    shared = sampler.prefill(prompts, max_new_tokens=10)
    runs = [
        (jax.random.key(0), SamplingParams(greedy=True)),
        (jax.random.key(1), SamplingParams(temperature=1.0)),
        (jax.random.key(2), SamplingParams(temperature=1.0)),
    ]
    for key, sampling in runs:
        alone = sampler.generate(prompts, key=key, sampling=sampling, max_new_tokens=10)
        state = sampler.start(key=key, sampling=sampling, prefilled=shared)
        out = sampler.trajectories(state)
        np.testing.assert_array_equal(out.tokens, alone.tokens)
        np.testing.assert_array_equal(out.logprobs, alone.logprobs)
    assert not any(a.is_deleted() for a in jax.tree.leaves(shared))


def test_fresh_prefill_writes_the_cache_of_a_windowed_prefill():
    """A prompt batch prefilled in causal query blocks over its own keys (`fresh`) writes the
    cache that attending over every slot writes."""
    with jax.default_matmul_precision("float32"):
        blocked = Decoder(get_preset("tiny-qwen3", query_block=4), rngs=nnx.Rngs(3))
        prompts = _prompts(5, (3, 9, 14, 6))
        tokens = jnp.asarray(pad_rows(prompts, 16, 0))
        positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)
        empty = lambda: blocked.init_cache(len(prompts), 32)
        fresh = loop.prefill(blocked, tokens, positions, empty(), kv_window=16, fresh=True)
        ref = loop.prefill(blocked, tokens, positions, empty(), kv_window=16)
    for b, p in enumerate(prompts):
        for got, want in ((fresh.k, ref.k), (fresh.v, ref.v)):
            np.testing.assert_allclose(
                np.asarray(got[:, b, : len(p)]), np.asarray(want[:, b, : len(p)]), atol=1e-5
            )


def test_categorical_of_some_rows_draws_what_the_whole_batch_draws():
    """Rows of a batch, sampled with their row ids, pick the tokens the whole batch picks."""
    logits = jax.random.normal(jax.random.key(0), (16, 50))
    key = jax.random.key(1)
    whole = np.asarray(jax.random.categorical(key, logits))
    rows = jnp.asarray([1, 4, 5, 11])
    some = categorical(key, logits[rows], rows=rows, batch=16)
    np.testing.assert_array_equal(np.asarray(some), whole[np.asarray(rows)])


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True), SamplingParams(1.0)])
def test_resuming_some_rows_as_a_smaller_batch_matches_the_whole_batch(model, sampling):
    """A host turn that resumes 5 of 16 rows decodes them as an 8-row batch (`take_rows`), and
    the state it gives back equals resuming the whole batch: the same tokens, lengths and
    status, and log-probs and cache up to rounding (a smaller batch's matmuls round apart)."""
    spec = TurnSpec(end_id=END, tool_call_id=CALL, mode="host", max_message_tokens=10_000)
    sampler = Sampler(model, spec, pad_id=0)
    prompts = _prompts(6, tuple(range(3, 19)))
    started = sampler.start(prompts, key=jax.random.key(4), sampling=sampling, max_new_tokens=12)
    paused = np.asarray([1, 2, 7, 12, 15])
    status = np.full(16, Status.FINISHED, np.int8)
    status[paused] = Status.AWAITING_ENV
    T = started.tokens.shape[1]
    started = started.replace(status=jnp.asarray(status), budget=jnp.full((16,), T, jnp.int32))
    obs = [[30 + b, 31, 32][: 1 + b % 3] if b in paused else None for b in range(16)]
    taken = []
    take = sampler._take
    sampler._take = lambda state, rows: taken.append(len(rows)) or take(state, rows)
    runs = {}
    for how, rows_of in (("whole", lambda *a: None), ("part", sampler._rows_bucket)):
        sampler._rows_bucket = rows_of
        state = sampler.resume(jax.tree.map(jnp.copy, started), obs, sampling=sampling)
        runs[how] = state.replace(key=None)
    assert taken == [8]  # the smallest part (`MIN_PART_ROWS`)
    whole, part = (jax.tree.map(np.asarray, runs[k]) for k in ("whole", "part"))
    assert (part.length[paused] > np.asarray(started.length)[paused] + 1).all()  # decoded on
    for name in ("tokens", "roles", "segments", "length", "status", "step"):
        np.testing.assert_array_equal(getattr(part, name), getattr(whole, name), err_msg=name)
    np.testing.assert_allclose(part.logprobs, whole.logprobs, atol=1e-5)
    for b in paused:
        n, row = whole.length[b] - 1, np.asarray([b])
        rows = (jax.tree.leaves(run.cache.take_rows(row)) for run in (part, whole))
        for got, want in zip(*rows, strict=True):  # slots are axis 2 in either cache type
            np.testing.assert_allclose(got[:, :, :n], want[:, :, :n], atol=1e-5)


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True), SamplingParams(1.0)])
def test_decoding_on_with_the_running_rows_alone_matches_the_whole_batch(model, sampling):
    """Once fewer than half of the rows run, the rest decode as a smaller batch, and again:
    the tokens are those of decoding the whole batch to the end."""
    prompts = _prompts(7, tuple(3 + b % 16 for b in range(64)))
    budgets = [2 + b for b in range(64)]  # rows stop one after another
    runs, taken = {}, {}
    for how, compact in (("whole", False), ("part", True)):
        sampler = Sampler(model, GENERATE, pad_id=0, compact_rows=compact)
        taken[how] = []
        take = sampler._take
        sampler._take = lambda state, rows, t=taken[how], take=take: (
            t.append(len(rows)) or take(state, rows)
        )
        runs[how] = sampler.generate(
            prompts, key=jax.random.key(5), sampling=sampling, max_new_tokens=budgets
        )
    assert taken == {"whole": [], "part": [32, 16, 8]}
    whole, part = runs["whole"], runs["part"]
    for name in ("tokens", "roles", "segments", "lengths", "status"):
        np.testing.assert_array_equal(getattr(part, name), getattr(whole, name), err_msg=name)
    np.testing.assert_allclose(part.logprobs, whole.logprobs, atol=1e-5)


def _chunk(obs):
    C = max(len(o) for o in obs)
    chunk = np.zeros((len(obs), C), np.int32)
    for i, o in enumerate(obs):
        chunk[i, : len(o)] = o
    return jnp.asarray(chunk), jnp.asarray([len(o) for o in obs], jnp.int32)
