"""FinMCP-Bench tool-call metrics and an offline replay harness over an OpenAI-compatible endpoint.

Metrics (tool names only, as the benchmark's TP / TR / TF1): for one sample with predicted
tool names P and gold names G (multisets), the matches are |P ∩ G| (multiset intersection, so
calling the right tool twice when it was needed once earns one match).

    precision = matches / |P|   recall = matches / |G|   TF1 = 2 P R / (P + R)

with the conventions: a sample with no predicted and no gold call scores 1 / 1 / 1; no
predicted call but some gold ones: precision 0; some predicted but no gold: recall 0 (never
divide by zero, never reward silence on a tool task). Macro averages the per-sample values
(macro TF1 is the mean of per-sample TF1); micro pools matches and counts over all samples.
`exact_match` is the share of samples whose predicted name sequence equals the gold sequence.

Record format (one JSON object per line), in OpenAI chat format::

    {"id": "s1", "type": "multi_tool",                      # type: optional grouping key
     "tools": [{"type": "function", "function": {...}}],    # the sample's tool schemas
     "messages": [{"role": "user", "content": "..."},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "f", "arguments": "{...}"}}]},
                  {"role": "tool", "content": "..."},
                  {"role": "assistant", "content": "final answer"}]}

Replay (the MCP servers behind the benchmark are not reachable offline): every assistant
message of the gold conversation is one step. The model sees the gold history before the step
(user turns, earlier gold calls and their recorded tool results) and its reply's tool calls are
compared with the step's gold calls; a sample's predictions are its steps' calls together. Steps
whose gold answer is a final reply count too (a call there is a false positive).

    python -m envace_jax.eval.finmcp --records R.jsonl --base-url http://127.0.0.1:8000/v1 \\
        --model NAME --out DIR            # writes predictions.jsonl and metrics.json
    python -m envace_jax.eval.finmcp --predictions DIR/predictions.jsonl   # scores only
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# ---------------------------------------------------------------------------------------------
# Metrics


@dataclasses.dataclass(frozen=True)
class SampleCounts:
    """Tool-name counts of one sample."""

    matches: int
    predicted: int
    gold: int
    exact: bool

    @property
    def precision(self) -> float:
        if self.predicted == 0:
            return 1.0 if self.gold == 0 else 0.0
        return self.matches / self.predicted

    @property
    def recall(self) -> float:
        if self.gold == 0:
            return 1.0 if self.predicted == 0 else 0.0
        return self.matches / self.gold

    @property
    def tf1(self) -> float:
        p, r = self.precision, self.recall
        return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def count(predicted: Sequence[str], gold: Sequence[str]) -> SampleCounts:
    """Counts for one sample from its predicted and gold tool-name sequences."""
    overlap = collections.Counter(predicted) & collections.Counter(gold)
    return SampleCounts(
        sum(overlap.values()), len(predicted), len(gold), list(predicted) == list(gold)
    )


def _f1(p: float, r: float) -> float:
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def aggregate(samples: Sequence[SampleCounts]) -> dict[str, Any]:
    """Macro and micro precision / recall / TF1 and the exact-match rate."""
    n = len(samples)
    if n == 0:
        raise ValueError("no samples to score")
    m, p, g = (sum(getattr(s, k) for s in samples) for k in ("matches", "predicted", "gold"))
    micro_p = m / p if p else (1.0 if g == 0 else 0.0)
    micro_r = m / g if g else (1.0 if p == 0 else 0.0)
    return {
        "samples": n,
        "macro": {
            "precision": sum(s.precision for s in samples) / n,
            "recall": sum(s.recall for s in samples) / n,
            "tf1": sum(s.tf1 for s in samples) / n,
        },
        "micro": {"precision": micro_p, "recall": micro_r, "tf1": _f1(micro_p, micro_r)},
        "exact_match": sum(s.exact for s in samples) / n,
    }


def score_predictions(rows: Iterable[Mapping]) -> dict[str, Any]:
    """Metrics from prediction rows {"id", "type"?, "predicted": [names], "gold": [names]}:
    overall and per `type`."""
    by_type: dict[str, list[SampleCounts]] = collections.defaultdict(list)
    every = []
    for row in rows:
        c = count(row["predicted"], row["gold"])
        every.append(c)
        if row.get("type"):
            by_type[row["type"]].append(c)
    out = aggregate(every)
    if by_type:
        out["by_type"] = {k: aggregate(v) for k, v in sorted(by_type.items())}
    return out


# ---------------------------------------------------------------------------------------------
# Records


class RecordError(ValueError):
    """A record that is not in the format above; the message names the file, line and field."""


def _check_record(rec: Any, where: str) -> dict:
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise RecordError(f"{where}: messages[{i}].role must be system/user/assistant/tool")
        for j, call in enumerate(m.get("tool_calls") or []):
            if _call_name(call) is None:
                raise RecordError(f"{where}: messages[{i}].tool_calls[{j}] has no function name")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(f"{where}: no assistant message to replay")
    tools = rec.get("tools", [])
    if not isinstance(tools, list):
        raise RecordError(f"{where}: 'tools' must be a list of tool schemas")
    rec.setdefault("id", where)
    return rec


def load_records(path: str) -> list[dict]:
    """Reads and validates a JSON-lines record file (blank lines are skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{where}: not valid JSON: {e}") from e
            records.append(_check_record(rec, where))
    if not records:
        raise RecordError(f"{path}: no records")
    return records


def _call_name(call: Any) -> str | None:
    if not isinstance(call, Mapping):
        return None
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) and name else None


# ---------------------------------------------------------------------------------------------
# Replay

# (messages, tools) -> the reply's tool-call names; raises on transport errors.
Responder = Callable[[list[dict], list[dict]], list[str]]


def steps(record: Mapping) -> list[tuple[list[dict], list[str]]]:
    """(gold history before the step, gold tool names of the step) for each assistant message."""
    messages = list(record["messages"])
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            out.append((messages[:k], [_call_name(c) for c in m.get("tool_calls") or []]))
    return out


def replay_record(record: Mapping, respond: Responder) -> dict:
    """One prediction row for a record: every step replayed on its gold history."""
    predicted, gold, errors = [], [], []
    for history, gold_names in steps(record):
        gold += gold_names
        try:
            predicted += respond(history, list(record.get("tools") or []))
        except Exception as e:  # a failed request predicts nothing for its step
            errors.append(f"{type(e).__name__}: {e}")
    row = {"id": record["id"], "predicted": predicted, "gold": gold}
    if record.get("type"):
        row["type"] = record["type"]
    if errors:
        row["errors"] = errors
    return row


def replay(records: Sequence[Mapping], respond: Responder, *, concurrency: int = 8) -> list[dict]:
    """Prediction rows for all records (in order), `concurrency` records at a time."""
    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(lambda r: replay_record(r, respond), records))


def openai_responder(
    base_url: str, model: str, *, api_key: str = "EMPTY", max_tokens: int = 512, **extra
) -> Responder:
    """A responder calling `/chat/completions` with the openai client (greedy by default)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=600)
    kwargs = {"temperature": 0.0, "max_tokens": max_tokens, **extra}

    def respond(messages, tools):
        out = client.chat.completions.create(
            model=model, messages=messages, tools=tools or None, **kwargs
        )
        calls = out.choices[0].message.tool_calls or []
        return [c.function.name for c in calls]

    return respond


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m envace_jax.eval.finmcp", description=__doc__)
    p.add_argument("--records", help="JSON-lines records to replay")
    p.add_argument("--predictions", help="score an existing predictions.jsonl instead")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N records")
    p.add_argument("--out", default="finmcp_out", help="directory for predictions and metrics")
    args = p.parse_args(argv)
    if bool(args.records) == bool(args.predictions):
        p.error("give exactly one of --records or --predictions")
    if args.predictions:
        with open(args.predictions, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        records = load_records(args.records)[: args.limit]
        model = args.model
        if model is None:
            import openai

            client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
            model = client.models.list().data[0].id
        respond = openai_responder(
            args.base_url, model, api_key=args.api_key, max_tokens=args.max_tokens
        )
        rows = replay(records, respond, concurrency=args.concurrency)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "predictions.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    metrics = score_predictions(rows)
    metrics["failed_requests"] = sum(len(r.get("errors", [])) for r in rows)
    text = json.dumps(metrics, indent=2)
    if args.records:
        with open(os.path.join(args.out, "metrics.json"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
