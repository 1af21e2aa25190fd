"""Sharding: logical-axis rules, meshes, and the sharded forward on 8 fake CPU devices.

The 8-device checks run in a subprocess with XLA_FLAGS set before jax starts, so the rest
of the suite keeps its single CPU device. The reference is the unsharded forward of the same
randomised model on one device, computed in that subprocess before any mesh exists.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from envace_jax import parallel
from envace_jax.parallel import MESH_AXES, logical_to_spec
from tests.conftest import REPO, fake_devices_env

MESH_222 = AbstractMesh((2, 2, 2), MESH_AXES)


# ------------------------------------------------------------ rules (no devices)


def test_rules_map_parameters_to_fsdp_and_tensor():
    spec = logical_to_spec(("layers", "embed", "heads", "head_dim"), MESH_222, shape=(2, 64, 4, 8))
    assert spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert logical_to_spec(("vocab", "embed"), MESH_222, shape=(512, 64)) == PartitionSpec(
        "tensor", "fsdp"
    )
    assert logical_to_spec(("layers", "mlp", "embed"), MESH_222) == PartitionSpec(
        None, "tensor", "fsdp"
    )


def test_indivisible_dimension_falls_back_to_replication():
    # 3 KV heads cannot split over tensor=2; the embed dim still shards over fsdp.
    spec = logical_to_spec(
        ("layers", "embed", "kv_heads", "head_dim"), MESH_222, shape=(2, 64, 3, 8)
    )
    assert spec == PartitionSpec(None, "fsdp", None, None)
    # A batch of 2 cannot take data x fsdp (4): the next 'batch' rule (data alone) applies.
    spec = logical_to_spec(("batch", "length"), MESH_222, shape=(2, 16))
    assert spec == PartitionSpec("data", None)
    spec = logical_to_spec(("batch", "length"), MESH_222, shape=(8, 16))
    assert spec == PartitionSpec(("data", "fsdp"), None)


def test_a_mesh_axis_is_used_once_per_array():
    rules = (("a", "tensor"), ("b", "tensor"), ("b", "fsdp"))
    assert logical_to_spec(("a", "b"), MESH_222, rules) == PartitionSpec("tensor", "fsdp")


def test_size_one_mesh_axes_are_ignored():
    mesh = AbstractMesh((4, 1, 1), MESH_AXES)
    assert logical_to_spec(("batch", "act_vocab"), mesh, shape=(8, 10)) == PartitionSpec(
        "data", None
    )


def test_unknown_names_replicate_and_bad_rules_are_rejected():
    assert logical_to_spec(("nope", None), MESH_222) == PartitionSpec(None, None)
    with pytest.raises(ValueError, match="rule #0"):
        logical_to_spec(("embed",), MESH_222, rules=(("embed",),))
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("embed",), MESH_222, shape=(4, 4))


def test_axis_rules_context_overrides_defaults():
    with parallel.axis_rules((("embed", "tensor"),)):
        assert logical_to_spec(("embed",), MESH_222) == PartitionSpec("tensor")
    assert logical_to_spec(("embed",), MESH_222) == PartitionSpec("fsdp")


def test_logical_constraint_is_a_noop_without_a_mesh():
    import jax.numpy as jnp

    x = jnp.arange(6.0).reshape(2, 3)
    assert parallel.with_logical_constraint(x, ("batch", "act_embed")) is x


def test_make_mesh_errors_name_the_problem():
    with pytest.raises(ValueError, match="data\\*fsdp\\*tensor = 2"):
        parallel.make_mesh({"data": 2, "fsdp": 1, "tensor": 1})
    with pytest.raises(ValueError, match="only one axis may be -1"):
        parallel.make_mesh({"data": -1, "fsdp": -1})
    with pytest.raises(ValueError, match="unknown axes"):
        parallel.make_mesh({"dp": 1})
    with pytest.raises(ValueError, match="mesh.tensor=0"):
        parallel.make_mesh({"tensor": 0})
    mesh = parallel.make_mesh({"data": -1})
    assert mesh.axis_names == MESH_AXES and mesh.devices.size == 1


def test_initialize_distributed_only_for_multi_process_environments():
    assert parallel.initialize_distributed({}) is False
    assert parallel.initialize_distributed({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is False
    assert parallel.initialize_distributed({"TPU_WORKER_HOSTNAMES": "localhost"}) is False
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        parallel.initialize_distributed({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert parallel._multi_process_env({"TPU_WORKER_HOSTNAMES": "a,b"}) == "tpu"
    assert parallel._multi_process_env({"OMPI_COMM_WORLD_SIZE": "4"}) == "mpi"


# ------------------------------------------------------- 8 fake devices (subprocess)

_CHILD = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from envace_jax import parallel
    from envace_jax.models import CACHE_LOGICAL_AXES, Decoder, get_preset, init_cache

    assert jax.device_count() == 8, jax.devices()
    family = sys.argv[1]
    if family == "qwen3":
        cfg = get_preset("tiny-qwen3")
    else:  # 3 KV heads: not divisible by tensor=2, must fall back to replication
        cfg = get_preset("tiny-qwen3", family="llama", qk_norm=False, num_heads=6,
                         num_kv_heads=3, head_dim=16, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=32))

    def build():  # the same random weights every call; norms random too
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        for i, (path, var) in enumerate(nnx.to_flat_state(state)):
            x = jax.random.normal(jax.random.key(i), var.get_value().shape, jnp.float32)
            scale = {"scale": 0.5, "embedding": 0.25}.get(path[-1], 0.1)
            var.set_value(x * scale + (1.0 if path[-1] == "scale" else 0.0))
        nnx.update(model, state)
        return model

    B, T, S = 8, 12, 16
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    tokens = np.where(mask, rng.integers(1, cfg.vocab_size, (B, T)), 0).astype(np.int32)
    positions = np.broadcast_to(np.arange(T), (B, T)).astype(np.int32)

    @nnx.jit
    def forward(model, tokens, positions, mask):
        return model(tokens, positions, attention_mask=mask)[0]

    @nnx.jit
    def cached(model, tokens, positions, cache):
        logits, cache = model(tokens[:, :8], positions[:, :8], cache=cache)
        logits2, cache = model(tokens[:, 8:9], positions[:, 8:9], cache=cache)
        return jnp.concatenate([logits, logits2], axis=1), cache

    # Reference: one device, no mesh.
    model = build()
    ref = np.asarray(forward(model, tokens, positions, mask))
    ref_cached = np.asarray(cached(model, tokens, positions, init_cache(cfg, B, S))[0])

    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": -1})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    sharded = parallel.shard_model(build(), mesh)
    state = nnx.state(sharded, nnx.Param)
    specs = {".".join(map(str, k)): v.get_value().sharding.spec
             for k, v in nnx.to_flat_state(state)}
    ndims = {".".join(map(str, k)): v.get_value().ndim for k, v in nnx.to_flat_state(state)}
    batch = parallel.logical_to_sharding(("batch", "length"), mesh, shape=(B, T))
    cache_sh = parallel.logical_to_sharding(CACHE_LOGICAL_AXES, mesh,
        shape=(cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim))
    put = lambda x: jax.device_put(x, batch)
    with jax.set_mesh(mesh):
        out = forward(sharded, put(tokens), put(positions), put(mask))
        cache0 = jax.tree.map(lambda x: jax.device_put(x, cache_sh), init_cache(cfg, B, S))
        out_cached, cache = cached(sharded, put(tokens), put(positions), cache0)
    real = mask.astype(bool)
    shards = lambda var: var.get_value().addressable_shards
    def full(spec, ndim):  # jax drops trailing Nones from result specs; compare whole specs
        return str(P(*spec, *[None] * (ndim - len(spec))))
    print(json.dumps(dict(
        diff=float(np.abs(np.asarray(out) - ref)[real].max()),
        diff_cached=float(np.abs(np.asarray(out_cached) - ref_cached)[real[:, :9]].max()),
        ref_scale=float(np.abs(ref).max()),
        specs={k: full(v, ndims[k]) for k, v in specs.items()},
        n_shards={".".join(map(str, k)): len({str(sh.index) for sh in shards(v)})
                  for k, v in nnx.to_flat_state(state)},
        logits_spec=full(out.sharding.spec, 3),
        cache_spec=full(cache.k.sharding.spec, 5),
        batch_spec=str(batch.spec),
    )))
    """
)


def _run_child(family: str) -> dict:
    import json

    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, family],
        env=fake_devices_env(8),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_sharded_forward_equals_unsharded(family):
    r = _run_child(family)
    assert r["ref_scale"] > 1.0
    assert r["diff"] <= 1e-5, (r["diff"], r["ref_scale"])
    assert r["diff_cached"] <= 1e-5, r["diff_cached"]
    specs = r["specs"]
    # Parameters really are sharded (not replicated), as the rules say.
    assert specs["layers.attn.q_proj.kernel"] == str(PartitionSpec(None, "fsdp", "tensor", None))
    assert specs["layers.mlp.down_proj.kernel"] == str(PartitionSpec(None, "tensor", "fsdp"))
    assert specs["embed.embedding"] == str(PartitionSpec("tensor", "fsdp"))
    assert r["n_shards"]["layers.attn.q_proj.kernel"] == 4  # fsdp x tensor distinct blocks
    assert r["n_shards"]["embed.embedding"] == 4
    assert specs["layers.attn_norm.scale"] == str(PartitionSpec(None, None))
    kv_tensor = "tensor" if family == "qwen3" else None
    if family == "qwen3":
        assert specs["layers.attn.k_proj.kernel"] == str(
            PartitionSpec(None, "fsdp", "tensor", None)
        )
        assert specs["lm_head.kernel"] == str(PartitionSpec("fsdp", "tensor"))
    else:  # 3 KV heads over tensor=2: replicated on that dim, no crash
        assert specs["layers.attn.k_proj.kernel"] == str(PartitionSpec(None, "fsdp", None, None))
        assert "lm_head.kernel" not in specs
    assert r["batch_spec"] == str(PartitionSpec(("data", "fsdp"), None))
    # The activation constraint on the logits took effect inside jit.
    assert r["logits_spec"] == str(PartitionSpec(("data", "fsdp"), None, "tensor"))
    assert r["cache_spec"] == str(PartitionSpec(None, ("data", "fsdp"), None, kv_tensor, None))
