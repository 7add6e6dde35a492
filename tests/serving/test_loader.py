"""The checkpoint loader reads both config layouts and refuses what it cannot run, clearly."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jax_paged.serving.loader import (
    CheckpointError, config_from_hf, load_checkpoint, read_eos_token_ids,
)
from jax_paged.serving.model import rope_inv_freq

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "checkpoints")


def _copy(name, tmp_path):
    d = tmp_path / name
    shutil.copytree(os.path.join(DATA, name), d)
    return d


def _config(d):
    return json.loads((d / "config.json").read_text())


def _write_config(d, cfg):
    (d / "config.json").write_text(json.dumps(cfg))


def _tensors(path):
    from safetensors.numpy import load_file
    return dict(load_file(str(path)))


def _save(path, tensors):
    from safetensors.numpy import save_file
    save_file(tensors, str(path))


# ------------------------------------------------------------------ config.json layouts

def test_transformers_4_layout_reads_as_5():
    """RoPE at the top level (rope_theta, rope_scaling with "type" or "rope_type") gives the
    same config as transformers 5's rope_parameters."""
    with open(os.path.join(DATA, "llama3", "config.json")) as f:
        v5 = json.load(f)
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = dict(v5["rope_parameters"])
    v4["rope_theta"] = rope.pop("rope_theta")
    v4["rope_scaling"] = rope
    assert config_from_hf(v4) == config_from_hf(v5)
    rope_old = dict(rope)
    rope_old["type"] = rope_old.pop("rope_type")
    assert config_from_hf({**v4, "rope_scaling": rope_old}) == config_from_hf(v5)
    # Without the scaling, the frequencies differ (the failure this guards against).
    plain = config_from_hf({**v4, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.rope_theta == 500000.0
    assert not np.allclose(rope_inv_freq(plain), rope_inv_freq(config_from_hf(v5)))


def test_window_layers_without_layer_types():
    """Older configs lack layer_types: each family's own rule (Gemma 2 even layers local,
    Mistral every layer, Qwen only with use_sliding_window from max_window_layers on)."""
    with open(os.path.join(DATA, "gemma2", "config.json")) as f:
        g = json.load(f)
    g.pop("layer_types")
    assert config_from_hf(g).window_layers == (0, 2)
    with open(os.path.join(DATA, "qwen2", "config.json")) as f:
        q = json.load(f)
    q.pop("layer_types")
    assert config_from_hf({**q, "sliding_window": 4096}).window_layers == ()
    c = config_from_hf({**q, "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1})
    assert c.window_layers == (1,) and c.sliding_window == 16
    with open(os.path.join(DATA, "mistral", "config.json")) as f:
        m = json.load(f)
    assert config_from_hf({**m, "sliding_window": None}).window_layers == ()


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     r"architectures \['LlamaForSequenceClassification'\] is not supported .* expected \['LlamaForCausalLM'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"rope_parameters.rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     r"rope_type 'llama3' lacks \['low_freq_factor'"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"attention_bias": True}, r"attention_bias True"),
    ({"mlp_bias": True}, r"mlp_bias True"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5"),
    ({"hidden_size": None}, r"hidden_size is missing"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
     r"Llama has no sliding window layers"),
])
def test_config_refused_naming_the_key(change, match):
    with open(os.path.join(DATA, "llama3", "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(CheckpointError, match=match):
        config_from_hf({**cfg, **change})


def test_generation_config_eos_ids(tmp_path):
    d = _copy("llama3", tmp_path)
    with open(os.path.join(DATA, "llama3.expected.json")) as f:
        assert read_eos_token_ids(str(d)) == tuple(json.load(f)["eos_token_ids"])
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 5}))
    assert read_eos_token_ids(str(d)) == (5,)
    (d / "generation_config.json").unlink()
    assert read_eos_token_ids(str(d)) == (_config(d)["eos_token_id"],)  # config.json's


# ------------------------------------------------------------------ weights refused

def test_missing_file(tmp_path):
    d = _copy("mistral", tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        load_checkpoint(str(d))
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"found \['pytorch_model.bin'\]; only safetensors"):
        load_checkpoint(str(d))
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        load_checkpoint(str(d))


def test_missing_shard(tmp_path):
    d = _copy("llama3", tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists {shard.name}, which is not in"):
        load_checkpoint(str(d))


def test_wrong_shape(tmp_path):
    """An embedding with fewer rows than vocab_size: refused, naming tensor and shapes."""
    d = _copy("mistral", tmp_path)
    t = _tensors(d / "model.safetensors")
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:100]
    _save(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight has shape \[100, 64\] "
                                              r"in model.safetensors, expected \[128, 64\]"):
        load_checkpoint(str(d))


def test_missing_tensor(tmp_path):
    """Qwen2 without its q/k/v biases is not run as a bias-free model."""
    d = _copy("qwen2", tmp_path)
    t = _tensors(d / "model.safetensors")
    del t["model.layers.1.self_attn.k_proj.bias"]
    _save(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"missing: model.layers.1.self_attn.k_proj.bias"):
        load_checkpoint(str(d))


def test_untied_lm_head_missing(tmp_path):
    d = _copy("mistral", tmp_path)
    t = _tensors(d / "model.safetensors")
    del t["lm_head.weight"]
    _save(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"missing: lm_head.weight"):
        load_checkpoint(str(d))


def test_unused_tensor(tmp_path):
    """A tensor the model would not use is an error, not a silent drop: q/k/v biases in a
    checkpoint declared as Llama (whose config says no attention bias)."""
    d = _copy("qwen2", tmp_path)
    cfg = _config(d)
    _write_config(d, {**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                      "layer_types": None})
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj.bias \(shape \[64\]\) "
                                              r"is not used by a llama model"):
        load_checkpoint(str(d))


def test_unsupported_dtype(tmp_path):
    d = _copy("mistral", tmp_path)
    t = _tensors(d / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int8)
    _save(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"model.norm.weight has dtype I8"):
        load_checkpoint(str(d))


def test_derived_tensors_checked(tmp_path):
    """A tied lm_head equal to the embedding and RoPE inv_freq buffers equal to the config's
    frequencies are accepted; a different lm_head or different frequencies are not."""
    d = _copy("qwen3", tmp_path)
    ckpt = load_checkpoint(str(d))
    t = _tensors(d / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = rope_inv_freq(ckpt.config)
    _save(d / "model.safetensors", t)
    load_checkpoint(str(d))
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = rope_inv_freq(ckpt.config) * 2
    _save(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"inv_freq disagrees with the RoPE settings"):
        load_checkpoint(str(d))
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = rope_inv_freq(ckpt.config)
    t["lm_head.weight"] = t["lm_head.weight"] + 1
    _save(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"lm_head.weight differs from model.embed_tokens.weight"):
        load_checkpoint(str(d))


def test_dtypes_read_exactly(tmp_path):
    """bf16 / fp16 checkpoints read bit-exactly, into float32 or their own dtype."""
    import jax.numpy as jnp
    import ml_dtypes

    def raw_tensor(path, name):  # the safetensors layout, read independently of the loader
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            info = json.loads(f.read(n))[name]
            data = f.read()
        lo, hi = info["data_offsets"]
        dt = {"BF16": ml_dtypes.bfloat16, "F16": np.float16}[info["dtype"]]
        return np.frombuffer(data[lo:hi], dt).reshape(info["shape"])

    for name, dtype in (("qwen2", jnp.bfloat16), ("mistral", jnp.float16)):
        raw = raw_tensor(os.path.join(DATA, name, "model.safetensors"), "model.layers.0.mlp.up_proj.weight")
        for target in (jnp.float32, dtype):
            got = load_checkpoint(os.path.join(DATA, name), target).params["layers"][0]["w_up"]
            assert got.dtype == target
            np.testing.assert_array_equal(np.asarray(got, np.float32), raw.astype(np.float32).T)
