"""Request and response models of the OpenAI-compatible API (the subset this server speaks).

Requests are pydantic models that forbid unknown top-level fields, so a typo or a parameter we
do not implement is a 400 naming the field rather than silently ignored. Parameters that are
part of OpenAI's API but that the sampler cannot honour (penalties, logit_bias, top_logprobs,
best_of, suffix, ...) are accepted at their neutral values only; any other value is a 400 that
says so (`unsupported_values`). Extensions from vLLM's API: `top_k`, `stop_token_ids`,
`skip_special_tokens`.

Message objects ignore fields they do not use (`refusal`, `annotations`, `audio`, ...): clients
echo the assistant messages they received back into the next request.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from envace_jax.sampling.distributions import SamplingParams

# ---------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------
# Requests


# Types are strict, as OpenAI's are: "2" is not an n, nor "yes" a stream flag (an int is still a
# float). A client that sends them has a bug that a silent conversion would hide.
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# A tool name is rendered into the prompt as is: no markup (`</tool_call><|im_end|>`) fits.
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDef(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class CallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self, where: str) -> str | None:
        """The content as one string (text parts joined); non-text parts are a 400."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        out = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise APIError(
                    400,
                    f"{where}.content[{j}]: only text content parts are supported, got "
                    f"type {part.type!r}",
                    param=f"{where}.content",
                )
            if part.text is None:
                raise APIError(
                    400,
                    f"{where}.content[{j}]: a text part needs a 'text' string",
                    param=f"{where}.content[{j}].text",
                )
            out.append(part.text)
        return "".join(out)


class JSONSchemaFormat(_Strict):
    """`response_format.json_schema` (OpenAI's shape); the schema is checked when compiled
    (`serve.structured`)."""

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the field keeps its name on the wire.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: 'text', 'json_object', or 'json_schema' with `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def sampling_params(self) -> SamplingParams:
        """The sampler's settings: OpenAI's defaults, and temperature 0 as greedy."""
        t = 1.0 if self.temperature is None else self.temperature
        if t == 0:
            return SamplingParams(greedy=True)
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        top_p = 1.0 if self.top_p is None else self.top_p
        return SamplingParams(temperature=t, top_k=top_k, top_p=top_p)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for parameters set to values the sampler cannot honour."""
        out = []
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                out.append((name, "penalties are not supported (only 0)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None

    def unsupported(self):
        out = super().unsupported()
        if self.top_logprobs:
            out.append(("top_logprobs", "only the sampled token's logprob is available (use 0)"))
        if self.store:
            out.append(("store", "stored completions are not supported"))
        return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    skip_special_tokens: bool = False

    def prompt_items(self) -> list:
        """The prompts: the one string or token-id list, or each of a list of them."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            return [p]
        return list(p)

    def unsupported(self):
        out = super().unsupported()
        if self.logprobs:
            out.append(("logprobs", "only the sampled token's logprob is available (use 0)"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of is not supported (only 1)"))
        if self.echo and self.stream:
            out.append(("echo", "echo is not supported with stream"))
        return out


# ---------------------------------------------------------------------------------------------
# Responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "envace_jax",
        "max_model_len": max_model_len,
    }
