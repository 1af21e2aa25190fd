"""ModelConfig: HF config.json conversion both ways (checked with transformers), validation,
presets."""

from __future__ import annotations

import json

import jax
import pytest
import torch

from envace_jax.models import PRESETS, ModelConfig, get_preset

transformers = pytest.importorskip("transformers")

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json (transformers v4 layout).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_param_count(hf_dict: dict) -> int:
    cfg = transformers.AutoConfig.for_model(**hf_dict)
    with torch.device("meta"):  # shapes only, nothing allocated
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def test_smollm2_v4_config_reads_as_the_preset():
    cfg = ModelConfig.from_hf(SMOLLM2_CONFIG)
    assert cfg == PRESETS["smollm2-135m"]
    assert cfg.num_params == _hf_param_count(SMOLLM2_CONFIG) == 134_515_008


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_transformers(name, tmp_path):
    cfg = PRESETS[name]
    d = cfg.to_hf()
    # transformers reads it (from a directory, as from_pretrained would) with the same sizes.
    (tmp_path / "config.json").write_text(json.dumps(d))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(theirs).__name__ == {"qwen3": "Qwen3Config", "llama": "LlamaConfig"}[cfg.family]
    assert theirs.head_dim == cfg.head_dim and theirs.num_key_value_heads == cfg.num_kv_heads
    assert theirs.rope_parameters["rope_theta"] == cfg.rope_theta
    assert theirs.tie_word_embeddings == cfg.tie_word_embeddings
    assert cfg.num_params == _hf_param_count(d)
    # ... and reading back what transformers writes gives the same config.
    assert ModelConfig.from_hf(theirs.to_dict()) == cfg
    assert ModelConfig.from_hf(tmp_path) == cfg
    assert ModelConfig.from_hf(tmp_path / "config.json") == cfg


def test_llama3_scaling_round_trips_in_both_layouts():
    cfg = get_preset("smollm2-135m", rope_scaling=LLAMA3_SCALING, rope_theta=5e5)
    v5 = transformers.LlamaConfig(**cfg.to_hf()).to_dict()
    assert v5["rope_parameters"]["rope_type"] == "llama3"
    assert ModelConfig.from_hf(v5) == cfg
    legacy = dict(SMOLLM2_CONFIG, rope_theta=5e5, rope_scaling=dict(LLAMA3_SCALING))
    legacy["rope_scaling"]["type"] = legacy["rope_scaling"].pop("rope_type")  # oldest spelling
    assert ModelConfig.from_hf(legacy) == cfg


def test_presets_have_the_documented_shapes():
    tiny = PRESETS["tiny-qwen3"]
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads) == (2, 64, 4, 2)
    assert tiny.head_dim == 24 != tiny.hidden_size // tiny.num_heads
    assert (tiny.rope_theta, tiny.rms_norm_eps, tiny.vocab_size) == (5e5, 1e-5, 512)
    assert 1e6 <= PRESETS["demo-qwen3"].num_params <= 3e6
    assert 1e6 <= get_preset("demo-qwen3", vocab_size=2000).num_params <= 3e6


def test_config_is_hashable_and_usable_as_a_static_argument():
    cfg = get_preset("tiny-qwen3", rope_scaling=LLAMA3_SCALING)
    assert hash(cfg) == hash(get_preset("tiny-qwen3", rope_scaling=dict(LLAMA3_SCALING)))
    f = jax.jit(lambda x, c: x * c.num_layers, static_argnums=1)
    assert int(f(1, cfg)) == 2


@pytest.mark.parametrize(
    "change,key",
    [
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(model_type="mistral"), "model_type"),
        (dict(num_local_experts=8), "num_local_experts"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(architectures=["MistralForCausalLM"]), "architectures"),
    ],
)
def test_unsupported_hf_features_name_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf({**SMOLLM2_CONFIG, **change})


def test_unsupported_qwen3_features_name_the_key():
    base = transformers.Qwen3Config(num_hidden_layers=2).to_dict()
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 128})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**base, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="rope_parameters"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})


def test_missing_or_bad_files_are_clear(tmp_path):
    with pytest.raises(ValueError, match="missing required key 'vocab_size'"):
        ModelConfig.from_hf({k: v for k, v in SMOLLM2_CONFIG.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="config not found"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(num_heads=5), "num_heads"),
        (dict(head_dim=23), "head_dim"),
        (dict(remat="some"), "remat"),
        (dict(family="gpt2"), "family"),
        (dict(param_dtype="float16"), "param_dtype"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(qk_norm=False), "qk_norm"),
        (dict(eos_token_id=512), "eos_token_id"),
        (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling"),
    ],
)
def test_validate_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
        get_preset("tiny-qwen3", **overrides)


def test_get_preset_errors():
    with pytest.raises(ValueError, match="known presets: .*tiny-qwen3"):
        get_preset("tiny")
    with pytest.raises(ValueError, match="no field"):
        get_preset("tiny-qwen3", hidden=3)
