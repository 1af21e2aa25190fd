"""Host-facing sampler: bucketing, compiled-program caching, and the three decode modes.

    sampler = Sampler(model, spec, pad_id=tok.pad_token_id)
    out = sampler.generate(prompts, key=key, sampling=SamplingParams(temperature=1.0),
                           max_new_tokens=256)            # world rehearsal (spec.mode)
    state = sampler.start(prompts, ...); state = sampler.resume(state, observations)  # host turns

Prompt lengths and buffer lengths are rounded up to power-of-two buckets so that a run compiles
a handful of programs, not one per batch. The decode state (with its KV cache) is donated to
each compiled call, so the cache is updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envace_jax.sampling import loop
from envace_jax.sampling.distributions import SamplingParams


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    b = minimum
    while b < n:
        b *= 2
    return b


def pad_rows(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> np.ndarray:
    """Right-pads token lists into an int32 [len(rows), width] array."""
    out = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"row {i} has {len(r)} tokens, more than the width {width}")
        out[i, : len(r)] = r
    return out


class Sampler:
    """Compiled decoding for one model and one chat layout (`loop.TurnSpec`)."""

    def __init__(self, model: nnx.Module, spec: loop.TurnSpec, *, pad_id: int):
        self.graphdef, self.params = nnx.split(model)
        self.spec = spec
        self.pad_id = int(pad_id)
        self._init = jax.jit(
            loop.init_state, static_argnums=(0,), static_argnames=("spec", "max_len")
        )
        self._decode = jax.jit(
            loop.decode,
            static_argnums=(0,),
            static_argnames=("spec", "sampling"),
            donate_argnums=(2,),
        )
        self._append = jax.jit(loop.append_tokens, static_argnums=(0,), donate_argnums=(2,))

    def set_params(self, params) -> None:
        """Swaps in new parameters (same tree), e.g. after a train step."""
        self.params = params

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        sampling: SamplingParams,
        max_new_tokens: int | Sequence[int],
        user_turns: Sequence[Sequence[Sequence[int]]] | None = None,
        max_len: int | None = None,
    ) -> loop.LoopState:
        """Prefills `prompts` and decodes until every row stops or pauses.

        max_new_tokens: the token budget on top of each prompt (one for all rows, or per row).
        max_len: the buffer length (default: a bucket that fits the longest prompt + budget).
        """
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("Sampler.start: every prompt needs at least one token")
        budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (len(prompts),))
        longest = max(len(p) for p in prompts)
        P = bucket(longest)
        T = max_len or bucket(longest + int(budget.max()))
        if T < longest + 1:
            raise ValueError(f"max_len {T} leaves no room after a {longest}-token prompt")
        ut, ut_lens = self._user_turns(user_turns, len(prompts))
        state = self._init(
            self.graphdef,
            self.params,
            jnp.asarray(pad_rows(prompts, P, self.pad_id)),
            jnp.asarray([len(p) for p in prompts], jnp.int32),
            key=key,
            spec=self.spec,
            max_len=T,
            max_new_tokens=jnp.asarray(budget),
            user_turns=ut,
            user_turn_lens=ut_lens,
        )
        return self._decode(
            self.graphdef, self.params, state, spec=self.spec, sampling=sampling, max_steps=T
        )

    def resume(
        self,
        state: loop.LoopState,
        observations: Sequence[Sequence[int] | None],
        *,
        sampling: SamplingParams,
    ) -> loop.LoopState:
        """Host turns: appends each paused row's observation ids (None/empty: nothing) and
        decodes on. The observation ids include the chat glue around the tool responses."""
        C = bucket(max((len(o) for o in observations if o), default=1))
        chunk = pad_rows([o or [] for o in observations], C, self.pad_id)
        lens = np.asarray([len(o or []) for o in observations], np.int32)
        state = self._append(self.graphdef, self.params, state, jnp.asarray(chunk), lens)
        T = state.tokens.shape[1]
        return self._decode(
            self.graphdef, self.params, state, spec=self.spec, sampling=sampling, max_steps=T
        )

    def generate(self, prompts, *, key, sampling, max_new_tokens, user_turns=None, max_len=None):
        """`start` then copy to the host: a `loop.Trajectories`."""
        state = self.start(
            prompts,
            key=key,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            user_turns=user_turns,
            max_len=max_len,
        )
        return loop.to_trajectories(state, self.pad_id)

    def _user_turns(self, user_turns, batch):
        if not user_turns or not any(user_turns):
            return None, None
        if len(user_turns) != batch:
            raise ValueError(f"user_turns has {len(user_turns)} rows for {batch} prompts")
        U = max(len(t) for t in user_turns)
        W = bucket(max((len(x) for t in user_turns for x in t), default=1), minimum=8)
        ids = np.zeros((batch, U, W), np.int32)
        lens = np.zeros((batch, U), np.int32)
        for b, turns in enumerate(user_turns):
            for u, x in enumerate(turns):
                ids[b, u, : len(x)] = x
                lens[b, u] = len(x)
        return jnp.asarray(ids), jnp.asarray(lens)
