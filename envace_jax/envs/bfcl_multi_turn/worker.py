"""The bfcl-eval side of the `bfcl_multi_turn` domain: a process in bfcl-eval's own virtual
environment (`envs.bfcl_package`) that loads the package's multi-turn entries, executes calls in
its backends and judges episodes with its own checker. It imports only the standard library and
`bfcl_eval`; `envs/worker_loop.py` serves its `answer`, one JSON request per line:

    {"op": "load", "category": C}              -> every entry of C: id, question, function,
                                                  initial_config, involved_classes,
                                                  ground_truth (calls as name + arguments per
                                                  turn) and gold_responses (what the backends
                                                  return for them, turn by turn)
    {"op": "reset", "env": E, "id": I}         -> world E set to entry I's initial state
    {"op": "step", "env": E, "calls": [...]}   -> one response string per {name, arguments}
    {"op": "check", "id": I, "turns": [...]}   -> the checker's verdict on a result in the
                                                  package's result-file layout (per turn, the
                                                  text of each assistant step)
    {"op": "close", "env": E}                  -> world E forgotten

Calls are executed the way `bfcl evaluate` executes a model's: `convert_to_function_call`
writes them as Python calls, and `execute_multi_turn_func_call` runs them on instances it keeps
under a (model name, entry id) key. Each world and each check has a model name of its own, and
its instances are dropped when it is reset, closed or done, so no two ever share state.
"""

import ast
import copy
import re

from bfcl_eval.eval_checker.eval_runner import _evaluate_single_multi_turn_entry
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.model_handler.local_inference.qwen_fc import QwenFCHandler
from bfcl_eval.model_handler.utils import convert_to_function_call
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

ENTRIES = {}  # id -> dataset entry
TRUTH = {}  # id -> ground truth (Python call strings per turn)
WORLDS = {}  # env id -> (model name, entry id)
CHECKS = [0]


def python_call(text, docs):
    """{name, arguments} of a ground-truth call string, positional arguments named from the
    function's documented parameter order."""
    node = ast.parse(text, mode="eval").body
    name = ast.unparse(node.func)
    order = list(docs.get(name, {}).get("parameters", {}).get("properties", {}))
    args = {order[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return {"name": name, "arguments": args}


def forget(model_name, entry_id):
    """Drop the backend instances `execute_multi_turn_func_call` keeps for this key."""
    prefix = re.sub(r"[-./:]", "_", f"{model_name}_{entry_id}_")
    space = vars(multi_turn_utils)
    for key in [k for k in space if k.startswith(prefix)]:
        del space[key]


def execute(model_name, entry, calls):
    """The backends' response strings to `calls` ({name, arguments}), in order."""
    results, _ = multi_turn_utils.execute_multi_turn_func_call(
        convert_to_function_call([{c["name"]: c["arguments"]} for c in calls]),
        entry["initial_config"],
        entry["involved_classes"],
        model_name,
        entry["id"],
        long_context="long_context" in entry["id"],
    )
    return results


def load(category):
    entries = load_dataset_entry(category, include_language_specific_hint=False)
    truth = {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(category)}
    out = []
    for entry in entries:
        ENTRIES[entry["id"]] = entry
        TRUTH[entry["id"]] = truth[entry["id"]]
        docs = {f["name"]: f for f in entry["function"]}
        turns = [[python_call(c, docs) for c in calls] for calls in truth[entry["id"]]]
        name = "envace_gold"
        gold = [execute(name, entry, calls) if calls else [] for calls in turns]
        forget(name, entry["id"])
        out.append(
            {
                **{k: entry[k] for k in ("id", "question", "function", "involved_classes")},
                "initial_config": entry["initial_config"],
                "ground_truth": turns,
                "gold_responses": gold,
            }
        )
    return out


def check(entry_id, turns):
    CHECKS[0] += 1
    name = f"envace_check_{CHECKS[0]}"
    handler = QwenFCHandler(name, 0.0, name, True)
    try:
        return _evaluate_single_multi_turn_entry(
            handler,
            entry_id,
            turns,
            TRUTH[entry_id],
            copy.deepcopy(ENTRIES[entry_id]),
            name,
            entry_id.rsplit("_", 1)[0],
        )
    finally:
        for suffix in ("_eval", "_ground_truth_eval"):
            forget(name + suffix, entry_id)


def answer(req):
    op = req["op"]
    if op == "load":
        return load(req["category"])
    if op == "reset":
        old = WORLDS.pop(req["env"], None)
        if old:
            forget(*old)
        WORLDS[req["env"]] = (f"envace_world_{req['env']}", req["id"])
        return None
    if op == "step":
        name, entry_id = WORLDS[req["env"]]
        return execute(name, ENTRIES[entry_id], req["calls"])
    if op == "check":
        verdict = check(req["id"], req["turns"])
        reason = verdict.get("error", {}).get("error_type")
        return {"valid": bool(verdict["valid"]), "reason": reason}
    if op == "close":
        old = WORLDS.pop(req["env"], None)
        if old:
            forget(*old)
        return None
    raise ValueError(f"unknown op {op!r}")
