"""Decoder vs the transformers PyTorch models (Qwen3 and Llama), float32 on CPU.

The HF models are tiny, randomly initialised with non-default config values (rope theta,
eps, head_dim != hidden / heads, GQA, Llama-3 rope scaling that actually changes the
frequencies, tied and untied heads), and every tensor, norm weights included, is
randomised. The torch -> JAX conversion here is deliberately separate from the project's
HF loader, so each checks the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from envace_jax.models import Decoder, ModelConfig, init_cache, param_paths
from envace_jax.models.primitives import rope_inv_freq

transformers = pytest.importorskip("transformers")

TOL = 1e-4
PAD = 0
LENGTHS = (12, 7, 10)  # rows of different lengths, right-padded to 12


def _hf_config(family: str):
    if family == "qwen3":
        return transformers.Qwen3Config(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,  # != 64 / 4
            rope_theta=5e5,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=256,
        )
    return transformers.LlamaConfig(
        vocab_size=200,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,  # != 48 / 6
        rope_theta=1.5e5,
        rms_norm_eps=3e-6,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        # original_max_position_embeddings=32 puts some wavelengths in each of the three
        # llama3 bands (kept, blended, divided by the factor) for head_dim 16.
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    eps = model.config.rms_norm_eps
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * noise)  # fresh norms are all ones and would hide bugs
            elif "embed_tokens" in name:
                # Even token ids get embeddings of RMS ~ sqrt(eps), so the first RMSNorm's
                # eps visibly changes their outputs (with O(1) inputs eps is invisible).
                noise[::2] *= eps**0.5
                p.copy_(noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))


def _hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(family), attn_implementation="eager", dtype=torch.float32
    )
    _randomise(model, seed)
    return model.eval()


def _torch_to_tree(sd: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF state dict -> our flat parameter tree (kernels [in, out], heads split, stacked)."""
    E, H, K, D, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers

    def g(key):
        return sd[key].detach().cpu().numpy().astype(np.float32)

    def stack(name, fn=lambda w: w):
        return np.stack([fn(g(f"model.layers.{i}.{name}")) for i in range(L)])

    tree = {
        "embed.embedding": g("model.embed_tokens.weight"),
        "layers.attn_norm.scale": stack("input_layernorm.weight"),
        "layers.attn.q_proj.kernel": stack(
            "self_attn.q_proj.weight", lambda w: w.T.reshape(E, H, D)
        ),
        "layers.attn.k_proj.kernel": stack(
            "self_attn.k_proj.weight", lambda w: w.T.reshape(E, K, D)
        ),
        "layers.attn.v_proj.kernel": stack(
            "self_attn.v_proj.weight", lambda w: w.T.reshape(E, K, D)
        ),
        "layers.attn.o_proj.kernel": stack(
            "self_attn.o_proj.weight", lambda w: w.T.reshape(H, D, E)
        ),
        "layers.mlp_norm.scale": stack("post_attention_layernorm.weight"),
        "layers.mlp.gate_proj.kernel": stack("mlp.gate_proj.weight", lambda w: w.T),
        "layers.mlp.up_proj.kernel": stack("mlp.up_proj.weight", lambda w: w.T),
        "layers.mlp.down_proj.kernel": stack("mlp.down_proj.weight", lambda w: w.T),
        "final_norm.scale": g("model.norm.weight"),
    }
    if cfg.qk_norm:
        tree["layers.attn.q_norm.scale"] = stack("self_attn.q_norm.weight")
        tree["layers.attn.k_norm.scale"] = stack("self_attn.k_norm.weight")
    if not cfg.tie_word_embeddings:
        tree["lm_head.kernel"] = g("lm_head.weight").T
    return tree


def _load(model: Decoder, tree: dict[str, np.ndarray]) -> Decoder:
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    got = {".".join(map(str, k)) for k, _ in flat}
    assert got == set(tree), f"tree mismatch: {sorted(got ^ set(tree))}"
    for key, var in flat:
        value = tree[".".join(map(str, key))]
        assert var.get_value().shape == value.shape, key
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    nnx.update(model, state)
    return model


_CACHE: dict = {}


def _pair(family: str):
    """(hf_model, our ModelConfig, flat tree), built once per family."""
    if family not in _CACHE:
        hf = _hf_model(family)
        cfg = ModelConfig.from_hf(hf.config.to_dict())
        _CACHE[family] = (hf, cfg, _torch_to_tree(hf.state_dict(), cfg))
    return _CACHE[family]


def _ours(family: str, **overrides) -> Decoder:
    _, cfg, tree = _pair(family)
    return _load(Decoder(cfg.replace(**overrides), rngs=nnx.Rngs(1)), tree)


def _batch(vocab: int, seed: int = 0):
    """Right-padded tokens [B, T] and mask [B, T] for rows of LENGTHS."""
    rng = np.random.default_rng(seed)
    T = max(LENGTHS)
    mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
    tokens = np.where(mask, rng.integers(1, vocab, (len(LENGTHS), T)), PAD).astype(np.int32)
    return tokens, mask


def _hf_logits(hf, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = hf(
            input_ids=torch.from_numpy(tokens).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return out.logits.float().numpy()


@pytest.fixture(autouse=True)
def _fp32_highest():
    assert not jax.config.jax_enable_x64, "parity must run with x64 off, as in training"
    with jax.default_matmul_precision("highest"):
        yield


def _max_diff_on(a, b, mask) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask.astype(bool)].max())


# ----------------------------------------------------------------------------- tests


def test_config_read_from_hf():
    _, qcfg, _ = _pair("qwen3")
    assert (qcfg.family, qcfg.head_dim, qcfg.rope_theta, qcfg.rms_norm_eps) == (
        "qwen3",
        24,
        5e5,
        1e-5,
    )
    assert qcfg.qk_norm and not qcfg.tie_word_embeddings and qcfg.rope_scaling is None
    _, lcfg, _ = _pair("llama")
    assert (lcfg.family, lcfg.head_dim, lcfg.rope_theta, lcfg.rms_norm_eps) == (
        "llama",
        16,
        1.5e5,
        3e-6,
    )
    assert lcfg.tie_word_embeddings and not lcfg.qk_norm
    assert lcfg.rope_scaling["original_max_position_embeddings"] == 32


def test_llama3_rope_frequencies_match_transformers():
    hf, cfg, _ = _pair("llama")
    theirs = hf.model.rotary_emb.inv_freq.numpy()
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    np.testing.assert_allclose(rope_inv_freq(cfg), theirs, rtol=1e-6)
    # The scaling must matter in this fixture: some frequencies unchanged, some divided by
    # the factor, some blended in between.
    ratio = plain / theirs
    assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 8.0))
    assert np.any((ratio > 1.01) & (ratio < 7.99))


def test_param_tree_is_the_contract():
    for family in ("qwen3", "llama"):
        _, cfg, _ = _pair(family)
        model = nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)))
        state = nnx.state(model, nnx.Param)
        specs = nnx.to_flat_state(nnx.get_partition_spec(state))
        shapes = {".".join(map(str, k)): v.get_value().shape for k, v in nnx.to_flat_state(state)}
        axes = {".".join(map(str, k)): tuple(v.get_value()) for k, v in specs}
        table = param_paths(cfg)
        assert shapes == {k: v[0] for k, v in table.items()}
        assert axes == {k: v[1] for k, v in table.items()}
        assert ("lm_head.kernel" in table) == (not cfg.tie_word_embeddings)
        assert ("layers.attn.q_norm.scale" in table) == cfg.qk_norm


# query_block 5 splits the 12-token rows into query blocks of 5, 5 and 2 (the last partial).
@pytest.mark.parametrize("family,query_block", [("qwen3", 256), ("llama", 256), ("qwen3", 5)])
def test_right_padded_batch_matches_transformers(family, query_block):
    hf, cfg, _ = _pair(family)
    tokens, mask = _batch(cfg.vocab_size)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int32)
    ref = _hf_logits(hf, tokens, mask, positions)
    model = _ours(family, query_block=query_block)
    logits, cache = _forward(model, tokens, positions, mask)
    assert cache is None and logits.dtype == jnp.float32
    assert np.abs(ref).max() > 1.0  # logits are not vanishingly small
    assert _max_diff_on(logits, ref, mask) <= TOL


@pytest.mark.parametrize("family,query_block", [("qwen3", 256), ("llama", 5)])
def test_left_padded_batch_matches_transformers(family, query_block):
    hf, cfg, _ = _pair(family)
    right, rmask = _batch(cfg.vocab_size, seed=1)
    T = right.shape[1]
    # Shift each row right so the padding comes first; positions start at 0 at the first
    # real token (pads get position 0).
    tokens, mask = np.full_like(right, PAD), np.zeros_like(rmask)
    for b, n in enumerate(LENGTHS):
        tokens[b, T - n :], mask[b, T - n :] = right[b, :n], 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    ref = _hf_logits(hf, tokens, mask, positions)
    logits, _ = _forward(_ours(family, query_block=query_block), tokens, positions, mask)
    assert np.isfinite(np.asarray(logits)).all()  # pad queries attend to nothing: no NaN
    assert _max_diff_on(logits, ref, mask) <= TOL
    # And the same real tokens give the same logits as the right-padded layout.
    rpos = np.broadcast_to(np.arange(T), right.shape).astype(np.int32)
    ref_right = _hf_logits(hf, right, rmask, rpos)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(logits[b, T - n :], ref_right[b, :n], atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen3", dict(remat="full", scan_layers=False)),
        ("llama", dict(remat="dots", scan_layers=True, query_block=4)),
    ],
)
def test_layer_loop_and_remat_variants_match_transformers(family, overrides):
    hf, cfg, _ = _pair(family)
    tokens, mask = _batch(cfg.vocab_size, seed=2)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int32)
    ref = _hf_logits(hf, tokens, mask, positions)
    logits, _ = _forward(_ours(family, **overrides), tokens, positions, mask)
    assert _max_diff_on(logits, ref, mask) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("family,remat,query_block", [("qwen3", "dots", 256), ("llama", "full", 5)])
def test_gradients_match_torch_autograd(family, remat, query_block):
    """Backward through scan + remat (and query blocks) equals torch autograd on the same
    scalar loss."""
    hf, cfg, _ = _pair(family)
    tokens, mask = _batch(cfg.vocab_size, seed=3)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int32)
    weights = np.random.default_rng(4).normal(size=(*tokens.shape, cfg.vocab_size))
    weights = (weights * mask[..., None]).astype(np.float32)

    hf.zero_grad()
    out = hf(
        input_ids=torch.from_numpy(tokens).long(),
        attention_mask=torch.from_numpy(mask).long(),
        position_ids=torch.from_numpy(positions).long(),
    )
    (out.logits * torch.from_numpy(weights)).sum().backward()
    grads_hf = _torch_to_tree(
        {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
        | {"model.embed_tokens.weight": hf.model.embed_tokens.weight.grad},
        cfg,
    )

    model = _ours(family, remat=remat, query_block=query_block)

    def loss(m):
        logits, _ = m(tokens, positions, attention_mask=mask)
        return jnp.sum(logits * weights)

    grads = nnx.jit(nnx.grad(loss))(model)
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(grads)}
    for path in ("layers.attn.q_proj.kernel", "layers.attn_norm.scale", "embed.embedding"):
        scale = np.abs(grads_hf[path]).max()
        np.testing.assert_allclose(flat[path], grads_hf[path], atol=1e-4 * max(scale, 1.0))
    if cfg.qk_norm:
        path = "layers.attn.k_norm.scale"
        np.testing.assert_allclose(
            flat[path], grads_hf[path], atol=1e-4 * np.abs(grads_hf[path]).max()
        )


@nnx.jit
def _forward(model, tokens, positions, mask):
    return model(tokens, positions, attention_mask=mask)


def _step(model, tokens, positions, cache, kv_window=None):
    return model(tokens, positions, cache=cache, kv_window=kv_window)


@pytest.mark.parametrize("family,windowed", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_incremental_decoding_matches_full_forward(family, windowed):
    """Prefill a prefix, decode one token at a time, append a multi-token chunk with a
    different number of real tokens per row, decode to the end; every real token's logits
    equal the transformers full forward of the whole sequence. Windowed: each call attends
    over only the slots up to its largest position."""
    hf, cfg, _ = _pair(family)
    tokens, mask = _batch(cfg.vocab_size, seed=5)
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T), tokens.shape).astype(np.int32)
    ref = _hf_logits(hf, tokens, mask, positions)

    model = _ours(family)
    step = nnx.jit(_step, donate_argnums=3, static_argnums=4)
    S = T + 6
    cache = init_cache(cfg, B, S, jnp.float32)
    lengths = np.array(LENGTHS)
    got = np.full((B, T, cfg.vocab_size), np.nan, np.float32)

    def feed(cur, n_real, width):
        """Feeds up to n_real[b] real tokens per row from cur[b], right-padded to width."""
        nonlocal cache
        pos = cur[:, None] + np.arange(width)[None]
        real = (np.arange(width)[None] < n_real[:, None]) & (pos < lengths[:, None])
        tok = np.where(real, tokens[np.arange(B)[:, None], np.minimum(pos, T - 1)], PAD)
        window = int(pos.max()) + 1 if windowed else None
        logits, cache = step(
            model, jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32), cache, window
        )
        logits = np.asarray(logits)
        for b, t in zip(*np.nonzero(real), strict=True):
            assert np.isnan(got[b, pos[b, t]]).all(), "each token is fed once"
            got[b, pos[b, t]] = logits[b, t]
        return cur + real.sum(axis=1)

    cur = np.zeros(B, np.int64)
    cur = feed(cur, np.array([5, 3, 4]), width=5)  # prefill, right-padded
    cur = feed(cur, np.ones(B, int), width=1)  # one-token decode, rows at different lengths
    cur = feed(cur, np.ones(B, int), width=1)
    cur = feed(cur, np.array([4, 2, 3]), width=4)  # chunk appended on top of the cache
    while (cur < lengths).any():
        cur = feed(cur, np.ones(B, int), width=1)  # finished rows write past their end
    assert (cur == lengths).all()
    assert not np.isnan(got[mask.astype(bool)]).any()
    assert _max_diff_on(got, ref, mask) <= TOL


def test_out_of_range_positions_do_not_corrupt_the_cache():
    hf, cfg, _ = _pair("qwen3")
    tokens, mask = _batch(cfg.vocab_size, seed=6)
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T), tokens.shape).astype(np.int32)
    ref = _hf_logits(hf, tokens, mask, positions)
    model = _ours("qwen3")
    S = T
    n = 6
    step = nnx.jit(_step)
    cache = init_cache(cfg, B, S, jnp.float32)
    _, cache = step(model, tokens[:, :n], positions[:, :n], cache)
    before = np.asarray(cache.k)
    # Row 0 writes at S (past the end) and row 1 at -1; neither may touch a valid slot.
    bad_pos = np.array([[S], [-1], [n]], np.int32)
    _, cache = step(model, tokens[:, n : n + 1], bad_pos, cache)
    after = np.asarray(cache.k)
    np.testing.assert_array_equal(after[:, :2], before[:, :2])
    np.testing.assert_array_equal(after[:, 2, :n], before[:, 2, :n])
    # Row 2's legitimate write happened, and decoding continues correctly from there.
    assert not np.array_equal(after[:, 2, n], before[:, 2, n])
    logits, _ = step(model, tokens[:, n + 1 : n + 2], np.full((B, 1), n + 1, np.int32), cache)
    np.testing.assert_allclose(logits[2, 0], ref[2, n + 1], atol=TOL, rtol=0)


def test_bfloat16_compute_stays_close_to_float32():
    hf, cfg, _ = _pair("qwen3")
    tokens, mask = _batch(cfg.vocab_size, seed=7)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int32)
    ref = _hf_logits(hf, tokens, mask, positions)
    logits, _ = _forward(
        _ours("qwen3", param_dtype="bfloat16", dtype="bfloat16"), tokens, positions, mask
    )
    assert logits.dtype == jnp.float32
    err = _max_diff_on(logits, ref, mask)
    assert err < 0.05 * np.abs(ref).max(), err  # bf16 has ~3 significant digits
    assert err > TOL  # and the compute really ran in bf16


def test_bad_inputs_raise_clear_errors():
    _, cfg, _ = _pair("qwen3")
    model = _ours("qwen3")
    tok = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="positions"):
        model(tok, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask is only for the cache-less path"):
        model(tok, tok, attention_mask=jnp.ones((2, 3)), cache=init_cache(cfg, 2, 8))
    with pytest.raises(ValueError, match="KVCache"):
        model(tok, tok, cache=init_cache(cfg, 3, 8))
    with pytest.raises(ValueError, match="kv_window=9 .* cache length 8"):
        model(tok, tok, cache=init_cache(cfg, 2, 8), kv_window=9)
    with pytest.raises(ValueError, match="kv_window=4 needs a cache"):
        model(tok, tok, kv_window=4)
