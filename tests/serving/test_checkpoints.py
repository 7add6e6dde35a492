"""Real checkpoint layouts, per family, against transformers.

The checkpoints under tests/data/checkpoints/ were written by transformers' ``save_pretrained``
(tiny random weights) and the expected outputs beside them computed by transformers in float32
(``dev/make_checkpoint_fixtures.py``): logits of one prompt longer than every sliding window,
and ``model.generate``'s greedy tokens for prompts of several lengths, stopping on the
checkpoint's EOS ids. Where transformers is importable, the logits are also compared live.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged.serving.engine import EngineConfig, generate
from jax_paged.serving.loader import load_checkpoint
from jax_paged.serving.model import forward, generate_dense

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "checkpoints")
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma2"]


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _load(name):
    return load_checkpoint(os.path.join(DATA, name))


def _expected(name):
    with open(os.path.join(DATA, f"{name}.expected.json")) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def _jitted_forward(config):
    return jax.jit(lambda p, tokens: forward(p, config, tokens))


def test_configs_read_as_written():
    """What each family's config.json says, as the model config holds it (transformers 5.x
    layout: RoPE under rope_parameters, layer_types listed)."""
    c = _load("llama3").config
    assert (c.family, c.rope_theta, c.tie_word_embeddings) == ("llama", 500000.0, True)
    assert dict(c.rope_scaling) == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    c = _load("mistral").config
    assert (c.sliding_window, c.window_layers, c.layer_window(1)) == (8, (0, 1), 8)
    c = _load("qwen2").config
    assert c.qkv_bias and not c.qk_norm and c.window_layers == () and c.rope_theta == 1e6
    c = _load("qwen3").config
    assert c.qk_norm and c.head_dim == 16 and c.hidden_size == 48 and c.tie_word_embeddings
    c = _load("gemma2").config
    assert (c.head_dim, c.window_layers, c.layer_window(1), c.attn_soft_cap, c.final_soft_cap,
            c.hidden_act) == (256, (0, 2), None, 3.0, 8.0, "gelu_tanh")
    assert c.attn_scale == 64 ** -0.5 and c.embed_scale == np.sqrt(32)
    for name in FAMILIES:
        assert _load(name).eos_token_ids == tuple(_expected(name)["eos_token_ids"])


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_logits_match_transformers(name):
    ckpt, exp = _load(name), _expected(name)
    want = np.load(os.path.join(DATA, f"{name}.logits.npy"))
    got = np.asarray(_jitted_forward(ckpt.config)(ckpt.params, jnp.asarray([exp["logits_prompt"]])))[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_tokens_match_transformers(name):
    """A batch of prompts of different lengths (up to 19 tokens + 12 generated: past the
    Mistral / Gemma 2 windows of 8 / 6), all the checkpoint's EOS ids; paged prefill and
    decode through the Engine with a small block size, so windows span several blocks."""
    ckpt, exp = _load(name), _expected(name)
    ec = EngineConfig(max_batch=4, num_blocks=32, block_size=8, max_seq_len=32,
                      prefill_min_rows=4, prefill_min_len=32)
    reqs = [(p, exp["max_new_tokens"], ckpt.eos_token_ids) for p in exp["prompts"]]
    outputs, _ = generate(ckpt.config, ckpt.params, reqs, ec)
    assert outputs == exp["outputs"]
    assert any(len(o) < exp["max_new_tokens"] for o in outputs)  # one stopped on an EOS id


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_dense_cache_reference_windows_too(name):
    """The dense-cache reference (the engine tests' oracle) applies the windows as well."""
    ckpt, exp = _load(name), _expected(name)
    got = [generate_dense(ckpt.params, ckpt.config, p, exp["max_new_tokens"],
                          eos_id=ckpt.eos_token_ids, max_len=32) for p in exp["prompts"]]
    assert got == exp["outputs"]


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_windows_change_the_outputs(name):
    """The fixtures exercise the windows: without them the logits past the window differ
    (so the match above is not one a windowless model would give)."""
    import dataclasses
    ckpt, exp = _load(name), _expected(name)
    plain = dataclasses.replace(ckpt.config, sliding_window=None, window_layers=())
    got = np.asarray(_jitted_forward(plain)(ckpt.params, jnp.asarray([exp["logits_prompt"]])))[0]
    want = np.load(os.path.join(DATA, f"{name}.logits.npy"))
    w = ckpt.config.sliding_window
    np.testing.assert_allclose(got[:w], want[:w], rtol=0, atol=1e-4)
    assert np.abs(got[w:] - want[w:]).max() > 1e-2


@pytest.mark.parametrize("name", FAMILIES)
def test_live_against_transformers(name):
    """With transformers installed: its float32 logits of the committed checkpoint, now."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(DATA, name), dtype=torch.float32, attn_implementation="eager").eval()
    exp = _expected(name)
    with torch.no_grad():
        want = model(torch.tensor([exp["logits_prompt"]])).logits[0].float().numpy()
    ckpt = _load(name)
    got = np.asarray(_jitted_forward(ckpt.config)(ckpt.params, jnp.asarray([exp["logits_prompt"]])))[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
