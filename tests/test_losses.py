"""Policy and SFT losses vs a NumPy re-computation, for every aggregation mode."""

import jax.numpy as jnp
import numpy as np
import pytest

from envace_jax.rl.advantages import role_mask
from envace_jax.rl.config import LOSS_AGGREGATIONS, GRPOConfig
from envace_jax.rl.losses import k3_kl, policy_loss, sft_loss, token_weights
from envace_jax.rl.synthetic import random_batch


def np_token_loss(logp, old, adv, cfg, ref=None, ent=None):
    """verl's compute_policy_loss (dual clip) + low_var_kl + entropy, token by token."""
    lr = np.clip(logp - old, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = np.exp(lr)
    out = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        a, r = adv[idx], ratio[idx]
        loss = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
        if a < 0 and cfg.dual_clip > 0:
            loss = min(loss, -a * cfg.dual_clip)
        if cfg.use_kl:
            d = np.clip(ref[idx] - logp[idx], -20, 20)
            loss += cfg.kl_coef * np.clip(np.exp(d) - d - 1, -cfg.kl_clamp, cfg.kl_clamp)
        loss -= cfg.entropy_coef * ent[idx]
        out[idx] = loss
    return out


def np_aggregate(per_token, mask, segs, mode):
    """Aggregation by explicit loops over rows and messages."""
    if mode == "token-mean":
        return per_token[mask].sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        rows = [per_token[i][mask[i]].mean() for i in range(mask.shape[0]) if mask[i].any()]
        return np.mean(rows)
    msgs = []
    for i in range(mask.shape[0]):
        for s in sorted(set(segs[i][mask[i]].tolist())):
            sel = mask[i] & (segs[i] == s)
            msgs.append(per_token[i][sel].mean())
    return np.mean(msgs)


def make_inputs(seed, b=8, t=48):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, batch_size=b, seq_len=t, num_groups=2, padding_rows=1)
    old = np.asarray(batch.logprobs, np.float64)
    # New log-probs within and beyond the clip range, so every branch is taken.
    logp = np.where(np.asarray(batch.segments) > 0, old + rng.normal(0, 0.4, old.shape), 0.0)
    adv = rng.normal(0, 1, old.shape) * (np.asarray(batch.segments) > 0)
    ref = old + rng.normal(0, 0.5, old.shape)
    ent = rng.uniform(0, 3, old.shape)
    return batch, logp, old, adv, ref, ent


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("variant", ["reference", "kl_entropy", "asymmetric_no_dual"])
def test_policy_loss_matches_numpy(mode, variant):
    cfg = {
        "reference": GRPOConfig(loss_agg=mode),
        "kl_entropy": GRPOConfig(loss_agg=mode, use_kl=True, kl_coef=0.3, entropy_coef=0.05),
        "asymmetric_no_dual": GRPOConfig(
            loss_agg=mode, clip_low=0.1, clip_high=0.28, dual_clip=0.0, train_roles=("rehearse",)
        ),
    }[variant]
    for seed in range(3):
        batch, logp, old, adv, ref, ent = make_inputs(seed)
        mask = np.asarray(role_mask(batch.roles, batch.segments, cfg.train_role_ids))
        segs = np.asarray(batch.segments)
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        w = token_weights(mask, segs, mode)
        loss, sums = policy_loss(
            f32(logp), f32(old), f32(adv), w, mask, cfg, ref_logp=f32(ref), entropy=f32(ent)
        )
        per_tok = np_token_loss(logp, old, adv, cfg, ref, ent)
        want = np_aggregate(per_tok, mask, segs, mode)
        np.testing.assert_allclose(float(loss), want, rtol=1e-6, atol=1e-6)
        ratio = np.exp(logp - old)
        clipped = (ratio < 1 - cfg.clip_low) & (adv < 0) | (ratio > 1 + cfg.clip_high) & (adv > 0)
        assert float(sums["tokens"]) == mask.sum()
        assert float(sums["clipped"]) == (clipped & mask).sum()
        assert 0 < float(sums["clipped"]) < mask.sum()
        np.testing.assert_allclose(float(sums["entropy"]), ent[mask].sum(), rtol=1e-5)


def test_weights_split_over_micro_batches_sum_to_the_full_loss():
    batch, logp, old, adv, ref, ent = make_inputs(7, b=8)
    cfg = GRPOConfig()
    mask = np.asarray(role_mask(batch.roles, batch.segments, cfg.train_role_ids))
    w = token_weights(mask, batch.segments, cfg.loss_agg)
    np.testing.assert_allclose(float(w.sum()), 1.0, rtol=1e-6)
    full, _ = policy_loss(logp, old, adv, w, mask, cfg)
    parts = [
        policy_loss(logp[i::4], old[i::4], adv[i::4], w[i::4], mask[i::4], cfg)[0] for i in range(4)
    ]
    np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    cfg = GRPOConfig()
    logp, old = jnp.array([[5.0, 5.0]]), jnp.zeros((1, 2))  # ratio e^5, far above 1 + eps
    adv = jnp.array([[-1.0, 1.0]])
    mask = jnp.ones((1, 2), bool)
    w = jnp.array([[1.0, 0.0]])
    loss, sums = policy_loss(logp, old, adv, w, mask, cfg)
    assert float(loss) == pytest.approx(3.0)  # -A * c, not -A * e^5
    assert float(sums["dual_clipped"]) == 1


def test_k3_is_clamped_and_zero_at_equality():
    assert float(k3_kl(jnp.array(0.3), jnp.array(0.3), 10.0)) == 0.0
    assert float(k3_kl(jnp.array(-30.0), jnp.array(0.0), 10.0)) == 10.0


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_sft_loss_matches_numpy(mode):
    batch, logp, *_ = make_inputs(11)
    mask = np.asarray(role_mask(batch.roles, batch.segments, (1,)))
    w = token_weights(mask, batch.segments, mode)
    loss, sums = sft_loss(jnp.asarray(logp, jnp.float32), w, mask)
    want = np_aggregate(-logp, mask, np.asarray(batch.segments), mode)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    np.testing.assert_allclose(float(sums["nll"]), -logp[mask].sum(), rtol=1e-5)
