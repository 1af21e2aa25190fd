"""The decode loop's view of a tokenizer's chat layout: stop ids and role-switch glue.

Everything here is derived from the chat template (`text.role_pieces`), never hard-coded, so any
tokenizer whose template renders the Qwen3 layout drives the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from envace_jax.sampling.loop import TurnSpec
from envace_jax.text.role_pieces import role_pieces, tool_responses_ids
from envace_jax.text.tokenizer import special_ids
from envace_jax.text.untrusted import encode_plain


def turn_spec(
    tokenizer, *, mode: str = "rehearse", max_turns: int = 8, max_message_tokens: int = 512
) -> TurnSpec:
    """A `TurnSpec` for `tokenizer`'s chat template (mode: 'generate', 'rehearse' or 'host')."""
    pieces = role_pieces(tokenizer)
    ids = special_ids(tokenizer)
    return TurnSpec(
        end_id=pieces.stop_id,
        tool_call_id=ids.tool_call_open,
        abort_ids=tuple(i for i in {ids.endoftext} if i != pieces.stop_id),
        act_to_rehearse=tuple(pieces.act_to_rehearse),
        rehearse_to_act=tuple(pieces.rehearse_to_act),
        mode=mode,
        max_turns=max_turns,
        max_message_tokens=max_message_tokens,
    )


def user_turn_ids(tokenizer, text: str) -> list[int]:
    """Glue after a final reply + the user's text (as text: `text.untrusted`) + glue up to the
    next assistant content."""
    pieces = role_pieces(tokenizer)
    return (
        list(pieces.final_to_user_prefix)
        + encode_plain(tokenizer, text)
        + list(pieces.user_to_act_suffix)
    )


def observation_ids(tokenizer, responses: Sequence[str]) -> list[int]:
    """Host turns: the ids appended after an ACT message with tool calls — the tool-response turn
    holding `responses` (real-environment output, CONTEXT) and the glue to the next ACT message.
    The bodies are encoded as one text, so BPE merges inside the turn match the template's, and
    as text: a `<|im_end|>` in an environment's output cannot end the turn."""
    pieces = role_pieces(tokenizer)
    return (
        list(pieces.act_to_rehearse)
        + tool_responses_ids(tokenizer, responses)
        + list(pieces.rehearse_to_act)
    )


def later_user_turns(tokenizer, reference_messages: Sequence[Mapping]) -> list[list[int]]:
    """The user turns after the first one of a reference conversation, as loop-ready ids."""
    users = [m for m in reference_messages if m.get("role") == "user"]
    return [user_turn_ids(tokenizer, m.get("content") or "") for m in users[1:]]
