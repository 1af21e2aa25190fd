"""GRPO and SFT train steps on a tiny policy (one device).

Independent references: a NumPy next-token scorer for the SFT loss, torch's AdamW for the
optimizer, and equalities that must hold by construction (accumulated micro-batches equal one
big batch; recomputed old log-probs equal the sampling policy's own log-probs).
"""

import dataclasses

import jax
import ml_collections
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from envace_jax.rl import steps
from envace_jax.rl.advantages import compute_advantages
from envace_jax.rl.batch import from_numpy, validate
from envace_jax.rl.config import GRPOConfig, SFTConfig
from envace_jax.rl.optim import OptimConfig, make_optimizer, make_schedule
from tests.rl_helpers import batch_with_policy_logprobs, numpy_token_logprobs, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def batch(model):
    rng = np.random.default_rng(0)
    return batch_with_policy_logprobs(
        model, rng, noise=0.3, batch_size=8, seq_len=32, num_groups=2, padding_rows=1
    )


def params_of(model):
    return nnx.state(model, nnx.Param)


def run(model, tx, cfg, batch, n_steps=1, ref=None):
    state = steps.init_train_state(params_of(model), tx)
    step = steps.make_grpo_step(model, tx, cfg)
    for _ in range(n_steps):
        state, metrics = step(state, batch, *(() if ref is None else (ref,)))
    return state, metrics


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def max_diff(a, b):
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_gradient_accumulation_equals_one_big_batch(model, batch):
    tx = optax.sgd(0.5)
    ref = steps.frozen_copy(params_of(model))
    cfg = GRPOConfig(old_logprobs="sampler", use_kl=True, kl_coef=0.1, entropy_coef=0.01)
    one, m1 = run(model, tx, cfg, batch, ref=ref)
    four, m4 = run(model, tx, GRPOConfig(**{**cfg.__dict__, "micro_batches": 4}), batch, ref=ref)
    moved = max_diff(one.params, params_of(model))
    assert moved > 1e-3  # the update is large enough for the comparison to mean something
    assert_trees_close(one.params, four.params, atol=1e-6)
    for k in ("loss", "grad_norm", "pg_clipfrac", "kl", "entropy", "approx_kl"):
        np.testing.assert_allclose(float(m1[k]), float(m4[k]), rtol=1e-5, atol=1e-7)
    assert 0 < float(m1["pg_clipfrac"]) < 1
    assert float(m1["trained_tokens"]) == (np.asarray(batch.segments) > 0).sum()


@pytest.mark.slow
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_recomputed_old_logprobs_equal_the_sampling_policys(model, mini_batches):
    # The batch's logprobs are exactly the starting policy's, so recomputing them with the
    # starting params must give the same updates: also for the second mini-batch, which sees
    # params already moved by the first (ratios != 1 there).
    exact = batch_with_policy_logprobs(
        model, np.random.default_rng(1), batch_size=8, seq_len=32, num_groups=2
    )
    tx = optax.sgd(1.0)
    kw = dict(mini_batches=mini_batches, entropy_coef=0.0)
    rec, m_rec = run(model, tx, GRPOConfig(old_logprobs="recompute", **kw), exact)
    smp, m_smp = run(model, tx, GRPOConfig(old_logprobs="sampler", **kw), exact)
    assert_trees_close(rec.params, smp.params, atol=1e-5)
    np.testing.assert_allclose(float(m_rec["approx_kl"]), float(m_smp["approx_kl"]), atol=1e-6)
    if mini_batches == 2:
        assert float(m_rec["approx_kl"]) > 1e-6  # the second update is off-policy


def test_sft_step_is_next_token_cross_entropy_and_trains_the_chosen_role(model, batch):
    tx = make_optimizer(OptimConfig(learning_rate=3e-3))
    state = steps.init_train_state(params_of(model), tx)
    step = steps.make_sft_step(model, tx, SFTConfig(train_roles=("rehearse",), micro_batches=2))
    before = numpy_token_logprobs(model, batch.tokens)
    rehearse = np.asarray(batch.roles) == 2
    for i in range(4):
        state, metrics = step(state, batch)
        if i == 0:  # the loss is measured with the starting params
            np.testing.assert_allclose(float(metrics["loss"]), -before[rehearse].mean(), rtol=1e-5)
            assert float(metrics["trained_tokens"]) == rehearse.sum()
    after = numpy_token_logprobs(nnx.merge(nnx.graphdef(model), state.params), batch.tokens)
    assert after[rehearse].mean() > before[rehearse].mean() + 0.05
    assert int(state.step) == 4


def test_grpo_moves_logprobs_with_the_advantage_and_keeps_the_reference(model, batch):
    tx = make_optimizer(OptimConfig(learning_rate=3e-3))
    params = params_of(model)
    ref = steps.frozen_copy(params)
    cfg = GRPOConfig(use_kl=True)
    state, metrics = run(model, tx, cfg, batch, n_steps=4, ref=ref)
    adv, _ = compute_advantages(batch.roles, batch.segments, batch.group, batch.reward, cfg)
    adv = np.asarray(adv)
    before = numpy_token_logprobs(model, batch.tokens)
    after = numpy_token_logprobs(nnx.merge(nnx.graphdef(model), state.params), batch.tokens)
    gain = after - before
    assert gain[adv > 0].mean() > 0.01 > -0.01 > gain[adv < 0].mean()
    for role in ("act", "rehearse"):
        assert float(metrics[f"{role}/outputs"]) > 0
    # The reference is a copy: the donated train state never touched it.
    assert_trees_close(ref, params, atol=0)
    assert float(metrics["kl"]) > 0  # by the last step the policy has left the reference
    half = steps.frozen_copy(params, dtype=jax.numpy.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(half)} == {np.dtype(jax.numpy.bfloat16)}


def test_indivisible_batch_names_the_config_keys(model, batch):
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"config\.grpo\.mini_batches=3"):
        run(model, tx, GRPOConfig(mini_batches=3), batch)


def test_optimizer_matches_torch_adamw_with_clipping():
    cfg = OptimConfig(
        learning_rate=1e-2,
        weight_decay=0.1,
        grad_clip=0.5,
        warmup_steps=2,
        schedule="cosine",
        decay_steps=5,
        end_lr_ratio=0.1,
    )
    rng = np.random.default_rng(0)
    p0 = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=(3,))}
    grads = [{k: rng.normal(size=v.shape) for k, v in p0.items()} for _ in range(6)]
    tx = make_optimizer(cfg)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), p0)
    state = tx.init(params)
    tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in p0.items()}
    opt = torch.optim.AdamW(
        list(tp.values()),
        lr=1.0,
        betas=(cfg.b1, cfg.b2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    sched = make_schedule(cfg)
    for i, g in enumerate(grads):
        upd, state = tx.update(jax.tree.map(lambda x: np.asarray(x, np.float32), g), state, params)
        params = optax.apply_updates(params, upd)
        for k in tp:
            tp[k].grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = float(sched(i))
        opt.step()
        for k in tp:
            np.testing.assert_allclose(np.asarray(params[k]), tp[k].detach().numpy(), atol=2e-6)
    # The warmup's first update is at peak / warmup_steps, never at 0.
    assert float(sched(0)) == pytest.approx(5e-3) and float(sched(1)) == pytest.approx(1e-2)
    assert float(sched(2)) == pytest.approx(1e-2) and float(sched(7)) == pytest.approx(1e-3)


def test_step_schedule_drops_to_the_end_rate_right_after_the_warmup():
    """The warmup's last update is at the peak; every later one at the end rate."""
    cfg = OptimConfig(learning_rate=3e-4, warmup_steps=4, schedule="step", end_lr_ratio=0.1)
    rates = [float(make_schedule(cfg)(k)) for k in range(8)]
    np.testing.assert_allclose(rates, [7.5e-5, 1.5e-4, 2.25e-4, 3e-4] + [3e-5] * 4, rtol=1e-6)


def test_optim_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"config\.optim\.lr_peak"):
        OptimConfig.from_config({"lr_peak": 1.0})
    with pytest.raises(ValueError, match=r"config\.optim\.schedule"):
        OptimConfig.from_config({"schedule": "exponential"})
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig.from_config({"schedule": "cosine"})
    assert OptimConfig.from_config({"learning_rate": 2e-6}).learning_rate == 2e-6


def test_grpo_and_sft_configs_from_config_dicts():
    cfg = GRPOConfig.from_config(
        ml_collections.ConfigDict({"train_roles": ["act"], "use_kl": True, "micro_batches": 4})
    )
    assert cfg.train_roles == ("act",) and cfg.train_role_ids == (1,) and cfg.kl_coef == 1e-4
    with pytest.raises(ValueError, match=r"config\.grpo\.clip_eps.*config\.grpo\.ppo_epochs"):
        GRPOConfig.from_config({"clip_eps": 0.2, "ppo_epochs": 2})
    with pytest.raises(ValueError, match=r"config\.grpo\.loss_agg = 'mean'"):
        GRPOConfig.from_config({"loss_agg": "mean"})
    with pytest.raises(ValueError, match=r"config\.sft\.train_roles"):
        SFTConfig.from_config({"train_roles": ["context"]})


# ---------------------------------------------------------------- SFT context LM loss


def context_batch(vocab: int, pad_seed: int = 0):
    """Four rows of 12 tokens: context (C), ACT (A), REHEARSE (R), padding (.) past length.

    row 0: CCCCAAACCRRR  length 12
    row 1: CCCAAACC....  length 8
    row 2: CCRRR.......  length 5
    row 3: ............  length 0 (a padding row)
    Padding tokens are random non-zero ids (seeded by pad_seed), so the model scores them like
    any other token and only the step's masking can keep them out of the loss.
    """
    layout = ["CCCCAAACCRRR", "CCCAAACC....", "CCRRR.......", "............"]
    lengths = np.array([12, 8, 5, 0])
    b, t = len(layout), len(layout[0])
    code = {"C": 0, ".": 0, "A": 1, "R": 2}
    roles = np.array([[code[c] for c in row] for row in layout])
    segments = np.zeros((b, t), np.int32)
    for i in range(b):
        seg, prev = 0, 0
        for j in range(t):
            if roles[i, j] and roles[i, j] != prev:
                seg += 1
            segments[i, j] = seg if roles[i, j] else 0
            prev = roles[i, j]
    tokens = np.random.default_rng(100).integers(1, vocab, (b, t))
    pad = np.arange(t)[None, :] >= lengths[:, None]
    tokens[pad] = np.random.default_rng(pad_seed + 1).integers(1, vocab, pad.sum())
    out = from_numpy(
        tokens=tokens,
        roles=roles,
        segments=segments,
        lengths=lengths,
        group=np.zeros(b),
        reward=np.zeros(b),
    )
    validate(out)
    return out


def sft_reference(logp, batch, train_ids, weight, mini, micro=1):
    """Expected reported SFT loss when every update sees the starting params: mean over the
    mini-batches of their token-mean NLL on the trained roles, plus weight x the token-mean NLL
    over the batch's real context tokens at positions >= 1. Row r lies in chunk
    r % (mini * micro) (steps.split_rows) and chunk c in mini-batch c // micro."""
    roles, lengths = np.asarray(batch.roles), np.asarray(batch.lengths)
    pos = np.arange(roles.shape[1])[None, :]
    trained = np.isin(roles, train_ids)
    ctx = (roles == 0) & (pos >= 1) & (pos < lengths[:, None])
    of = (np.arange(len(lengths)) % (mini * micro)) // micro
    role_loss = np.mean([-logp[of == k][trained[of == k]].mean() for k in range(mini)])
    return role_loss + weight * -logp[ctx].mean(), ctx


@pytest.mark.parametrize(
    ("roles", "weight", "mini", "micro"),
    [
        (("act", "rehearse"), 0.5, 1, 1),
        (("act", "rehearse"), 2.0, 1, 2),
        (("act",), 0.5, 2, 1),  # REHEARSE tokens are neither trained nor context
        (("act", "rehearse"), 0.0, 2, 2),  # plain SFT
    ],
)
def test_sft_context_weight_adds_a_token_mean_lm_loss_on_context(model, roles, weight, mini, micro):
    batch = context_batch(model.cfg.vocab_size)
    logp = numpy_token_logprobs(model, batch.tokens)
    # A zero learning rate keeps the params fixed, so every mini-batch's loss is measured with
    # the starting params and the NumPy reference applies to mini_batches > 1 as well.
    tx = optax.sgd(0.0)
    cfg = SFTConfig(
        train_roles=roles, context_weight=weight, mini_batches=mini, micro_batches=micro
    )
    state = steps.init_train_state(params_of(model), tx)
    _, metrics = steps.make_sft_step(model, tx, cfg)(state, batch)
    expected, ctx = sft_reference(logp, batch, cfg.train_role_ids, weight, mini, micro)
    assert ctx.sum() == 3 + 4 + 2 + 1  # real context after position 0, none from padding
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    # The reported nll and token count stay those of the trained roles alone.
    trained = np.isin(np.asarray(batch.roles), cfg.train_role_ids)
    np.testing.assert_allclose(float(metrics["nll"]), -logp[trained].mean(), rtol=1e-5)
    assert float(metrics["trained_tokens"]) == trained.sum()
    if weight == 0:
        plain = SFTConfig(train_roles=roles, mini_batches=mini, micro_batches=micro)
        state = steps.init_train_state(params_of(model), tx)
        _, m0 = steps.make_sft_step(model, tx, plain)(state, batch)
        assert float(metrics["loss"]) == float(m0["loss"])


def test_sft_context_loss_ignores_padding_and_trains_the_context(model):
    tx = make_optimizer(OptimConfig(learning_rate=3e-3))
    a, b = context_batch(model.cfg.vocab_size, 0), context_batch(model.cfg.vocab_size, 1)
    assert (np.asarray(a.tokens) != np.asarray(b.tokens)).any()  # only the padding differs
    step = steps.make_sft_step(model, tx, SFTConfig(context_weight=1.0))
    (sa, ma), (sb, mb) = [step(steps.init_train_state(params_of(model), tx), x) for x in (a, b)]
    # Padding tokens reach neither the loss nor the gradient.
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-6)
    assert_trees_close(sa.params, sb.params, atol=1e-7)

    # The extra term trains the context: its NLL falls more than under plain SFT.
    _, ctx = sft_reference(numpy_token_logprobs(model, a.tokens), a, (1, 2), 0.0, 1)
    gains = {}
    for w in (0.0, 1.0):
        step = steps.make_sft_step(model, tx, SFTConfig(context_weight=w))
        state = steps.init_train_state(params_of(model), tx)
        for _ in range(4):
            state, _ = step(state, a)
        after = numpy_token_logprobs(nnx.merge(nnx.graphdef(model), state.params), a.tokens)
        gains[w] = after[ctx].mean()
    assert gains[1.0] > gains[0.0] + 0.05


def test_sft_context_weight_must_be_non_negative():
    with pytest.raises(ValueError, match="context_weight"):
        SFTConfig(context_weight=-1)
    with pytest.raises(ValueError, match=r"config\.sft\.context_weight"):
        SFTConfig.from_config({"context_weight": -0.5})
    assert SFTConfig.from_config({"context_weight": 0.3}).context_weight == 0.3


def test_demo_rl_schedule_keeps_its_warmup_and_drops_after_it():
    """The demo's RL steps are its warmup, at the rates a constant schedule gives them (so the
    drop changes no 4-step result); every later update runs at a tenth of the peak."""
    from envace_jax.configuration import load
    from tests.conftest import demo_config

    config = load(demo_config())
    optim = config.optim
    demo = make_schedule(optim)
    constant = make_schedule(dataclasses.replace(optim, schedule="constant"))
    warmup = optim.warmup_steps
    assert warmup == config.schedule.rl_steps
    for k in range(warmup):
        assert float(demo(k)) == float(constant(k))
    end = optim.learning_rate * optim.end_lr_ratio
    for k in (warmup, warmup + 1, warmup + 20):
        assert float(demo(k)) == pytest.approx(end)
