"""Shared pieces of the train-step tests: a tiny policy and an independent token scorer."""

import numpy as np
from flax import nnx

from envace_jax.models.config import get_preset
from envace_jax.models.decoder import Decoder
from envace_jax.rl import synthetic


def tiny_model(seed: int = 0) -> Decoder:
    return Decoder(get_preset("tiny-qwen3"), rngs=nnx.Rngs(seed))


def numpy_token_logprobs(model, tokens) -> np.ndarray:
    """log p(tokens[:, t] | tokens[:, :t]) in float64 NumPy from the model's logits; 0 at t=0."""
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    logits, _ = model(tokens, np.broadcast_to(np.arange(t), (b, t)))
    z = np.asarray(logits, np.float64)[:, :-1]
    logsm = z - z.max(-1, keepdims=True)
    logsm = logsm - np.log(np.exp(logsm).sum(-1, keepdims=True))
    picked = np.take_along_axis(logsm, tokens[:, 1:, None], -1)[..., 0]
    return np.concatenate([np.zeros((b, 1)), picked], 1)


def batch_with_policy_logprobs(model, rng, noise: float = 0.0, **kwargs):
    """A random batch whose sampler log-probs are the model's own (plus optional noise), as if
    the model had sampled it; noise makes PPO ratios differ from 1 so clipping is exercised."""
    kwargs.setdefault("vocab_size", model.cfg.vocab_size)
    batch = synthetic.random_batch(rng, **kwargs)
    logp = numpy_token_logprobs(model, batch.tokens)
    logp = logp + noise * rng.normal(size=logp.shape)
    gen = np.asarray(batch.segments) > 0
    return batch.replace(logprobs=np.where(gen, logp, 0.0).astype(np.float32))
