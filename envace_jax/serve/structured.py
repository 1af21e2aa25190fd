"""Structured output: `response_format` `json_schema` and `json_object`, enforced while decoding.

A chat request with `response_format: {"type": "json_schema", "json_schema": {"name": ...,
"strict": true, "schema": {...}}}` (or `{"type": "json_object"}`) is decoded under a grammar:
before each of its tokens, the grammar's matcher computes on the host the set of tokens that
keep the reply a prefix of a JSON text the schema accepts, packed as a bitmask of
ceil(V / 32) int32 words (bit j of word i allows token 32 i + j); the compiled decode step
sets every other logit to -1e30 before sampling (`sampling.loop.apply_token_mask`), and the
sampled token advances the matcher. So every model this server serves returns JSON that
parses and validates, whatever its weights. Once the JSON value is closed the grammar allows
only the end-of-turn token, and the reply ends with finish_reason `stop`; if `max_tokens` runs
out first it ends with `length` and may not parse (as OpenAI's does).

* JSON is written compactly with Python's separators (`{"a": 1, "b": [1, 2]}`) and no other
  whitespace: a small model at temperature 1 allowed free whitespace writes runs of newlines.
* `strict` is accepted and the schema always enforced (strict or not). Schemas follow JSON
  Schema as llguidance implements it (`type`, `properties`, `required`, `additionalProperties`,
  `enum`, `const`, `anyOf`/`oneOf`, `$ref`/`$defs`, `items`, `minItems`/`maxItems`,
  `minLength`/`maxLength`, `pattern`, `minimum`/`maximum`, ...). A schema the library
  rejects (unknown type, unimplemented keyword such as `not`, a `$ref` that points nowhere,
  a bad `pattern`, an unsatisfiable schema) is a 400 naming `response_format.json_schema.schema`
  with the library's reason; so is a schema that is not a JSON object.
* The reply is content only: tool calls are not parsed from it, and a `tool_choice` that
  forces a call cannot be combined with a `response_format` (a 400).
* Forced function calls: a call forced by `tool_choice` ('required', or a named function;
  `forced`) decodes its JSON under the same mechanism, so that a finished call always parses
  (a model's reply is never an error), the arguments valid against the function's
  `parameters` (`compile_call`); with 'required' and several tools, the name is one of
  theirs. A `strict: true` function's schema must be usable (a 400 otherwise); a non-strict
  function's arguments are any JSON object where the library cannot use its schema. A call
  the model chooses to make (`tool_choice` 'auto') is not constrained.
* Log-probs of constrained tokens are those of the masked (renormalised) distribution the
  token was sampled from.

Cost (see `serve.batcher`): a batch with a constrained row decodes one token per host
round-trip (the next mask depends on the token just sampled), with the mask an input of the
compiled step; a batch without one runs the same program as without this feature (no mask
input, chunks of `chunk_steps` tokens). `benchmarks/structured_output.py` measures both side
by side.

The library, chosen by measurement (`benchmarks/structured_output.py --libraries`; the demo
tokenizer, V = 2,048; 100 random walks per schema, each token drawn uniformly among those the
mask allows, the end token half the time it is allowed; every finished reply checked with
`jsonschema`; 2-core CPU):

=====================  ============================  ============================
                       llguidance 1.9.1              xgrammar 0.2.9
=====================  ============================  ============================
replies valid          100/100 judge verdict         35/100 judge verdict
(bounded strings)      100/100 nested + enum         75/100 nested + enum
why not                --                            lets raw control characters
                                                     and broken UTF-8 into strings
mask, per token        27-30 us                      15 us
consume, per token     2-3 us                        1.5 us
compile a schema       ~1 ms                         ~2 ms
dependencies           none (abi3 wheel)             torch, triton, apache-tvm-ffi
=====================  ============================  ============================

llguidance is the one whose output always parses; its ~30 us per row and token is small next
to a decode step (the demo policy's step at 16 rows is about 3 ms on 2 cores), and it pulls
in no dependency. Decoding under masks, same model, batch and tokens (the same script):
0.69x the unconstrained tokens/s at 16 rows and 0.81x at 32, most of it the host round-trip
per token (0.77x / 0.82x with one token per call and no mask); docs/benchmarks.md has the
table. The tokenizer view is built from the HF fast tokenizer's serialised form
(`llguidance.hf.from_tokenizer`) once per server, on the first structured request.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from typing import Any

import numpy as np

from envace_jax.serve import protocol as P
from envace_jax.text.tool_calls import CALL_OPEN

log = logging.getLogger("envace_jax.serve")

# How JSON is written under a grammar (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_PARAM = "response_format.json_schema.schema"


class TokenGrammar:
    """One reply's matcher (used on the engine thread only): the engine asks it for the mask
    of the next token (`fill_mask`) and hands it each sampled token (`advance`)."""

    def __init__(self, matcher, words: int):
        self._matcher = matcher
        self.words = words  # int32 words of a mask: ceil(V / 32)

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the allowed next tokens into `out` (int32 [words], C-contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"grammar: {self._matcher.get_error()}")

    def advance(self, tokens) -> str | None:
        """Consumes sampled tokens; an error message if the grammar refuses one."""
        for t in tokens:
            if not self._matcher.consume_token(int(t)):
                return f"grammar refused token {int(t)}: {self._matcher.get_error()}"
        return None

    @staticmethod
    def fill_masks(mask: np.ndarray, rows) -> list[str | None]:
        """`fill_mask` for many grammars at once: rows [(row of `mask`, TokenGrammar)] of
        `mask` (int32 [B, words], C-contiguous). One call into the library, which computes the
        masks on its threads with the GIL released once (per-row calls release and re-take it
        once a row, and each re-take can wait out the HTTP thread's switch interval). Returns
        per row an error message or None."""
        _executor().unsafe_compute_mask_ptr(
            [(g._matcher, slot) for slot, g in rows], mask.ctypes.data, mask.strides[0], len(mask)
        )
        return [
            f"grammar: {g._matcher.get_error()}" if g._matcher.is_error() else None for _, g in rows
        ]

    @property
    def complete(self) -> bool:
        """The JSON value is closed: only the end token may follow."""
        return self._matcher.is_stopped()


class CompiledGrammar:
    """A request's grammar, checked once; `new()` gives each choice a matcher of its own."""

    def __init__(self, matcher, words: int):
        self._matcher = matcher  # a pristine matcher, only ever copied
        self.words = words

    def new(self) -> TokenGrammar:
        return TokenGrammar(self._matcher.deep_copy(), self.words)


class StructuredOutput:
    """Compiles `response_format`s for one tokenizer and model (thread-safe).

    vocab_size: the model's logits width V (>= the tokenizer's ids; masks have ceil(V/32)
    words). end_id: the end-of-turn token, the only one allowed once the JSON is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, end_id: int):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.end_id = int(end_id)
        self.words = -(-self.vocab_size // 32)
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def ll_tokenizer(self, param: str = "response_format"):
        """llguidance's view of the tokenizer (built once: ~1 s for a 150k vocabulary); a 400
        naming `param` if the library cannot read this tokenizer."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                if not hasattr(self.tokenizer, "backend_tokenizer"):
                    raise _bad(param, "structured output needs a fast (tokenizers) tokenizer")
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size, eos_token=self.end_id
                    )
                except Exception as e:  # a tokenizer the library cannot read
                    log.warning("structured output: the tokenizer cannot be used", exc_info=e)
                    raise _bad(param, "structured output is unavailable for this tokenizer") from e
            return self._ll_tokenizer

    def compile(self, fmt: P.ResponseFormat | None) -> CompiledGrammar | None:
        """The grammar of a request's `response_format` (None: free text), or a 400 naming
        the field at fault."""
        if fmt is None or fmt.type == "text":
            if fmt is not None and fmt.json_schema is not None:
                raise _bad("response_format.json_schema", "only allowed with type 'json_schema'")
            return None
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise _bad("response_format.json_schema", "only allowed with type 'json_schema'")
            return self.compile_schema({"type": "object"}, "response_format")
        if fmt.json_schema is None:
            raise _bad("response_format.json_schema", "required with type 'json_schema'")
        return self.compile_schema(fmt.json_schema.schema_, SCHEMA_PARAM)

    def compile_schema(self, schema: Any, param: str) -> CompiledGrammar:
        import llguidance

        if not isinstance(schema, dict):
            raise _bad(param, "the schema must be a JSON object")
        ll_tokenizer = self.ll_tokenizer(param)
        try:
            # Overrides: a schema's own "x-guidance" options cannot loosen the JSON's layout.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except Exception as e:  # whatever the library makes of a bad schema: the client's
            raise _bad(param, f"not a usable JSON schema: {e}") from None
        matcher = llguidance_matcher(ll_tokenizer, grammar)
        if matcher.is_error():
            raise _bad(param, f"not a usable JSON schema: {_first_lines(matcher.get_error())}")
        return CompiledGrammar(matcher, self.words)

    def compile_call(self, tools: list[dict], name: str | None, prefix: str):
        """The grammar of a forced tool call (`tool_choice` 'required' or a named function,
        `forced.prefix`): the rest of the call's JSON, so that a finished call always parses.
        Arguments follow the function's `parameters`: a `strict` function's must compile (a
        400 naming them); a non-strict function's fall back to any JSON object where the
        library cannot use them. `prefix` (the call's start, already in the prompt) is
        consumed by the matcher. None (the call is decoded free, `forced` reads it) where no
        grammar fits a call of non-strict functions."""
        candidates = [
            (i, t["function"])
            for i, t in enumerate(tools)
            if name is None or t["function"]["name"] == name
        ]
        strict = [i for i, f in candidates if f.get("strict")]
        param = f"tools[{(strict or [candidates[0][0]])[0]}].function.parameters"
        try:
            ll_tokenizer = self.ll_tokenizer(param)
        except P.APIError:
            if strict:
                raise
            return None  # a tokenizer the library cannot read: free decoding, as before
        first_key = None
        head = '"arguments": {"'
        if head in prefix:
            first_key = json.loads('"' + prefix.split(head, 1)[1].split('"', 1)[0] + '"')
        rest = prefix[len(CALL_OPEN) :] if prefix.startswith(CALL_OPEN) else prefix
        error = None
        for loose in (False, True):  # loose: non-strict arguments as any object
            calls = [_call_schema(f, first_key, loose) for _, f in candidates]
            schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
            grammar = 'start: "\\n" %json ' + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
            matcher = llguidance_matcher(ll_tokenizer, grammar)
            if matcher.is_error():
                error = _first_lines(matcher.get_error())
            elif matcher.consume_tokens(ll_tokenizer.tokenize_str(rest)):
                return CompiledGrammar(matcher, self.words)
        if error is not None and strict:
            raise _bad(param, f"not a usable JSON schema: {error}")
        log.warning("no grammar fits the forced call %r (%s); it is decoded free", prefix, error)
        return None


def llguidance_matcher(ll_tokenizer, grammar: str):
    import llguidance

    return llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """The library's thread pool for batched masks (one per process)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def _call_schema(function: dict, first_key: str | None, loose: bool = False) -> dict:
    """The JSON schema of one call of `function` as the chat template writes it: {"name":
    <its name>, "arguments": <its parameters; any object if `loose` and it is not strict>},
    with the argument the forced prefix opens (`first_key`) declared first (properties are
    written in order)."""
    params: Any = {"type": "object"}
    if function.get("strict") or not loose:
        params = copy.deepcopy(function.get("parameters") or {"type": "object", "properties": {}})
        props = params.get("properties") if isinstance(params, dict) else None
        if first_key is not None and isinstance(props, dict) and first_key in props:
            params["properties"] = {first_key: props[first_key], **props}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _first_lines(message: str, limit: int = 400) -> str:
    message = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return message[:limit]


def _bad(param: str, why: str) -> P.APIError:
    return P.APIError(400, f"{param}: {why}", param=param, code="invalid_response_format")
