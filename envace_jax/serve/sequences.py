"""What a request hands the batching engine (`batcher.Engine`) and what it gets back.

A `Sequence` is one generated row: prompt ids, a budget of new tokens, sampling, an optional
grammar, and a callback. The engine calls it on its own thread with the row's new `Tokens` as
they are decoded and finally one `Done`, so the callback must only enqueue.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from envace_jax.sampling.distributions import SamplingParams

RESERVE_TOKENS = 128  # room for new tokens a row is admitted with (see `batcher`'s docstring)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """New tokens of one sequence (the terminal stop token is never included)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Done:
    """A sequence ended. finish_reason: 'stop' (stop or eos token), 'length' (token budget),
    'cancelled', or 'error' (then `error` says why). num_generated counts the stop token."""

    finish_reason: str
    num_generated: int
    error: str | None = None


Event = Tokens | Done


@dataclasses.dataclass(eq=False)
class Sequence:
    """One row to generate: prompt ids, a budget of new tokens, sampling, and a callback that
    receives `Tokens` and finally one `Done` (called on the engine thread: it must not block)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    on_event: Callable[[Event], None]
    cancelled: bool = False
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    # Structured output: an object with `words` (int32 words of a mask), `fill_mask(row)` (the
    # allowed next tokens, packed, into row: int32 [words]) and `advance(ids)` (the sampled
    # tokens; an error message if it refuses one), e.g. `serve.structured.TokenGrammar`; its
    # class may add `fill_masks(mask, [(row, grammar)])` -> [error or None], every row in one
    # call. Called on the engine thread only. None: free text.
    grammar: Any = None
    failed: str | None = None  # why the engine fails the sequence (its grammar broke)
    # Engine bookkeeping.
    slot: int = -1
    emitted: int = 0  # tokens of this row already handed out (prompt excluded)
    done: bool = False

    @property
    def budget(self) -> int:
        """The most tokens the row may hold: prompt plus new tokens."""
        return len(self.prompt) + self.max_new_tokens

    @property
    def need(self) -> int:
        """Buffer length the row is admitted with: prompt plus the reserve (or its budget)."""
        return min(self.budget, len(self.prompt) + RESERVE_TOKENS)
