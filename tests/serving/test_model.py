"""The Llama-style model: presets, RoPE, the HF checkpoint loader, and the paged forward paths."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_paged.cache import allocate_kv_cache
from jax_paged.serving.loader import CheckpointError, load_hf_checkpoint
from jax_paged.serving.model import (
    LlamaConfig, apply_rope, decode_step_paged, forward, generate_dense, init_params,
    prefill_paged, rope_inv_freq,
)

TINY = LlamaConfig.preset("tiny")


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, seed=1)


def test_presets():
    c = LlamaConfig.preset("llama3-8b", num_layers=2)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (128256, 4096, 14336, 32, 8, 128)
    assert c.num_layers == 2 and not c.tie_word_embeddings
    full = LlamaConfig.preset("llama3-8b")
    assert full.num_layers == 32 and abs(full.num_params() - 8.03e9) < 0.01e9  # Llama-3-8B: 8.03B
    assert LlamaConfig.preset("llama3.2-1b").tie_word_embeddings
    assert abs(LlamaConfig.preset("llama3.2-1b").num_params() - 1.236e9) < 0.01e9
    with pytest.raises(ValueError):
        LlamaConfig.preset("nope")
    hash(LlamaConfig.preset("llama3.2-1b"))  # usable as a static jit argument


def test_rope_is_a_rotation_with_relative_positions():
    """rotate_half RoPE = complex rotation of pairs (x[i], x[i + d/2]) by pos * inv_freq[i]; so
    q·k depends only on the position difference."""
    rng = np.random.default_rng(0)
    inv = rope_inv_freq(TINY)
    d = TINY.head_dim
    x = rng.standard_normal((5, 1, d)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 3000], np.int32)
    rope = jax.jit(functools.partial(apply_rope, inv_freq=inv))
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos)))[:, 0]
    z = (x[:, 0, : d // 2] + 1j * x[:, 0, d // 2:]) * np.exp(1j * pos[:, None] * inv.astype(np.float64))
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], -1), atol=2e-4)
    q, k = rng.standard_normal((2, 1, 1, d)).astype(np.float32)
    dots = [float(np.sum(np.asarray(rope(q, jnp.array([m + 5]))) * np.asarray(rope(k, jnp.array([m])))))
            for m in (0, 9, 40)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


def test_llama3_rope_scaling():
    base = LlamaConfig(head_dim=128, rope_theta=500000.0)
    scaled = LlamaConfig(head_dim=128, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    a, b = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * np.pi / a
    hi = wavelen < 8192 / 4
    lo = wavelen > 8192 / 1
    np.testing.assert_allclose(b[hi], a[hi])           # high frequencies untouched
    np.testing.assert_allclose(b[lo], a[lo] / 8.0)     # low frequencies slowed by `factor`
    mid = ~hi & ~lo
    assert mid.any() and np.all(b[mid] < a[mid]) and np.all(b[mid] > a[mid] / 8.0)


# ------------------------------------------------------------------ checkpoint loader

def _meta_forward(w, cfg, tokens):
    """Independent numpy forward in the *original* Meta Llama convention: RoPE rotates
    interleaved pairs (x[2i], x[2i+1]) as complex numbers; q/k weights are unpermuted."""
    eps, hd, nh, nkv = cfg["rms_norm_eps"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t = len(tokens)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

    def rope(x):  # [T, n, hd]
        inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * np.arange(t)[:, None, None] * inv)
        return np.stack([z.real, z.imag], -1).reshape(x.shape)

    x = w["tok_embeddings"][tokens].astype(np.float64)
    causal = np.tril(np.ones((t, t), bool))
    for i in range(cfg["num_hidden_layers"]):
        L = lambda n: w[f"layers.{i}.{n}"].astype(np.float64)
        h = norm(x, L("attention_norm"))
        q = rope((h @ L("wq").T).reshape(t, nh, hd))
        k = rope((h @ L("wk").T).reshape(t, nkv, hd))
        v = (h @ L("wv").T).reshape(t, nkv, hd)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(t, -1) @ L("wo").T
        h = norm(x, L("ffn_norm"))
        g = h @ L("w1").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ L("w3").T)) @ L("w2").T
    x = norm(x, w["norm"].astype(np.float64))
    head = w["tok_embeddings"] if cfg["tie_word_embeddings"] else w["output"]
    return x @ head.astype(np.float64).T


def _hf_permute(w, n_heads):
    """HF's convert_llama_weights_to_hf permutation of q/k rows (interleaved -> rotate_half)."""
    dim1, dim2 = w.shape
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(dim1, dim2)


def _write_checkpoint(directory, cfg, w, dtype, shards=2):
    import ml_dtypes
    from safetensors.numpy import save_file

    hf = {"model.embed_tokens.weight": w["tok_embeddings"], "model.norm.weight": w["norm"]}
    if not cfg["tie_word_embeddings"]:
        hf["lm_head.weight"] = w["output"]
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(cfg["num_hidden_layers"]):
        for meta, hfname in names.items():
            a = w[f"layers.{i}.{meta.split('.')[-1]}"]
            if meta == "attention.wq":
                a = _hf_permute(a, cfg["num_attention_heads"])
            elif meta == "attention.wk":
                a = _hf_permute(a, cfg["num_key_value_heads"])
            hf[f"model.layers.{i}.{hfname}.weight"] = a
    keys = sorted(hf)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: np.ascontiguousarray(hf[k].astype(dtype)) for k in keys[s::shards]}
        save_file(part, str(directory / name))
        weight_map.update({k: name for k in part})
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(directory / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                   **{k: v for k, v in cfg.items() if k != "head_dim"}}, f)


@pytest.mark.parametrize("tied,dtype", [(False, np.float32), (True, np.float32), (False, ml_dtypes.bfloat16)])
def test_load_hf_checkpoint_matches_meta_reference(tmp_path, tied, dtype):
    rng = np.random.default_rng(3)
    cfg = {"vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
           "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": tied, "max_position_embeddings": 128}
    d, hd, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    r = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
    w = {"tok_embeddings": rng.standard_normal((97, d)).astype(np.float32),
         "norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)}
    if not tied:
        w["output"] = r(97, d)
    for l in range(2):
        w.update({f"layers.{l}.wq": r(6 * hd, d), f"layers.{l}.wk": r(2 * hd, d), f"layers.{l}.wv": r(2 * hd, d),
                  f"layers.{l}.wo": r(d, 6 * hd), f"layers.{l}.w1": r(i, d), f"layers.{l}.w3": r(i, d),
                  f"layers.{l}.w2": r(d, i),
                  f"layers.{l}.attention_norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
                  f"layers.{l}.ffn_norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)})
    # The reference sees exactly the stored values (bf16-rounded when stored as bf16).
    w = {k: v.astype(dtype).astype(np.float32) for k, v in w.items()}
    _write_checkpoint(tmp_path, cfg, w, dtype)

    config, params = load_hf_checkpoint(str(tmp_path))
    assert config.num_kv_heads == 2 and config.head_dim == 8 and config.tie_word_embeddings == tied
    assert ("lm_head" in params) == (not tied)
    tokens = rng.integers(0, 97, 11)
    got = np.asarray(_jitted_forward(config)(params, jnp.asarray(tokens)[None]))[0]
    want = _meta_forward(w, cfg, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_load_hf_checkpoint_missing_tensor(tmp_path):
    from safetensors.numpy import save_file
    save_file({"model.embed_tokens.weight": np.zeros((4, 8), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 4, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(CheckpointError, match="missing: model.layers.0.input_layernorm.weight"):
        load_hf_checkpoint(str(tmp_path))


# ------------------------------------------------------------------ paged paths vs dense forward

@functools.lru_cache(maxsize=None)
def _jitted_forward(config):
    return jax.jit(lambda p, tokens: forward(p, config, tokens))


def _forward_padded(params, seq, length=32):
    """Dense logits [len(seq), vocab] of TINY, computed at one padded length (one compilation;
    attention is causal, so tokens after the sequence do not change its logits)."""
    padded = np.zeros(length, np.int32)
    padded[: len(seq)] = seq
    return np.asarray(_jitted_forward(TINY)(params, jnp.asarray(padded)[None]))[0, : len(seq)]


@pytest.mark.parametrize("attn_impl", ["auto", "reference"])
def test_paged_prefill_and_decode_match_dense_forward(params, attn_impl):
    """Prefill part of each sequence, then decode the rest one token per step through the paged
    cache with scattered physical blocks: every step's logits equal the dense forward's."""
    rng = np.random.default_rng(7)
    block_size, num_blocks, max_blocks = 8, 10, 3
    lens = [5, 21, 9]           # total tokens per sequence
    prompt_lens = [3, 12, 1]    # prefilled part
    seqs = [rng.integers(0, TINY.vocab_size, n) for n in lens]
    # Scatter physical blocks randomly over the pool, leaving some unused.
    perm = rng.permutation(num_blocks).astype(np.int32)
    block_tables = perm[: 3 * max_blocks].reshape(3, max_blocks)
    caches = allocate_kv_cache(TINY.num_layers, num_blocks, TINY.num_kv_heads, TINY.head_dim, block_size)
    # Poison the cache: stale NaNs in unwritten slots must never leak into the outputs.
    caches = [(jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan)) for k, v in caches]

    def slot(s, p):
        return block_tables[s, p // block_size] * block_size + p % block_size

    t_pad = 16
    tokens = np.zeros((3, t_pad), np.int32)
    slots = np.full((3, t_pad), -1, np.int32)
    for s in range(3):
        tokens[s, : prompt_lens[s]] = seqs[s][: prompt_lens[s]]
        slots[s, : prompt_lens[s]] = [slot(s, p) for p in range(prompt_lens[s])]
    prefill = jax.jit(functools.partial(prefill_paged, config=TINY), donate_argnums=(1,))
    logits, caches = prefill(params, caches, tokens, np.array(prompt_lens, np.int32), slots)
    dense = [_forward_padded(params, sq) for sq in seqs]
    for s in range(3):
        np.testing.assert_allclose(logits[s], dense[s][prompt_lens[s] - 1], rtol=1e-4, atol=1e-4)

    step = jax.jit(functools.partial(decode_step_paged, config=TINY, attn_impl=attn_impl), donate_argnums=(1,))
    pos = np.array(prompt_lens, np.int32)
    while np.any(pos < lens):
        live = pos < np.array(lens)
        toks = np.array([sq[min(p, len(sq) - 1)] for sq, p in zip(seqs, pos)], np.int32)
        slot_mapping = np.array([slot(s, pos[s]) if live[s] else -1 for s in range(3)], np.int32)
        ctx = np.where(live, pos + 1, 0).astype(np.int32)
        logits, caches = step(params, caches, toks, pos, block_tables, slot_mapping, ctx)
        logits = np.asarray(logits)
        for s in np.flatnonzero(live):
            np.testing.assert_allclose(logits[s], dense[s][pos[s]], rtol=1e-4, atol=1e-4)
        assert np.all(logits[~live] == logits[~live])  # idle slots: finite, no NaN from the poison
        pos = pos + live


def test_generate_dense_is_greedy_argmax(params):
    """The dense-cache reference (the oracle of the engine tests) equals re-running the full
    forward and taking the argmax, token by token; and it stops after EOS."""
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, TINY.vocab_size, 5)]
    out = generate_dense(params, TINY, prompt, 7, max_len=64)  # 64: the engine tests' length
    seq = list(prompt)
    for _ in range(7):
        seq.append(int(np.argmax(_forward_padded(params, seq)[-1])))
    assert out == seq[len(prompt):]
    eos = out[3]
    k = out.index(eos)
    assert generate_dense(params, TINY, prompt, 7, eos_id=eos, max_len=64) == out[: k + 1]
