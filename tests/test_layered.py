"""The per-layer decoding model (`models.layered`) against the stacked `Decoder`: the same
logits and cache contents on every path (cache-less, prompt prefill, decode steps at batch 1
and above, appended chunks, dropped positions), and the sampler's tokens either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envace_jax.models import layered
from envace_jax.models.config import get_preset
from envace_jax.models.decoder import Decoder, KVCache
from envace_jax.models.layered import DecodingWeights, LayerCache, LayeredDecoder
from envace_jax.rollout.role_models import RoleDecoders
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.loop import TurnSpec
from envace_jax.sampling.sampler import Sampler

END, CALL = 5, 6


@pytest.fixture(scope="module", params=["tiny-qwen3", "demo-qwen3"])
def models(request):
    """A decoder (qk-norm, untied head / tied head) and its per-layer copy."""
    with jax.default_matmul_precision("float32"):
        decoder = Decoder(get_preset(request.param, query_block=4), rngs=nnx.Rngs(1))
        yield decoder, LayeredDecoder(decoder)


def _stacked(cache: LayerCache) -> np.ndarray:
    """A LayerCache's keys as the decoder's layout [L, B, S, K, D]."""
    return np.moveaxis(np.stack([np.asarray(a) for a in cache.k]), 2, 3)


def _tokens(rng, cfg, shape):
    return jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)


def test_cacheless_logits_match_with_padding(models):
    decoder, per_layer = models
    rng = np.random.default_rng(0)
    tokens = _tokens(rng, decoder.cfg, (3, 9))
    mask = jnp.asarray(rng.integers(0, 2, (3, 9))).at[:, 0].set(1)
    positions = jnp.broadcast_to(jnp.arange(9), (3, 9))
    want = decoder(tokens, positions, attention_mask=mask)[0]
    got = per_layer(tokens, positions, attention_mask=mask)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_decode_and_append_match_the_decoder(models, batch):
    """A prompt prefill, decode steps with rows at different positions inside a window, and
    an appended chunk: the same logits and cache as the decoder's."""
    decoder, per_layer = models
    cfg = decoder.cfg
    rng = np.random.default_rng(batch)
    T, S = 9, 32
    prompt = _tokens(rng, cfg, (batch, T))
    positions = jnp.broadcast_to(jnp.arange(T), (batch, T))
    want = decoder.prefill(prompt, positions, decoder.init_cache(batch, S), T, fresh=True)
    got = per_layer.prefill(prompt, positions, per_layer.init_cache(batch, S), T, fresh=True)
    np.testing.assert_allclose(_stacked(got), np.asarray(want.k), atol=2e-5)
    pos = jnp.asarray(rng.integers(T - 2, T, (batch, 1)), jnp.int32)
    for _ in range(5):
        tok = _tokens(rng, cfg, (batch, 1))
        ref, want = decoder(tok, pos, cache=want, kv_window=16)
        out, got = per_layer(tok, pos, cache=got, kv_window=16)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
        pos = pos + 1
    chunk_pos = pos + jnp.arange(4)[None]
    chunk = _tokens(rng, cfg, (batch, 4))
    ref, want = decoder(chunk, chunk_pos, cache=want)
    out, got = per_layer(chunk, chunk_pos, cache=got)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
    np.testing.assert_allclose(_stacked(got), np.asarray(want.k), atol=2e-5)
    v = np.moveaxis(np.stack([np.asarray(a) for a in got.v]), 2, 3)
    np.testing.assert_allclose(v, np.asarray(want.v), atol=2e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_position_past_the_cache_is_not_written(models, batch):
    """The decoder's rule: a token at p >= S writes nothing (the scatter drops it)."""
    _, per_layer = models
    cache = per_layer.init_cache(batch, 8)
    tok = jnp.ones((batch, 1), jnp.int32)
    _, after = per_layer(tok, jnp.full((batch, 1), 8, jnp.int32), cache=cache)
    assert all(not np.asarray(a).any() for a in jax.tree.leaves(after))


def test_cache_type_and_shape_are_checked(models):
    decoder, per_layer = models
    tok = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="decodes with a LayerCache, not a KVCache"):
        per_layer(tok, tok, cache=decoder.init_cache(2, 8))
    with pytest.raises(ValueError, match="decodes with a KVCache, not a LayerCache"):
        decoder(tok, tok, cache=per_layer.init_cache(2, 8))
    with pytest.raises(ValueError, match=r"LayerCache .* expected \d+ layers of \[B=2"):
        per_layer(tok, tok, cache=per_layer.init_cache(3, 8))


def test_cache_row_methods_agree_between_types(models):
    """take_rows / put_rows / grow do to a LayerCache what they do to a KVCache."""
    decoder, per_layer = models
    rng = np.random.default_rng(2)
    stacked = KVCache(*(jnp.asarray(rng.normal(size=decoder.init_cache(4, 8).k.shape)),) * 2)
    per = LayerCache(
        k=tuple(jnp.moveaxis(stacked.k[i], 2, 1) for i in range(decoder.cfg.num_layers)),
        v=tuple(jnp.moveaxis(stacked.v[i], 2, 1) for i in range(decoder.cfg.num_layers)),
    )
    rows = jnp.asarray([2, 0])
    part_s, part_p = stacked.take_rows(rows), per.take_rows(rows)
    np.testing.assert_array_equal(_stacked(part_p), np.asarray(part_s.k))
    back_s = stacked.grow(12).put_rows(jnp.asarray([1, 9]), part_s.grow(12))
    back_p = per.grow(12).put_rows(jnp.asarray([1, 9]), part_p.grow(12))  # row 9 is dropped
    np.testing.assert_array_equal(_stacked(back_p), np.asarray(back_s.k))
    assert back_p.max_len == 12


def test_decoding_weights_convert_lazily_and_bind_new_params_without_changing_the_old():
    decoder = Decoder(get_preset("tiny-qwen3"), rngs=nnx.Rngs(0))
    weights = DecodingWeights(decoder)
    assert isinstance(nnx.merge(weights.graphdef, weights.params), LayeredDecoder)
    other = nnx.state(Decoder(get_preset("tiny-qwen3"), rngs=nnx.Rngs(7)), nnx.Param)
    before = np.asarray(nnx.merge(weights.graphdef, weights.params).embedding[...])
    bound = weights.bound(other)
    got = nnx.merge(bound.graphdef, bound.params).embedding[...]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(other["embed"]["embedding"][...]))
    kept = nnx.merge(weights.graphdef, weights.params).embedding[...]
    np.testing.assert_array_equal(np.asarray(kept), before)
    assert not np.array_equal(before, np.asarray(got))
    spec = TurnSpec(
        end_id=END, tool_call_id=CALL, mode="rehearse", act_to_rehearse=(1,), rehearse_to_act=(2,)
    )
    roles = RoleDecoders(decoder, decoder, spec)
    assert DecodingWeights(roles).graphdef == nnx.graphdef(roles)  # kept stacked


@pytest.mark.parametrize("lengths", [(7,), (3, 9, 14, 6, 11)])
def test_sampler_tokens_are_the_stacked_decoders(models, lengths, monkeypatch):
    """The sampler's greedy tokens and sampled log-probs are those it gives over the stacked
    decoder, at batch 1 (where the step reads the cache before writing) and above."""
    decoder, _ = models
    spec = TurnSpec(end_id=END, tool_call_id=CALL, mode="generate", max_message_tokens=10_000)
    rng = np.random.default_rng(len(lengths))
    prompts = [[int(t) for t in rng.integers(10, 500, size=n)] for n in lengths]
    runs = {}
    for here in (True, False):
        monkeypatch.setattr(layered, "layered_here", lambda model, here=here: here)
        sampler = Sampler(decoder, spec, pad_id=0)
        runs[here] = [
            sampler.generate(prompts, key=jax.random.key(3), sampling=s, max_new_tokens=20)
            for s in (SamplingParams(greedy=True), SamplingParams(temperature=1.0))
        ]
    for got, want in zip(runs[True], runs[False], strict=True):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
