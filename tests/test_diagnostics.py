"""Held-out copy diagnostics: scored positions and accuracies against hand-made predictors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envace_jax.envs.demo import demonstrations, generate_tasks, oracle_messages, response_tools
from envace_jax.text import load_tokenizer
from envace_jax.text.trajectory import Role
from envace_jax.train.diagnostics import build_copy_probe, copy_metrics


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


@pytest.fixture(scope="module")
def tasks():
    return generate_tasks(0, 12, split="validation")


@pytest.fixture(scope="module")
def examples(tok, tasks):
    return demonstrations(tasks, tok)


class Oracle(nnx.Module):
    """Predicts the true next token of the probe it was made for (or a constant token)."""

    def __init__(self, tokens: np.ndarray, vocab: int, constant: int | None = None):
        nxt = np.roll(tokens, -1, axis=1)
        if constant is not None:
            nxt[:] = constant
        self.logits = nnx.Variable(jnp.asarray(np.eye(vocab, dtype=np.float32)[nxt]))

    def __call__(self, tokens, positions):
        return self.logits[...], None


def test_probe_scores_act_tokens_and_their_digits(tok, examples):
    probe = build_copy_probe(examples, tok, tok.pad_token_id, length=1024)
    for b, ex in enumerate(examples):
        n = len(ex.ids)
        roles = np.asarray(ex.roles)
        assert probe.act[b, :n].sum() == (roles[1:] == Role.ACT).sum()  # position 0: no target
        assert not probe.act[b, n:].any(), "padding is never scored"
        text = tok.decode([ex.ids[i] for i in np.flatnonzero(probe.digits[b])])
        assert text and text.isdigit()
        # Every digit an ACT message writes is scored: the ids and amounts of its calls.
        act_text = tok.decode([ex.ids[i] for i in np.flatnonzero(probe.act[b])])
        assert sum(ch.isdigit() for ch in act_text) == len(text)
        # ... and every digit of a tool response: what the rehearser reads off the world.
        rehearsed = np.flatnonzero(probe.rehearse_digits[b])
        assert (roles[rehearsed] == Role.REHEARSE).all()
        responses = tok.decode([ex.ids[i] for i in np.flatnonzero(roles == Role.REHEARSE)])
        assert sum(ch.isdigit() for ch in responses) == len(rehearsed) > 0


def test_accuracies_against_hand_made_predictors(tok, examples):
    probe = build_copy_probe(examples, tok, tok.pad_token_id, length=1024)
    perfect = copy_metrics(Oracle(probe.tokens, len(tok)), probe)
    assert perfect == {
        "heldout/act_token_acc": 1.0,
        "heldout/act_digit_acc": 1.0,
        "heldout/rehearse_digit_acc": 1.0,
    }

    five = tok.convert_tokens_to_ids("5")
    const = copy_metrics(Oracle(probe.tokens, len(tok), constant=five), probe)
    targets = probe.tokens  # scored positions are targets themselves (mask aligned to tokens)
    want_digit = float(np.mean(targets[probe.digits] == five))
    want_act = float(np.mean(targets[probe.act] == five))
    assert const["heldout/act_digit_acc"] == pytest.approx(want_digit)
    assert const["heldout/act_token_acc"] == pytest.approx(want_act)
    want_rehearse = float(np.mean(targets[probe.rehearse_digits] == five))
    assert const["heldout/rehearse_digit_acc"] == pytest.approx(want_rehearse)
    assert 0 < want_digit < 1


def test_cut_examples_and_empty_input(tok, examples):
    probe = build_copy_probe(examples, tok, tok.pad_token_id, length=64)
    assert probe.tokens.shape == (len(examples), 64)
    with pytest.raises(ValueError, match="no examples"):
        build_copy_probe([], tok, tok.pad_token_id, length=64)


def test_rehearse_digits_scored_per_tool(tok, tasks, examples):
    probe = build_copy_probe(examples, tok, tok.pad_token_id, 1024, response_tools(tasks))
    assert {"find_customer", "refund", "transfer"} <= set(probe.tools)
    # Every REHEARSE token carries the tool of its response; nothing else carries one.
    rehearse = np.zeros_like(probe.act)
    for b, ex in enumerate(examples):
        rehearse[b, : len(ex.ids)] = np.asarray(ex.roles) == Role.REHEARSE
    rehearse[:, 0] = False
    assert ((probe.response_tool >= 0) == rehearse).all()
    # Independently of the segments: a tool's tagged digits are the digits its tool messages
    # hold (the demo tokenizer writes one digit per token).
    for t, tool in enumerate(probe.tools):
        tagged = (probe.rehearse_digits & (probe.response_tool == t)).sum()
        in_text = sum(
            ch.isdigit()
            for task in tasks
            for m in oracle_messages(task)
            if m["role"] == "tool" and m["name"] == tool
            for ch in m["content"]
        )
        assert tagged == in_text > 0, tool

    # A predictor right everywhere except before the digits of `refund` responses.
    refund = probe.rehearse_digits & (probe.response_tool == probe.tools.index("refund"))
    model = Oracle(probe.tokens, len(tok))
    wrong = np.roll(refund, -1, axis=1)  # the prediction for token t + 1 is made at t
    logits = np.array(model.logits[...])
    logits[wrong] = np.eye(len(tok), dtype=np.float32)[tok.pad_token_id]
    model.logits[...] = jnp.asarray(logits)
    got = copy_metrics(model, probe)
    assert got["heldout/rehearse_digit_acc/refund"] == 0.0
    for tool in probe.tools:
        if tool != "refund":
            assert got[f"heldout/rehearse_digit_acc/{tool}"] == 1.0, tool
    n_rehearse = probe.rehearse_digits.sum()
    assert got["heldout/rehearse_digit_acc"] == pytest.approx(1 - refund.sum() / n_rehearse)
    assert got["heldout/act_digit_acc"] == 1.0


def test_tool_names_must_match_the_responses(tok, tasks, examples):
    names = response_tools(tasks)
    names[3] = names[3][:-1]
    with pytest.raises(ValueError, match=r"example 3 has \d+ REHEARSE segments"):
        build_copy_probe(examples, tok, tok.pad_token_id, 1024, names)
    with pytest.raises(ValueError, match="response_tools lists"):
        build_copy_probe(examples, tok, tok.pad_token_id, 1024, names[:2])
