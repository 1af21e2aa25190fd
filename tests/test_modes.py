"""Training modes: the two-policy sampler, and every mode through the trainer on the smoke config.

References are independent of the code under test: log-probs from a cache-less forward of each
decoder, role tags of the chat template's encoding of a demonstration, the executed demo
environment, NumPy token counts of the training batch.
"""

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from envace_jax import configuration, modes
from envace_jax.configuration import base_config, load, validate
from envace_jax.envs.base import result_text
from envace_jax.envs.demo import DemoEnv, demonstrations, generate_tasks
from envace_jax.models.config import ModelConfig
from envace_jax.models.decoder import Decoder, init_cache
from envace_jax.rl.steps import token_logprobs
from envace_jax.rollout.role_models import RoleDecoders, role_state
from envace_jax.sampling import loop
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.loop import TurnSpec
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.role_pieces import prompt_ids
from envace_jax.text.tokenizer import load_tokenizer
from envace_jax.train.strategies import RealEnvPolicy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import demo as demo_config  # noqa: E402

ACT, REHEARSE = 1, 2


def _peaked_decoder(cfg: ModelConfig, seed: int, scale: float = 8.0) -> Decoder:
    """A random decoder with large weights, so two of them give clearly different logits."""
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))
    state = jax.tree.map(lambda x: x * scale if x.ndim > 1 else x, state)
    return nnx.merge(graphdef, state)


def _reference_logprobs(decoder: Decoder, tokens: np.ndarray, temperature=1.0) -> np.ndarray:
    graphdef, params, rest = nnx.split(decoder, nnx.Param, ...)
    logp, _ = token_logprobs(graphdef, params, rest, jnp.asarray(tokens), temperature)
    return np.asarray(logp)


def test_the_mode_table_is_what_the_configuration_accepts():
    """Every row names a strategy class that exists, every (mode, view) row validates, and a
    mode or a view outside the table is refused naming its key."""
    for name in modes.names():
        for row in [m for m in modes._TABLE if m.name == name]:
            assert isinstance(row.strategy_class(), type)
            config = base_config()
            config.mode, config.rollout.rehearsal_view = name, row.view or "shared"
            assert configuration.load(config).mode == name
    config = base_config()
    config.mode = "nope"
    with pytest.raises(configuration.ConfigError, match=r"config\.mode = 'nope'.*'envace'"):
        validate(config)
    config.mode, config.rollout.rehearsal_view = "envace_noshare", "grounded"
    with pytest.raises(configuration.ConfigError, match="rehearsal_view = 'grounded'.*shared"):
        validate(config)


class CountedRealEnv(RealEnvPolicy):
    """A mode of the test's own: GRPO in the real environment that counts its RL batches."""

    batches: list[int] = []

    def rollouts(self, params, tasks, key, sampling):
        CountedRealEnv.batches.append(len(tasks))
        return super().rollouts(params, tasks, key, sampling)


def test_a_new_mode_is_one_row_and_one_class(tmp_path):
    """A row added to the table (for this block only) is a mode the config accepts and the train
    job runs: its class makes every RL batch, and the report names it."""
    from envace_jax.train.trainer import Trainer

    row = modes.Mode(
        "counted_real_env",
        None,
        "environment",
        "the environment",
        ("act",),
        False,
        "tests.test_modes:CountedRealEnv",
    )
    CountedRealEnv.batches.clear()
    with modes.added(row):
        config = smoke("counted_real_env", **{"schedule.eval_warm_start": False})
        out = Trainer(load(config), str(tmp_path)).run()
    assert CountedRealEnv.batches == [config.rollout.tasks_per_step] * config.schedule.rl_steps
    assert out["final"]["success"] is not None
    assert "| RL (counted_real_env)" in (tmp_path / "summary.md").read_text()
    with pytest.raises(configuration.ConfigError, match="counted_real_env"):
        smoke("counted_real_env")  # outside the block, the row is gone


@pytest.mark.slow  # two decoders compiled into one sampler
def test_role_decoders_sample_each_role_from_its_own_parameters():
    """In the compiled rehearsal loop, every ACT token is sampled from the ACT decoder and every
    REHEARSE token from the REHEARSE decoder: the loop's log-probs equal a cache-less forward of
    the decoder its role tag names, and not the other one's."""
    # A 12-token vocabulary with its own chat ids, so random decoders call tools, rehearse,
    # reply and get replayed user turns (which contain the end id) within a few tokens.
    cfg = ModelConfig(
        vocab_size=12,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=300.0,
    )
    act, rehearse = _peaked_decoder(cfg, 1), _peaked_decoder(cfg, 2)
    spec = TurnSpec(
        end_id=2,
        tool_call_id=3,
        act_to_rehearse=(6, 1, 4, 6, 7, 6),
        rehearse_to_act=(6, 1, 5, 6),
        mode="rehearse",
        max_turns=6,
        max_message_tokens=6,
    )
    sampler = Sampler(RoleDecoders(act, rehearse, spec), spec, pad_id=0)
    rows = 24
    user_turn = [6, 1, 4, 6, 9, 10, 2, 6, 1, 5, 6]  # glue, text, <end>, glue to the next ACT
    out = sampler.generate(
        [[1, 4, 6, 8, 9, 2, 6, 1, 5, 6]] * rows,
        key=jax.random.key(3),
        sampling=SamplingParams(temperature=2.0),
        max_new_tokens=60,
        user_turns=[[user_turn, user_turn]] * rows,
    )
    roles = out.roles
    assert (roles == REHEARSE).sum() >= 15 and (roles == ACT).sum() >= 100
    switches = ((roles[:, 1:] == ACT) & (roles[:, :-1] != ACT)).sum(1)
    assert switches.max() >= 3  # rows come back to ACT after rehearsing and after user turns
    # The loop's log-probs are those of the temperature-scaled distribution.
    by_act = _reference_logprobs(act, out.tokens, 2.0)
    by_rehearse = _reference_logprobs(rehearse, out.tokens, 2.0)
    for role, ref, other in ((ACT, by_act, by_rehearse), (REHEARSE, by_rehearse, by_act)):
        m = roles == role
        np.testing.assert_allclose(out.logprobs[m], ref[m], atol=2e-4, err_msg=f"role {role}")
        assert np.abs(out.logprobs[m] - other[m]).max() > 0.5  # the decoders differ


@pytest.mark.slow  # two decoders compiled into one sampler
def test_role_decoders_follow_the_demo_chat_layout():
    """Fed a demonstration the way the loop feeds tokens (prefill, then one token at a time,
    re-feeding the prompt's last), the wrapper gives each next token the logits of the decoder
    of that token's role in the chat template's encoding."""
    tok = load_tokenizer("demo")
    cfg = ModelConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
    )
    act, rehearse = _peaked_decoder(cfg, 4), _peaked_decoder(cfg, 5)
    spec = turn_spec(tok, mode="rehearse")
    model = RoleDecoders(act, rehearse, spec)
    task = next(t for t in generate_tasks(0, 20, "train") if len(t.reference_messages) > 6)
    conv = demonstrations([task], tok)[0]
    ids, roles = conv.ids, conv.roles
    P = len(prompt_ids(tok, task.messages, task.template_tools))
    assert (roles[:P] == 0).all() and roles[P] == ACT and (roles == REHEARSE).sum() > 0
    T = len(ids)
    graphdef, state = nnx.split(model)

    @jax.jit
    def feed(state, token, pos, cache):
        logits, cache = nnx.merge(graphdef, state)(token[None, None], pos[None, None], cache=cache)
        return logits[0, 0], cache

    cache = init_cache(model.cfg, 1, T + 1)
    cache = loop.prefill(
        nnx.merge(graphdef, state), jnp.asarray(ids[None, :P]), jnp.arange(P)[None], cache
    )
    got = []
    for t in range(P - 1, T - 1):
        logits, cache = feed(state, jnp.int32(ids[t]), jnp.int32(t), cache)
        got.append(np.asarray(jax.nn.log_softmax(logits))[ids[t + 1]])
    got = np.asarray(got)  # log-prob of ids[P..T-1]
    by_act = _reference_logprobs(act, ids[None])[0, P:]
    by_rehearse = _reference_logprobs(rehearse, ids[None])[0, P:]
    target = roles[P:]
    for role, ref in ((ACT, by_act), (REHEARSE, by_rehearse)):
        m = target == role
        np.testing.assert_allclose(got[m], ref[m], atol=2e-4, err_msg=f"role {role}")


def test_role_state_is_what_the_sampler_splits():
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_heads=2)
    spec = TurnSpec(end_id=2, tool_call_id=3, act_to_rehearse=(1,), rehearse_to_act=(1,))
    a, r = Decoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, rngs=nnx.Rngs(1))
    split = nnx.split(RoleDecoders(a, r, spec))[1]
    built = role_state(nnx.state(a, nnx.Param), nnx.state(r, nnx.Param))
    assert jax.tree.structure(split) == jax.tree.structure(built)
    with pytest.raises(ValueError, match="share a ModelConfig"):
        RoleDecoders(a, Decoder(cfg.replace(hidden_size=32), rngs=nnx.Rngs(0)), spec)


# ------------------------------------------------------------------- modes in the trainer


def smoke(mode: str, warm_start_dir: str = "", **overrides):
    config = demo_config.get_config("smoke")
    config.mode = mode
    config.schedule.warm_start_dir = warm_start_dir
    for path, value in overrides.items():
        section, key = path.split(".")
        config[section][key] = value
    return validate(config)


def _max_change(a, b) -> float:
    """Largest absolute difference between two parameter trees of the same structure."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(la, lb, strict=True)
    )


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """One warm start ('sft_only': the warm start, no RL) shared by every mode below."""
    from envace_jax.train.trainer import Trainer

    workdir = tmp_path_factory.mktemp("warm")
    trainer = Trainer(load(smoke("sft_only")), str(workdir))
    out = trainer.run()
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["phase"] == "rl"]  # no RL steps
    assert out["final"] == out["sft"]  # one evaluation: the final policy is the warm start
    return str(workdir)


def _warm_params(trainer):
    """The warm start's params, restored the way the trainer loads them."""
    _, state, _ = trainer.load_warm_start(trainer.config.schedule.warm_start_dir)
    return state.params


class _Recorder:
    """Wraps trainer.rollouts and trainer.grpo_step to keep the first batch and metrics."""

    def __init__(self, trainer):
        self.batches, self.metrics = [], []
        rollouts, step = trainer.rollouts, trainer.grpo_step

        def record_rollouts(*args, **kw):
            rb = rollouts(*args, **kw)
            self.batches.append(rb)
            return rb

        def record_step(state, batch):
            state, m = step(state, batch)
            self.metrics.append({k: float(v) for k, v in m.items()})
            return state, m

        trainer.rollouts, trainer.grpo_step = record_rollouts, record_step


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", ["envace", "envace_noshare", "external_simulator", "grpo_real_env"]
)
def test_each_mode_trains_from_the_shared_warm_start(warm_start, tmp_path, mode):
    from envace_jax.train.strategies import RoleParams
    from envace_jax.train.trainer import Hooks, Trainer

    captured = {}
    hooks = Hooks(on_finish=lambda state: captured.setdefault("state", state))
    trainer = Trainer(load(smoke(mode, warm_start)), str(tmp_path), hooks)
    warm = _warm_params(trainer)
    rec = _Recorder(trainer)
    out = trainer.run()
    state = captured["state"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["phase"] == "rl"]) == 2 == len(rec.metrics)
    with open(os.path.join(warm_start, "metrics.jsonl")) as f:
        warm_rows = [json.loads(x) for x in f]
    warm_eval = next(r for r in warm_rows if r["phase"] == "eval")
    assert out["sft"] == {k: warm_eval[k] for k in out["sft"]}  # taken over, not re-run

    rb = rec.batches[0]
    b = rb.batch
    real = b.lengths > 0
    n_act = int((np.asarray(b.roles) == ACT).sum())
    n_reh = int((np.asarray(b.roles) == REHEARSE).sum())
    m = rec.metrics[0]
    assert n_act > 0
    if mode == "envace":
        assert m["trained_tokens"] == n_act + n_reh
        assert _max_change(state.params, warm) > 0
    elif mode == "envace_noshare":
        assert isinstance(state.params, RoleParams)
        assert m["trained_tokens"] == n_act
        assert m["rehearse_params/trained_tokens"] == n_reh
        assert _max_change(state.params.act, warm) > 0
        assert _max_change(state.params.rehearse, warm) > 0 or n_reh == 0
        assert os.path.isdir(tmp_path / "export_rehearse")
    elif mode == "external_simulator":
        assert isinstance(state.params, RoleParams)
        assert m["trained_tokens"] == n_act  # REHEARSE tokens are masked out of the loss
        assert _max_change(state.params.act, warm) > 0
        assert _max_change(state.params.rehearse, warm) == 0.0  # never trained
    else:  # grpo_real_env: observations come from the executed environment, as CONTEXT
        assert n_reh == 0 and m["trained_tokens"] == n_act
        assert _max_change(state.params, warm) > 0
        for ep, task in zip(rb.episodes, rb.tasks, strict=True):
            env = DemoEnv()
            env.reset(task)
            tool_msgs = [x["content"] for x in ep.messages if x["role"] == "tool"]
            executed = [
                result_text(r)
                for name, args in ep.calls
                for r in env.step([{"name": name, "arguments": args}])
            ]
            assert tool_msgs[: len(executed)] == executed[: len(tool_msgs)]
    assert real.sum() == 4  # smoke: 2 tasks x 2 rollouts

    # The last checkpoint restores into the mode's state layout with the same parameters.
    from envace_jax.runtime import checkpoint as ckpt_lib

    ckpt = ckpt_lib.Checkpointer(os.path.join(tmp_path, "checkpoints"))
    step, restored, meta = ckpt.restore(lambda s, meta: trainer.abstract_state("rl"))
    ckpt.close()
    assert meta["phase"] == "done" and meta["warm_start_dir"] == warm_start
    assert _max_change(restored.params, state.params) == 0.0


@pytest.mark.slow  # needs the warm start job of the fixture (a minute of CPU)
def test_a_train_jobs_workdir_gives_the_warm_start_it_kept(warm_start, tmp_path):
    """A train job ends on RL, and its checkpoint at step sft_steps opens the RL phase rather
    than ending a warm start; the warm start it keeps in warm_start/ is what a longer RL run
    from that workdir starts from."""
    from envace_jax.train.trainer import Trainer

    first = str(tmp_path / "first")
    Trainer(load(smoke("envace", warm_start)), first).run()
    longer = Trainer(load(smoke("envace", first, **{"schedule.rl_steps": 6})), str(tmp_path / "b"))
    step, state, meta = longer.load_warm_start(first)
    _, shared, shared_meta = longer.load_warm_start(warm_start)
    assert step == 4 and meta["warm_start_dir"] == first
    assert _max_change(state.params, shared.params) == 0.0
    assert meta["warm_start_eval"] == shared_meta["warm_start_eval"]


@pytest.mark.slow  # needs the warm start job of the fixture (a minute of CPU)
def test_an_unreadable_kept_warm_start_falls_back_to_the_checkpoint(warm_start, tmp_path, capsys):
    """The copy kept in warm_start/ comes first; when it is corrupt, the checkpoint at step
    sft_steps is used, with a warning; when that is unreadable too, the error names it."""
    from envace_jax.train.trainer import Trainer

    copy = tmp_path / "warm"
    shutil.copytree(warm_start, copy)
    (copy / "checkpoints" / "warm_start" / "4" / "meta" / "metadata").write_text("{not json")
    trainer = Trainer(load(smoke("envace", str(copy))), str(tmp_path / "run"))
    step, state, _ = trainer.load_warm_start(str(copy))
    _, shared, _ = trainer.load_warm_start(warm_start)
    assert step == 4 and _max_change(state.params, shared.params) == 0.0
    assert "warning:" in capsys.readouterr().out
    (copy / "checkpoints" / "4" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(ValueError, match=r"checkpoint there is unreadable: checkpoint step 4 in"):
        trainer.load_warm_start(str(copy))


@pytest.mark.slow  # needs the warm start job of the fixture (a minute of CPU)
def test_warm_start_from_another_config_is_refused(warm_start, tmp_path):
    from envace_jax.train.trainer import Trainer

    config = smoke("envace", warm_start, **{"sft_optim.learning_rate": 0.5})
    with pytest.raises(ValueError, match=r"warm_start_dir.*other sft_optim"):
        Trainer(load(config), str(tmp_path)).run()
    config = smoke("envace", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="nowhere'?: no such directory"):
        Trainer(load(config), str(tmp_path / "b")).run()
    (tmp_path / "empty").mkdir()
    config = smoke("envace", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no checkpoint at the end of a 4-step warm start"):
        Trainer(load(config), str(tmp_path / "c")).run()


@pytest.mark.slow  # two short jobs from the shipped base
def test_a_corrupted_world_with_corruption_off_is_grpo_in_the_real_environment(tmp_path):
    """The sensitivity control's arm with `corruption_rate` 0 samples, judges and trains exactly
    what real-environment GRPO does (bit for bit), but counts its calls as simulator calls: RL
    makes no environment call."""
    from envace_jax.train.trainer import Hooks, Trainer

    finals = {}
    # The shipped base makes tool calls (a tiny random policy may make none); each run makes the
    # same 4-step warm start from it.
    calls = {
        "model.preset": base_config().model.preset,
        "model.hf_path": "demo-base",
        "rollout.max_new_tokens": 256,
        "rollout.max_message_tokens": base_config().rollout.max_message_tokens,
        "rehearsal.sft_memory_fraction": 0.0,  # plain demonstrations keep the base's calls
    }
    for mode in ("grpo_real_env", "corrupted_world"):
        hooks = Hooks(on_finish=lambda state, mode=mode: finals.setdefault(mode, state))
        overrides = {"rollout.corruption_rate": 0.0} if mode == "corrupted_world" else {}
        Trainer(load(smoke(mode, **calls, **overrides)), str(tmp_path / mode), hooks).run()
    assert _max_change(finals["corrupted_world"].params, finals["grpo_real_env"].params) == 0.0
    rows = {
        mode: [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        for mode in finals
    }
    real = [r for r in rows["grpo_real_env"] if r["phase"] == "rl"]
    sim = [r for r in rows["corrupted_world"] if r["phase"] == "rl"]
    for r, s in zip(real, sim, strict=True):
        assert s["env_calls"] == 0 and s["rollout_sim_calls"] == r["env_calls"] > 0
        assert s["loss"] == r["loss"] and s["rollout_reward"] == r["rollout_reward"]
        assert s["rollout_sim_tool_error_rate"] == r["rollout_real_tool_error_rate"]
