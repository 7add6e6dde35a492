"""Hugging Face checkpoints, read right or refused.

:func:`load_checkpoint` reads a directory written by transformers' ``save_pretrained``:

- ``config.json`` of transformers 4.x or 5.x: RoPE settings at the top level (``rope_theta``,
  ``rope_scaling``) or under ``rope_parameters``; ``model_type`` and ``architectures`` must be
  in :data:`SUPPORTED_ARCHITECTURES`, and every setting that would change the math must be one
  the model implements (anything else raises :class:`CheckpointError` naming the key);
- ``generation_config.json`` (else ``config.json``): every ``eos_token_id``;
- the weights: ``model.safetensors``, or the shards named by ``model.safetensors.index.json``,
  float32, float16 or bfloat16. Before any data is read, each tensor's presence and shape is
  checked against the config, and a tensor the model would not use is an error (the only ones
  accepted beside the weights are derived copies that are checked: a tied ``lm_head.weight``
  equal to the embedding, RoPE ``inv_freq`` buffers equal to the config's frequencies).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_paged.serving.model import ModelConfig, Params, _param_specs, rope_inv_freq

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
"""``model_type`` -> the one ``architectures`` entry read for it."""

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
"""Weight dtypes read (safetensors' names)."""

ROPE_TYPES = ("default", "linear", "llama3")

# transformers' defaults for keys a config.json may leave out, where they differ by family.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False, sliding_window=4096),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=False, head_dim=128),
    "gemma2": dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=4096),
}


class CheckpointError(ValueError):
    """A checkpoint directory this model cannot run as its authors meant; the message names
    the file and key (or tensor), what it holds and what was expected."""


@dataclasses.dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read."""

    directory: str
    config: ModelConfig
    params: Params
    eos_token_ids: tuple[int, ...]
    bos_token_id: Optional[int]


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _rope(cfg: Mapping[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling dict or None) from either config layout."""
    params = cfg.get("rope_parameters")
    if params is not None:
        where = "rope_parameters"
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
            raise CheckpointError(f"config.json: {where} must be one dict of RoPE settings, got "
                                  f"{params!r} (per-layer-type RoPE is not supported)")
        rope = dict(params)
    else:
        where = "rope_scaling"
        rope = dict(cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"config.json: {where}.rope_type {kind!r} is not supported; "
                              f"supported: {list(ROPE_TYPES)}")
    needed = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}[kind]
    missing = [k for k in needed if rope.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json: {where} of rope_type {kind!r} lacks {missing}")
    if kind == "default":
        return float(theta), None
    return float(theta), {"rope_type": kind, **{k: rope[k] for k in needed}}


def _window_layers(cfg: Mapping[str, Any], family: str, num_layers: int,
                   window: Optional[int]) -> tuple[int, ...]:
    """Indices of the layers that attend through the sliding window."""
    types = cfg.get("layer_types")
    if types is not None:
        kinds = ("full_attention", "sliding_attention")
        if len(types) != num_layers or any(t not in kinds for t in types):
            raise CheckpointError(f"config.json: layer_types must list {num_layers} entries of "
                                  f"{list(kinds)}, got {types!r}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if family == "mistral" and layers != (tuple(range(num_layers)) if window else ()):
            raise CheckpointError(f"config.json: layer_types {types!r}: Mistral applies "
                                  f"sliding_window ({window}) to every layer or to none")
        if family == "llama" and layers:
            raise CheckpointError(f"config.json: layer_types {types!r}: Llama has no sliding "
                                  f"window layers")
    elif window is None or family == "llama":
        layers = ()
    elif family == "mistral":
        layers = tuple(range(num_layers))
    elif family == "gemma2":
        layers = tuple(range(0, num_layers, 2))
    else:  # qwen2, qwen3: the layers from max_window_layers on
        first = int(cfg.get("max_window_layers", 28))
        layers = tuple(range(min(first, num_layers), num_layers))
    if layers and window is None:
        raise CheckpointError(f"config.json: layers {list(layers)} are sliding_attention but "
                              f"sliding_window is {cfg.get('sliding_window')!r}")
    return layers


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """A :class:`~jax_paged.serving.model.ModelConfig` from a ``config.json`` dict, or
    :class:`CheckpointError` naming the key that is missing or not supported."""
    family = cfg.get("model_type")
    if family not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"config.json: model_type {family!r} is not supported; supported: "
                              f"{sorted(SUPPORTED_ARCHITECTURES)}")
    arch = SUPPORTED_ARCHITECTURES[family]
    archs = cfg.get("architectures")
    if archs is not None and list(archs) != [arch]:
        raise CheckpointError(f"config.json: architectures {archs!r} is not supported for "
                              f"model_type {family!r}; expected [{arch!r}]")
    defaults = _FAMILY_DEFAULTS[family]

    def get(key: str, fallback: Any = None) -> Any:
        value = cfg.get(key)
        return defaults.get(key, fallback) if value is None and key not in cfg else value

    def need(key: str) -> int:
        if cfg.get(key) is None:
            raise CheckpointError(f"config.json: {key} is missing")
        return int(cfg[key])

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"config.json: no head_dim, and hidden_size {hidden} is not a "
                                  f"multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if family == "gemma2":
        act_key = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
        act, want = cfg.get(act_key, "gelu_pytorch_tanh"), ("gelu_pytorch_tanh", "gelu_tanh")
    else:
        act_key, want = "hidden_act", ("silu",)
        act = cfg.get(act_key, "silu")
    if act not in want:
        raise CheckpointError(f"config.json: {act_key} {act!r} is not supported for model_type "
                              f"{family!r}; expected one of {list(want)}")
    for key, why in (("attention_bias", "biases on the attention projections"),
                     ("mlp_bias", "biases on the MLP projections"),
                     ("use_bidirectional_attention", "bidirectional attention")):
        if cfg.get(key) and not (key == "attention_bias" and family == "qwen2"):
            raise CheckpointError(f"config.json: {key} {cfg[key]!r} ({why}) is not supported "
                                  f"for model_type {family!r}")
    if cfg.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise CheckpointError(f"config.json: partial_rotary_factor "
                              f"{cfg['partial_rotary_factor']!r} is not supported (only 1.0)")
    theta, scaling = _rope(cfg)
    num_layers = need("num_hidden_layers")
    window = get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None  # as transformers reads it: the window applies only when switched on
    if window is not None and (not isinstance(window, int) or window < 1):
        raise CheckpointError(f"config.json: sliding_window must be a positive integer or null, "
                              f"got {window!r}")
    window_layers = _window_layers(cfg, family, num_layers, window)
    gemma = family == "gemma2"
    try:
        return ModelConfig(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            max_position_embeddings=int(get("max_position_embeddings", 8192)),
            hidden_act="gelu_tanh" if gemma else "silu",
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            sliding_window=window if window_layers else None,
            window_layers=window_layers,
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")) if gemma else None,
            attn_soft_cap=get("attn_logit_softcapping") if gemma else None,
            final_soft_cap=get("final_logit_softcapping") if gemma else None,
        )
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def read_eos_token_ids(directory: str) -> tuple[int, ...]:
    """Every EOS id: ``generation_config.json``'s ``eos_token_id`` (an int or a list), else
    ``config.json``'s; () when neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            value = _read_json(path).get("eos_token_id")
            if value is not None:
                ids = [value] if isinstance(value, int) else list(value)
                if not all(isinstance(i, int) for i in ids):
                    raise CheckpointError(f"{path}: eos_token_id must be an int or a list of "
                                          f"ints, got {value!r}")
                return tuple(dict.fromkeys(ids))
    return ()


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    path: str      # file
    dtype: str     # safetensors name
    shape: tuple[int, ...]
    offset: int    # of the data in the file
    nbytes: int


def _safetensors_header(path: str) -> dict[str, _TensorInfo]:
    """The tensors of one .safetensors file (``u64`` header length, JSON header, data)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= size - 8:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file "
                                  f"size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file ({e})") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        out[name] = _TensorInfo(path, info["dtype"], tuple(info["shape"]), 8 + n + lo, hi - lo)
        if 8 + n + hi > size:
            raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file")
    return out


def _index_tensors(directory: str) -> dict[str, _TensorInfo]:
    """Every tensor of the checkpoint, by name, from the index or the single file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
        tensors: dict[str, _TensorInfo] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{index} lists {name}, which is not in {directory}")
            for t, info in _safetensors_header(path).items():
                if weight_map.get(t) != name:
                    raise CheckpointError(f"{path} holds {t!r}, which {index} maps to "
                                          f"{weight_map.get(t)!r}")
                tensors[t] = info
        absent = [t for t, name in weight_map.items() if t not in tensors]
        if absent:
            raise CheckpointError(f"{index} maps {len(absent)} tensors to files that do not hold "
                                  f"them, e.g. {absent[0]!r} -> {weight_map[absent[0]]}")
        return tensors
    if os.path.isfile(single):
        return _safetensors_header(single)
    others = sorted(f for f in os.listdir(directory)
                    if f.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf"))) \
        if os.path.isdir(directory) else []
    raise CheckpointError(f"{directory}: no model.safetensors and no model.safetensors.index.json"
                          + (f" (found {others}; only safetensors checkpoints are read, sharded "
                             f"ones through their index)" if others else ""))


def hf_tensor_map(config: ModelConfig) -> dict[str, tuple[tuple, bool]]:
    """HF tensor name -> (our parameter path, transposed?) for every parameter of ``config``.
    PyTorch stores linear weights ``[out, in]``; ours are ``[in, out]``."""
    layer = {"attn_norm": "input_layernorm.weight",
             "mlp_norm": ("pre_feedforward_layernorm.weight" if config.sandwich_norms
                          else "post_attention_layernorm.weight"),
             "post_attn_norm": "post_attention_layernorm.weight",
             "post_mlp_norm": "post_feedforward_layernorm.weight",
             "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
             "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
             "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
             "bv": "self_attn.v_proj.bias",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight"}
    top = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
           "lm_head": "lm_head.weight"}
    out = {}
    for path, _, kind in _param_specs(config):
        name = top[path[0]] if path[0] != "layers" else f"model.layers.{path[1]}.{layer[path[2]]}"
        out[name] = (path, kind == "linear")
    return out


def _expected_hf_shape(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transposed else tuple(shape)


def _read(info: _TensorInfo) -> np.ndarray:
    dtype = np.dtype(SAFETENSORS_DTYPES[info.dtype])
    count = int(np.prod(info.shape)) if info.shape else 1
    if count * dtype.itemsize != info.nbytes:
        raise CheckpointError(f"{info.path}: a {info.dtype} tensor of shape {info.shape} needs "
                              f"{count * dtype.itemsize} bytes, its data span is {info.nbytes}")
    return np.memmap(info.path, dtype=dtype, mode="r", offset=info.offset,
                     shape=info.shape or (1,)).reshape(info.shape)


def _to_jax(a: np.ndarray, transpose: bool, dtype: Any) -> Any:
    a = np.ascontiguousarray(a.T if transpose else a)
    if a.dtype == np.dtype(dtype):
        return jnp.asarray(a)
    # Via float32 on the host: exact from fp16/bf16, one rounding to a 16-bit target.
    return jnp.asarray(a.astype(np.float32)).astype(dtype)


def load_params(directory: str, config: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The parameters of ``config`` from the checkpoint's safetensors, every tensor checked
    first (see the module docstring); raises :class:`CheckpointError` listing every problem."""
    tensors = _index_tensors(directory)
    mapping = hf_tensor_map(config)
    specs = {path: shape for path, shape, _ in _param_specs(config)}
    problems = []
    missing = [n for n in mapping if n not in tensors]
    if missing:
        problems.append(f"{len(missing)} tensors the config needs are missing: "
                        + ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else ""))
    for name, (path, transposed) in mapping.items():
        info = tensors.get(name)
        if info is None:
            continue
        want = _expected_hf_shape(specs[path], transposed)
        if info.shape != want:
            problems.append(f"{name} has shape {list(info.shape)} in "
                            f"{os.path.basename(info.path)}, expected {list(want)} from "
                            f"config.json")
        if info.dtype not in SAFETENSORS_DTYPES:
            problems.append(f"{name} has dtype {info.dtype}; supported: "
                            f"{sorted(SAFETENSORS_DTYPES)}")
    derived = {}
    for name, info in tensors.items():
        if name in mapping:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            derived[name] = "tied"
        elif name.endswith(".rotary_emb.inv_freq"):
            derived[name] = "inv_freq"
        else:
            problems.append(f"{name} (shape {list(info.shape)}) is not used by a "
                            f"{config.family} model of this config.json")
    if problems:
        raise CheckpointError(f"{directory}: " + "; ".join(problems))

    for name, what in derived.items():
        info = tensors[name]
        a = _read(info).astype(np.float32) if info.dtype in SAFETENSORS_DTYPES else None
        if what == "tied":
            embed = _read(tensors["model.embed_tokens.weight"]).astype(np.float32)
            if a is None or a.shape != embed.shape or not np.array_equal(a, embed):
                raise CheckpointError(f"{directory}: config.json ties the embeddings "
                                      f"(tie_word_embeddings) but lm_head.weight differs from "
                                      f"model.embed_tokens.weight")
        else:
            want = rope_inv_freq(config)
            if a is None or a.shape != want.shape or not np.allclose(a, want, rtol=1e-3, atol=0):
                raise CheckpointError(f"{directory}: {name} disagrees with the RoPE settings of "
                                      f"config.json (theta {config.rope_theta}, scaling "
                                      f"{dict(config.rope_scaling or ())})")

    params: Params = {"layers": [{} for _ in range(config.num_layers)]}
    for name, (path, transposed) in mapping.items():
        node = params
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = _to_jax(_read(tensors[name]), transposed, jnp.dtype(dtype))
    return params


def load_checkpoint(directory: str, dtype: Any = jnp.float32) -> Checkpoint:
    """Read a Hugging Face checkpoint directory (see the module docstring); parameters in
    ``dtype``. Raises :class:`CheckpointError` when it cannot be run as written."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such directory")
    cfg = _read_json(os.path.join(directory, "config.json"))
    config = config_from_hf(cfg)
    params = load_params(directory, config, dtype)
    bos = cfg.get("bos_token_id")
    gen = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen):
        bos = _read_json(gen).get("bos_token_id", bos)
    return Checkpoint(directory, config, params, read_eos_token_ids(directory),
                      bos if isinstance(bos, int) else None)


def load_hf_checkpoint(directory: str, dtype: Any = jnp.float32) -> tuple[ModelConfig, Params]:
    """``(config, params)`` of :func:`load_checkpoint`."""
    ckpt = load_checkpoint(directory, dtype)
    return ckpt.config, ckpt.params
