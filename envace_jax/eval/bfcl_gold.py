"""BFCL gold check: the ground truth, written as our model would write it, through the checker.

Two halves. `EXTRACT` runs inside the bfcl-eval environment and reads, with the package's own
loaders, each selected entry's ground truth as plain calls (name + arguments):

* AST categories: the first allowed value of each parameter (nested dicts recursively), and
  optional parameters that may be omitted (the marker "" among the allowed values) left out;
* irrelevance: no call; live relevance: one call of the entry's first function with its
  required parameters (that category checks only that a call was made);
* multi-turn: each turn's calls, parsed from the Python-call strings of the ground truth
  (positional arguments named from the function's documented parameter order) by the
  `bfcl_multi_turn` world's own reader (`envs/bfcl_multi_turn/worker.py`);
* memory: the expected answer as the final reply.

`write_results` then renders these exactly as our policy's replies look (`<tool_call>` blocks
from `text.tool_calls.format_tool_calls`) in the package's result-file layout: one string per
single-turn entry, and per multi-turn turn a step with the calls and a closing text step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from envace_jax.text.tool_calls import format_tool_calls

EXTRACT = r'''
import importlib.util, json, sys
from bfcl_eval.utils import (
    load_dataset_entry, load_ground_truth_entry, get_directory_structure_by_category,
    is_relevance_or_irrelevance, is_multi_turn, is_memory,
)

OMIT = object()


def resolve(value):
    """Inside a chosen value, dicts still map keys to allowed-value lists."""
    if isinstance(value, dict):
        return {k: v for k, v in ((k, choose(vs)) for k, vs in value.items()) if v is not OMIT}
    if isinstance(value, list):
        return [resolve(x) for x in value]
    return value


def choose(allowed, required=False):
    """One value the checker accepts, or OMIT for a parameter that may be left out ("" among
    the allowed values) and is not required by the function."""
    if not isinstance(allowed, list):  # a few nested answers give a bare value
        return allowed
    if "" in allowed and not required:
        return OMIT
    for value in allowed:
        if value != "":
            return resolve(value)
    return OMIT


def _boolean(v) -> str:
    return "true" if v else "false"


# Scalar types' literals, as the package's Java and JavaScript type converters parse them back.
_JAVA_SCALARS = {
    "boolean": _boolean,
    "long": "{}L".format,
    "float": "{}f".format,
    "char": "'{}'".format,
}
_JS_SCALARS = {"Boolean": _boolean, "Bigint": "{}n".format}


def java_value(v):
    """A literal the package's untyped Java value parser reads back as v."""
    if isinstance(v, bool):
        return _boolean(v)
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def java(v, typ, nested=None):
    """Java source text for v, as the package's Java type converter parses it back."""
    if typ in _JAVA_SCALARS:
        return _JAVA_SCALARS[typ](v)
    if typ == "ArrayList" and isinstance(v, list):
        quote = {"String": json.dumps, "char": lambda x: f"'{x}'"}.get(nested)
        items = [quote(x) if quote else java(x, nested) if nested else java_value(x) for x in v]
        return f"new ArrayList<>(Arrays.asList({', '.join(items)}))"
    if typ == "Array" and isinstance(v, list):
        items = [java(x, nested) if nested else java_value(x) for x in v]
        return f"new {nested or 'Object'}[]{{{', '.join(items)}}}"
    if typ == "HashMap" and isinstance(v, dict):
        puts = " ".join(f"put({json.dumps(k)}, {java_value(x)});" for k, x in v.items())
        return "new HashMap<String, String>() {{ " + puts + " }}"
    return str(v)


def js(v, typ, nested=None):
    """JavaScript source text for v, as the package's JS type converter parses it back."""
    if typ in _JS_SCALARS:
        return _JS_SCALARS[typ](v)
    if typ == "array" and isinstance(v, list):
        return "[" + ", ".join(js(x, nested) if nested else json.dumps(x) for x in v) + "]"
    if typ == "dict" and isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(x)}" for k, x in v.items()) + "}"
    return str(v)


def ast_calls(truth, entry, cat):
    """Calls from AST ground truth; Java / JavaScript arguments as source-code strings."""
    docs = {f["name"]: f.get("parameters", {}).get("properties", {}) for f in entry["function"]}
    to_text = {"simple_java": java, "simple_javascript": js}.get(cat)
    calls = []
    required = {
        f["name"]: set(f.get("parameters", {}).get("required", [])) for f in entry["function"]
    }
    for item in truth:
        ((name, params),) = item.items()
        need = required.get(name, set())
        args = {k: choose(vs, k in need) for k, vs in params.items()}
        args = {k: v for k, v in args.items() if v is not OMIT}
        if to_text:
            props = docs.get(name, {})
            types = {k: (p.get("type"), p.get("items", {}).get("type")) for k, p in props.items()}
            args = {k: to_text(v, *types.get(k, (None, None))) for k, v in args.items()}
        calls.append({"name": name, "arguments": args})
    return calls


def relevance_call(entry):
    fn = entry["function"][0]
    props = fn.get("parameters", {}).get("properties", {})
    sample = {"string": "x", "integer": 1, "number": 1.0, "boolean": True, "array": [], "dict": {}}
    args = {p: sample.get(props.get(p, {}).get("type"), "x")
            for p in fn.get("parameters", {}).get("required", [])}
    return [{"name": fn["name"], "arguments": args}]


# Multi-turn ground truth is read as the bfcl_multi_turn world reads it (its worker module).
spec = importlib.util.spec_from_file_location("bfcl_world", sys.argv[3])
world = importlib.util.module_from_spec(spec)
spec.loader.exec_module(world)
python_call = world.python_call

ids = json.load(open(sys.argv[1]))
out = {}
for cat, wanted in ids.items():
    # Without the language hints: those rewrite Java / JS parameter types to "string".
    entries = {e["id"]: e for e in load_dataset_entry(cat, include_language_specific_hint=False)}
    truth = {}
    if not is_relevance_or_irrelevance(cat):
        truth = {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(cat)}
    rows = []
    for i in wanted:
        if "prereq" in i:
            continue  # prerequisite conversations are inputs, not scored
        entry = entries[i]
        if "irrelevance" in cat:
            rows.append({"id": i, "kind": "text", "text": "I cannot help with that."})
        elif is_relevance_or_irrelevance(cat):
            rows.append({"id": i, "kind": "calls", "calls": relevance_call(entry)})
        elif is_multi_turn(cat):
            docs = {f["name"]: f for f in entry["function"]}
            for turn in entry.get("missed_function", {}).values():
                docs.update({f["name"]: f for f in turn})
            turns = [[python_call(c, docs) for c in calls] for calls in truth[i]]
            rows.append({"id": i, "kind": "turns", "turns": turns})
        elif is_memory(cat):
            answers = truth.get(i) or truth[i.replace(cat, "memory", 1)]  # ids lack the backend
            rows.append({"id": i, "kind": "answer", "text": answers[0]})
        else:
            rows.append({"id": i, "kind": "calls", "calls": ast_calls(truth[i], entry, cat)})
    name = f"BFCL_v4_{cat}_result.json"
    out[cat] = {"path": f"{get_directory_structure_by_category(cat)}/{name}", "rows": rows}
json.dump(out, open(sys.argv[2], "w"))
'''


def result_entry(row: dict) -> dict:
    """One result-file line for an extracted gold row, in our policy's reply format."""
    kind = row["kind"]
    if kind == "calls":
        result = format_tool_calls(row["calls"])
    elif kind == "text":
        result = row["text"]
    elif kind == "answer":
        result = [[f"The answer is {row['text']}."]]
    elif kind == "turns":
        result = [
            ([format_tool_calls(calls)] if calls else []) + ["Done."] for calls in row["turns"]
        ]
    else:
        raise ValueError(f"unknown gold row kind {kind!r} for {row['id']}")
    return {"id": row["id"], "result": result}


def write_results(extracted: dict, result_dir: Path) -> int:
    """Writes the result files; returns the number of entries written."""
    n = 0
    for item in extracted.values():
        path = result_dir / item["path"]
        os.makedirs(path.parent, exist_ok=True)
        with open(path, "w") as f:
            for row in item["rows"]:
                f.write(json.dumps(result_entry(row)) + "\n")
                n += 1
    return n
