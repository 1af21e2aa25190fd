"""The server's configuration: what the HTTP layer needs besides the engine and the tokenizer.

Its own module so that the application (`app`) and the state its handlers share (`state`) both
import it, and neither imports the other for it.
"""

from __future__ import annotations

import dataclasses

from envace_jax.serve.limits import Limits


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine and the tokenizer.

    model_name: the id `/v1/models` lists; aliases: other names requests may use (e.g. the
      model directory). max_model_len: prompt + completion tokens allowed per request.
    default_max_tokens: completion budget of chat requests that set none (None: the rest of
      the context). api_key: required as `Authorization: Bearer KEY` when set.
    limits: request sizes and times (`limits.Limits`; the connection limits are enforced by
      the HTTP layer, `connections`).
    max_prompt_chars: longer prompt text is refused before it is tokenized (see `prompts`;
      None: max_model_len times the tokenizer's longest token).
    """

    model_name: str
    max_model_len: int
    aliases: tuple[str, ...] = ()
    default_max_tokens: int | None = None
    api_key: str | None = None
    limits: Limits = Limits()
    max_prompt_chars: int | None = None
