"""Oracle trajectories of demo tasks, and warm-start demonstrations built from them.

The oracle plays a task's ground-truth solution against the real `DemoEnv`, one call per
assistant message (later calls use values that earlier results returned), then gives the
templated final reply. Its conversation is the task's reference conversation.

The warm start also imitates imperfect agents: one that makes the lookups and then takes its
family's default action whatever the lookup said (`default_messages`), and one that stops a
call short (`unfinished_messages`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from envace_jax.envs.base import ToolResult, error_code, result_text
from envace_jax.envs.demo.env import DemoEnv
from envace_jax.envs.demo.tools import STATE_CHANGING, execute
from envace_jax.envs.demo.world import World, copy_world

# The domain error a recovery demonstration shows: a lookup of an unknown id. (A refused change
# would fail the task whatever followed, so no demonstration recovers from one.)
RECOVERED_ERRORS = ("not_found",)
_ID_PREFIXES = ("M", "C", "A", "O")

if TYPE_CHECKING:
    from envace_jax.text.trajectory import EncodedConversation


def call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant message making one tool call (OpenAI chat format)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def tool_message(name: str, result: ToolResult) -> dict[str, Any]:
    """The tool message carrying one call's response."""
    return {"role": "tool", "name": name, "content": result_text(result)}


def conversation(
    opening: Sequence[dict[str, Any]],
    calls: Sequence[dict[str, Any]],
    results: Sequence[ToolResult],
    final_reply: str,
) -> list[dict[str, Any]]:
    """Opening chat, then (call, result) message pairs, then the final reply."""
    out = [dict(m) for m in opening]
    for call, result in zip(calls, results, strict=True):
        out.append(call_message(call["name"], call["arguments"]))
        out.append(tool_message(call["name"], result))
    out.append({"role": "assistant", "content": final_reply})
    return out


def oracle_messages(task: Any, env: DemoEnv | None = None) -> list[dict[str, Any]]:
    """The ground-truth conversation of `task`, its tool messages produced by executing the
    solution in a real environment (a fresh `DemoEnv` unless `env` is given; it is reset)."""
    env = env or DemoEnv()
    env.reset(task)
    gt = task.ground_truth
    results = [env.step([call])[0] for call in gt["solution"]]
    return conversation(task.messages, gt["solution"], results, gt["final_reply"])


def _wrong_calls(rng: random.Random, world: World, call: dict[str, Any]) -> list[dict]:
    """Variants of `call` with an id that does not exist in `world`."""
    name, args = call["name"], call["arguments"]
    out = []
    text = str(world)
    for key, value in args.items():
        if isinstance(value, str) and value[:1] in _ID_PREFIXES:
            free = [f"{value[0]}{n}" for n in range(1, 10) if f"'{value[0]}{n}'" not in text]
            if free:
                out.append({"name": name, "arguments": {**args, key: rng.choice(free)}})
    return out


def recovery_messages(task: Any, rng: random.Random, env: DemoEnv | None = None):
    """The oracle conversation of `task` with one failing lookup before one of its solution's
    lookups: a wrong variant of that call (`_wrong_calls`) that the real environment answers
    with one of `RECOVERED_ERRORS`, its error response, then the right call and the rest. None
    when no variant fails that way."""
    env = env or DemoEnv()
    solution = task.ground_truth["solution"]
    lookups = [i for i, c in enumerate(solution) if c["name"] not in STATE_CHANGING]
    if not lookups:
        return None
    at = rng.choice(lookups)
    env.reset(task)
    results = [env.step([c])[0] for c in solution[:at]]
    world = env.state()["world"]
    by_code: dict[str, list[dict]] = {}
    for c in _wrong_calls(rng, world, solution[at]):
        code = error_code(execute(copy_world(world), c["name"], c["arguments"]))
        if code in RECOVERED_ERRORS:
            by_code.setdefault(code, []).append(c)
    if not by_code:
        return None
    wrong = rng.choice(by_code[rng.choice(sorted(by_code))])  # each error kind equally often
    results.append(env.step([wrong])[0])  # the environment's own error response
    results += [env.step([c])[0] for c in solution[at:]]
    calls = [*solution[:at], wrong, *solution[at:]]
    return conversation(task.messages, calls, results, task.ground_truth["final_reply"])


def default_messages(task: Any, env: DemoEnv | None = None) -> list[dict[str, Any]]:
    """An agent that makes the task's lookups, then its family's default action whatever the
    lookups said (`ground_truth['default_call']`), answered by the real environment: the
    oracle's conversation where the default is the branch's action, else the refusal and the
    agent's report of it (`ground_truth['refused_reply']`)."""
    env = env or DemoEnv()
    env.reset(task)
    gt = task.ground_truth
    lookups = [c for c in gt["solution"] if c["name"] not in STATE_CHANGING]
    calls = [*lookups, gt["default_call"]]
    results = [env.step([c])[0] for c in calls]
    reply = gt["final_reply"] if error_code(results[-1]) is None else gt["refused_reply"]
    return conversation(task.messages, calls, results, reply)


def unfinished_messages(task: Any, env: DemoEnv | None = None) -> list[dict[str, Any]]:
    """The oracle conversation of `task` without its last call and that call's response: the
    agent gives the final reply one call early, claiming a change it did not make."""
    messages = oracle_messages(task, env)
    return [*messages[:-3], messages[-1]]


def demonstration_messages(
    tasks: Sequence[Any],
    failure_fraction: float = 0.0,
    seed: int = 0,
    unfinished_fraction: float = 0.0,
    default_fraction: float = 0.0,
) -> list[list[dict[str, Any]]]:
    """The conversation each task's warm-start demonstration shows (see `demonstrations`), its
    demonstrator drawn per task index from `seed`."""
    env = DemoEnv()
    out = []
    for i, t in enumerate(tasks):
        rng = random.Random(f"{seed}-{i}-recovery")
        messages = None
        if random.Random(f"{seed}-{i}-default").random() < default_fraction:
            messages = default_messages(t, env)
        elif random.Random(f"{seed}-{i}-unfinished").random() < unfinished_fraction:
            messages = unfinished_messages(t, env)
        elif rng.random() < failure_fraction:
            messages = recovery_messages(t, rng, env)
        out.append(messages or oracle_messages(t, env))
    return out


def demonstrations(
    tasks: Sequence[Any],
    tokenizer,
    failure_fraction: float = 0.0,
    seed: int = 0,
    unfinished_fraction: float = 0.0,
    default_fraction: float = 0.0,
) -> list[EncodedConversation]:
    """Warm-start SFT sequences: each task's oracle conversation encoded as one role-tagged
    token sequence (`EncodedConversation`: ids/roles/segments, each [T]). Assistant messages
    are ACT targets and the real environment's responses REHEARSE targets, so a policy learns
    both to act and to predict what the world answers. A share `failure_fraction` of them (drawn
    from `seed`) shows a failing call, its real error response and the recovery
    (`recovery_messages`), so that both roles see what a failure looks like. Another share
    `unfinished_fraction` (drawn independently) stops one call short (`unfinished_messages`),
    and a share `default_fraction` takes the family's default action whatever the lookup said
    (`default_messages`): demonstrations logged from an imperfect agent, whose mistake RL can
    find and undo."""
    # Imported here: the environment itself needs no tokenizer machinery.
    from envace_jax.text.trajectory import encode_conversation

    shown = demonstration_messages(
        tasks, failure_fraction, seed, unfinished_fraction, default_fraction
    )
    return [
        encode_conversation(tokenizer, messages, t.template_tools, rehearse=True)
        for t, messages in zip(tasks, shown, strict=True)
    ]


def response_tools(tasks: Sequence[Any]) -> list[list[str]]:
    """The tool of each response in each task's demonstration, in order (one per call of
    its solution): per-tool scores of the rehearser (`diagnostics.build_copy_probe`)."""
    return [[call["name"] for call in t.ground_truth["solution"]] for t in tasks]
