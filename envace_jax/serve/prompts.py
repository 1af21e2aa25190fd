"""Requests to prompt token ids: checks of the request's text, chat templating, tokenization.

The work runs on worker threads, not on the event loop, so one large prompt delays no other
client (`/health` included). Before anything is rendered or tokenized, the request's text is
checked:

* every string must be valid Unicode: JSON can carry a lone UTF-16 surrogate (`"\\ud800"`), which
  no tokenizer can encode; that is a 400 naming the field;
* the text must be able to fit: no text longer than `max_prompt_chars` (the context length
  times the longest token, in characters) can be a prompt of at most `max_model_len` tokens, so
  a longer one is refused without tokenizing it.

`tool_choice`: 'auto' (default with tools) parses calls; 'none' renders no tools and parses
nothing; 'required' and a named function force the start of the reply into the prompt
(`forced.prefix`), so the model writes the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import uuid
from typing import Any

from pydantic import BaseModel

from envace_jax.data.validation import LONE_SURROGATE
from envace_jax.serve import forced
from envace_jax.serve import protocol as P
from envace_jax.text.chat import encode, render_marked
from envace_jax.text.serving_template import serving_template
from envace_jax.text.untrusted import encode_marked

log = logging.getLogger("envace_jax.serve")

# Request fields that hold no user text (nothing to check).
_NOT_TEXT = (int, float, bool, type(None))


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token decodes to more characters (a
    byte-level entry has one character per byte, a SentencePiece entry at most one per text
    character)."""
    return max(len(t) for t in tokenizer.get_vocab())


def scan_text(value: Any, where: str) -> tuple[str | None, int]:
    """(the path of the first string or key holding a lone surrogate, or None; the characters
    of all strings in `value`). Iterative: request JSON may nest deeper than Python recursion."""
    stack, bad, chars = [(where, value)], None, 0
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            chars += len(v)
            if bad is None and LONE_SURROGATE.search(v):
                bad = path
        elif isinstance(v, BaseModel):
            names = list(type(v).model_fields)
            stack.extend((f"{path}.{n}", getattr(v, n)) for n in reversed(names))
        elif isinstance(v, dict):
            for k in v:
                chars += len(k)
                if bad is None and LONE_SURROGATE.search(k):
                    bad = f"{path} (the key {ascii(k)})"
            stack.extend((f"{path}.{k}", x) for k, x in reversed(v.items()))
        elif isinstance(v, list | tuple):
            items = [(i, x) for i, x in enumerate(v) if not isinstance(x, _NOT_TEXT)]
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(items))
    return bad, chars


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    prefix: str  # forced start of the reply (tool_choice), part of the prompt
    parse_calls: bool  # whether replies are parsed for tool calls


class Prompts:
    """Builds prompts for one tokenizer on a small thread pool (see the module docstring)."""

    def __init__(self, tokenizer, max_model_len: int, max_prompt_chars: int, workers: int = 2):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "envace-prompt")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the pool's threads (work per row of a request)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def chat(self, req: P.ChatCompletionRequest) -> ChatPrompt:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._chat, req)

    async def completion(self, req: P.CompletionRequest) -> list[tuple[list[int], int]]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._completion, req)

    # ------------------------------------------------------------------ checks

    def _check_text(self, req: BaseModel, counted: tuple[str, ...]) -> dict[str, int]:
        """Refuses lone surrogates anywhere; returns the characters of the `counted` fields."""
        chars = {}
        for name in type(req).model_fields:
            bad, n = scan_text(getattr(req, name), name)
            if bad is not None:
                raise P.APIError(
                    400,
                    f"{bad}: the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                    "escape), which is not valid Unicode; send UTF-8 text or paired escapes",
                    param=bad.split(" ")[0],
                    code="invalid_text",
                )
            if name in counted:
                chars[name] = n
        return chars

    def _check_length(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise P.APIError(
                400,
                f"{param}: the text has {chars} characters, and no text longer than "
                f"{self.max_prompt_chars} characters fits this model's maximum context length "
                f"of {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def _encode(self, encoding, param: str) -> list[int]:
        """`encoding()`, the ids of the request's text; a 400 naming `param` if the tokenizer
        rejects the text."""
        try:
            return encoding()
        except Exception as e:  # text the tokenizer rejects: the client's text, not a fault
            rid = "req-" + uuid.uuid4().hex[:16]
            log.warning("request %s: %s cannot be tokenized", rid, param, exc_info=e)
            raise P.APIError(
                400, f"{param}: the text cannot be tokenized (request id {rid})", param=param
            ) from None

    def budget(self, prompt_len, requested, default, param: str, prompt_param: str) -> int:
        """Completion tokens of a request: `requested`, else the room left (at most
        `default`); a 400 naming `param` if they do not fit the context."""
        limit = self.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise P.APIError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return min(room, default) if default else room
        if prompt_len + requested > limit:
            raise P.APIError(
                400,
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
                f"the completion): reduce the prompt or {param}",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    # ------------------------------------------------------------------ completions

    def _completion(self, req: P.CompletionRequest) -> list[tuple[list[int], int]]:
        """(prompt ids, completion tokens) per prompt."""
        self._check_text(req, ())
        items = req.prompt_items()
        if not items:
            raise P.APIError(400, "prompt: must not be empty", param="prompt")
        out = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                self._check_length(len(item), f"prompt[{i}]")
                ids = self._encode(lambda item=item: encode(self.tokenizer, item), f"prompt[{i}]")
            else:
                ids = list(item)
            if not ids:
                raise P.APIError(400, f"prompt[{i}]: encodes to no tokens", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise P.APIError(
                    400, f"prompt[{i}]: token id {bad[0]} outside [0, {self.vocab})", param="prompt"
                )
            out.append((ids, self.budget(len(ids), req.max_tokens, None, "max_tokens", "prompt")))
        return out

    # ------------------------------------------------------------------ chat

    def _chat(self, req: P.ChatCompletionRequest) -> ChatPrompt:
        chars = self._check_text(req, ("messages", "tools"))
        self._check_length(sum(chars.values()), "messages")
        messages = [self._message(m, f"messages[{i}]") for i, m in enumerate(req.messages)]
        choice = req.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        if choice is not None and choice != "none" and not tools:
            raise P.APIError(400, "tool_choice is set but no tools are given", param="tool_choice")
        if choice == "none":
            tools = []
        if tools and not serving_template(self.tokenizer).tools:
            raise P.APIError(
                400,
                "tools: the model's chat template does not render tools, so it cannot be "
                "offered any; send the request without tools",
                param="tools",
            )
        prefix = ""
        if choice == "required":
            prefix = forced.prefix(tools, None)
        elif isinstance(choice, P.NamedToolChoice):
            name = choice.function.name
            if name not in {t["function"]["name"] for t in tools}:
                raise P.APIError(
                    400,
                    f"tool_choice names function {name!r}, which is not among the tools",
                    param="tool_choice",
                )
            prefix = forced.prefix(tools, name)
        try:  # message text as text (`text.untrusted`): it cannot forge a turn
            marked = render_marked(self.tokenizer, messages, tools or None, True) + prefix
        except Exception as e:  # the template rejects the conversation
            raise P.APIError(
                400, f"messages: cannot render the conversation: {e}", param="messages"
            ) from e
        self._check_length(len(marked.text), "messages")
        ids = self._encode(lambda: encode_marked(self.tokenizer, marked), "messages")
        return ChatPrompt(ids, prefix, bool(tools))

    @staticmethod
    def _message(m: P.Message, where: str) -> dict:
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": m.text(where)}
        if m.tool_calls:
            if role != "assistant":
                raise P.APIError(
                    400, f"{where}: only assistant messages have tool_calls", param=where
                )
            msg["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": tc.function.arguments
                        if isinstance(tc.function.arguments, str)
                        else json.dumps(tc.function.arguments, ensure_ascii=False),
                    },
                }
                for tc in m.tool_calls
            ]
        return msg
