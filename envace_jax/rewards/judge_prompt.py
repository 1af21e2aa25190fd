"""What the LLM judge (`rewards.llm_judge`) sends and reads back: the conversation rendered
for the judge, the per-item prompt, the verdict's JSON schema, and the verdict parser.

Where we depart from the reference prompt rendering: an assistant message without a `<think>`
block is rendered as a user-visible reply (the reference files its whole content under
thinking, which misjudges models that do not think aloud), and turns are numbered within the
whole conversation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.data.checklists import ChecklistItem

TOOL_ROLES = ("tool", "observation")  # the message roles rendered as tool responses

VERDICT_FIELDS = (
    "high_level_understanding_of_the_question",
    "analysis_of_if_focus_on",
    "analysis_of_pass_condition",
    "analysis_of_failure_examples",
)
VERDICT_SCHEMA = {
    "type": "object",
    "properties": {
        **{k: {"type": "string"} for k in VERDICT_FIELDS},
        "answer": {"type": "boolean"},
    },
    "required": [*VERDICT_FIELDS, "answer"],
    "additionalProperties": False,
}


# --------------------------------------------------------------------------------------------
# Prompt


_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def _split_thinking(msg: Mapping[str, Any]) -> tuple[str, str]:
    content = msg.get("content") or ""
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
    thinking = msg.get("reasoning_content") or ""
    m = _THINK.search(content)
    if m:
        thinking = thinking or m.group(1).strip()
        content = content[m.end() :]
    elif "</think>" in content:  # template-opened think block: only the closing tag is emitted
        head, content = content.split("</think>", 1)
        thinking = thinking or head.replace("<think>", "").strip()
    return thinking.strip() or "None", content.strip() or "None"


def render_messages(messages: Sequence[Mapping[str, Any]], first_turn: int = 0) -> str:
    """Serialise chat messages for the judge: `# Turn: k` per user message, `## Step: s` per
    assistant message of a turn (thinking, user-visible reply, tool calls as JSON), tool
    responses, system messages."""
    out, turn, step = [], first_turn - 1, 0
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        content = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        if role == "system":
            out.append(f"Role: system\ncontent: {content}\n")
        elif role == "user":
            turn, step = turn + 1, 0
            out.append(f"# Turn: {turn}\nRole: user\ncontent: {content}\n")
        elif role == "assistant":
            thinking, reply = _split_thinking(m)
            calls = m.get("tool_calls")
            calls = json.dumps(calls, ensure_ascii=False) if calls else "None"
            out.append(
                f"## Step: {step}\nRole: assistant\ncontent.thinking: {thinking}\n"
                f"content.user_visible_reply: {reply}\ntool_call: {calls}\n"
            )
            step += 1
        elif role in TOOL_ROLES:
            out.append(f"Role: tool\ncontent: {content}\n")
    return "".join(out)


def build_prompt(item: ChecklistItem, previous: str, current: str) -> str:
    """The judge's user message for one item: criteria, context, current turn, output format."""
    fails = json.dumps(list(item.failure_examples), ensure_ascii=True, indent=2)
    snippets = json.dumps(list(item.evidence), ensure_ascii=True, indent=2)
    previous = previous or "None\n"
    return (
        "# Role\n"
        "You are a precise checklist evaluator. You decide whether the messages exchanged "
        "between the user, the assistant and the tools meet one criterion.\n\n"
        "# Objective\n"
        "Give a strict JSON verdict, and nothing else, following the steps below.\n\n"
        "# Criterion\n"
        f"**Question:** {item.question}\n"
        f"**Focus on:** {item.focus_on}\n"
        f"**Pass condition:** {item.pass_condition}\n"
        f"**Failure examples:** {fails}\n"
        f"**Reference snippet:** {snippets}\n\n"
        "# Previous Messages\n"
        f"{previous}"
        "# Current Messages to Evaluate\n"
        f"{current}\n"
        "# Rules about tool calls\n"
        "Tool calls written only inside content.thinking (none under tool_call) are malformed: "
        "treat every such call as not made. If a tool response reports an error, the tool calls "
        "of the latest assistant step before it are invalid.\n\n"
        "# Evaluation steps (one JSON field each)\n"
        "1. high_level_understanding_of_the_question: restate briefly what is evaluated and "
        "what meeting it means here.\n"
        "2. analysis_of_if_focus_on: is the part named by 'Focus on' present in the current "
        "messages?\n"
        "3. analysis_of_pass_condition: is the pass condition fully met?\n"
        "4. analysis_of_failure_examples: for EACH failure example, say 'triggered' or "
        "'not triggered', with a short reason.\n"
        "5. answer: true ONLY IF the focus part is present, the pass condition is fully met and "
        "no failure example is triggered; otherwise false.\n\n"
        "# Output format\n"
        "Return ONLY one JSON object with exactly these keys:\n"
        "{\n"
        '  "high_level_understanding_of_the_question": str,\n'
        '  "analysis_of_if_focus_on": str,\n'
        '  "analysis_of_pass_condition": str,\n'
        '  "analysis_of_failure_examples": str,\n'
        '  "answer": bool\n'
        "}"
    )


# --------------------------------------------------------------------------------------------
# Verdict parsing


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
_ANSWER = re.compile(r"""["']?\banswer\b["']?\s*[:=]\s*["']?(true|false)\b""", re.IGNORECASE)


def _answer_of(obj: Any) -> bool | None:
    if not isinstance(obj, Mapping) or "answer" not in obj:
        return None
    a = obj["answer"]
    if isinstance(a, bool):
        return a
    if isinstance(a, str) and a.strip().lower() in ("true", "false"):
        return a.strip().lower() == "true"
    return None


def parse_verdict(text: Any) -> bool | None:
    """The boolean `answer` of a verdict, or None when there is none. Accepts a JSON object,
    one inside a ``` fence or surrounded by prose, or a trailing `answer: true|false`;
    `<think>` blocks are ignored."""
    if not isinstance(text, str):
        return None
    text = _THINK.sub("", text)
    if "</think>" in text:
        text = text.split("</think>")[-1]
    text = text.strip()
    try:
        a = _answer_of(json.loads(text))
        if a is not None:
            return a
    except ValueError:
        pass
    for block in reversed(_FENCE.findall(text)):
        try:
            a = _answer_of(json.loads(block.strip()))
            if a is not None:
                return a
        except ValueError:
            pass
    decoder = json.JSONDecoder()
    last = None
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        a = _answer_of(obj)
        if a is not None:
            last = a
    if last is not None:
        return last
    hits = _ANSWER.findall(text)
    return hits[-1].lower() == "true" if hits else None
