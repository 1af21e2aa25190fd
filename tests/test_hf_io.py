"""HF safetensors <-> decoder params, checked against the transformers PyTorch models.

Fixtures are tiny random models with every tensor randomised (norm weights too: fresh ones
are all ones and would hide a mixed-up norm) and non-default rope theta / eps / head_dim.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from envace_jax.models.hf_io import load_hf_model, save_hf_model
from tests.conftest import fake_devices_env

VOCAB = 128
LENGTHS = (9, 5, 7)  # a right-padded batch: rows of different lengths


def _randomise_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _qwen3():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # != hidden / heads = 16
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0},
        rms_norm_eps=3e-5,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    return _randomise_norms(Qwen3ForCausalLM(cfg)).eval()


def _llama():
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        # A short original context puts head_dim's frequencies in all three llama3 regimes.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 23456.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rms_norm_eps=7e-6,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    return _randomise_norms(LlamaForCausalLM(cfg)).eval()


@pytest.fixture(scope="module")
def torch_models():
    return {"qwen3": _qwen3(), "llama": _llama()}


@pytest.fixture(scope="module")
def hf_dirs(torch_models, tmp_path_factory):
    """HF directories written by transformers: name -> (dir, reference torch model)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, model in torch_models.items():
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    # Several shards plus model.safetensors.index.json.
    torch_models["qwen3"].save_pretrained(root / "qwen3-sharded", max_shard_size="40KB")
    out["qwen3-sharded"] = (root / "qwen3-sharded", torch_models["qwen3"])
    # bfloat16 storage; the reference is the float32 model holding the same rounded weights.
    _llama().to(torch.bfloat16).save_pretrained(root / "llama-bf16")
    rounded = _llama()  # same seed, same weights; rounded in place (buffers stay float32)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    out["llama-bf16"] = (root / "llama-bf16", rounded)
    return out


def _batch():
    rng = np.random.default_rng(0)
    T = max(LENGTHS)
    mask = (np.arange(T)[None, :] < np.array(LENGTHS)[:, None]).astype(np.int32)
    tokens = np.where(mask, rng.integers(1, VOCAB, (len(LENGTHS), T)), 0)
    positions = np.broadcast_to(np.arange(T), tokens.shape)
    return tokens, positions, mask


def _torch_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask, dtype=torch.long)
        )
    return out.logits.float().numpy()


def _our_logits(model, tokens, positions, mask) -> np.ndarray:
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), attention_mask=jnp.asarray(mask))
    return np.asarray(logits, np.float32)


def _max_diff(a, b, mask) -> float:
    """Max |a - b| over the real (unpadded) tokens."""
    return float(np.abs(a - b)[mask.astype(bool)].max())


# ------------------------------------------------------------------------ loading


@pytest.mark.parametrize("name", ["qwen3", "qwen3-sharded", "llama", "llama-bf16"])
def test_load_matches_transformers(hf_dirs, name):
    path, ref = hf_dirs[name]
    if name == "qwen3-sharded":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
    model, cfg = load_hf_model(path)
    # The fixture's non-default values reached the config (a loader ignoring them fails).
    assert cfg.head_dim == 24 and cfg.num_heads == 4 and cfg.hidden_size == 64
    if name.startswith("qwen3"):
        assert (cfg.family, cfg.rope_theta, cfg.rms_norm_eps) == ("qwen3", 12345.0, 3e-5)
        assert not cfg.tie_word_embeddings
    else:
        assert (cfg.family, cfg.rope_theta, cfg.rms_norm_eps) == ("llama", 23456.0, 7e-6)
        assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    tokens, positions, mask = _batch()
    diff = _max_diff(
        _our_logits(model, tokens, positions, mask), _torch_logits(ref, tokens, mask), mask
    )
    assert diff <= 1e-4, diff


def test_bf16_compute_close_to_float32(hf_dirs):
    """bfloat16 params and matmuls vs the float32 reference. bfloat16 keeps 8 mantissa bits
    (relative rounding 2^-9 per op); over two layers that gives logit errors of about 3e-3
    on these O(1) logits, so the bound is 3e-2: ten times the rounding, and well below the
    O(0.1-1) error a mis-loaded tensor causes."""
    path, ref = hf_dirs["llama-bf16"]
    model, cfg = load_hf_model(path, param_dtype="bfloat16", dtype="bfloat16")
    assert model.layers.attn.q_proj.kernel[...].dtype == jnp.bfloat16
    tokens, positions, mask = _batch()
    ours = _our_logits(model, tokens, positions, mask)
    theirs = _torch_logits(ref, tokens, mask)
    assert _max_diff(ours, theirs, mask) <= 3e-2
    assert np.abs(theirs).max() > 0.5  # the bound is meaningful at this logit scale


# ------------------------------------------------------------------------- saving


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_export_loads_in_transformers(hf_dirs, tmp_path, name):
    model, cfg = load_hf_model(hf_dirs[name][0])
    files = save_hf_model(model, cfg, tmp_path)
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(files)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf_dirs[name][1])
    tokens, positions, mask = _batch()
    diff = _max_diff(
        _our_logits(model, tokens, positions, mask), _torch_logits(reloaded, tokens, mask), mask
    )
    assert diff <= 1e-4, diff
    has_head = "lm_head.weight" in _saved_names(tmp_path)
    assert has_head == (not cfg.tie_word_embeddings)


def _saved_names(path) -> set:
    from safetensors import safe_open

    names = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "np") as h:
                names |= set(h.keys())
    return names


def test_sharded_bf16_export(hf_dirs, tmp_path):
    """Shards + index, bfloat16 storage: transformers reads back the bf16-rounded weights."""
    path, ref = hf_dirs["qwen3"]
    model, cfg = load_hf_model(path)
    files = save_hf_model(model, cfg, tmp_path, dtype="bfloat16", max_shard_bytes=30_000)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" not in shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.dtype == torch.bfloat16
    want = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    got = reloaded.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # And our own loader reads the shards back to the same (rounded) params.
    again, _ = load_hf_model(tmp_path)
    q = np.asarray(model.layers.attn.q_proj.kernel[...])
    q_rounded = q.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(again.layers.attn.q_proj.kernel[...]), q_rounded)


def test_export_with_tokenizer(hf_dirs, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2")
    model, cfg = load_hf_model(hf_dirs["llama"][0])
    save_hf_model(model, cfg, tmp_path, tokenizer=tok)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("w5 w7 w3")["input_ids"] == [5, 7, 3]


# ------------------------------------------------------------------------- errors


@pytest.fixture
def broken_dir(hf_dirs, tmp_path):
    """Returns make(state_dict_edit) -> directory with the edited qwen3 state dict."""
    path, ref = hf_dirs["qwen3"]

    def make(edit):
        sd = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
        edit(sd)
        shutil.copy(path / "config.json", tmp_path / "config.json")
        save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
        return tmp_path

    return make


def test_tied_checkpoint_may_store_head_and_rope_buffers(hf_dirs, tmp_path):
    """Tied exports sometimes keep lm_head.weight, old Llama exports keep inv_freq buffers."""
    path, ref = hf_dirs["llama"]
    sd = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
    assert "lm_head.weight" not in _saved_names(path)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(12)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(path / "config.json", tmp_path / "config.json")
    model, _ = load_hf_model(tmp_path)
    tokens, positions, mask = _batch()
    diff = _max_diff(
        _our_logits(model, tokens, positions, mask), _torch_logits(ref, tokens, mask), mask
    )
    assert diff <= 1e-4, diff


def test_missing_tensor(broken_dir):
    path = broken_dir(lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight \(96, 64\)"
    ):
        load_hf_model(path)


def test_unexpected_tensor(broken_dir):
    def edit(sd):
        sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(3, 5)

    path = broken_dir(edit)
    with pytest.raises(
        ValueError,
        match=r"unexpected tensors: model\.layers\.0\.self_attn\.extra\.weight "
        r"\(shape \(3, 5\), in model\.safetensors\)",
    ):
        load_hf_model(path)


def test_wrong_shape(broken_dir):
    def edit(sd):
        sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(40, 64)

    path = broken_dir(edit)
    with pytest.raises(ValueError) as err:
        load_hf_model(path)
    msg = str(err.value)
    assert "'model.layers.1.self_attn.k_proj.weight' has shape (40, 64), expected (48, 64)" in msg
    assert os.path.join(str(path), "model.safetensors") in msg


def test_missing_config_key(hf_dirs, tmp_path):
    path = hf_dirs["qwen3"][0]
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="hidden_size"):
        load_hf_model(tmp_path)


def test_index_names_missing_shard(hf_dirs, tmp_path):
    src = hf_dirs["qwen3-sharded"][0]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    victim = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        load_hf_model(tmp_path)


# ------------------------------------------------------------------- sharded load

_MESH_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from flax import nnx
    from envace_jax import parallel
    from envace_jax.models.hf_io import load_hf_model

    assert jax.device_count() == 8, jax.devices()
    path = sys.argv[1]
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    ref, cfg = load_hf_model(path)
    ref_params = dict(nnx.to_flat_state(nnx.state(ref, nnx.Param)))
    tokens = np.arange(1, 15).reshape(2, 7)
    positions = np.broadcast_to(np.arange(7), (2, 7))
    ref_logits = np.asarray(ref(tokens, positions)[0])
    # The default rules, then rules that slice head_dim (not contiguous in the HF tensors'
    # rows / columns) and the stacked layers axis.
    custom = (("vocab", "tensor"), ("embed", "fsdp"), ("head_dim", "tensor"),
              ("mlp", "data"), ("layers", "data"))
    for rules in (None, custom):
        model, _ = load_hf_model(path, mesh=mesh, rules=rules)
        want = dict(nnx.to_flat_state(parallel.param_shardings(ref, mesh, rules)))
        n_sharded = 0
        for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            x, full = var.get_value(), np.asarray(ref_params[p].get_value())
            assert x.sharding == want[p], (p, x.sharding, want[p])
            n_sharded += any(a is not None for a in x.sharding.spec)
            for shard in x.addressable_shards:  # every device holds exactly its slice
                np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            np.testing.assert_array_equal(np.asarray(x), full)
        assert n_sharded >= 8, n_sharded
        logits = np.asarray(model(tokens, positions)[0])
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
        print("rules", "default" if rules is None else "custom", "sharded params:", n_sharded)
    print("OK")
    """
)


def test_sharded_load_on_fake_devices(hf_dirs):
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(hf_dirs["qwen3"][0])],
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout


def test_export_rejects_params_that_do_not_fit_the_config(hf_dirs, tmp_path):
    from flax import nnx

    model, cfg = load_hf_model(hf_dirs["qwen3"][0])  # untied
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    head = params.pop("lm_head")
    with pytest.raises(ValueError, match="lm_head.kernel"):
        save_hf_model(params, cfg, tmp_path)
    params["lm_head"] = head
    params["layers"]["attn"]["q_bias"] = {"bias": np.zeros((2, 4, 24), np.float32)}
    with pytest.raises(ValueError, match="layers.attn.q_bias.bias"):
        save_hf_model(params, cfg, tmp_path)
    assert not os.listdir(tmp_path)  # nothing half-written
