"""A small, readable Llama-style decoder whose attention runs on the paged KV cache.

Architecture (as in Hugging Face ``LlamaForCausalLM``): token embedding, then ``num_layers`` blocks of

    x = x + o_proj(attention(rope(q_proj(rms_norm(x))), rope(k_proj(...)), v_proj(...)))
    x = x + down_proj(silu(gate_proj(rms_norm(x))) * up_proj(rms_norm(x)))

then a final RMSNorm and the LM head (tied to the embedding or not). Attention is grouped-query
(``num_kv_heads`` divides ``num_heads``) and RoPE is applied in the *rotate_half* form, which is
the convention Hugging Face Llama checkpoints are stored in (their q/k projection rows are
permuted for it), so HF weights load without any re-permutation.

Three forward paths share the same layer math:

- :func:`forward` — dense causal attention over whole sequences (logits for every position);
  used for checkpoint tests.
- :func:`prefill_paged` / :func:`decode_step_paged` — the paged path: prefill runs dense causal
  attention over the prompt and writes all prompt K/V with one ``jax_paged.reshape_and_cache`` per
  layer; a decode step writes the new token's K/V with ``reshape_and_cache`` and attends with
  ``jax_paged.paged_attention`` (one call each per layer).
- :func:`generate_dense` — the *dense-cache reference*: greedy decoding of one request with a
  contiguous ``[num_layers, max_len, num_kv_heads, head_dim]`` K/V array and plain masked
  attention, one token at a time. It shares no paging or batching code with the engine, so equal
  greedy tokens mean the paged cache, the page allocator and the batching are right.

Parameters are a plain pytree (dicts and lists of ``jax.Array``); linear weights are stored
``[in_features, out_features]`` (``y = x @ w``), i.e. transposed with respect to PyTorch.

Tensor parallelism (Megatron-style, over a 1-D mesh axis ``"tp"``): :func:`shard_params` places
the q/k/v and gate/up weights split on their output columns and o_proj/down_proj on their input
rows; the paged paths take ``tensor_parallel=True`` to call the ``jax_paged.sharding`` variants
of the cache ops, which run on each device's local KV heads. The layer math is unchanged: under
``jax.jit`` XLA partitions it and adds one all-reduce after o_proj and one after down_proj.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_paged
import jax_paged.sharding
from jax_paged._shapes import is_fp8
from jax_paged.reference import fp8_round_trip

Params = dict[str, Any]
KVCaches = list[tuple[jax.Array, jax.Array]]
# fp8 caches: one (k_scale, v_scale) per layer, each float32 () or [num_kv_heads]; None = 1.
KVScales = Optional[Sequence[tuple[Any, Any]]]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of a Llama-style decoder.

    ``rope_scaling`` is ``None`` or a tuple of ``(key, value)`` pairs (hashable form of HF's
    ``rope_scaling`` dict); types ``"llama3"`` and ``"linear"`` are supported.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple[tuple[str, Any], ...]] = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("RoPE needs an even head_dim")

    @staticmethod
    def preset(name: str, num_layers: Optional[int] = None, **overrides: Any) -> "LlamaConfig":
        """A named configuration; ``num_layers`` overrides the preset's depth.

        Presets: ``tiny`` (default test/CPU model, ~0.1M params), ``small`` (a few M params, for
        CPU timing), ``llama3.2-1b`` and ``llama3-8b`` (the real shapes; use ``num_layers`` to
        keep a few layers for benchmarking).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        kw = dict(PRESETS[name])
        if num_layers is not None:
            kw["num_layers"] = num_layers
        kw.update(overrides)
        return LlamaConfig(**kw)

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> "LlamaConfig":
        """Build a config from a Hugging Face ``config.json`` dict (Llama family)."""
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise NotImplementedError("attention/MLP biases are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={cfg['hidden_act']!r} (only silu)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        return LlamaConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        )

    def num_params(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        d, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * i + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head


_LLAMA3_SCALING = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4,
                  num_heads=8, num_kv_heads=2, head_dim=32),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                        rope_scaling=(("factor", 32.0),) + _LLAMA3_SCALING[1:],
                        tie_word_embeddings=True, max_position_embeddings=131072),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                      rope_scaling=None, max_position_embeddings=8192),
}


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def init_params(config: LlamaConfig, seed: int = 0, dtype: Any = jnp.float32) -> Params:
    """Random parameters from ``seed``.

    Linear weights ``[in, out]`` ~ N(0, 1/in) so activations stay O(1) at any width (which also
    keeps greedy argmax well separated, avoiding near-ties that float rounding could flip);
    embeddings ~ N(0, 1); norm weights 1 + small noise. Returns the pytree documented in the
    module docstring, all leaves of ``dtype``. Generated on the default device in one jitted
    call (fast even for Llama-3-8B shapes on a GPU).
    """
    return _init_params_jit(jnp.uint32(seed), config=config, dtype=jnp.dtype(dtype))


def _param_specs(c: LlamaConfig) -> list[tuple[tuple, tuple[int, ...], str]]:
    """(pytree path, shape, kind) of every parameter, kind in {"embed", "linear", "norm"}."""
    d, hd = c.hidden_size, c.head_dim
    specs: list[tuple[tuple, tuple[int, ...], str]] = [(("embed",), (c.vocab_size, d), "embed")]
    for i in range(c.num_layers):
        for name, shape, kind in (
                ("attn_norm", (d,), "norm"), ("wq", (d, c.num_heads * hd), "linear"),
                ("wk", (d, c.num_kv_heads * hd), "linear"), ("wv", (d, c.num_kv_heads * hd), "linear"),
                ("wo", (c.num_heads * hd, d), "linear"), ("mlp_norm", (d,), "norm"),
                ("w_gate", (d, c.intermediate_size), "linear"), ("w_up", (d, c.intermediate_size), "linear"),
                ("w_down", (c.intermediate_size, d), "linear")):
            specs.append((("layers", i, name), shape, kind))
    specs.append((("final_norm",), (d,), "norm"))
    if not c.tie_word_embeddings:
        specs.append((("lm_head",), (d, c.vocab_size), "linear"))
    return specs


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _init_params_jit(seed: jax.Array, *, config: LlamaConfig, dtype: Any) -> Params:
    specs = _param_specs(config)
    sizes = [math.prod(shape) for _, shape, _ in specs]
    # One normal draw for all parameters, then sliced: a single RNG computation compiles far
    # faster than one per leaf (XLA's CPU compile of threefry dominated tiny-model start-up).
    z_all = jax.random.normal(jax.random.PRNGKey(seed), (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0] + sizes)
    params: Params = {"layers": [{} for _ in range(config.num_layers)]}
    for (path, shape, kind), lo, hi in zip(specs, offsets[:-1], offsets[1:]):
        z = z_all[lo:hi].reshape(shape)
        if kind == "linear":
            z = z / math.sqrt(shape[0])
        elif kind == "norm":
            z = 1.0 + 0.1 * z
        node = params
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = z.astype(dtype)
    return params


def cast_params(params: Params, dtype: Any) -> Params:
    """Return ``params`` with every leaf cast to ``dtype``."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a).astype(dtype), params)


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoint loader
# --------------------------------------------------------------------------------------------


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as numpy arrays (bf16 via ``ml_dtypes``)."""
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except (TypeError, ValueError):
        pass
    # Older safetensors releases cannot return bf16 through numpy: parse the (simple) format
    # ourselves: u64 header length, JSON header {name: {dtype, shape, data_offsets}}, raw data.
    import ml_dtypes

    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def load_hf_checkpoint(directory: str, dtype: Any = jnp.float32) -> tuple[LlamaConfig, Params]:
    """Load a Hugging Face Llama-family checkpoint directory.

    Reads ``config.json`` and every ``*.safetensors`` file (sharded checkpoints work: the shards
    are merged by name). Maps ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
    ``model.layers.N.mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``,
    ``model.norm`` and ``lm_head`` (absent, or ignored, when ``tie_word_embeddings``). PyTorch
    ``[out, in]`` linear weights are transposed to our ``[in, out]``. No q/k permutation is needed
    because our RoPE is the rotate_half form HF checkpoints are stored for.

    Returns ``(config, params)`` with params cast to ``dtype``.
    """
    with open(os.path.join(directory, "config.json")) as f:
        config = LlamaConfig.from_hf_config(json.load(f))
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        for name, arr in _read_safetensors(path).items():
            tensors[name.removeprefix("model.")] = arr

    def get(name: str, transpose: bool = False) -> jax.Array:
        if name not in tensors:
            raise KeyError(f"checkpoint lacks {name!r}")
        a = tensors[name]
        if transpose:
            a = a.T
        # Convert on the host in float32 first: ml_dtypes bf16 -> jnp float32/bf16 is exact.
        return jnp.asarray(np.ascontiguousarray(a).astype(np.float32)).astype(dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append({
            "attn_norm": get(p + "input_layernorm.weight"),
            "wq": get(p + "self_attn.q_proj.weight", True),
            "wk": get(p + "self_attn.k_proj.weight", True),
            "wv": get(p + "self_attn.v_proj.weight", True),
            "wo": get(p + "self_attn.o_proj.weight", True),
            "mlp_norm": get(p + "post_attention_layernorm.weight"),
            "w_gate": get(p + "mlp.gate_proj.weight", True),
            "w_up": get(p + "mlp.up_proj.weight", True),
            "w_down": get(p + "mlp.down_proj.weight", True),
        })
    params: Params = {"embed": get("embed_tokens.weight"), "layers": layers, "final_norm": get("norm.weight")}
    if not config.tie_word_embeddings:
        if "lm_head.weight" not in tensors:
            # Some exports omit lm_head while forgetting to set the flag: that means tied.
            config = dataclasses.replace(config, tie_word_embeddings=True)
        else:
            params["lm_head"] = get("lm_head.weight", True)
    return config, params


# --------------------------------------------------------------------------------------------
# Layer math (shared by every forward path)
# --------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back (as HF does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` float32, with HF's ``llama3``/``linear`` scaling."""
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if config.rope_scaling:
        s = dict(config.rope_scaling)
        kind = s.get("rope_type", s.get("type"))
        if kind == "linear":
            inv = inv / s["factor"]
        elif kind == "llama3":
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            inv = np.where(medium, smoothed, scaled)
        elif kind not in (None, "default"):
            raise NotImplementedError(f"rope_scaling type {kind!r}")
    return inv.astype(np.float32)


def rotate_half(x: jax.Array) -> jax.Array:
    """``[x1, x2] -> [-x2, x1]`` on the last axis (HF Llama's RoPE convention)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding. ``x [..., n_heads, head_dim]``, ``positions int32 [...]``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # broadcast over heads
    x32 = x.astype(jnp.float32)
    return (x32 * jnp.cos(emb) + rotate_half(x32) * jnp.sin(emb)).astype(x.dtype)


def _qkv(layer: Params, h: jax.Array, config: LlamaConfig, positions: jax.Array, inv_freq: np.ndarray):
    """Projections + RoPE. ``h [..., hidden]`` -> q ``[..., H, hd]``, k/v ``[..., KVH, hd]``."""
    lead = h.shape[:-1]
    q = (h @ layer["wq"]).reshape(*lead, config.num_heads, config.head_dim)
    k = (h @ layer["wk"]).reshape(*lead, config.num_kv_heads, config.head_dim)
    v = (h @ layer["wv"]).reshape(*lead, config.num_kv_heads, config.head_dim)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _mlp(layer: Params, x: jax.Array, eps: float) -> jax.Array:
    h = rms_norm(x, layer["mlp_norm"], eps)
    return (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]


def _lm_head(params: Params, x: jax.Array, config: LlamaConfig) -> jax.Array:
    """Final norm + LM head; logits in float32."""
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    w = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return (x @ w).astype(jnp.float32)


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Plain GQA attention in float32.

    ``q [B, Tq, H, hd]``, ``k/v [B, Tk, KVH, hd]``, ``mask bool [B, Tq, Tk]`` -> ``[B, Tq, H, hd]``.
    """
    b, tq, nh, hd = q.shape
    nkv = k.shape[2]
    qg = q.reshape(b, tq, nkv, nh // nkv, hd).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32)) * (hd ** -0.5)
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)  # fully-masked (padding) rows give 0, not NaN
    o = jnp.einsum("bkgqt,btkd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(b, tq, nh, hd).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Dense forward (no cache)
# --------------------------------------------------------------------------------------------


def forward(params: Params, config: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """Dense causal forward. ``tokens int32 [B, T]`` -> logits ``float32 [B, T, vocab]``."""
    _, t = tokens.shape
    inv_freq = rope_inv_freq(config)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
    x = params["embed"][tokens]
    for layer in params["layers"]:
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(layer, h, config, positions, inv_freq)
        o = _dense_attention(q, k, v, mask)
        x = x + o.reshape(*o.shape[:2], -1) @ layer["wo"]
        x = x + _mlp(layer, x, config.rms_norm_eps)
    return _lm_head(params, x, config)


# --------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron-style, over heads and the MLP's intermediate axis)
# --------------------------------------------------------------------------------------------

TP_AXIS = "tp"
"""Name of the mesh axis tensor parallelism shards over."""

# Where each layer weight is split: q/k/v and gate/up on their output columns (so each device
# holds whole heads / a slice of the intermediate axis), o_proj and down_proj on their input rows
# (so each device's partial product is summed by one all-reduce). Norms stay replicated.
_LAYER_SPLIT = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 0}


def check_tensor_parallel(config: LlamaConfig, tp: int) -> None:
    """Raise ``ValueError`` unless heads, KV heads and the intermediate size split evenly over
    ``tp`` devices (a KV head, like a query head, lives whole on one device)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    uneven = [f"{name} ({count})" for name, count in (
        ("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size)) if count % tp]
    if uneven:
        raise ValueError(f"tensor parallel over {tp} devices needs every sharded size to be a "
                         f"multiple of {tp}; {', '.join(uneven)} "
                         f"{'is' if len(uneven) == 1 else 'are'} not")


def param_partition_specs(config: LlamaConfig, axis: str = TP_AXIS) -> Params:
    """A pytree like the parameters' with the ``PartitionSpec`` of each leaf.

    Embedding, norms and LM head are replicated: they are small next to the layers at the
    sizes this example runs, and a replicated LM head keeps the greedy argmax local.
    """
    layer = {name: P() for name in ("attn_norm", "mlp_norm")}
    for name, dim in _LAYER_SPLIT.items():
        layer[name] = P(None, axis) if dim == 1 else P(axis, None)
    specs: Params = {"embed": P(), "layers": [dict(layer) for _ in range(config.num_layers)],
                     "final_norm": P()}
    if not config.tie_word_embeddings:
        specs["lm_head"] = P()
    return specs


def shard_params(params: Params, config: LlamaConfig, mesh: Mesh, axis: str = TP_AXIS) -> Params:
    """``params`` placed on ``mesh`` for tensor parallelism over ``axis`` (new arrays; the
    input is left as it is). Raises ``ValueError`` for sizes that do not split evenly."""
    check_tensor_parallel(config, mesh.shape[axis])
    shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec),
                                       param_partition_specs(config, axis))
    return jax.device_put(params, shardings)


def _cache_input(x: jax.Array, cache: jax.Array) -> jax.Array:
    """K, V or the query as the cache ops take them beside ``cache``: with an fp8 cache the
    model's own values (a write quantises K and V itself, value / scale saturated; attention
    needs a 16- or 32-bit query), otherwise the values cast to the cache's dtype."""
    return x if is_fp8(cache.dtype) else x.astype(cache.dtype)


def check_kv_scales(kv_scales: KVScales, cache_dtype: Any, num_layers: int):
    """``kv_scales`` as float32 arrays, one ``(k_scale, v_scale)`` per layer, or None; their
    shapes are checked by the cache ops at trace time."""
    if kv_scales is None:
        return None
    if not is_fp8(cache_dtype):
        raise ValueError(f"kv_scales: only for fp8 caches (cache_dtype float8_e4m3fn or "
                         f"float8_e5m2), got cache_dtype {jnp.dtype(cache_dtype).name}")
    pairs = list(kv_scales)
    if len(pairs) != num_layers or any(not isinstance(p, (tuple, list)) or len(p) != 2
                                       for p in pairs):
        raise ValueError(f"kv_scales: expected {num_layers} (k_scale, v_scale) pairs, one per "
                         f"layer, got {len(pairs)} entries")
    return [tuple(jnp.asarray(a, jnp.float32) for a in p) for p in pairs]


def _scale_kwargs(kv_scales: KVScales, layer: int) -> dict:
    """``k_scale`` / ``v_scale`` of one layer for the cache ops ({} without scales)."""
    if kv_scales is None:
        return {}
    k_scale, v_scale = kv_scales[layer]
    return dict(k_scale=k_scale, v_scale=v_scale)


def paged_ops(tensor_parallel: bool):
    """The module whose ``reshape_and_cache`` / ``paged_attention`` the paged paths call.

    Tensor-parallel runs need ``jax_paged.sharding``: its partitioning rule keeps each device
    on its own KV heads, where XLA would gather the whole cache around the plain primitives.
    Single-device runs keep the plain ops, which (unlike the sharding variants) support vmap.
    """
    return jax_paged.sharding if tensor_parallel else jax_paged


# --------------------------------------------------------------------------------------------
# Paged path: prefill and one decode step
# --------------------------------------------------------------------------------------------


def prefill_paged(
    params: Params,
    kv_caches: KVCaches,
    tokens: jax.Array,
    prompt_lens: jax.Array,
    slot_mapping: jax.Array,
    *,
    config: LlamaConfig,
    tensor_parallel: bool = False,
    kv_scales: KVScales = None,
) -> tuple[jax.Array, KVCaches]:
    """Run prompts densely and write their K/V into the paged cache.

    Args:
      params: model parameters.
      kv_caches: one ``(key_cache, value_cache)`` per layer (see ``jax_paged.cache``); donate them.
      tokens: int32 ``[R, T]`` right-padded prompts.
      prompt_lens: int32 ``[R]``; rows with 0 are padding rows.
      slot_mapping: int32 ``[R, T]`` cache slot of each prompt token, -1 for padding.
      tensor_parallel: write through ``jax_paged.sharding`` (caches sharded on KV heads; see
        :func:`paged_ops`).
      kv_scales: fp8 caches: one ``(k_scale, v_scale)`` per layer (float32 scalars or
        ``[num_kv_heads]``); None means 1. The prompt attends its own K/V unquantised; the
        cache stores them quantised.

    Returns:
      ``(logits float32 [R, vocab] at each prompt's last token, kv_caches)``.
    """
    r, t = tokens.shape
    inv_freq = rope_inv_freq(config)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
    valid = positions < prompt_lens[:, None]
    # Causal, and padded keys never attended (padded queries are discarded anyway).
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
    flat_slots = slot_mapping.reshape(r * t)
    ops = paged_ops(tensor_parallel)
    x = params["embed"][tokens]
    new_caches = []
    for i, (layer, (key_cache, value_cache)) in enumerate(zip(params["layers"], kv_caches)):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(layer, h, config, positions, inv_freq)
        # All prompt tokens of all rows in one cache write per layer.
        key_cache, value_cache = ops.reshape_and_cache(
            _cache_input(k.reshape(r * t, config.num_kv_heads, config.head_dim), key_cache),
            _cache_input(v.reshape(r * t, config.num_kv_heads, config.head_dim), value_cache),
            key_cache, value_cache, flat_slots, **_scale_kwargs(kv_scales, i))
        new_caches.append((key_cache, value_cache))
        o = _dense_attention(q, k, v, mask)
        x = x + o.reshape(r, t, -1) @ layer["wo"]
        x = x + _mlp(layer, x, config.rms_norm_eps)
    last = jnp.clip(prompt_lens - 1, 0, t - 1)
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return _lm_head(params, x_last, config), new_caches


def decode_step_paged(
    params: Params,
    kv_caches: KVCaches,
    tokens: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    slot_mapping: jax.Array,
    seq_lens: jax.Array,
    *,
    config: LlamaConfig,
    attn_impl: str = "auto",
    partition_size: int = 512,
    tensor_parallel: bool = False,
    kv_scales: KVScales = None,
) -> tuple[jax.Array, KVCaches]:
    """One decode step of a batch of sequences on the paged cache.

    Args:
      tokens: int32 ``[B]`` the newest token of each sequence (not yet in the cache).
      positions: int32 ``[B]`` its position (= tokens already in the cache).
      block_tables: int32 ``[B, max_blocks_per_seq]``.
      slot_mapping: int32 ``[B]`` where the new token's K/V goes; -1 for idle slots.
      seq_lens: int32 ``[B]`` context length *including* the new token; 0 for idle slots.
      tensor_parallel: use the ``jax_paged.sharding`` ops (see :func:`paged_ops`).
      kv_scales: fp8 caches: one ``(k_scale, v_scale)`` per layer; None means 1. The query
        stays in the model's dtype (an fp8 cache needs a 16- or 32-bit query).

    Returns:
      ``(logits float32 [B, vocab], kv_caches)``.
    """
    b = tokens.shape[0]
    inv_freq = rope_inv_freq(config)
    ops = paged_ops(tensor_parallel)
    x = params["embed"][tokens]  # [B, D]
    new_caches = []
    for i, (layer, (key_cache, value_cache)) in enumerate(zip(params["layers"], kv_caches)):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(layer, h, config, positions, inv_freq)
        scales = _scale_kwargs(kv_scales, i)
        # Write first, then attend: the new token attends to itself through the cache.
        key_cache, value_cache = ops.reshape_and_cache(
            _cache_input(k, key_cache), _cache_input(v, value_cache), key_cache, value_cache,
            slot_mapping, **scales)
        o = ops.paged_attention(
            _cache_input(q, key_cache), key_cache, value_cache, block_tables, seq_lens,
            scale=config.head_dim ** -0.5, impl=attn_impl, partition_size=partition_size,
            **scales)
        new_caches.append((key_cache, value_cache))
        x = x + o.reshape(b, -1).astype(x.dtype) @ layer["wo"]
        x = x + _mlp(layer, x, config.rms_norm_eps)
    return _lm_head(params, x, config), new_caches


# --------------------------------------------------------------------------------------------
# Dense-cache reference decoding
# --------------------------------------------------------------------------------------------


def _dense_cache_step(params: Params, config: LlamaConfig, k_all: jax.Array, v_all: jax.Array,
                      token: jax.Array, pos: jax.Array, inv_freq: np.ndarray, read_kv=None):
    """One token through a contiguous cache. ``k_all/v_all [L, max_len, KVH, hd]``;
    ``read_kv(layer, k, v)`` (default: as stored) gives the K/V the token attends."""
    max_len = k_all.shape[1]
    x = params["embed"][token][None, None]  # [1, 1, D]
    mask = (jnp.arange(max_len) <= pos)[None, None, :]  # [1, 1, max_len]
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q, k, v = _qkv(layer, h, config, pos[None, None], inv_freq)
        k_all = k_all.at[i, pos].set(k[0, 0].astype(k_all.dtype))
        v_all = v_all.at[i, pos].set(v[0, 0].astype(v_all.dtype))
        k_read, v_read = (k_all[i], v_all[i]) if read_kv is None else read_kv(i, k_all[i], v_all[i])
        o = _dense_attention(q, k_read[None].astype(q.dtype), v_read[None].astype(q.dtype), mask)
        x = x + o.reshape(1, 1, -1) @ layer["wo"]
        x = x + _mlp(layer, x, config.rms_norm_eps)
    return _lm_head(params, x[0, 0], config), k_all, v_all


def _generate_dense_impl(params, prompt, prompt_len, max_new_tokens, eos_id, kv_scales=None, *,
                         config, max_len, cache_dtype=None):
    inv_freq = rope_inv_freq(config)
    dtype = params["embed"].dtype
    shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
    out = jnp.full((max_len,), -1, jnp.int32)

    def cond(c):
        pos, _, _, _, _, n_out, done = c
        return ~done & (pos < max_len)

    def body(c):
        pos, token, k_all, v_all, out, n_out, done = c
        read_kv = None
        if cache_dtype is not None:  # (a static dtype name)
            # The paged engine's prefill attends the prompt's K/V as computed; every later
            # token attends the whole cache as an fp8 cache holds it.
            def read_kv(i, k, v):
                scale_k, scale_v = (None, None) if kv_scales is None else kv_scales[i]
                quantised = pos >= prompt_len
                fp8 = jnp.dtype(cache_dtype)
                return (jnp.where(quantised, fp8_round_trip(k, scale_k, fp8), k),
                        jnp.where(quantised, fp8_round_trip(v, scale_v, fp8), v))
        logits, k_all, v_all = _dense_cache_step(params, config, k_all, v_all, token, pos, inv_freq,
                                                 read_kv)
        nxt = jnp.argmax(logits).astype(jnp.int32)
        in_prompt = pos + 1 < prompt_len
        # While in the prompt, the next input is the next prompt token; after it, the prediction.
        token = jnp.where(in_prompt, prompt[jnp.minimum(pos + 1, max_len - 1)], nxt)
        out = jnp.where(in_prompt, out, out.at[n_out].set(nxt))
        n_out = jnp.where(in_prompt, n_out, n_out + 1)
        done = ~in_prompt & ((n_out >= max_new_tokens) | (nxt == eos_id))
        return pos + 1, token, k_all, v_all, out, n_out, done

    init = (jnp.int32(0), prompt[0], jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), out,
            jnp.int32(0), jnp.bool_(False))
    *_, out, n_out, _ = jax.lax.while_loop(cond, body, init)
    return out, n_out


_generate_dense_jit = jax.jit(_generate_dense_impl,
                              static_argnames=("config", "max_len", "cache_dtype"))


def generate_dense(
    params: Params,
    config: LlamaConfig,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_id: Optional[int] = None,
    max_len: Optional[int] = None,
    *,
    cache_dtype: Any = None,
    kv_scales: KVScales = None,
) -> list[int]:
    """Greedy decoding of one request with a dense (contiguous) KV cache: the reference.

    Feeds the prompt one token at a time through a ``[num_layers, max_len, num_kv_heads,
    head_dim]`` cache with plain masked attention, then generates up to ``max_new_tokens``
    tokens, stopping after (and including) ``eos_id``. ``max_len`` (default: prompt + new tokens
    rounded up to a power of two, to share compilations) bounds the cache.

    ``cache_dtype`` float8_e4m3fn / float8_e5m2 (with ``kv_scales``, one ``(k_scale,
    v_scale)`` per layer, None = 1) mirrors an :class:`~jax_paged.engine.Engine` with an fp8
    cache: the prompt attends its K/V as computed (the engine's dense prefill), every generated
    token attends the whole cache as the fp8 cache returns it
    (:func:`jax_paged.reference.fp8_round_trip`).

    Returns the generated token ids (not including the prompt).
    """
    prompt = [int(t) for t in prompt]
    need = len(prompt) + max_new_tokens
    if max_len is None:
        max_len = max(16, 1 << (need - 1).bit_length())
    if need > max_len:
        raise ValueError(f"prompt + max_new_tokens = {need} > max_len = {max_len}")
    padded = np.zeros(max_len, np.int32)
    padded[: len(prompt)] = prompt
    kv_scales = check_kv_scales(kv_scales, params["embed"].dtype if cache_dtype is None
                                else cache_dtype, config.num_layers)
    if cache_dtype is not None and not is_fp8(cache_dtype):
        cache_dtype = None  # a 16- or 32-bit cache: the model's own values
    out, n = _generate_dense_jit(params, jnp.asarray(padded), jnp.int32(len(prompt)),
                                 jnp.int32(max_new_tokens), jnp.int32(-1 if eos_id is None else eos_id),
                                 kv_scales, config=config, max_len=max_len,
                                 cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype).name)
    return [int(t) for t in np.asarray(out)[: int(n)]]
