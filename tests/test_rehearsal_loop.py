"""World rehearsal inside the compiled loop, driven by a scripted model.

The scripted model puts all probability on the next token of a fixed script (teacher forcing
through the logits), so the loop's bookkeeping — glue insertion, role tags, segment ids,
statuses, turn counts — can be compared exactly with the chat template's own rendering of the
same conversation (`text.trajectory.encode_conversation`, an independent reference).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envace_jax.models.config import ModelConfig
from envace_jax.models.decoder import CausalLM
from envace_jax.sampling.chat_spec import later_user_turns, observation_ids, turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.loop import to_trajectories
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.chat import messages_from_text, render
from envace_jax.text.codes import Status
from envace_jax.text.role_pieces import prompt_ids
from envace_jax.text.tokenizer import load_tokenizer
from envace_jax.text.trajectory import encode_conversation

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_balance",
            "description": "Balance of an account.",
            "parameters": {
                "type": "object",
                "properties": {"account_id": {"type": "string"}},
                "required": ["account_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "transfer",
            "description": "Move money between accounts.",
            "parameters": {
                "type": "object",
                "properties": {
                    "from_id": {"type": "string"},
                    "to_id": {"type": "string"},
                    "amount": {"type": "integer"},
                },
                "required": ["from_id", "to_id", "amount"],
            },
        },
    },
]


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _conversation(two_users=False):
    msgs = [
        {"role": "system", "content": "You are a bank agent."},
        {"role": "user", "content": "Send 5 from A1 to A2, then tell me the A1 balance."},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_balance", account_id="A1")]},
        {"role": "tool", "content": json.dumps({"balance": 40})},
        {
            "role": "assistant",
            "content": "Enough funds.",
            "tool_calls": [
                _call("transfer", from_id="A1", to_id="A2", amount=5),
                _call("get_balance", account_id="A2"),
            ],
        },
        {"role": "tool", "content": json.dumps({"balance": 35})},
        {"role": "tool", "content": json.dumps({"balance": 12})},
        {"role": "assistant", "content": "Done. A1 now holds 35."},
    ]
    if two_users:
        msgs += [
            {"role": "user", "content": "And A2?"},
            {"role": "assistant", "content": "A2 holds 12."},
        ]
    return msgs


class ScriptedModel(CausalLM):
    """Logits that make `script[b, p + 1]` the certain next token at position p of row b.

    A position outside the attended window (`kv_window`) gets flat logits, as a query that
    cannot see itself would get wrong ones: the loop must never feed such a position."""

    def __init__(self, script: np.ndarray, vocab: int):
        self.cfg = ModelConfig(
            vocab_size=vocab,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=2,
        )
        self.script = nnx.Variable(jnp.asarray(script, jnp.int32))

    def _forward(self, tokens, positions, attention_mask, cache, kv_window):
        script = self.script[...]
        nxt = jnp.take_along_axis(script, jnp.minimum(positions + 1, script.shape[1] - 1), axis=1)
        logits = jax.nn.one_hot(nxt, self.cfg.vocab_size) * 100.0 - 50.0
        if kv_window is not None:
            logits = jnp.where((positions < kv_window)[..., None], logits, 0.0)
        return logits, cache


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def _generated_part(ref):
    """The reference up to the last generated token: the loop stops at the final reply's end id
    and never writes the template's closing turn separator."""
    n = int(np.flatnonzero(ref.roles)[-1]) + 1
    return ref.ids[:n], ref.roles[:n], ref.segments[:n]


def _run(tok, convs, *, mode="rehearse", max_turns=8, max_new_tokens=400, user_turns=None):
    refs = [encode_conversation(tok, c, TOOLS) for c in convs]
    prompts = [prompt_ids(tok, c[:2], TOOLS) for c in convs]
    width = max(len(r.ids) for r in refs) + 8
    script = np.zeros((len(convs), width), np.int32)
    for b, r in enumerate(refs):
        script[b, : len(r.ids)] = r.ids
    spec = turn_spec(tok, mode=mode, max_turns=max_turns, max_message_tokens=200)
    # The script is read by row, so the batch keeps every row.
    sampler = Sampler(
        ScriptedModel(script, len(tok)), spec, pad_id=tok.pad_token_id, compact_rows=False
    )
    out = sampler.generate(
        prompts,
        key=jax.random.key(0),
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=max_new_tokens,
        user_turns=user_turns,
    )
    return out, refs, prompts


def test_call_rehearse_call_rehearse_final(tok):
    convs = [_conversation(), _conversation(two_users=True)]
    users = [later_user_turns(tok, c) for c in convs]
    out, refs, _ = _run(tok, convs, user_turns=users)
    for b, ref in enumerate(refs):
        ids, roles, segments = _generated_part(ref)
        n = len(ids)
        assert out.lengths[b] == n
        assert out.tokens[b, :n].tolist() == ids.tolist()
        assert out.roles[b, :n].tolist() == roles.tolist()
        assert out.segments[b, :n].tolist() == segments.tolist()
        assert out.status[b] == Status.FINISHED
    # ACT, REHEARSE, ACT, REHEARSE, ACT (+ ACT after the replayed user turn).
    assert out.act_turns.tolist() == [3, 4]
    assert refs[0].segments.max() == 5 and refs[1].segments.max() == 6
    # Rehearsed tokens carry log-probs (near 0 for a certain script); glue carries exactly 0.
    ctx = out.roles[0, : out.lengths[0]] == 0
    assert (out.logprobs[0, : out.lengths[0]][ctx] == 0).all()


def test_invariant_decode_parse_render_gives_the_same_ids(tok):
    convs = [_conversation(), _conversation(two_users=True)]
    out, _, _ = _run(tok, convs, user_turns=[later_user_turns(tok, c) for c in convs])
    for b in range(len(convs)):
        ids = out.tokens[b, : out.lengths[b]].tolist()
        messages = messages_from_text(tok, ids)
        rendered = render(tok, messages, TOOLS)
        # The template closes the last turn with a separator the loop does not generate.
        assert rendered[: len(ids)] == ids
        assert tok.decode(rendered[len(ids) :]) == "\n"
        # The parse recovers the conversation itself, not just text that re-renders alike.
        assert [m["role"] for m in messages] == [m["role"] for m in convs[b]]
        calls = [c["function"]["name"] for m in messages for c in m.get("tool_calls", [])]
        assert calls == ["get_balance", "transfer", "get_balance"]


def test_turn_limit_stops_after_the_last_allowed_call(tok):
    out, refs, _ = _run(tok, [_conversation()], max_turns=2)
    ref = refs[0]
    assert out.status[0] == Status.TURN_LIMIT
    assert out.act_turns[0] == 2
    # It stops right after the second ACT message (segment 3): no rehearsal of its calls.
    n = int(out.lengths[0])
    assert out.segments[0, n - 1] == 3 and out.roles[0, n - 1] == 1
    assert out.tokens[0, :n].tolist() == ref.ids[:n].tolist()
    assert out.roles[0, :n].tolist() == ref.roles[:n].tolist()


def test_token_budget_truncates(tok):
    out, refs, prompts = _run(tok, [_conversation()], max_new_tokens=30)
    assert out.status[0] == Status.TRUNCATED
    assert out.lengths[0] == len(prompts[0]) + 30
    n = int(out.lengths[0])
    assert out.tokens[0, :n].tolist() == refs[0].ids[:n].tolist()
    assert out.segments[0, :n].tolist() == refs[0].segments[:n].tolist()


def test_host_mode_round_trip_matches_the_real_environment_rendering(tok):
    """Host turns: the row pauses after each ACT message with calls; the real observation is
    appended as CONTEXT on top of the cache and decoding resumes. The result is the template's
    rendering of the conversation with tool turns as CONTEXT."""
    conv = _conversation()
    ref = encode_conversation(tok, conv, TOOLS, rehearse=False)
    script = np.zeros((1, len(ref.ids) + 8), np.int32)
    script[0, : len(ref.ids)] = ref.ids
    spec = turn_spec(tok, mode="host", max_turns=8, max_message_tokens=200)
    sampler = Sampler(ScriptedModel(script, len(tok)), spec, pad_id=tok.pad_token_id)
    sampling = SamplingParams(temperature=1.0)
    state = sampler.start(
        [prompt_ids(tok, conv[:2], TOOLS)],
        key=jax.random.key(0),
        sampling=sampling,
        max_new_tokens=400,
    )
    observations = [[conv[3]["content"]], [conv[5]["content"], conv[6]["content"]]]
    pauses = []
    for responses in observations:
        assert int(state.status[0]) == Status.AWAITING_ENV
        pauses.append(int(state.length[0]))
        state = sampler.resume(state, [observation_ids(tok, responses)], sampling=sampling)
    out = to_trajectories(state, tok.pad_token_id)
    ids, roles, segments = _generated_part(ref)
    assert out.status[0] == Status.FINISHED
    assert out.tokens[0, : out.lengths[0]].tolist() == ids.tolist()
    assert out.roles[0, : out.lengths[0]].tolist() == roles.tolist()
    assert out.segments[0, : out.lengths[0]].tolist() == segments.tolist()
    # It paused exactly at the end of the two ACT messages that called tools.
    act_ends = [int(np.flatnonzero(ref.segments == s)[-1]) + 1 for s in (1, 2)]
    assert pauses == act_ends
