"""What serving needs of a chat template, for any template that renders a chat.

Training and rehearsal build on the full Qwen3 tool-use layout (`text.chat.ChatLayout`,
`text.role_pieces`). Serving needs much less: the id that ends an assistant message, and
whether the template renders tools at all. So a plain ChatML template (SmolLM2's own, with its
default system turn and no tools) is served, and a template that cannot be served is refused
with what it lacks.
"""

from __future__ import annotations

import dataclasses

from envace_jax.text.chat import (
    PROBE_TOOLS,
    TemplateLayoutError,
    cached_per_tokenizer,
    decode,
    encode,
    render_text,
)
from envace_jax.text.tool_calls import CALL_OPEN

_USER = {"role": "user", "content": "qzuserq"}
_REPLY = "qzreplyq"


@dataclasses.dataclass(frozen=True)
class ServingTemplate:
    """stop_id: the special id the template puts right after an assistant message's content.
    abort_ids: the tokenizer's other end ids (eos, `<|endoftext|>`), which end a row too.
    tools: the template renders the request's tools (then replies are parsed for
    `<tool_call>` blocks); False for a chat-only template.
    tool_call_id: `<tool_call>`'s id where it is one token, else -1 (never generated)."""

    stop_id: int
    abort_ids: tuple[int, ...]
    tools: bool
    tool_call_id: int


def _single_id(tokenizer, text: str | None) -> int | None:
    if not text:
        return None
    ids = encode(tokenizer, text)
    return ids[0] if len(ids) == 1 else None


def _derive(tokenizer) -> ServingTemplate:
    plain = render_text(tokenizer, [_USER])
    prompt = render_text(tokenizer, [_USER], add_generation_prompt=True)
    if prompt == plain:
        raise TemplateLayoutError(
            "chat template cannot be served: add_generation_prompt renders nothing, so there is "
            "no assistant header to generate after"
        )
    replied = render_text(tokenizer, [_USER, {"role": "assistant", "content": _REPLY}])
    if replied.count(_REPLY) != 1:
        raise TemplateLayoutError(
            f"chat template cannot be served: it does not render an assistant message's content "
            f"once (rendered {replied!r})"
        )
    after = encode(tokenizer, replied.split(_REPLY)[1])
    if not after or after[0] not in tokenizer.all_special_ids:
        raise TemplateLayoutError(
            "chat template cannot be served: an assistant message is not followed by a special "
            f"end-of-turn token, so a reply has no stop id (after the content: "
            f"{decode(tokenizer, after[:4])!r})"
        )
    stop_id = after[0]
    ends = {_single_id(tokenizer, tokenizer.eos_token), _single_id(tokenizer, "<|endoftext|>")}
    abort_ids = tuple(sorted(i for i in ends if i is not None and i != stop_id))
    tools = "probe_fn_one" in render_text(tokenizer, [_USER], PROBE_TOOLS)
    call_id = _single_id(tokenizer, CALL_OPEN) if tools else None
    return ServingTemplate(stop_id, abort_ids, tools, -1 if call_id is None else call_id)


def serving_template(tokenizer) -> ServingTemplate:
    """The tokenizer's :class:`ServingTemplate` (derived once; TemplateLayoutError naming what
    the template lacks if it cannot be served)."""
    return cached_per_tokenizer("serving", tokenizer, _derive)
