"""Host-turn rollouts (what `grpo_real_env` and evaluation run) in the third-party worlds: a
scripted policy that writes the reference conversation, token for token, decodes through the
sampler's host mode; the package's world answers every call, the loop replays BFCL's later user
turns, and the package's checker judges the episode. A policy that leaves the last user turn's
calls out is the control: it must fail. Slow: the packages' venvs."""

import jax
import numpy as np
import pytest

from envace_jax.envs.registry import domain
from envace_jax.envs.tau2_package import find_tau2, tau2_venv
from envace_jax.rollout.real_env import real_env_rollouts
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.codes import Status
from envace_jax.text.role_pieces import prompt_ids
from envace_jax.text.tokenizer import load_tokenizer
from envace_jax.text.trajectory import encode_conversation
from tests.test_rehearsal_loop import ScriptedModel

pytestmark = pytest.mark.slow


def short_of_the_last_turn(task):
    """The reference conversation, with the last user turn answered by a reply and no call."""
    messages = list(task.reference_messages)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: last_user + 1] + [{"role": "assistant", "content": "Done."}]


def scripted_rollouts(tok, dom, tasks, conversations):
    """Real-world episodes of a policy that writes `conversations[b]` for task b."""
    refs = [
        encode_conversation(tok, c, t.template_tools, rehearse=False)
        for c, t in zip(conversations, tasks, strict=True)
    ]
    script = np.zeros((len(refs), max(len(r.ids) for r in refs) + 8), np.int32)
    for b, ref in enumerate(refs):
        script[b, : len(ref.ids)] = ref.ids
    spec = turn_spec(tok, mode="host", max_turns=40, max_message_tokens=400)
    model = ScriptedModel(script, len(tok))
    sampler = Sampler(model, spec, pad_id=tok.pad_token_id, compact_rows=False)
    longest = max(
        len(r.ids) - len(prompt_ids(tok, t.messages, t.template_tools))
        for r, t in zip(refs, tasks, strict=True)
    )
    results, out = real_env_rollouts(
        sampler,
        tok,
        tasks,
        dom.make_env,
        key=jax.random.key(0),
        sampling=SamplingParams(temperature=1.0),
        max_new_tokens=longest + 8,
    )
    return results, out, refs


def check_world(dom, tasks):
    tok = load_tokenizer("demo")
    gold = [list(t.reference_messages) for t in tasks]
    results, out, refs = scripted_rollouts(tok, dom, tasks, gold)
    for b, (task, result) in enumerate(zip(tasks, results, strict=True)):
        assert out.status[b] == Status.FINISHED, task.task_id
        # The row is the reference rendering: the world's answers are the logged ones.
        n = int(out.lengths[b])
        assert out.tokens[b, :n].tolist() == refs[b].ids[:n].tolist(), task.task_id
        calls = [c["function"] for m in task.reference_messages for c in m.get("tool_calls") or []]
        assert [{"name": n, "arguments": a} for n, a in result.episode.calls] == calls
        assert result.env_state["n_calls"] == len(calls)
        assert result.success, task.task_id
    control, _, _ = scripted_rollouts(tok, dom, tasks, [short_of_the_last_turn(t) for t in tasks])
    assert not any(r.success for r in control)


def test_bfcl_multi_turn_episodes_with_replayed_user_turns():
    dom = domain("bfcl_multi_turn")
    tok = load_tokenizer("demo")
    several_turns = [t for t in dom.generate_tasks(0, 200, "validation") if t.num_turns >= 3]
    tasks = sorted(several_turns, key=lambda t: len(prompt_ids(tok, t.messages, t.template_tools)))
    check_world(dom, tasks[:3])


@pytest.mark.skipif(find_tau2(tau2_venv()) is None, reason="make tau2")
def test_tau2_mock_episodes():
    dom = domain("tau2_mock")
    tasks = [t for s in ("train", "validation", "test") for t in dom.generate_tasks(0, 10, s)]
    check_world(dom, tasks)
