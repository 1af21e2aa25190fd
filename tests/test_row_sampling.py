"""Per-row sampling parameters (`RowSampling`): each row samples exactly as the batch-wide
`SamplingParams` of its setting would, inside one compiled program for every mix of settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.sampling.distributions import (
    RowSampling,
    SamplingParams,
    sample_next,
    truncate_logits,
    truncate_rows,
)

SETTINGS = [
    SamplingParams(greedy=True),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=2.0, top_p=0.999),
    SamplingParams(temperature=1.0, top_k=1000),  # k beyond the vocabulary keeps all
]


def _logits(seed=0, V=64):
    logits = jax.random.normal(jax.random.key(seed), (len(SETTINGS), V)) * 3.0
    return logits.at[:, 7].set(logits[:, 9])  # a tie, at whatever rank it lands


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (8, 0.5), (1, 0.3)])
def test_row_truncation_is_the_batch_truncation(top_k, top_p):
    logits = _logits()
    B = logits.shape[0]
    want = truncate_logits(logits, top_k, top_p)
    got = truncate_rows(logits, jnp.full((B,), top_k, jnp.int32), jnp.full((B,), top_p))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_samples_as_its_own_setting_would(seed):
    logits, key = _logits(seed), jax.random.key(100 + seed)
    tokens, logprobs = jax.jit(sample_next)(logits, key, RowSampling.of(SETTINGS))
    for row, params in enumerate(SETTINGS):
        want_tok, want_lp = sample_next(logits, key, params)  # same key and shape: same noise
        assert int(tokens[row]) == int(want_tok[row]), (row, params)
        # Compiled whole or op by op, float32 multiply-adds may round differently (~1e-5).
        np.testing.assert_allclose(float(logprobs[row]), float(want_lp[row]), rtol=3e-5)


def test_one_program_serves_every_mix_of_settings():
    traces = []

    @jax.jit
    def step(logits, key, sampling):
        traces.append(1)
        return sample_next(logits, key, sampling)

    logits = _logits()
    rng = np.random.default_rng(0)
    for i in range(6):
        mix = [SETTINGS[j] for j in rng.integers(0, len(SETTINGS), len(SETTINGS))]
        step(logits, jax.random.key(i), RowSampling.of(mix))
    assert len(traces) == 1
