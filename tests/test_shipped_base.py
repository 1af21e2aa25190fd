"""The shipped demo base policy: it loads by name, is the trained policy (it copies ids and
amounts on held-out tasks where a fresh initialisation cannot), and the script that stores
it writes a loadable bfloat16 checkpoint."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from envace_jax.configuration import base_config
from envace_jax.envs.demo import demonstrations, generate_tasks
from envace_jax.models.config import get_preset
from envace_jax.models.decoder import Decoder
from envace_jax.models.hf_io import load_hf_model, save_hf_model
from envace_jax.models.shipped import DEMO_BASE_DIR
from envace_jax.rollout.grounded import simulator_demonstrations
from envace_jax.runtime.build import build_model
from envace_jax.text import load_tokenizer
from envace_jax.text.codes import Role
from envace_jax.train.diagnostics import build_copy_probe, copy_metrics
from envace_jax.train.warm_start_data import rows_batch
from tests.conftest import REPO


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def _config(hf_path: str):
    config = base_config()
    config.model.hf_path = hf_path
    return config


@pytest.mark.slow  # teacher-forced demonstrations of held-out tasks through the demo base
def test_demo_base_copies_on_held_out_tasks(tok):
    base = build_model(_config("demo-base"), tok)
    assert base.cfg.vocab_size == len(tok)
    fresh = build_model(_config(""), tok)  # the same architecture, randomly initialised
    assert base.cfg.replace(param_dtype="float32") == fresh.cfg.replace(param_dtype="float32")
    examples = demonstrations(generate_tasks(7, 32, split="test"), tok)
    probe = build_copy_probe(examples, tok, tok.pad_token_id, length=768)
    trained, untrained = copy_metrics(base, probe), copy_metrics(fresh, probe)
    # A digit of an id or amount in a call can only be right by copying it from the context.
    assert trained["heldout/act_digit_acc"] > 0.5, trained
    assert untrained["heldout/act_digit_acc"] < 0.2, untrained
    assert trained["heldout/act_token_acc"] > 0.9, trained


def _simulator_exact(model, tok, tasks) -> float:
    """Share of simulator rows (oracle demonstrations of `tasks`) whose whole answer is the
    model's most likely continuation, teacher-forced."""
    rows = simulator_demonstrations(tok, tasks, demonstrations(tasks, tok))
    batch = rows_batch(rows, np.arange(len(rows)), tok.pad_token_id)
    T = batch.tokens.shape[1]
    logits, _ = model(batch.tokens, jnp.broadcast_to(jnp.arange(T), batch.tokens.shape))
    right = np.asarray(jnp.argmax(logits[:, :-1], -1)) == np.asarray(batch.tokens[:, 1:])
    answer = np.asarray(batch.roles[:, 1:]) == Role.REHEARSE
    return float((right | ~answer).all(1).mean())


@pytest.mark.slow  # simulator rows of held-out tasks through both shipped bases
def test_simulator_base_copies_logged_responses_on_held_out_tasks(tok):
    """`demo-base-simulator` answers a call whose response the prompt's logged block holds by
    copying it, where the base it was trained from writes values from its priors."""
    tasks = generate_tasks(7, 24, split="test")
    copied = _simulator_exact(build_model(_config("demo-base-simulator"), tok), tok, tasks)
    base = _simulator_exact(build_model(_config("demo-base"), tok), tok, tasks)
    assert copied > 0.5 and base < 0.1, (copied, base)


def test_unknown_checkpoint_name_is_a_clear_error(tok):
    with pytest.raises(FileNotFoundError, match="config.model.hf_path.*demo-bse"):
        build_model(_config("demo-bse"), tok)


def test_ship_script_writes_bfloat16_checkpoint(tok, tmp_path):
    cfg = get_preset("tiny-qwen3", vocab_size=len(tok))
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    save_hf_model(model, cfg, tmp_path / "export")
    out = tmp_path / "shipped"
    run = subprocess.run(
        [sys.executable, "scripts/ship_demo_base.py", str(tmp_path / "export"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    tensors = load_file(out / "model.safetensors")
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    loaded, loaded_cfg = load_hf_model(out)
    assert loaded_cfg.vocab_size == cfg.vocab_size
    want = np.asarray(model.embed.embedding[...].astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(loaded.embed.embedding[...], np.float32), want)


def test_ship_script_rejects_a_directory_without_a_checkpoint(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/ship_demo_base.py", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "no config.json" in run.stderr and str(tmp_path) in run.stderr


def test_shipped_files_are_small():
    size = sum(os.path.getsize(os.path.join(DEMO_BASE_DIR, f)) for f in os.listdir(DEMO_BASE_DIR))
    assert size < 3 * 2**20


def test_base_variant_trains_from_random_init():
    from configs.demo import get_config
    from envace_jax.configuration import validate

    config = get_config("base")
    validate(config)
    assert config.model.hf_path == "" and config.schedule.rl_steps == 0
    assert config.schedule.sft_steps > get_config().schedule.sft_steps
