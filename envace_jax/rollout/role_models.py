"""Two policies in one decode loop: ACT tokens from one decoder, REHEARSE tokens from another.

`RoleDecoders` wraps two decoders of the same architecture behind the `Decoder` call signature
(both are `models.decoder.CausalLM`s), so the compiled world-rehearsal loop (`sampling.loop`,
mode 'rehearse') runs it unchanged. It serves the training modes in which the environment's
responses are not written by the acting parameters: separate parameter sets per role
(`envace_noshare`) and a frozen external simulator (`external_simulator`).

Both decoders read the whole trajectory, so every token goes through both and each keeps its own
KV cache; the logits of a row come from the decoder of the row's current role. The loop does not
pass the role to the model, so the wrapper tracks it from the tokens it is fed, with the loop's
own transition rule (`sampling.loop`): an ACT message that wrote `tool_call_id` and then
`end_id` hands over to REHEARSE; `end_id` in REHEARSE hands back to ACT. The loop feeds every
written token of a running row exactly once, in order (forced glue included, which holds neither
id), so the tracked role equals the loop's role for every token it samples. A call with more
than one token is a prefill (the prompt, or appended host tokens), after which the loop's row is
ACT with no tool call open, and so is the tracked state.

Cache layout: the loop allocates the cache from `model.cfg` (`init_cache`), so `cfg` reports
2L + 1 layers: layers [0, L) hold the ACT decoder's keys and values, [L, 2L) the REHEARSE
decoder's, and slot (2L, b, 0, 0, 0) of k / v holds row b's tracked role / open-tool-call flag
(small integers, exact in any float dtype).

Parameters: `nnx.split(wrapper)` gives a State {'act': ..., 'rehearse': ...};
`role_state(act_params, rehearse_params)` builds one for `Sampler.with_params`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from envace_jax.models.config import ModelConfig
from envace_jax.models.decoder import CausalLM, Decoder, KVCache
from envace_jax.sampling.loop import TurnSpec
from envace_jax.text.codes import Role


class RoleDecoders(CausalLM):
    """Per-row choice between an ACT decoder and a REHEARSE decoder (see the module docstring).

    Args:
      act, rehearse: decoders with the same `ModelConfig` (their parameter values may differ).
      spec: the `TurnSpec` of the loop that will run this model (its end and tool-call ids).
    """

    def __init__(self, act: Decoder, rehearse: Decoder, spec: TurnSpec):
        if act.cfg != rehearse.cfg:
            raise ValueError("RoleDecoders: the ACT and REHEARSE decoders must share a ModelConfig")
        if spec.mode != "rehearse":
            raise ValueError(f"RoleDecoders drives the 'rehearse' loop mode, not {spec.mode!r}")
        self.act = act
        self.rehearse = rehearse
        self.end_id = int(spec.end_id)
        self.tool_call_id = int(spec.tool_call_id)
        self.layers_per_role = act.cfg.num_layers

    @property
    def cfg(self) -> ModelConfig:
        """The cache layout the loop allocates: both decoders' layers plus one state layer."""
        return self.act.cfg.replace(num_layers=2 * self.layers_per_role + 1)

    def _forward(self, tokens, positions, attention_mask, cache, kv_window):
        """`__call__`: per row, the logits of its role's decoder. Without a cache (scoring),
        every position gets the ACT decoder's logits."""
        if cache is None:
            return self.act(tokens, positions, attention_mask=attention_mask)
        act_cache, reh_cache = self._split(cache)
        act_logits, act_cache = self.act(tokens, positions, cache=act_cache, kv_window=kv_window)
        reh_logits, reh_cache = self.rehearse(
            tokens, positions, cache=reh_cache, kv_window=kv_window
        )
        role, open_call = self._track(tokens, cache)
        logits = jnp.where((role == Role.REHEARSE)[:, None, None], reh_logits, act_logits)
        return logits, self._join(cache, act_cache, reh_cache, role, open_call)

    def prefill(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        kv_window: int | None = None,
        fresh: bool = False,
    ) -> KVCache:
        """`models.protocols.Prefills`: writes `tokens` [B, T] into both decoders' caches
        without computing logits."""
        act_cache, reh_cache = self._split(cache)
        act_cache = self.act.prefill(tokens, positions, act_cache, kv_window, fresh)
        reh_cache = self.rehearse.prefill(tokens, positions, reh_cache, kv_window, fresh)
        role, open_call = self._track(tokens, cache)
        return self._join(cache, act_cache, reh_cache, role, open_call)

    def _split(self, cache: KVCache) -> tuple[KVCache, KVCache]:
        L = self.layers_per_role
        return (
            KVCache(k=cache.k[:L], v=cache.v[:L]),
            KVCache(k=cache.k[L : 2 * L], v=cache.v[L : 2 * L]),
        )

    def _join(self, cache, act_cache, reh_cache, role, open_call) -> KVCache:
        L2 = 2 * self.layers_per_role
        state_k = cache.k[L2:].at[:, :, 0, 0, 0].set(role.astype(cache.k.dtype))
        state_v = cache.v[L2:].at[:, :, 0, 0, 0].set(open_call.astype(cache.v.dtype))
        return KVCache(
            k=jnp.concatenate([act_cache.k, reh_cache.k, state_k]),
            v=jnp.concatenate([act_cache.v, reh_cache.v, state_v]),
        )

    def _track(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array]:
        """The rows' roles and open-tool-call flags after `tokens` ([B] each)."""
        B, T = tokens.shape
        if T > 1:  # a prefill: the loop's rows are ACT with no tool call open
            return jnp.full((B,), Role.ACT, jnp.int32), jnp.zeros((B,), jnp.int32)
        L2 = 2 * self.layers_per_role
        role = cache.k[L2, :, 0, 0, 0].astype(jnp.int32)
        open_call = cache.v[L2, :, 0, 0, 0].astype(jnp.int32)
        tok = tokens[:, 0]
        is_act = role == Role.ACT
        open_call = jnp.where(is_act & (tok == self.tool_call_id), 1, open_call)
        ends = tok == self.end_id
        to_rehearse = is_act & ends & (open_call == 1)
        to_act = ~is_act & ends
        role = jnp.where(to_rehearse, Role.REHEARSE, jnp.where(to_act, Role.ACT, role))
        open_call = jnp.where(ends, 0, open_call)
        return role, open_call


def role_state(act_params: Any, rehearse_params: Any) -> nnx.State:
    """The `RoleDecoders` parameter State (as `nnx.split` gives it) from the two decoders'."""
    flat = [(("act", *path), v) for path, v in nnx.to_flat_state(act_params)]
    flat += [(("rehearse", *path), v) for path, v in nnx.to_flat_state(rehearse_params)]
    return nnx.from_flat_state(flat)


def role_decoders(
    graphdef: nnx.GraphDef, act_params, rehearse_params, spec: TurnSpec
) -> RoleDecoders:
    """A `RoleDecoders` over two decoders built from one decoder graph and two param States.
    Each decoder gets its own Variables (even from one State), so its params can be swapped
    independently of the other's."""
    return RoleDecoders(
        nnx.merge(graphdef, act_params, copy=True),
        nnx.merge(graphdef, rehearse_params, copy=True),
        spec,
    )
