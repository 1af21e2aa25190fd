"""Oracle trajectories of demo tasks, and warm-start demonstrations built from them.

The oracle plays a task's ground-truth solution against the real `DemoEnv`, one call per
assistant message (later calls use values that earlier results returned), then gives the
templated final reply. Its conversation is the task's reference conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from envace_jax.envs.base import ToolResult, result_text
from envace_jax.envs.demo.env import DemoEnv

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


def demonstrations(tasks: Sequence[Any], tokenizer) -> list[EncodedConversation]:
    """Warm-start SFT sequences: each task's oracle conversation encoded as one role-tagged
    token sequence (`EncodedConversation`: ids/roles/segments, each [T]). Assistant messages
    are ACT targets and the real environment's responses REHEARSE targets, so a policy learns
    both to act and to predict what the world answers."""
    # Imported here: the environment itself needs no tokenizer machinery.
    from envace_jax.text.trajectory import encode_conversation

    env = DemoEnv()
    return [
        encode_conversation(tokenizer, oracle_messages(t, env), t.template_tools, rehearse=True)
        for t in tasks
    ]


def response_tools(tasks: Sequence[Any]) -> list[list[str]]:
    """The tool of each response in each task's demonstration, in order (one per call of
    its solution): per-tool scores of the rehearser (`diagnostics.build_copy_probe`)."""
    return [[call["name"] for call in t.ground_truth["solution"]] for t in tasks]
