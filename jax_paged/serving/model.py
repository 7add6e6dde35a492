"""A small, readable decoder for the Llama family and its relatives, whose attention runs on the
paged KV cache.

Architecture (as in Hugging Face ``LlamaForCausalLM``): token embedding, then ``num_layers`` blocks of

    x = x + o_proj(attention(rope(q_proj(rms_norm(x))), rope(k_proj(...)), v_proj(...)))
    x = x + down_proj(act(gate_proj(rms_norm(x))) * up_proj(rms_norm(x)))

then a final RMSNorm and the LM head (tied to the embedding or not). Attention is grouped-query
(``num_kv_heads`` divides ``num_heads``) and RoPE is applied in the *rotate_half* form, which is
the convention Hugging Face checkpoints are stored in (their q/k projection rows are permuted
for it), so HF weights load without any re-permutation.

One module serves every supported family; :class:`ModelConfig` holds the differences, each a
field or a property read at one place in the layer math:

- ``llama`` (Llama 2, 3, 3.1, 3.2): the block above; ``rope_scaling`` ``llama3`` or ``linear``.
- ``mistral``: every layer attends only its last ``sliding_window`` tokens (``window_layers``).
- ``qwen2``: biases on the q/k/v projections (``qkv_bias``).
- ``qwen3``: an RMSNorm over each head of q and k before RoPE (``qk_norm``).
- ``gemma2``: embeddings scaled by ``sqrt(hidden_size)``; RMSNorm scales by ``1 + w`` in float32;
  norms after attention and after the MLP as well as before (``sandwich_norms``); GeGLU with the
  tanh GELU (``hidden_act="gelu_tanh"``); softmax scale ``query_pre_attn_scalar ** -0.5``;
  attention logits capped by ``attn_soft_cap * tanh(logit / attn_soft_cap)``, final logits by
  ``final_soft_cap``; even layers local (``sliding_window``), odd layers global.

Hugging Face checkpoints are read (and refused when they do not fit) by
:mod:`jax_paged.serving.loader`.

Three forward paths share the same layer math:

- :func:`forward` — dense causal attention over whole sequences (logits for every position);
  used for checkpoint tests.
- :func:`prefill_paged` / :func:`decode_step_paged` — the paged path: prefill runs dense causal
  attention over the prompt (windowed on window layers) and writes all prompt K/V with one
  ``jax_paged.reshape_and_cache`` per layer; a decode step writes the new token's K/V with
  ``reshape_and_cache`` and attends with ``jax_paged.paged_attention`` (one call each per layer,
  with the layer's ``sliding_window`` and the config's ``soft_cap``).
- :func:`generate_dense` — the *dense-cache reference*: greedy decoding of one request with a
  contiguous ``[num_layers, max_len, num_kv_heads, head_dim]`` K/V array and plain masked
  attention, one token at a time. It shares no paging or batching code with the engine, so equal
  greedy tokens mean the paged cache, the page allocator and the batching are right.

Parameters are a plain pytree (dicts and lists of ``jax.Array``); linear weights are stored
``[in_features, out_features]`` (``y = x @ w``), i.e. transposed with respect to PyTorch.

Tensor parallelism (Megatron-style, over a 1-D mesh axis ``"tp"``): :func:`shard_params` places
the q/k/v and gate/up weights split on their output columns and o_proj/down_proj on their input
rows; the paged cache ops carry their own partitioning rule and run on each device's local KV
heads (caches sharded on their KV-heads axis). The layer math is unchanged: under
``jax.jit`` XLA partitions it and adds one all-reduce after o_proj and one after down_proj.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_paged
from jax_paged._shapes import is_fp8
from jax_paged.reference import fp8_round_trip

Params = dict[str, Any]
KVCaches = list[tuple[jax.Array, jax.Array]]
# fp8 caches: one (k_scale, v_scale) per layer, each float32 () or [num_kv_heads]; None = 1.
KVScales = Optional[Sequence[tuple[Any, Any]]]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
"""Model families :class:`ModelConfig` describes (see the module docstring)."""

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a decoder of one of :data:`FAMILIES`.

    ``rope_scaling`` is ``None`` or a tuple of ``(key, value)`` pairs (hashable form of HF's
    ``rope_scaling`` dict); types ``"llama3"`` and ``"linear"`` are supported.
    ``window_layers`` lists the layers that attend only their last ``sliding_window`` tokens
    (the token itself included); the others attend the whole context.
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
    family: str = "llama"
    hidden_act: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    window_layers: tuple[int, ...] = ()
    query_pre_attn_scalar: Optional[float] = None
    attn_soft_cap: Optional[float] = None
    final_soft_cap: Optional[float] = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        object.__setattr__(self, "window_layers", tuple(int(i) for i in self.window_layers))
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        bad = [i for i in self.window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"window_layers must be layer indices in [0, {self.num_layers}), got {bad}")
        if self.window_layers and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError(f"window_layers {self.window_layers} need sliding_window >= 1, "
                             f"got {self.sliding_window}")

    # Per-family differences of the layer math (one place each).
    @property
    def unit_offset_norm(self) -> bool:
        """RMSNorm scales by ``1 + w``, computed in float32 (Gemma)."""
        return self.family == "gemma2"

    @property
    def sandwich_norms(self) -> bool:
        """Norms on the attention and MLP outputs too, before the residual add (Gemma 2)."""
        return self.family == "gemma2"

    @property
    def embed_scale(self) -> Optional[float]:
        """Factor on the embeddings (Gemma: ``sqrt(hidden_size)``, rounded to the weights' dtype)."""
        return math.sqrt(self.hidden_size) if self.family == "gemma2" else None

    @property
    def attn_scale(self) -> float:
        """Softmax scale: ``query_pre_attn_scalar ** -0.5`` if set, else ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer`` (None: it attends the whole context)."""
        return self.sliding_window if layer in self.window_layers else None

    @staticmethod
    def preset(name: str, num_layers: Optional[int] = None, **overrides: Any) -> "ModelConfig":
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
        return ModelConfig(**kw)

    def num_params(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        return sum(math.prod(shape) for _, shape, _ in _param_specs(self))


LlamaConfig = ModelConfig
"""The same class: a Llama-family config is a :class:`ModelConfig` with ``family="llama"``."""


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


def init_params(config: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> Params:
    """Random parameters from ``seed``.

    Linear weights ``[in, out]`` ~ N(0, 1/in) so activations stay O(1) at any width (which also
    keeps greedy argmax well separated, avoiding near-ties that float rounding could flip);
    embeddings ~ N(0, 1); norm weights 1 + small noise. Returns the pytree documented in the
    module docstring, all leaves of ``dtype``. Generated on the default device in one jitted
    call (fast even for Llama-3-8B shapes on a GPU).
    """
    return _init_params_jit(jnp.uint32(seed), config=config, dtype=jnp.dtype(dtype))


def _param_specs(c: ModelConfig) -> list[tuple[tuple, tuple[int, ...], str]]:
    """(pytree path, shape, kind) of every parameter, kind in {"embed", "linear", "norm",
    "bias"}. The layer keys beyond the Llama set: ``bq/bk/bv`` (``qkv_bias``), ``q_norm`` /
    ``k_norm`` over one head (``qk_norm``), ``post_attn_norm`` / ``post_mlp_norm``
    (``sandwich_norms``)."""
    d, hd = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_heads * hd, c.num_kv_heads * hd
    layer: list[tuple[str, tuple[int, ...], str]] = [
        ("attn_norm", (d,), "norm"), ("wq", (d, q_out), "linear"),
        ("wk", (d, kv_out), "linear"), ("wv", (d, kv_out), "linear"),
        ("wo", (q_out, d), "linear"), ("mlp_norm", (d,), "norm"),
        ("w_gate", (d, c.intermediate_size), "linear"), ("w_up", (d, c.intermediate_size), "linear"),
        ("w_down", (c.intermediate_size, d), "linear")]
    if c.qkv_bias:
        layer += [("bq", (q_out,), "bias"), ("bk", (kv_out,), "bias"), ("bv", (kv_out,), "bias")]
    if c.qk_norm:
        layer += [("q_norm", (hd,), "norm"), ("k_norm", (hd,), "norm")]
    if c.sandwich_norms:
        layer += [("post_attn_norm", (d,), "norm"), ("post_mlp_norm", (d,), "norm")]
    specs: list[tuple[tuple, tuple[int, ...], str]] = [(("embed",), (c.vocab_size, d), "embed")]
    for i in range(c.num_layers):
        specs += [(("layers", i, name), shape, kind) for name, shape, kind in layer]
    specs.append((("final_norm",), (d,), "norm"))
    if not c.tie_word_embeddings:
        specs.append((("lm_head",), (d, c.vocab_size), "linear"))
    return specs


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _init_params_jit(seed: jax.Array, *, config: ModelConfig, dtype: Any) -> Params:
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
            # Gemma's norms scale by (1 + w): both forms then scale by about 1.
            z = 0.1 * z if config.unit_offset_norm else 1.0 + 0.1 * z
        elif kind == "bias":
            z = 0.1 * z
        node = params
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = z.astype(dtype)
    return params


def cast_params(params: Params, dtype: Any) -> Params:
    """Return ``params`` with every leaf cast to ``dtype``."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a).astype(dtype), params)


# --------------------------------------------------------------------------------------------
# Layer math (shared by every forward path)
# --------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm over the last axis, as HF computes it: normalised in float32, then scaled by
    ``weight`` in ``x``'s dtype (Llama), or by ``1 + weight`` in float32 and cast back
    (``unit_offset``, Gemma)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * y.astype(x.dtype)


def _norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
    return rms_norm(x, weight, config.rms_norm_eps, config.unit_offset_norm)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
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


def _embed(params: Params, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    x = params["embed"][tokens]
    if config.embed_scale is not None:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    return x


def _qkv(layer: Params, x: jax.Array, config: ModelConfig, positions: jax.Array, inv_freq: np.ndarray):
    """Pre-attention norm, projections (+ biases, + per-head q/k norms) and RoPE.
    ``x [..., hidden]`` (the residual stream) -> q ``[..., H, hd]``, k/v ``[..., KVH, hd]``."""
    h = _norm(x, layer["attn_norm"], config)
    lead = h.shape[:-1]
    q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    if config.qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(*lead, config.num_heads, config.head_dim)
    k = k.reshape(*lead, config.num_kv_heads, config.head_dim)
    v = v.reshape(*lead, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q, k = _norm(q, layer["q_norm"], config), _norm(k, layer["k_norm"], config)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _attn_residual(layer: Params, x: jax.Array, o: jax.Array, config: ModelConfig) -> jax.Array:
    """``x`` plus the attention output ``o [..., H * hd]`` through o_proj (and its norm)."""
    y = o.astype(x.dtype) @ layer["wo"]
    if config.sandwich_norms:
        y = _norm(y, layer["post_attn_norm"], config)
    return x + y


def _mlp_residual(layer: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """``x`` plus the gated MLP of its norm (SwiGLU, or GeGLU with the tanh GELU)."""
    h = _norm(x, layer["mlp_norm"], config)
    gate = h @ layer["w_gate"]
    act = jax.nn.silu(gate) if config.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    y = (act * (h @ layer["w_up"])) @ layer["w_down"]
    if config.sandwich_norms:
        y = _norm(y, layer["post_mlp_norm"], config)
    return x + y


def _lm_head(params: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm + LM head (+ final soft cap); logits in float32."""
    x = _norm(x, params["final_norm"], config)
    w = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    logits = (x @ w).astype(jnp.float32)
    if config.final_soft_cap:
        logits = config.final_soft_cap * jnp.tanh(logits / config.final_soft_cap)
    return logits


def _attend_mask(q_pos: jax.Array, k_pos: jax.Array, window: Optional[int]) -> jax.Array:
    """bool ``[..., Tq, Tk]``: causal, and within the last ``window`` tokens when given (the
    query's own token included, as ``paged_attention(sliding_window=)`` and HF count)."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


def _dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     config: ModelConfig) -> jax.Array:
    """Plain GQA attention in float32, with the config's scale and soft cap.

    ``q [B, Tq, H, hd]``, ``k/v [B, Tk, KVH, hd]``, ``mask bool [B, Tq, Tk]`` -> ``[B, Tq, H, hd]``.
    """
    b, tq, nh, hd = q.shape
    nkv = k.shape[2]
    qg = q.reshape(b, tq, nkv, nh // nkv, hd).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32)) * config.attn_scale
    if config.attn_soft_cap:
        logits = config.attn_soft_cap * jnp.tanh(logits / config.attn_soft_cap)
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)  # fully-masked (padding) rows give 0, not NaN
    o = jnp.einsum("bkgqt,btkd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(b, tq, nh, hd).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Dense forward (no cache)
# --------------------------------------------------------------------------------------------


def forward(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Dense causal forward. ``tokens int32 [B, T]`` -> logits ``float32 [B, T, vocab]``."""
    b, t = tokens.shape
    inv_freq = rope_inv_freq(config)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    x = _embed(params, tokens, config)
    for i, layer in enumerate(params["layers"]):
        q, k, v = _qkv(layer, x, config, positions, inv_freq)
        mask = _attend_mask(positions, positions, config.layer_window(i))
        o = _dense_attention(q, k, v, mask, config)
        x = _attn_residual(layer, x, o.reshape(b, t, -1), config)
        x = _mlp_residual(layer, x, config)
    return _lm_head(params, x, config)


# --------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron-style, over heads and the MLP's intermediate axis)
# --------------------------------------------------------------------------------------------

TP_AXIS = "tp"
"""Name of the mesh axis tensor parallelism shards over."""

# Where each layer weight is split: q/k/v and gate/up on their output columns (so each device
# holds whole heads / a slice of the intermediate axis), o_proj and down_proj on their input rows
# (so each device's partial product is summed by one all-reduce). Norms stay replicated.
_LAYER_SPLIT = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 0,
                "bq": 0, "bk": 0, "bv": 0}


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
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


def param_partition_specs(config: ModelConfig, axis: str = TP_AXIS) -> Params:
    """A pytree like the parameters' with the ``PartitionSpec`` of each leaf.

    Embedding, norms and LM head are replicated: they are small next to the layers at the
    sizes this example runs, and a replicated LM head keeps the greedy argmax local. q/k/v
    biases split with their projections' output columns.
    """
    layer_names = [path[2] for path, _, _ in _param_specs(config) if path[:2] == ("layers", 0)]
    layer = {}
    for name in layer_names:
        dim = _LAYER_SPLIT.get(name)
        layer[name] = (P() if dim is None else P(axis) if name in ("bq", "bk", "bv") else
                       P(None, axis) if dim == 1 else P(axis, None))
    specs: Params = {"embed": P(), "layers": [dict(layer) for _ in range(config.num_layers)],
                     "final_norm": P()}
    if not config.tie_word_embeddings:
        specs["lm_head"] = P()
    return specs


def shard_params(params: Params, config: ModelConfig, mesh: Mesh, axis: str = TP_AXIS) -> Params:
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
    """The module whose ``reshape_and_cache`` / ``paged_attention`` the paged paths call:
    the top-level ops in both cases, since they carry their own partitioning rule (each
    device stays on its own KV heads under plain jit) and support vmap."""
    del tensor_parallel
    return jax_paged


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
    config: ModelConfig,
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
      tensor_parallel: caches sharded on KV heads (the ops are the same; see :func:`paged_ops`).
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
    # Causal (and windowed on window layers); padded keys never attended (padded queries are
    # discarded anyway).
    masks = {w: _attend_mask(positions, positions, w) & valid[:, None, :]
             for w in {config.layer_window(i) for i in range(config.num_layers)}}
    flat_slots = slot_mapping.reshape(r * t)
    ops = paged_ops(tensor_parallel)
    x = _embed(params, tokens, config)
    new_caches = []
    for i, (layer, (key_cache, value_cache)) in enumerate(zip(params["layers"], kv_caches)):
        q, k, v = _qkv(layer, x, config, positions, inv_freq)
        # All prompt tokens of all rows in one cache write per layer.
        key_cache, value_cache = ops.reshape_and_cache(
            _cache_input(k.reshape(r * t, config.num_kv_heads, config.head_dim), key_cache),
            _cache_input(v.reshape(r * t, config.num_kv_heads, config.head_dim), value_cache),
            key_cache, value_cache, flat_slots, **_scale_kwargs(kv_scales, i))
        new_caches.append((key_cache, value_cache))
        o = _dense_attention(q, k, v, masks[config.layer_window(i)], config)
        x = _attn_residual(layer, x, o.reshape(r, t, -1), config)
        x = _mlp_residual(layer, x, config)
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
    config: ModelConfig,
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
      tensor_parallel: caches sharded on KV heads (the ops are the same; see :func:`paged_ops`).
      kv_scales: fp8 caches: one ``(k_scale, v_scale)`` per layer; None means 1. The query
        stays in the model's dtype (an fp8 cache needs a 16- or 32-bit query).

    Returns:
      ``(logits float32 [B, vocab], kv_caches)``.
    """
    b = tokens.shape[0]
    inv_freq = rope_inv_freq(config)
    ops = paged_ops(tensor_parallel)
    x = _embed(params, tokens, config)  # [B, D]
    new_caches = []
    for i, (layer, (key_cache, value_cache)) in enumerate(zip(params["layers"], kv_caches)):
        q, k, v = _qkv(layer, x, config, positions, inv_freq)
        scales = _scale_kwargs(kv_scales, i)
        # Write first, then attend: the new token attends to itself through the cache.
        key_cache, value_cache = ops.reshape_and_cache(
            _cache_input(k, key_cache), _cache_input(v, value_cache), key_cache, value_cache,
            slot_mapping, **scales)
        o = ops.paged_attention(
            _cache_input(q, key_cache), key_cache, value_cache, block_tables, seq_lens,
            scale=config.attn_scale, soft_cap=config.attn_soft_cap,
            sliding_window=config.layer_window(i), impl=attn_impl,
            partition_size=partition_size, **scales)
        new_caches.append((key_cache, value_cache))
        x = _attn_residual(layer, x, o.reshape(b, -1), config)
        x = _mlp_residual(layer, x, config)
    return _lm_head(params, x, config), new_caches


EosIds = Union[None, int, Sequence[int]]


def eos_id_array(eos_id: EosIds, size: Optional[int] = None) -> np.ndarray:
    """int32 ``[size]`` of the stop ids ``eos_id`` (one id, several, or None), padded with -1
    (which no token equals); ``size`` defaults to ``max(1, number of ids)``."""
    ids = [] if eos_id is None else [int(eos_id)] if np.ndim(eos_id) == 0 else [int(e) for e in eos_id]
    size = max(1, len(ids)) if size is None else size
    if len(ids) > size:
        raise ValueError(f"eos_id: at most {size} stop ids, got {len(ids)}: {ids}")
    out = np.full(size, -1, np.int32)
    out[: len(ids)] = ids
    return out


# --------------------------------------------------------------------------------------------
# Dense-cache reference decoding
# --------------------------------------------------------------------------------------------


def _dense_cache_step(params: Params, config: ModelConfig, k_all: jax.Array, v_all: jax.Array,
                      token: jax.Array, pos: jax.Array, inv_freq: np.ndarray, read_kv=None):
    """One token through a contiguous cache. ``k_all/v_all [L, max_len, KVH, hd]``;
    ``read_kv(layer, k, v)`` (default: as stored) gives the K/V the token attends."""
    max_len = k_all.shape[1]
    x = _embed(params, token, config)[None, None]  # [1, 1, D]
    for i, layer in enumerate(params["layers"]):
        q, k, v = _qkv(layer, x, config, pos[None, None], inv_freq)
        mask = _attend_mask(pos[None, None], jnp.arange(max_len)[None], config.layer_window(i))
        k_all = k_all.at[i, pos].set(k[0, 0].astype(k_all.dtype))
        v_all = v_all.at[i, pos].set(v[0, 0].astype(v_all.dtype))
        k_read, v_read = (k_all[i], v_all[i]) if read_kv is None else read_kv(i, k_all[i], v_all[i])
        o = _dense_attention(q, k_read[None].astype(q.dtype), v_read[None].astype(q.dtype), mask,
                             config)
        x = _attn_residual(layer, x, o.reshape(1, 1, -1), config)
        x = _mlp_residual(layer, x, config)
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
        done = ~in_prompt & ((n_out >= max_new_tokens) | jnp.any(nxt == eos_id))
        return pos + 1, token, k_all, v_all, out, n_out, done

    init = (jnp.int32(0), prompt[0], jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), out,
            jnp.int32(0), jnp.bool_(False))
    *_, out, n_out, _ = jax.lax.while_loop(cond, body, init)
    return out, n_out


_generate_dense_jit = jax.jit(_generate_dense_impl,
                              static_argnames=("config", "max_len", "cache_dtype"))


def generate_dense(
    params: Params,
    config: ModelConfig,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_id: EosIds = None,
    max_len: Optional[int] = None,
    *,
    cache_dtype: Any = None,
    kv_scales: KVScales = None,
) -> list[int]:
    """Greedy decoding of one request with a dense (contiguous) KV cache: the reference.

    Feeds the prompt one token at a time through a ``[num_layers, max_len, num_kv_heads,
    head_dim]`` cache with plain masked attention, then generates up to ``max_new_tokens``
    tokens, stopping after (and including) ``eos_id`` (one id, several, or None). ``max_len`` (default: prompt + new tokens
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
                                 jnp.int32(max_new_tokens), jnp.asarray(eos_id_array(eos_id)),
                                 kv_scales, config=config, max_len=max_len,
                                 cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype).name)
    return [int(t) for t in np.asarray(out)[: int(n)]]
