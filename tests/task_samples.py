"""Small task records for the data and reward tests (our layout and the reference layout)."""

from __future__ import annotations

import copy
import json

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
                "days": {"type": ["integer", "null"]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}
BOOK_TOOL = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a restaurant table.",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant": {"type": "string"},
                "party": {
                    "type": "object",
                    "properties": {"size": {"type": "integer"}, "names": {"type": "array"}},
                    "required": ["size"],
                },
            },
            "required": ["restaurant", "party"],
        },
    },
}


def item(question, weight, *, focus="assistant.content.user_visible_reply", required=False, **kw):
    d = {
        "question": question,
        "focus_on": focus,
        "pass_condition": f"The assistant satisfies: {question}",
        "failure_examples": ["No attempt", "Wrong city"],
        "evidence": ["get_weather(city='Oslo')"],
        "weight": weight,
        "required_for_next_turn": required,
    }
    d.update(kw)
    return d


def task_dict(i: int = 0) -> dict:
    """Our layout: two user turns, two tools, three + two checklist items."""
    user0 = f"What is the weather in Oslo? (task {i})"
    user1 = "And book a table for two at Maaemo."
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})},
    }
    reference = [
        {"role": "system", "content": "You are a helpful travel assistant."},
        {"role": "user", "content": user0},
        {"role": "assistant", "content": "<think>Look it up.</think>", "tool_calls": [call]},
        {"role": "tool", "name": "get_weather", "content": '{"temp_c": 4, "sky": "rain"}'},
        {"role": "assistant", "content": "It is 4 C and raining in Oslo."},
        {"role": "user", "content": user1},
        {"role": "assistant", "content": "Booked: Maaemo, party of two."},
    ]
    return {
        "task_id": f"task-{i}",
        "messages": copy.deepcopy(reference[:2]),
        "tools": [copy.deepcopy(WEATHER_TOOL), copy.deepcopy(BOOK_TOOL)],
        "reference_messages": reference,
        "checklist": [
            [
                item(
                    "Did it call get_weather for Oslo?",
                    0.5,
                    focus="assistant.tool_calls",
                    required=True,
                    rule={"kind": "call", "tool": "get_weather", "args": {"city": "Oslo"}},
                ),
                item("Did it report the temperature?", 0.25),
                item("Did it mention the rain?", 0.25),
            ],
            [
                item("Did it book Maaemo?", 0.6, focus="assistant.tool_calls"),
                item("Did it confirm the party size?", 0.4),
            ],
        ],
        "ground_truth": {"calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
        "metadata": {"data_source": "unit"},
    }


def cm2_item(cid: str, question: str, weight: float, focus: str, snippet: str) -> dict:
    """A checklist item as the annotation pipeline writes it (ids, evidence objects, ...)."""
    return {
        "id": cid,
        "evidence": [{"turn": 0, "step": 1, "from": focus, "snippet": snippet}],
        "focus_on": focus,
        "question": question,
        "pass_condition": f"Pass if: {question}",
        "failure_examples": ["No tool call observed", "Wrong tool name"],
        "required_for_next_turn": cid == "C0",
        "dependence": [],
        "weight": weight,
        "extra_info": {"price_usd": 0.125},
    }


def reference_row(i: int, *, tools_as_json: bool) -> dict:
    """One row of the reference's training parquet: top-level `messages` (opening chat),
    `data_source`, and `extra_info` with index, original_index, tools, the full reference
    conversation and interaction_kwargs.checklist_list ([checklist][turn][item])."""
    team_tool = {
        "type": "function",
        "function": {
            "name": f"get_games_{i}",
            "description": "Last games of a team.",
            "parameters": {
                "type": "object",
                # Different property names per row: a struct column holds their union.
                "properties": {f"team_{i}": {"type": "string", "description": "Team name"}},
                "required": [f"team_{i}"],
            },
        },
    }
    user0 = f"How did team {i} do lately?"
    conv = [
        {"role": "user", "content": user0, "tool_calls": []},
        {
            "role": "assistant",
            "content": "<think>\nCall the tool.\n</think>",
            "tool_calls": [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {
                        "name": f"get_games_{i}",
                        "arguments": json.dumps({f"team_{i}": "Huskies"}),
                    },
                }
            ],
        },
        {"role": "tool", "content": '{"games": [{"score": "21-14"}]}', "tool_calls": []},
        {"role": "assistant", "content": "<think>ok</think>\n\nThey won 21-14.", "tool_calls": []},
        {"role": "user", "content": "Thanks, and the defense?", "tool_calls": []},
        {"role": "assistant", "content": "It allowed 14 points.", "tool_calls": []},
    ]
    turn0 = [
        cm2_item(
            "C0", "Did it call the tool?", 0.75, "assistant.tool_calls", '"name": "get_games"'
        ),
        cm2_item(
            "C1", "Did it report the score?", 0.25, "assistant.content.user_visible_reply", "21-14"
        ),
    ]
    turn1 = [cm2_item("C2", "Did it mention defense?", 1.0, "tool.content", "14 points")]
    return {
        "data_source": "nvidia_nemotron_checklist",
        "messages": [{"role": "user", "content": user0}],
        "extra_info": {
            "index": i,
            "original_index": f"uuid-{i}",
            "tools": json.dumps([team_tool]) if tools_as_json else [team_tool],
            "messages": conv,
            "interaction_kwargs": {"name": "checklist", "checklist_list": [[turn0, turn1]]},
        },
    }
