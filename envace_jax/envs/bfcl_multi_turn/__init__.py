"""BFCL-v4 multi-turn as a training domain (`data.env = 'bfcl_multi_turn'`): the tasks,
executable backends and checker of the `bfcl-eval` package, none of it written here.

A task is one entry of `multi_turn_base` (200 entries: file system, messaging, tickets, trading,
travel, posting, vehicle control and math backends, 1-7 user turns each):

* the opening chat is the entry's first user message; each later user turn is replayed after
  the agent's final reply to the previous one (`Task.reference_messages`);
* the tools are the entry's function docs, in JSON schema (the package's `dict`, `float`,
  `tuple` and `any` types mapped to `object`, `number`, `array` and no constraint);
* the reference conversation executes the ground truth in the backends, one call per
  assistant step, and closes each turn with "Done.": the warm start imitates it, and the
  grounded view's logged (call, response) pairs are what the backends returned;
* the checklist (the rule judge's reward for rehearsed episodes) asks, per turn, for each
  ground-truth call with exactly its arguments, and for a reply in a turn with none;
* success is the package's own checker (`env.BfclEnv.success`).

Splits follow the entry's number: test when it is 0 mod 5, validation when 1 mod 5, train
otherwise (120 / 40 / 40), so no evaluation task is ever trained on. `generate_tasks(seed, n,
split)` gives the first `n` of the split in entry order; the seed does not change them (the RL
stream's seed shuffles what it draws).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envace_jax.data.tasks import Task
from envace_jax.envs.base import Domain, call_items
from envace_jax.envs.bfcl_multi_turn.env import BfclEnv, response, worker
from envace_jax.envs.package_tasks import SPLITS, Loaded, executed_turn, package_domain

CATEGORY = "multi_turn_base"
_TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def split_of(entry_id: str) -> str:
    """The split of a package entry id such as `multi_turn_base_17` (its number mod 5)."""
    return SPLITS[int(entry_id.rsplit("_", 1)[1]) % len(SPLITS)]


def json_schema(doc: Any) -> Any:
    """A function doc's parameter schema in JSON schema (see the module docstring)."""
    if isinstance(doc, list):
        return [json_schema(d) for d in doc]
    if not isinstance(doc, Mapping):
        return doc
    out = {}
    for key, value in doc.items():
        if key == "type" and isinstance(value, str):
            if value != "any":
                out[key] = _TYPES.get(value, value)
        elif key == "properties" and isinstance(value, Mapping):
            out[key] = {name: json_schema(p) for name, p in value.items()}
        else:
            out[key] = json_schema(value)
    return out


def tool_of(doc: Mapping[str, Any]) -> dict:
    """An OpenAI-format tool from a package function doc (its `response` doc left out)."""
    function = {"name": doc["name"], "description": doc.get("description", "")}
    function["parameters"] = json_schema(doc.get("parameters") or {"type": "dict"})
    return {"type": "function", "function": function}


def reference_conversation(entry: Mapping[str, Any]) -> list[dict]:
    """Each user turn, then its ground-truth calls one per step with the backends' responses,
    then the closing reply."""
    messages: list[dict] = []
    turns = zip(entry["question"], entry["ground_truth"], entry["gold_responses"], strict=True)
    for question, calls, texts in turns:
        messages += [dict(m) for m in question]
        messages += executed_turn(calls, [response(t) for t in texts])
    return messages


def checklist(entry: Mapping[str, Any]) -> list[list[dict]]:
    """Per turn: each ground-truth call, weighted equally; a turn without calls asks for a
    reply."""
    reply = {
        "question": "Did the assistant reply?",
        "focus_on": "assistant.content.user_visible_reply",
        "pass_condition": "A final reply is given.",
        "weight": 1.0,
        "rule": {"kind": "reply_states", "values": []},
    }
    return [call_items(calls) if calls else [reply] for calls in entry["ground_truth"]]


def task_of(entry: Mapping[str, Any]) -> Task:
    """The project's task record of one loaded package entry."""
    reference = reference_conversation(entry)
    return Task.from_dict(
        {
            "task_id": entry["id"],
            "messages": [dict(m) for m in entry["question"][0]],
            "tools": [tool_of(doc) for doc in entry["function"]],
            "reference_messages": reference,
            "checklist": checklist(entry),
            "ground_truth": {"calls": entry["ground_truth"]},
            "metadata": {
                "data_source": f"bfcl_{CATEGORY}",
                "package_id": entry["id"],
                "involved_classes": list(entry["involved_classes"]),
                "split": split_of(entry["id"]),
            },
        }
    )


def _load() -> list[Task]:
    entries = worker().request("load", category=CATEGORY)
    entries.sort(key=lambda e: int(e["id"].rsplit("_", 1)[1]))
    return [task_of(e) for e in entries]


all_tasks = Loaded(_load)  # every entry as a task, in entry order, loaded once per process


def generate_tasks(seed: int, n: int, split: str) -> list[Task]:
    """The first `n` tasks of `split` (see the module docstring)."""
    return domain().generate_tasks(seed, n, split)


def domain(data=None, tokenizer=None, **unused) -> Domain:
    """The domain; `data.max_prompt_tokens` keeps the tasks whose prompt fits (measured with
    `tokenizer`)."""
    return package_domain("bfcl_multi_turn", all_tasks, BfclEnv, data, tokenizer)
