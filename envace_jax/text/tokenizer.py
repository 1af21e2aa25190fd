"""Tokenizer loading: the shipped demo tokenizer or a local Hugging Face tokenizer directory.

Only local files are read (no hub access). A tokenizer is usable by this project when it has a
chat template that renders the Qwen3 tool-use layout and single-id special tokens for the chat
control and tool tags (checked by :func:`special_ids` and by ``role_pieces``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

DEMO = "demo"
DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent / "demo_tokenizer"

# Field name -> token text, in the order reported in errors.
SPECIAL_TOKEN_TEXTS = {
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "endoftext": "<|endoftext|>",
    "tool_call_open": "<tool_call>",
    "tool_call_close": "</tool_call>",
    "tool_response_open": "<tool_response>",
    "tool_response_close": "</tool_response>",
    "think_open": "<think>",
    "think_close": "</think>",
}


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Ids of the chat-control and tag tokens (each a single token)."""

    im_start: int
    im_end: int
    endoftext: int
    tool_call_open: int
    tool_call_close: int
    tool_response_open: int
    tool_response_close: int
    think_open: int
    think_close: int


def load_tokenizer(name_or_path: str | Path = DEMO):
    """Load ``'demo'`` (the shipped demo tokenizer) or a local HF tokenizer directory.

    Raises:
      FileNotFoundError: the directory does not exist.
      ValueError: the tokenizer has no chat template.
    """
    from transformers import AutoTokenizer  # heavy import: only when a tokenizer is loaded

    path = DEMO_TOKENIZER_DIR if str(name_or_path) == DEMO else Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory not found: {path} (use 'demo' for the shipped demo tokenizer)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types; name the path in every case
        raise ValueError(f"could not load a tokenizer from {path}: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer at {path} has no chat template (expected chat_template.jinja or "
            "'chat_template' in tokenizer_config.json)"
        )
    return tokenizer


def special_ids(tokenizer) -> SpecialIds:
    """Ids of the Qwen3 special pieces; error naming every piece that is missing or not one id."""
    found, missing = {}, []
    for field, text in SPECIAL_TOKEN_TEXTS.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            found[field] = ids[0]
        else:
            missing.append(f"{text} ({field}: encodes to {len(ids)} ids)")
    if missing:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(
            f"tokenizer {name} lacks single-token special pieces: " + ", ".join(missing)
        )
    return SpecialIds(**found)
