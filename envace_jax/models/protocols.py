"""The structural types that the layers above the models name instead of a model class.

A model satisfies one by having its methods; it need not subclass it (an `nnx.Module`'s
metaclass does not mix with `Protocol`'s).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class Prefills(Protocol):
    """A causal LM that writes tokens into its cache without computing logits.

    `prefill(tokens, positions, cache, kv_window=None, fresh=False) -> cache`: tokens and
    positions int [B, T], and `cache` the model's own (its `init_cache`), with the cache
    semantics of the `models.decoder` module docstring. kv_window (static): attend over the
    cache's first kv_window slots only. fresh (static): positions are 0..T-1 in every row (a
    prompt batch), so the call's own keys are all its queries see. Returns the updated cache,
    the same as the model's `__call__` with that cache would, minus the logits: a long prompt
    never materialises [B, T, V].

    Implemented by `models.decoder.Decoder`, `models.layered.LayeredDecoder` and
    `rollout.role_models.RoleDecoders`; `sampling.loop.prefill` checks for it with isinstance
    and falls back to `__call__` for a model without it.
    """

    def prefill(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: Any,
        kv_window: int | None = None,
        fresh: bool = False,
    ) -> Any: ...
