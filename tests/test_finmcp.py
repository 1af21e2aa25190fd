"""FinMCP-Bench tool-call metrics and replay on hand-made records, with scores worked out by hand
(fractions written out below, not recomputed by the code under test)."""

import json

import pytest

from envace_jax.eval import finmcp


def _call(name, args="{}"):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def test_sample_counts_by_hand():
    # gold {a, b}, predicted {a, c}: one match of two predicted, of two gold.
    c = finmcp.count(["a", "c"], ["a", "b"])
    assert (c.matches, c.precision, c.recall, c.tf1) == (1, 0.5, 0.5, 0.5)
    # A repeated call matches the gold call once: P = 1/2, R = 1, TF1 = 2/3.
    c = finmcp.count(["a", "a"], ["a"])
    assert (c.matches, c.precision, c.recall) == (1, 0.5, 1.0)
    assert c.tf1 == pytest.approx(2 / 3)
    # Silence on a tool task scores zero; silence when nothing was needed scores one.
    assert finmcp.count([], ["x"]).tf1 == 0.0
    assert finmcp.count([], []).tf1 == 1.0
    assert finmcp.count(["x"], []).recall == 0.0
    # Order matters for exact match only.
    assert finmcp.count(["b", "a"], ["a", "b"]).tf1 == 1.0
    assert not finmcp.count(["b", "a"], ["a", "b"]).exact


def test_macro_and_micro_by_hand():
    rows = [
        {"id": "1", "type": "multi_tool", "predicted": ["a", "c"], "gold": ["a", "b"]},
        {"id": "2", "type": "single_tool", "predicted": ["a", "a"], "gold": ["a"]},
        {"id": "3", "type": "multi_tool", "predicted": [], "gold": ["x", "y", "z"]},
        {"id": "4", "type": "single_tool", "predicted": ["q"], "gold": ["q"]},
    ]
    m = finmcp.score_predictions(rows)
    # Per sample (P, R, F1): (1/2, 1/2, 1/2), (1/2, 1, 2/3), (0, 0, 0), (1, 1, 1).
    assert m["macro"]["precision"] == pytest.approx((0.5 + 0.5 + 0 + 1) / 4)  # 0.5
    assert m["macro"]["recall"] == pytest.approx((0.5 + 1 + 0 + 1) / 4)  # 0.625
    assert m["macro"]["tf1"] == pytest.approx((0.5 + 2 / 3 + 0 + 1) / 4)  # 0.541666...
    # Pooled: 3 matches, 5 predicted, 7 gold -> P 3/5, R 3/7, F1 = 2*(3/5)(3/7)/(3/5+3/7) = 1/2.
    assert m["micro"]["precision"] == pytest.approx(3 / 5)
    assert m["micro"]["recall"] == pytest.approx(3 / 7)
    assert m["micro"]["tf1"] == pytest.approx(0.5)
    assert m["exact_match"] == pytest.approx(1 / 4)
    # single_tool: samples 2 and 4 -> macro TF1 (2/3 + 1) / 2 = 5/6; micro 2/3 and 2/2.
    single = m["by_type"]["single_tool"]
    assert single["macro"]["tf1"] == pytest.approx(5 / 6)
    assert single["micro"]["precision"] == pytest.approx(2 / 3)
    assert single["micro"]["recall"] == pytest.approx(1.0)


RECORD = {
    "id": "fund-1",
    "type": "multi_tool",
    "tools": [
        {"type": "function", "function": {"name": "search_fund", "parameters": {}}},
        {"type": "function", "function": {"name": "fund_nav", "parameters": {}}},
    ],
    "messages": [
        {"role": "system", "content": "You are a fund assistant."},
        {"role": "user", "content": "What is the NAV of the Alpha fund?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call("search_fund", '{"q": "Alpha"}')],
        },
        {"role": "tool", "content": '{"code": "000001"}'},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call("fund_nav", '{"code": "000001"}')],
        },
        {"role": "tool", "content": '{"nav": 1.23}'},
        {"role": "assistant", "content": "The NAV is 1.23."},
    ],
}


def test_replay_feeds_gold_history_and_scores_each_step(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(RECORD) + "\n\n")
    (record,) = finmcp.load_records(str(path))
    seen = []
    # Scripted policy: right first call, wrong second call, a spurious call at the answer step.
    script = [["search_fund"], ["search_fund"], ["fund_nav"]]

    def respond(messages, tools):
        seen.append((len(messages), [t["function"]["name"] for t in tools]))
        return script[len(seen) - 1]

    row = finmcp.replay_record(record, respond)
    # Step k sees the gold history up to assistant message k: 2, 4 and 6 messages.
    names = ["search_fund", "fund_nav"]
    assert seen == [(2, names), (4, names), (6, names)]
    assert row["gold"] == ["search_fund", "fund_nav"]
    assert row["predicted"] == ["search_fund", "search_fund", "fund_nav"]
    # 2 matches (search_fund once, fund_nav once) of 3 predicted and 2 gold: P 2/3, R 1, F1 4/5.
    m = finmcp.score_predictions([row])
    assert m["macro"]["precision"] == pytest.approx(2 / 3)
    assert m["macro"]["recall"] == pytest.approx(1.0)
    assert m["macro"]["tf1"] == pytest.approx(0.8)


def test_replay_counts_failed_requests_as_no_prediction():
    def respond(messages, tools):
        raise ConnectionError("server down")

    row = finmcp.replay_record(RECORD, respond)
    assert row["predicted"] == [] and len(row["errors"]) == 3
    assert finmcp.score_predictions([row])["macro"]["tf1"] == 0.0


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "robot"}]}', "messages[0].role"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        (
            '{"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}',
            "messages[0].tool_calls[0] has no function name",
        ),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORD) + "\n" + line + "\n")
    with pytest.raises(finmcp.RecordError) as e:
        finmcp.load_records(str(path))
    assert f"{path}:2" in str(e.value) and message in str(e.value)
