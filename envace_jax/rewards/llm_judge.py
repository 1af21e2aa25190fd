"""LLM checklist judge over an OpenAI-compatible `/v1/chat/completions` endpoint.

For every assistant step of the user turn being scored and every checklist item of that turn,
one request asks whether the conversation up to that step (and the tool responses that follow
it) satisfies the item. The prompt carries the item (question, focus, pass condition, failure
examples, reference snippets), the messages before the turn, and the turn's messages up to the
step; the model answers with a JSON verdict whose `answer` is true or false.

Robustness: a concurrency limit, a per-request deadline, retries with exponential backoff (on
timeouts, connection errors, HTTP 429/408/5xx and malformed verdicts), and no exceptions for
any server behaviour: an item without a valid verdict counts as FAILED and the counters in the
returned metrics say why (`judge_requests`, `judge_retries`, `judge_timeouts`,
`judge_http_errors`, `judge_malformed`, `judge_failures`).

The transport is the standard library's urllib run in a thread pool (no HTTP client dependency);
the event loop side is asyncio, so many turns can be judged concurrently under one limit.

The prompt and the verdict parser are in `rewards.judge_prompt`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import socket
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.data.checklists import ChecklistItem
from envace_jax.rewards.judge_prompt import (
    TOOL_ROLES,
    VERDICT_SCHEMA,
    build_prompt,
    parse_verdict,
    render_messages,
)

# Items about tool calls or tool output fail without a request when a tool response of the
# step reports an error (the reference short-circuits the same way).
_TOOL_FOCUS = ("assistant.tool_calls", "tool.content")

METRIC_KEYS = (
    "judge_items",
    "judge_short_circuit",
    "judge_requests",
    "judge_retries",
    "judge_timeouts",
    "judge_http_errors",
    "judge_malformed",
    "judge_failures",
    "judge_text_fallback",
)


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """Endpoint and request policy.

    base_url: server root including `/v1` (requests go to `{base_url}/chat/completions`).
    max_retries: attempts after the first one; backoff_s * 2**i (capped) between attempts.
    timeout_s: deadline of one attempt, connection to last byte.
    response_format: send the strict JSON-schema `response_format` (servers without
      structured output support reject it; the verdict parser copes without it).
    trust_env: honour the http(s)_proxy / no_proxy environment variables.
    """

    base_url: str
    model: str
    # The verdict's sampling.
    temperature: float = 0.6
    top_p: float | None = 0.8
    max_tokens: int = 6000
    # Deadlines and retries.
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # The connection.
    api_key: str | None = None
    concurrency: int = 64
    trust_env: bool = True
    # The verdict's format.
    response_format: bool = True
    # With `response_format`: when the server refuses it (HTTP 400), send plain requests and
    # parse the verdict from text from then on.
    fallback_to_text: bool = False
    retry_malformed: bool = True

    def __post_init__(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"JudgeConfig.base_url: expected an http(s) URL, got {self.base_url!r}"
            )
        for key in ("timeout_s", "backoff_s", "max_backoff_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"JudgeConfig.{key}: expected >= 0, got {getattr(self, key)}")
        if self.timeout_s <= 0:
            raise ValueError(f"JudgeConfig.timeout_s: expected > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"JudgeConfig.max_retries: expected >= 0, got {self.max_retries}")
        if self.max_tokens < 1:
            raise ValueError(f"JudgeConfig.max_tokens: expected >= 1, got {self.max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"JudgeConfig.concurrency: expected >= 1, got {self.concurrency}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


# --------------------------------------------------------------------------------------------
# Transport


class _Retryable(Exception):
    def __init__(self, kind: str, detail: str):
        self.kind = kind  # "timeout", "http", "connection", "malformed"
        super().__init__(detail)


class _Fatal(Exception):
    def __init__(self, detail: str, status: int = 0):
        self.status = status
        super().__init__(detail)


def _error_detail(e: urllib.error.HTTPError) -> str:
    """`: <message>` from an OpenAI-style error body (or its first bytes), '' without one."""
    try:
        raw = e.read()[:2000]
    except Exception:
        return ""
    try:
        err = json.loads(raw).get("error")
        message = err.get("message") if isinstance(err, Mapping) else err
    except (ValueError, AttributeError):
        message = raw.decode("utf-8", "replace")
    return f": {str(message).strip()[:300]}" if message else ""


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, (TimeoutError, socket.timeout)) or isinstance(
        getattr(e, "reason", None), (TimeoutError, socket.timeout)
    )


@dataclasses.dataclass
class TurnJudgement:
    """verdicts[step][item] (False where no valid verdict); failed[step][item] True where the
    judge gave none; metrics: counters (METRIC_KEYS)."""

    verdicts: list[list[bool]]
    failed: list[list[bool]]
    metrics: dict[str, int]

    @property
    def judge_failed(self) -> bool:
        return any(any(row) for row in self.failed)


class LLMJudge:
    """Judges checklist items of a user turn. Use `judge_turn` from synchronous code or
    `ajudge_turn` under asyncio; one instance's concurrency limit covers all its calls."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.concurrency, thread_name_prefix="llm-judge"
        )
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        headers = {"Content-Type": "application/json"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self._headers = headers
        handlers = [] if config.trust_env else [urllib.request.ProxyHandler({})]
        self._opener = urllib.request.build_opener(*handlers)
        self.structured = config.response_format  # False once the server refused the schema
        self.first_error: str | None = None  # the first failed attempt's reason, for reports

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> LLMJudge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._semaphores.get(loop)
        if sem is None:
            sem = self._semaphores[loop] = asyncio.Semaphore(self.config.concurrency)
        return sem

    def payload(self, prompt: str) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {
            "model": c.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": c.temperature,
            "max_tokens": c.max_tokens,
        }
        if c.top_p is not None:
            body["top_p"] = c.top_p
        if self.structured:
            schema = {"name": "evaluation_verdict", "strict": True, "schema": VERDICT_SCHEMA}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return body

    def _post(self, body: bytes) -> bool:
        """One blocking attempt (runs in the pool): the verdict, or _Retryable / _Fatal."""
        req = urllib.request.Request(self.config.url, data=body, headers=self._headers)
        try:
            with self._opener.open(req, timeout=self.config.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            if e.code in (408, 429) or e.code >= 500:
                raise _Retryable("http", f"HTTP {e.code}{detail}") from None
            raise _Fatal(f"HTTP {e.code}{detail}", e.code) from None
        except Exception as e:  # any socket/HTTP-level failure is a judge failure, not a crash
            if _is_timeout(e):
                raise _Retryable("timeout", str(e)) from None
            raise _Retryable("connection", repr(e)) from None
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Retryable("malformed", f"not a chat completion: {raw[:200]!r}") from None
        verdict = parse_verdict(content)
        if verdict is None:
            raise _Retryable("malformed", f"no boolean answer in: {str(content)[:200]!r}")
        return verdict

    async def ajudge_prompt(self, prompt: str, metrics: dict[str, int]) -> bool | None:
        """One item verdict with retries; None when no valid verdict was obtained."""
        c = self.config
        loop = asyncio.get_running_loop()
        for attempt in range(c.max_retries + 1):
            structured = False
            if attempt:
                metrics["judge_retries"] += 1
                await asyncio.sleep(min(c.backoff_s * 2 ** (attempt - 1), c.max_backoff_s))
            metrics["judge_requests"] += 1
            try:
                async with self._semaphore():
                    # Built once the request may go: it follows a fallback to text made while
                    # it waited.
                    structured = self.structured
                    body = json.dumps(self.payload(prompt)).encode()
                    fut = loop.run_in_executor(self._pool, self._post, body)
                    return await asyncio.wait_for(fut, c.timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                metrics["judge_timeouts"] += 1
                self._note(f"no answer within {c.timeout_s} s")
            except _Retryable as e:
                self._note(str(e))
                if e.kind == "timeout":
                    metrics["judge_timeouts"] += 1
                elif e.kind == "http":
                    metrics["judge_http_errors"] += 1
                elif e.kind == "malformed":
                    metrics["judge_malformed"] += 1
                    if not c.retry_malformed:
                        break
            except _Fatal as e:
                metrics["judge_http_errors"] += 1
                if e.status == 400 and structured and c.fallback_to_text:
                    if self.structured:  # the server has no structured output: parse text
                        self.structured = False
                        metrics["judge_text_fallback"] += 1
                    continue
                self._note(str(e))
                break
            except Exception as e:  # e.g. the pool was shut down: fail the item, not the rollout
                self._note(repr(e))
                break
        metrics["judge_failures"] += 1
        return None

    def _note(self, detail: str) -> None:
        if self.first_error is None:
            self.first_error = detail

    async def ajudge_turn(
        self, messages: Sequence[Mapping[str, Any]], items: Sequence[ChecklistItem]
    ) -> TurnJudgement:
        """Judge the current user turn: the assistant steps after the last user message.

        messages: the conversation so far (OpenAI chat dicts) ending with the turn's steps.
        items: the turn's checklist items.
        """
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        if last_user < 0:
            raise ValueError("ajudge_turn: the conversation has no user message")
        turn = sum(m.get("role") == "user" for m in messages) - 1
        previous = render_messages(messages[:last_user])
        metrics = dict.fromkeys(METRIC_KEYS, 0)
        jobs, table = [], []
        for i in range(last_user + 1, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            end = i + 1
            while end < len(messages) and messages[end].get("role") in TOOL_ROLES:
                end += 1
            tool_error = any(_has_tool_error(m) for m in messages[i + 1 : end])
            current = render_messages(messages[last_user:end], first_turn=turn)
            row = []
            for item in items:
                metrics["judge_items"] += 1
                if tool_error and item.focus_on in _TOOL_FOCUS:
                    metrics["judge_short_circuit"] += 1
                    row.append(False)
                else:
                    row.append(len(jobs))
                    jobs.append(self.ajudge_prompt(build_prompt(item, previous, current), metrics))
            table.append(row)
        results = await asyncio.gather(*jobs)
        # A row entry is either a short-circuit verdict (bool) or the index of a request.
        verdicts = [[v if isinstance(v, bool) else bool(results[v]) for v in row] for row in table]
        failed = [[not isinstance(v, bool) and results[v] is None for v in row] for row in table]
        return TurnJudgement(verdicts, failed, metrics)

    def judge_turn(
        self, messages: Sequence[Mapping[str, Any]], items: Sequence[ChecklistItem]
    ) -> TurnJudgement:
        """Synchronous `ajudge_turn` (runs its own event loop)."""
        return asyncio.run(self.ajudge_turn(messages, items))


def _has_tool_error(msg: Mapping[str, Any]) -> bool:
    content = msg.get("content")
    if not isinstance(content, str):
        return False
    try:
        parsed = json.loads(content)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "error_tool_call" in parsed
