"""Packed trajectories train the same objective as the reference's one-row-per-message setup.

The packed step scores each trajectory once. The reference scores every generated message as
its own row: the model runs on that message's prefix alone (left-padded, masked) and the loss
is the message's token mean, averaged over messages. Here the row-wise loss is written out
independently (its own PPO formula, its own advantages from the NumPy reference),
differentiated, and compared with the gradient the packed GRPO step applies (read off an SGD
update with learning rate 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from envace_jax.rl import steps
from envace_jax.rl.batch import validate
from envace_jax.rl.config import GRPOConfig
from tests.rl_helpers import batch_with_policy_logprobs, tiny_model
from tests.test_advantages import reference_advantages


def message_rows(batch, adv):
    """The reference's rows: one per generated message, its prefix left-padded to a common
    length L (attention mask and positions as a left-padded prompt gets), plus per-row index
    arrays [n, M] of the message's token slots (padded with slot 0 and weight 0)."""
    tokens, segs = np.asarray(batch.tokens), np.asarray(batch.segments)
    old = np.asarray(batch.logprobs)
    msgs = [
        (i, np.nonzero(segs[i] == s)[0])
        for i in range(tokens.shape[0])
        for s in sorted(set(segs[i][segs[i] > 0].tolist()))
    ]
    n, length = len(msgs), max(pos[-1] + 1 for _, pos in msgs)
    width = max(len(pos) for _, pos in msgs)
    rows = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), np.int32)
    slot = np.zeros((n, width), np.int32)
    w = np.zeros((n, width))
    a, o = np.zeros((n, width)), np.zeros((n, width))
    for k, (i, pos) in enumerate(msgs):
        prefix = tokens[i, : pos[-1] + 1]
        shift = length - len(prefix)
        rows[k, shift:], mask[k, shift:] = prefix, 1
        m = len(pos)
        slot[k, :m], w[k, :m] = pos + shift, 1.0 / m
        a[k, :m], o[k, :m] = adv[i, pos], old[i, pos]
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return dict(tokens=rows, mask=mask, positions=positions, slot=slot, w=w, adv=a, old=o)


def row_wise_loss(graphdef, params, rows, cfg):
    """Mean over message rows of the token-mean dual-clip PPO loss."""
    logits, _ = nnx.merge(graphdef, params)(
        rows["tokens"], rows["positions"], attention_mask=rows["mask"]
    )
    logsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    k = np.arange(rows["slot"].shape[0])[:, None]
    # The token in slot p is predicted by the logits at slot p - 1.
    logp = logsm[k, rows["slot"] - 1, rows["tokens"][k, rows["slot"]]]
    a = rows["adv"]
    ratio = jnp.exp(jnp.clip(logp - rows["old"], -20, 20))
    pg = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high))
    pg = jnp.where(a < 0, jnp.minimum(pg, -a * cfg.dual_clip), pg)
    return jnp.mean(jnp.sum(rows["w"] * pg, axis=1))


def test_packed_gradient_equals_message_by_message_gradient():
    model = tiny_model(seed=3)
    rng = np.random.default_rng(5)
    batch = batch_with_policy_logprobs(
        model, rng, noise=0.3, batch_size=4, seq_len=28, num_groups=2, padding_rows=1
    )
    validate(batch)
    cfg = GRPOConfig(old_logprobs="sampler")
    graphdef, params = nnx.split(model, nnx.Param)

    adv, _ = reference_advantages(batch, cfg)
    rows = message_rows(batch, adv)
    assert rows["tokens"].shape[0] >= 6 and (rows["w"] == 1.0).any()  # incl. 1-token messages
    loss_fn = jax.jit(jax.value_and_grad(row_wise_loss, argnums=1), static_argnums=(0, 3))
    want_loss, want_grad = loss_fn(graphdef, params, rows, cfg)

    tx = optax.sgd(1.0)
    state = steps.init_train_state(params, tx)
    new_state, metrics = steps.make_grpo_step(model, tx, cfg)(state, batch)
    got_grad = jax.tree.map(lambda a, b: a - b, params, new_state.params)

    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5, atol=1e-7)
    assert 0 < float(metrics["pg_clipfrac"]) < 1  # both clipped and unclipped tokens
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grad))
    assert scale > 1e-3
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * max(scale, 1.0))
