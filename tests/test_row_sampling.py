"""Per-row sampling parameters (`RowSampling`): each row samples exactly as the batch-wide
`SamplingParams` of its setting would, inside one compiled program for every mix of settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.sampling.distributions import (
    TOP_P_CANDIDATES,
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


def _support_reference(logits: np.ndarray, k: int, p: float) -> np.ndarray:
    """The kept tokens of one row by definition: the top k (ties with the k-th kept), then the
    fewest most likely of those whose renormalised mass reaches p (ties with the last kept)."""
    order = np.argsort(-logits, kind="stable")
    kth = logits[order[k - 1]] if 0 < k < len(logits) else -np.inf
    in_k = logits >= kth
    if p >= 1.0:
        return in_k
    probs = np.where(in_k, np.exp(logits - logits.max()), 0.0)
    probs = probs / probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    threshold = logits[order][mass_before < p].min()
    return in_k & (logits >= threshold)


def test_truncation_past_the_candidates_matches_the_definition():
    """A vocabulary wider than the candidates top-p searches first: peaked rows find their cut
    there, flat rows and a top-k past the candidates fall back to the sort; both give the
    support the definition gives."""
    V = 4 * TOP_P_CANDIDATES
    rows = [(8.0, 0, 0.95), (8.0, 5, 0.9), (8.0, 0, 1.0), (0.1, 0, 0.5), (4.0, 3 * V // 4, 0.99)]
    noise = np.asarray(jax.random.normal(jax.random.key(3), (len(rows), V)), np.float64)
    logits = np.stack([scale * n for (scale, _, _), n in zip(rows, noise, strict=True)]).astype(
        np.float32
    )
    k = jnp.asarray([r[1] for r in rows], jnp.int32)
    p = jnp.asarray([r[2] for r in rows], jnp.float32)
    for picked in (np.arange(3), np.arange(len(rows))):  # the head alone, and with fallback rows
        got = np.asarray(jax.jit(truncate_rows)(logits[picked], k[picked], p[picked])) > -1e29
        for i, row in enumerate(picked):
            want = _support_reference(logits[row].astype(np.float64), rows[row][1], rows[row][2])
            np.testing.assert_array_equal(got[i], want, err_msg=f"row {rows[row]}")
    assert _support_reference(logits[3].astype(np.float64), 0, 0.5).sum() > TOP_P_CANDIDATES
