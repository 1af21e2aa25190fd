"""GRPO and SFT train steps: one jitted function per step, sharded by the logical-axis rules.

A step takes the rollout batch whole. Inside the compiled function it computes the role-wise
advantages (they need every row of a group), the old log-probs (recomputed with the starting
params, as the reference does, or taken from the sampler) and the reference-policy log-probs
for the KL term, then runs `epochs x mini_batches` optimizer updates, each accumulating
gradients over `micro_batches` chunks with `lax.scan`, so a batch larger than memory still
trains.

Rows are dealt to chunks round-robin (chunk k holds rows k, k + C, k + 2C, ...), so with the
batch axis sharded over the data axes every chunk draws evenly from every device and no rows
move between devices. Aggregation weights are computed over a whole mini-batch before it is
cut, so accumulating over micro-batches gives exactly the mini-batch gradient.

The train state (params, optimizer state) is donated: the step updates it in place. Anything
that must survive the step, such as the frozen KL reference, is a separate copy
(`frozen_copy`).

Usage (sharded; drop `shardings` everywhere for one device):

    params = nnx.state(model, nnx.Param)
    tx = make_optimizer(OptimConfig.from_config(config.optim))
    sh = make_shardings(mesh, params, tx, batch_shape=(B, T))
    state = init_train_state(jax.device_put(params, sh.params), tx, sh)
    step = make_grpo_step(model, tx, GRPOConfig.from_config(config.grpo), shardings=sh)
    state, metrics = step(state, shard_batch(batch, sh))  # + ref_params when use_kl
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from envace_jax import parallel
from envace_jax.rl.advantages import compute_advantages, role_mask
from envace_jax.rl.batch import TrajectoryBatch
from envace_jax.rl.config import GRPOConfig, SFTConfig, chunking_problem
from envace_jax.rl.losses import policy_loss, sft_loss, token_weights
from envace_jax.rl.optim import opt_state_shardings
from envace_jax.text.codes import Role, Status

Metrics = dict[str, jax.Array]


@struct.dataclass
class TrainState:
    """step: [] int32 completed train steps; params: nnx.State of nnx.Param; opt_state: Optax."""

    step: jax.Array
    params: Any
    opt_state: Any


def init_train_state(params: Any, tx: optax.GradientTransformation, shardings=None) -> TrainState:
    """A fresh state; with `StepShardings`, params and optimizer state land on their shardings."""
    make = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p))
    if shardings is None:
        return jax.jit(make)(params)
    return jax.jit(make, out_shardings=shardings.state)(params)


def frozen_copy(params: Any, dtype: Any = None) -> Any:
    """A copy of `params` (optionally cast, e.g. to bfloat16) that keeps their shardings.

    The KL reference and a frozen rehearsal policy need only parameters (no optimizer state),
    and they must not alias the train state, whose buffers each step donates.
    """
    cast = lambda x: x.astype(dtype) if dtype is not None else jnp.copy(x)
    return jax.jit(lambda p: jax.tree.map(cast, p))(params)


# ------------------------------------------------------------------------------ shardings


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """NamedShardings of the step's inputs and outputs on one mesh."""

    mesh: Mesh
    rules: Any
    state: TrainState  # of NamedShardings
    params: Any  # nnx.State of NamedShardings (the KL reference's)
    batch: TrajectoryBatch  # of NamedShardings
    replicated: NamedSharding


def make_shardings(
    mesh: Mesh,
    params: Any,
    tx: optax.GradientTransformation,
    batch_shape: tuple[int, int],
    rules: Any = None,
) -> StepShardings:
    """Params and optimizer state by the logical-axis rules; the batch over the data axes.

    Args:
      params: nnx.State of the model's nnx.Param variables (arrays or abstract).
      batch_shape: (B, T) of the trajectory batches the step will see.
    """
    rules = parallel.current_rules() if rules is None else rules
    p_sh = parallel.param_shardings(params, mesh, rules)
    # Same tree structure as params (a sharding per array), which optax's tree walk needs.
    p_full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), p_sh, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    b, t = batch_shape
    tok = parallel.logical_to_sharding(("batch", "length"), mesh, rules, (b, t))
    row = parallel.logical_to_sharding(("batch",), mesh, rules, (b,))
    batch = TrajectoryBatch(
        tokens=tok,
        roles=tok,
        segments=tok,
        logprobs=tok,
        lengths=row,
        group=row,
        reward=row,
        status=row,
    )
    state = TrainState(
        step=replicated, params=p_full, opt_state=opt_state_shardings(tx, params, p_full, mesh)
    )
    return StepShardings(mesh, rules, state, p_full, batch, replicated)


def shard_batch(batch: TrajectoryBatch, shardings: StepShardings) -> TrajectoryBatch:
    return jax.device_put(batch, shardings.batch)


# ------------------------------------------------------------------------- model scoring


def token_logprobs(
    graphdef: nnx.GraphDef, params: Any, rest: Any, tokens: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each token given its prefix, and the policy entropy at that position.

    Args:
      tokens: [B, T] int, right-padded (causal attention keeps padding out of real tokens).

    Returns:
      logp, entropy: [B, T] f32, aligned with `tokens`; position 0 has no prefix and is 0.
    """
    model = nnx.merge(graphdef, params, rest)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = model(tokens, positions)
    logits = logits[:, :-1].astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = logz - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    pad = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([pad, picked - logz], 1), jnp.concatenate([pad, entropy], 1)


# ---------------------------------------------------------------------- batch plumbing


def split_rows(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B // n, ...]; chunk k holds rows k, k + n, k + 2n, ..."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def _check_divisible(b: int, mini: int, micro: int, section: str) -> None:
    if problem := chunking_problem(b, mini, micro, section):
        raise ValueError(f"batch of {b} rows {problem}; pad rows (batch.pad) or change the counts")


def _chunks(arrays: dict[str, jax.Array], mini: int, micro: int) -> dict[str, jax.Array]:
    """Each [B, ...] array -> [mini, micro, B / (mini * micro), ...], batch axis kept sharded."""
    out = {}
    for k, x in arrays.items():
        y = split_rows(x, mini * micro)
        y = y.reshape(mini, micro, *y.shape[1:])
        axes = (None, None, "batch") + (None,) * (x.ndim - 1)
        out[k] = parallel.with_logical_constraint(y, axes)
    return out


def _mini_batch_weights(chunk: dict[str, jax.Array], mode: str) -> jax.Array:
    """Aggregation weights over a whole mini-batch [micro, b, T], normalised across chunks."""
    a, b, t = chunk["mask"].shape
    w = token_weights(chunk["mask"].reshape(a * b, t), chunk["segments"].reshape(a * b, t), mode)
    return w.reshape(a, b, t)


def _score_in_chunks(graphdef, params, rest, tokens, n, temperature) -> jax.Array:
    """Log-probs [B, T] of all rows, computed n chunks at a time, without gradients."""
    chunks = parallel.with_logical_constraint(split_rows(tokens, n), (None, "batch", "length"))
    logp = jax.lax.map(
        lambda tok: token_logprobs(graphdef, params, rest, tok, temperature)[0], chunks
    )
    b = tokens.shape[0]
    return jax.lax.stop_gradient(jnp.swapaxes(logp, 0, 1).reshape(b, -1))


# ---------------------------------------------------------------------------- updates


def _update(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    params,
    opt_state,
    mini_batch,
    mode: str,
    grad_shardings=None,
):
    """One optimizer update from a mini-batch [micro, b, ...], accumulating over micro-batches.

    Gradients accumulate in float32, laid out like the params when `grad_shardings` is given
    (so FSDP reduces them with reduce-scatters into sharded accumulators).
    Returns new params, opt state, the mini-batch loss, its grad norm and summed statistics.
    """
    weights = _mini_batch_weights(mini_batch, mode)
    constrain = lambda tree: (
        tree if grad_shardings is None else jax.lax.with_sharding_constraint(tree, grad_shardings)
    )

    def micro_step(grads, inputs):
        mb, w = inputs
        (loss, sums), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, w)
        grads = jax.tree.map(lambda acc, x: acc + x.astype(jnp.float32), grads, constrain(g))
        return grads, (loss, sums)

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    grads, (losses, sums) = jax.lax.scan(micro_step, zeros, (mini_batch, weights))
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    sums = jax.tree.map(jnp.sum, sums)
    return params, opt_state, losses.sum(), grad_norm, sums


def _run_updates(loss_fn, tx, state: TrainState, data, epochs: int, mode: str, shardings):
    """epochs x mini_batches updates over data [mini, micro, b, ...]; returns state, stats."""
    grad_shardings = None if shardings is None else shardings.params

    def one_update(carry, mini_batch):
        params, opt_state = carry
        params, opt_state, loss, gnorm, sums = _update(
            loss_fn, tx, params, opt_state, mini_batch, mode, grad_shardings
        )
        return (params, opt_state), (loss, gnorm, sums)

    def one_epoch(carry, _):
        return jax.lax.scan(one_update, carry, data)

    (params, opt_state), (loss, gnorm, sums) = jax.lax.scan(
        one_epoch, (state.params, state.opt_state), None, length=epochs
    )
    stats = {"loss": loss.mean(), "grad_norm": gnorm.mean(), "grad_norm_max": gnorm.max()}
    sums = jax.tree.map(jnp.sum, sums)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, stats, sums


def _batch_metrics(batch: TrajectoryBatch) -> Metrics:
    real = batch.lengths > 0
    n = jnp.maximum(real.sum(), 1)
    out = {"reward/mean": jnp.where(real, batch.reward, 0.0).sum() / n}
    for code in Status.stopped():
        out[f"status/{code.label}"] = ((batch.status == code) & real).sum() / n
    return out


def _compile(fn, shardings: StepShardings | None, with_ref: bool):
    """jit with donated state; with shardings, in/out NamedShardings under the mesh and rules."""
    if shardings is None:
        return jax.jit(fn, donate_argnums=0)
    s = shardings
    in_sh = (s.state, s.batch) + ((s.params,) if with_ref else ())
    jitted = jax.jit(
        fn, in_shardings=in_sh, out_shardings=(s.state, s.replicated), donate_argnums=0
    )

    def call(*args):
        # The model's activation constraints read the mesh and rules at trace time.
        with jax.set_mesh(s.mesh), parallel.axis_rules(s.rules):
            return jitted(*args)

    def lower(*args):
        with jax.set_mesh(s.mesh), parallel.axis_rules(s.rules):
            return jitted.lower(*args)

    call.lower = lower  # ahead-of-time compilation, as `jax.jit(...).lower` (memory analysis)
    return call


# ------------------------------------------------------------------------------- GRPO


def make_grpo_step(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    cfg: GRPOConfig,
    *,
    shardings: StepShardings | None = None,
) -> Callable[..., tuple[TrainState, Metrics]]:
    """Builds `step(state, batch[, ref_params]) -> (state, metrics)`, jitted and donating state.

    `model` supplies the graph (its parameter values are not used: they come from the state);
    `ref_params` (frozen_copy of the initial params) is an argument iff cfg.use_kl. Batch rows
    must divide into mini_batches x micro_batches chunks.

    Metrics: loss, grad_norm(_max), pg_clipfrac, dual_clipfrac, approx_kl (old vs new, k3),
    ratio, entropy, kl (when use_kl), trained_tokens, reward/mean, status/*, and per role
    (act, rehearse): outputs, tokens, empty_outputs, adv_mean, adv_std.
    """
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    epochs, mini, micro = cfg.epochs, cfg.mini_batches, cfg.micro_batches
    # With a single update the recomputed old log-probs equal the current ones, so the
    # training forward pass provides them (stop-gradient) and the extra pass is skipped.
    reuse_current = cfg.old_logprobs == "recompute" and epochs * mini == 1

    def loss_fn(params, mb, w):
        logp, entropy = token_logprobs(graphdef, params, rest, mb["tokens"], cfg.temperature)
        old = jax.lax.stop_gradient(logp) if reuse_current else mb["old"]
        return policy_loss(
            logp, old, mb["adv"], w, mb["mask"], cfg, ref_logp=mb.get("ref"), entropy=entropy
        )

    def step(state: TrainState, batch: TrajectoryBatch, ref_params=None):
        b = batch.shape[0]
        _check_divisible(b, mini, micro, "grpo")
        adv, adv_metrics = compute_advantages(
            batch.roles, batch.segments, batch.group, batch.reward, cfg
        )
        data = {
            "tokens": batch.tokens,
            "segments": batch.segments,
            "mask": role_mask(batch.roles, batch.segments, cfg.train_role_ids),
            "adv": adv,
        }
        if cfg.old_logprobs == "sampler":
            data["old"] = batch.logprobs
        elif not reuse_current:
            data["old"] = _score_in_chunks(
                graphdef, state.params, rest, batch.tokens, mini * micro, cfg.temperature
            )
        if cfg.use_kl:
            data["ref"] = _score_in_chunks(
                graphdef, ref_params, rest, batch.tokens, mini * micro, cfg.temperature
            )
        state, stats, sums = _run_updates(
            loss_fn, tx, state, _chunks(data, mini, micro), epochs, cfg.loss_agg, shardings
        )
        tokens = jnp.maximum(sums["tokens"], 1.0)
        metrics = {
            **stats,
            "pg_clipfrac": sums["clipped"] / tokens,
            "dual_clipfrac": sums["dual_clipped"] / tokens,
            "approx_kl": sums["approx_kl"] / tokens,
            "ratio": sums["ratio"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "trained_tokens": sums["tokens"] / epochs,
            **adv_metrics,
            **_batch_metrics(batch),
        }
        if cfg.use_kl:
            metrics["kl"] = sums["kl"] / tokens
        return state, metrics

    if cfg.use_kl:
        return _compile(step, shardings, with_ref=True)
    return _compile(lambda state, batch: step(state, batch), shardings, with_ref=False)


# -------------------------------------------------------------------------------- SFT


def make_sft_step(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    cfg: SFTConfig,
    *,
    shardings: StepShardings | None = None,
) -> Callable[[TrainState, TrajectoryBatch], tuple[TrainState, Metrics]]:
    """Builds `step(state, batch) -> (state, metrics)`: cross-entropy on the generated tokens
    of cfg.train_roles (e.g. ACT only for an agent warm start, REHEARSE only for a simulator).

    Metrics: loss, nll (token mean), grad_norm(_max), trained_tokens.
    """
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    mini, micro = cfg.mini_batches, cfg.micro_batches

    def loss_fn(params, mb, w):
        logp, _ = token_logprobs(graphdef, params, rest, mb["tokens"], 1.0)
        loss, sums = sft_loss(logp, w, mb["mask"])
        if "context_w" in mb:
            loss = loss - jnp.sum(mb["context_w"] * logp)
        return loss, sums

    def step(state: TrainState, batch: TrajectoryBatch):
        _check_divisible(batch.shape[0], mini, micro, "sft")
        data = {
            "tokens": batch.tokens,
            "segments": batch.segments,
            "mask": role_mask(batch.roles, batch.segments, cfg.train_role_ids),
        }
        if cfg.context_weight > 0:
            # Real context tokens after the first (which nothing predicts), weighted to sum to
            # context_weight per update, as each update's role loss sums to 1.
            t = jnp.arange(batch.tokens.shape[1])[None, :]
            ctx = (batch.roles == Role.CONTEXT) & (t >= 1) & (t < batch.lengths[:, None])
            scale = cfg.context_weight * mini / jnp.maximum(ctx.sum(), 1)
            data["context_w"] = ctx.astype(jnp.float32) * scale
        state, stats, sums = _run_updates(
            loss_fn, tx, state, _chunks(data, mini, micro), 1, cfg.loss_agg, shardings
        )
        tokens = jnp.maximum(sums["tokens"], 1.0)
        return state, {**stats, "nll": sums["nll"] / tokens, "trained_tokens": sums["tokens"]}

    return _compile(step, shardings, with_ref=False)
