"""The memory planner: its estimates against measured allocations of small configs on CPU, the
production configs' verdicts, and the command line (which must not touch a device)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from envace_jax import parallel
from envace_jax.configuration import validate
from envace_jax.models.config import get_preset
from envace_jax.planner import estimate
from envace_jax.planner.topology import GIB, parse_topology
from tests.conftest import REPO, fake_devices_env

sys.path.insert(0, os.path.join(REPO, "configs"))
import demo as demo_config  # noqa: E402
import qwen3_1p7b  # noqa: E402
import qwen3_4b  # noqa: E402
import qwen3_8b  # noqa: E402

# Three small configs: (name, mesh, overrides). Measured on 4 fake CPU devices (the first one
# alone for the single-device config).
SMALL = [
    (
        "single device, full remat, float32",
        {"data": 1, "fsdp": 1, "tensor": 1},
        {"model.preset": "tiny-qwen3", "model.remat": "full", "rollout.length_buckets": (512,)},
    ),
    (
        "fsdp x tensor, full remat, bfloat16 compute, 2 micro-batches",
        {"data": 1, "fsdp": 2, "tensor": 2},
        {
            "model.preset": "tiny-qwen3",
            "model.remat": "full",
            "model.dtype": "bfloat16",
            "rollout.length_buckets": (256,),
            "rollout.group_size": 4,
            "grpo.micro_batches": 2,
        },
    ),
    (
        "data x fsdp, dots remat, tied embeddings",
        {"data": 2, "fsdp": 2, "tensor": 1},
        {"model.preset": "demo-qwen3", "model.remat": "dots", "rollout.length_buckets": (256,)},
    ),
]
PROMPT, NEW_TOKENS = 40, 60  # sampler call measured: 2 x 2 rows of 40-token prompts


def small_config(mesh, overrides):
    c = demo_config.get_config("smoke")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh["data"], mesh["fsdp"], mesh["tensor"]
    c.rollout.max_new_tokens = NEW_TOKENS
    for path, value in overrides.items():
        section, key = path.split(".")
        c[section][key] = value
    return validate(c)


MEASURE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from envace_jax import parallel
from envace_jax.runtime.build import build_model, build_tokenizer
from envace_jax.configuration import step_configs
from envace_jax.rl.batch import TrajectoryBatch
from envace_jax.rl.optim import make_optimizer
from envace_jax.rl.steps import init_train_state, make_grpo_step, make_shardings
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler
from test_plan import NEW_TOKENS, PROMPT, SMALL, small_config

def on_device0(tree):
    dev = jax.devices()[0]
    return sum(
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
        if s.device == dev
    )

out = []
for name, mesh_shape, overrides in SMALL:
    config = small_config(mesh_shape, overrides)
    n = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["tensor"]
    mesh = parallel.make_mesh(mesh_shape, jax.devices()[:n])
    tok = build_tokenizer(config)
    model = build_model(config, tok, mesh)
    params = nnx.state(model, nnx.Param)
    steps = step_configs(config)
    tx = make_optimizer(steps["optim"])
    r = config.rollout
    B, T = r.group_size * r.tasks_per_step, max(r.length_buckets)
    sh = make_shardings(mesh, params, tx, (B, T))
    state = init_train_state(params, tx, sh)
    step = make_grpo_step(model, tx, steps["grpo"], shardings=sh)
    sd = jax.ShapeDtypeStruct
    dtypes = dict(tokens=jnp.int32, roles=jnp.int8, segments=jnp.int32, logprobs=jnp.float32,
                  lengths=jnp.int32, group=jnp.int32, reward=jnp.float32, status=jnp.int8)
    batch = TrajectoryBatch(**{
        k: sd((B, T) if k in ("tokens", "roles", "segments", "logprobs") else (B,), d,
              sharding=getattr(sh.batch, k))
        for k, d in dtypes.items()
    })
    abstract = jax.tree.map(lambda x: sd(x.shape, x.dtype, sharding=x.sharding), state)
    temp = step.lower(abstract, batch).compile().memory_analysis().temp_size_in_bytes
    resident = on_device0((params, state.params, state.opt_state))
    sampler = Sampler(model, turn_spec(tok, mode="rehearse"), pad_id=tok.pad_token_id)
    sampler = sampler.with_params(state.params)
    layout = parallel.row_layout(mesh, B)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(5, 500, PROMPT)) for _ in layout.rows]
    s = sampler.start(prompts, key=jax.random.key(0), sampling=SamplingParams(greedy=True),
                      max_new_tokens=NEW_TOKENS, layout=layout)
    out.append(dict(name=name, temp=temp, state=resident, kv=on_device0(s.cache)))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured():
    env = fake_devices_env(4)
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), os.path.join(REPO, "tests")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return {m["name"]: m for m in json.loads(line[len("RESULT ") :])}


@pytest.mark.slow  # about a minute: three train steps and samplers compiled on 4 CPU devices
@pytest.mark.parametrize("name,mesh,overrides", SMALL, ids=[s[0] for s in SMALL])
def test_estimates_within_15_percent_of_measured(measured, name, mesh, overrides):
    config = small_config(mesh, overrides)
    cfg = estimate.model_config(config)
    phases = {
        p.name: p
        for p in estimate.plan_phases(
            config, cfg, estimate.abstract_mesh(mesh), prompt_tokens=PROMPT
        )
    }
    rl, rollouts = phases["RL step"], phases["rollouts"]
    got = measured[name]
    kv = next(line.bytes for line in rollouts.lines if line.name == "KV cache")
    pairs = {
        "parameters + optimizer state (live arrays)": (rl.of_kind("state"), got["state"]),
        "train step temporaries (XLA memory analysis)": (rl.of_kind("temp"), got["temp"]),
        "sampler KV cache (live arrays)": (kv, got["kv"]),
    }
    for what, (planned, actual) in pairs.items():
        print(f"{name}: {what}: planned {planned / 2**20:.2f} MiB, measured {actual / 2**20:.2f}")
        assert abs(planned - actual) <= 0.15 * actual, (what, planned, actual)


def test_parameter_bytes_match_a_hand_count():
    # Qwen3-8B on v5p-32 (fsdp 2 x tensor 8): every matrix splits 16 ways; norms replicate.
    cfg = get_preset("qwen3-8b")
    mesh = estimate.abstract_mesh({"data": 1, "fsdp": 2, "tensor": 8})
    L, E, D = 36, 4096, 128
    norms = L * (2 * E + 2 * D) + E
    expected = ((cfg.num_params - norms) / 16 + norms) * 4
    assert estimate.param_count_per_device(cfg, mesh) * 4 == expected


def test_topologies():
    t = parse_topology("v5p-32")
    assert (t.chips, t.hosts, t.hbm_bytes, t.name) == (16, 4, 95 * GIB, "v5p-32")
    t = parse_topology("v5e-8")
    assert (t.chips, t.hosts, t.hbm_bytes, t.name) == (8, 1, 16 * GIB, "v5litepod-8")
    t = parse_topology("v6e-16")
    assert (t.chips, t.hosts, t.hbm_bytes) == (16, 4, 32 * GIB)
    with pytest.raises(ValueError, match="v5e slices come in sizes"):
        parse_topology("v5e-12")
    with pytest.raises(ValueError, match="expected <generation>-<size>"):
        parse_topology("h100-8")


@pytest.mark.parametrize("module", [qwen3_1p7b, qwen3_4b, qwen3_8b])
def test_every_listed_slice_layout_fits(module):
    for slice_name, context in module.CONTEXTS.items():
        config = validate(module.get_config(slice_name))
        assert max(config.rollout.length_buckets) == context
        topology = parse_topology(slice_name)
        sizes = parallel.mesh_sizes(config.mesh, topology.devices)
        phases = estimate.plan_phases(
            config, estimate.model_config(config), estimate.abstract_mesh(sizes)
        )
        peak = max(p.total for p in phases)
        assert peak <= 0.9 * topology.hbm_bytes, (module.__name__, slice_name, peak / GIB)


def test_reference_hyperparameters():
    c = validate(qwen3_8b.get_config())
    assert (c.rollout.group_size, c.rollout.tasks_per_step) == (4, 16)
    assert (c.optim.learning_rate, c.optim.weight_decay) == (1e-6, 0.01)
    assert (c.grpo.clip_low, c.grpo.clip_high, c.grpo.dual_clip, c.grpo.use_kl) == (
        0.2,
        0.2,
        3.0,
        False,
    )
    assert c.rollout.max_message_tokens == 8000 and max(c.rollout.length_buckets) == 20480
    assert (c.model.dtype, c.model.param_dtype, c.model.remat) == ("bfloat16", "float32", "full")
    with pytest.raises(ValueError, match="unknown variant 'v4-8'"):
        qwen3_8b.get_config("v4-8")


def _plan(*args):
    env = dict(os.environ, JAX_PLATFORMS="tpu")  # any device access would fail: there is none
    return subprocess.run(
        [sys.executable, "-m", "envace_jax.planner", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_verdicts_without_touching_a_device():
    r = _plan("--config", "configs/qwen3_8b.py", "--topology", "v5p-32")
    assert r.returncode == 0, r.stderr[-3000:]
    for part in ("parameters", "optimizer state", "activations: saved", "KV cache"):
        assert part in r.stdout
    assert "verdict: FITS" in r.stdout and "mesh: data=1 x fsdp=2 x tensor=8" in r.stdout

    r = _plan("--config", "configs/qwen3_1p7b.py", "--topology", "v5e-16")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "verdict: DOES NOT FIT" in r.stdout and "Largest component" in r.stdout
    assert "RL step" in r.stdout and "KV cache" in r.stdout

    r = _plan("--config", "configs/qwen3_1p7b.py:v5e-16", "--topology", "v5e-16")
    assert r.returncode == 0 and "verdict: FITS" in r.stdout, r.stdout[-2000:]


def test_cli_refuses_bad_input_with_a_clear_message():
    r = _plan("--config", "configs/qwen3_8b.py:v5p-32", "--topology", "v5p-64")
    assert r.returncode == 2 and "config.mesh" in r.stderr and "32 devices" in r.stderr
    r = _plan("--config", "configs/qwen3_8b.py", "--topology", "v9x-8")
    assert r.returncode == 2 and "topology 'v9x-8'" in r.stderr
    r = _plan("--config", "configs/qwen3_8b.py", "--topology", "v5p-32", "--config.seed=-1")
    assert r.returncode == 2 and "config.seed" in r.stderr
