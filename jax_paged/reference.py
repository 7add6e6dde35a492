"""Pure ``jax.numpy`` reference with the kernels' exact semantics.

Every native kernel is tested against these functions; they mirror the
kernels step for step (see ``csrc/cpu/paged_attention_cpu.h``):

* effective length ``L = clip(seq_len, 0, max_blocks_per_seq * block_size)``;
* query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
* query row ``i`` of ``q_len`` (a 3-D query is ``q_len = 1``) sits at position
  ``L - q_len + i`` and attends tokens ``[start_i, end_i)`` with
  ``end_i = max(0, L - q_len + 1 + i)`` (causal) and ``start_i = max(0, end_i -
  w)`` with a sliding window ``w`` (else 0);
* fp8 caches are dequantised as ``value * scale`` (``k_scale`` / ``v_scale``,
  one per tensor or per KV head);
* ``logit_t = scale * q.k_t + slope[h] * (t - (end_i - 1))``, then with a soft
  cap ``c``: ``c * tanh(logit_t / c)``;
* tokens outside the row's range or whose physical block id is outside
  ``[0, num_blocks)`` are masked (they never enter max or sum, and their K/V
  are replaced by zeros because ``0 * NaN = NaN``);
* ``p_t = exp(logit_t - max) / (sum + 1e-6)``, max starting at ``-FLT_MAX``,
  so an empty range gives zeros; ``lse = max + log(sum + 1e-6)`` (``-inf``
  for an empty range, NaN where a NaN query or key makes the sum NaN), so
  that ``out * exp(lse) = sum_t exp(logit_t) v_t``;
* V2 splits the context into partitions of ``partition_size`` tokens, each
  normalised on its own, merged with the global max; partitions that do not
  overlap the row's range are left out of the merge, and
  ``lse = M + log(W + 1e-6)`` with ``W`` the merged weight.

The reference gathers the whole block-table width and is meant for testing
and as a fallback on platforms without native kernels, not for speed.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from . import _shapes

_NEG_FLT_MAX = float(np.finfo(np.float32).min)
_HIGHEST = jax.lax.Precision.HIGHEST

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "query_row_ranges",
           "fp8_round_trip"]


def _gather_kv(key_cache, value_cache, block_tables, dims):
    """Logical K/V per sequence: [num_seqs, num_kv_heads, capacity, head_size] float32,
    plus the validity of each token's physical block [num_seqs, capacity]."""
    num_blocks = dims.num_blocks
    block_valid = (block_tables >= 0) & (block_tables < num_blocks)
    s, m = block_tables.shape
    if num_blocks == 0:  # an empty pool: every id is invalid, nothing is read
        shape = (s, dims.num_kv_heads, m * dims.block_size, dims.head_size)
        return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((s, m * dims.block_size), bool))
    safe = jnp.where(block_valid, block_tables, 0)
    k = key_cache[safe]          # [S, M, Hkv, D/x, B, x]
    k = k.transpose(0, 2, 1, 4, 3, 5).reshape(s, dims.num_kv_heads, m * dims.block_size,
                                               dims.head_size)
    v = value_cache[safe]        # [S, M, Hkv, D, B]
    v = v.transpose(0, 2, 1, 4, 3).reshape(s, dims.num_kv_heads, m * dims.block_size,
                                           dims.head_size)
    token_block_valid = jnp.repeat(block_valid, dims.block_size, axis=1)
    return k.astype(jnp.float32), v.astype(jnp.float32), token_block_valid


def _per_kv_head(scale, num_kv_heads):
    """A scale of shape (), (1,) or (num_kv_heads,) as float32 [num_kv_heads]."""
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (num_kv_heads,))


def query_row_ranges(seq_lens, capacity: int, q_len: int, sliding_window: int | None):
    """Per (sequence, query row): the attended token range ``[start, end)``,
    int32 ``[num_seqs, q_len]`` each (see the module docstring)."""
    lens = jnp.clip(seq_lens, 0, capacity)
    ends = jnp.maximum(lens[:, None] - q_len + 1 + jnp.arange(q_len, dtype=jnp.int32)[None, :], 0)
    if sliding_window:
        starts = jnp.maximum(ends - sliding_window, 0)
    else:
        starts = jnp.zeros_like(ends)
    return starts, ends


def _log_sum_exp(m, s):
    """-inf where nothing is attended (s == 0); NaN where s is NaN (a NaN query or key)."""
    return jnp.where(s == 0, -jnp.inf, m + jnp.log(s + 1e-6))


def _normalised_partial(logits, v, spec):
    """Softmax-weighted V over the last axis of ``logits`` (masked entries are -inf);
    ``spec`` is the einsum of the probabilities with ``v``.

    Returns (out = sum p v / (sum + 1e-6), max logit, exp-sum)."""
    m = jnp.max(logits, axis=-1, initial=_NEG_FLT_MAX)   # NaN propagates; empty: -FLT_MAX
    p = jnp.exp(logits - m[..., None])
    s = jnp.sum(p, axis=-1)
    acc = jnp.einsum(spec, p, v, precision=_HIGHEST)
    return acc / (s[..., None] + 1e-6), m, s


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None,
                    alibi_slopes=None, impl: str = "auto", partition_size: int = 512,
                    k_scale=None, v_scale=None, soft_cap=None, sliding_window=None,
                    return_lse: bool = False):
    """Reference paged attention; same signature and semantics as
    :func:`jax_paged.paged_attention`. ``impl="v2"`` follows the partitioned
    V2 computation, anything else the single-pass V1 computation."""
    query, key_cache, value_cache, block_tables, seq_lens = map(
        jnp.asarray, (query, key_cache, value_cache, block_tables, seq_lens))
    k_scale = _shapes.check_concrete_scale("k_scale", k_scale)
    v_scale = _shapes.check_concrete_scale("v_scale", v_scale)
    alibi_slopes, k_scale, v_scale = (None if a is None else jnp.asarray(a)
                                      for a in (alibi_slopes, k_scale, v_scale))
    dims = _shapes.check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi_slopes, k_scale, v_scale)
    soft_cap = _shapes.check_soft_cap(soft_cap)
    sliding_window = _shapes.check_sliding_window(sliding_window)
    scale = _shapes.check_softmax_scale(scale, dims.head_size)
    num_seqs, num_heads, head_size = dims.num_seqs, dims.num_heads, dims.head_size
    q_len = dims.q_len
    kv_heads, group = dims.num_kv_heads, num_heads // dims.num_kv_heads
    capacity = dims.capacity

    k, v, token_block_valid = _gather_kv(key_cache, value_cache, block_tables, dims)
    if k_scale is not None:
        k = k * _per_kv_head(k_scale, kv_heads)[None, :, None, None]
    if v_scale is not None:
        v = v * _per_kv_head(v_scale, kv_heads)[None, :, None, None]
    starts, ends = query_row_ranges(seq_lens, capacity, q_len, sliding_window)   # [S, Q]
    t = jnp.arange(capacity, dtype=jnp.int32)
    mask = ((t[None, None, :] >= starts[..., None]) & (t[None, None, :] < ends[..., None])
            & token_block_valid[:, None, :])                                    # [S, Q, T]

    # Zero K and V that no row attends (0 * NaN = NaN): unused slots may hold
    # anything, and the gradient must not see them either.
    any_row = jnp.any(mask, axis=1)                                             # [S, T]
    k = jnp.where(any_row[:, None, :, None], k, 0.0)
    v = jnp.where(any_row[:, None, :, None], v, 0.0)
    q = query.astype(jnp.float32).reshape(num_seqs, q_len, kv_heads, group, head_size)
    logits = scale * jnp.einsum("sqkgd,sktd->sqkgt", q, k, precision=_HIGHEST)
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(kv_heads, group)
        rel = (t[None, None, :] - (ends[..., None] - 1)).astype(jnp.float32)   # [S, Q, T]
        logits = logits + slopes[None, None, :, :, None] * rel[:, :, None, None, :]
    if soft_cap:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(mask[:, :, None, None, :], logits, -jnp.inf)            # [S,Q,K,G,T]

    if impl != "v2":
        out, m, s = _normalised_partial(logits, v, "sqkgt,sktd->sqkgd")
        lse = _log_sum_exp(m, s)
    else:
        partition_size = _shapes.check_partition_size(partition_size, dims.block_size)
        # Sizes past the capacity all mean one partition (as in the kernels' lowering).
        partition_size = min(partition_size, max(dims.block_size, capacity))
        parts = dims.num_partitions(partition_size)
        pad = parts * partition_size - capacity
        logits = jnp.pad(logits, ((0, 0),) * 4 + ((0, pad),), constant_values=-jnp.inf)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
        logits = logits.reshape(logits.shape[:4] + (parts, partition_size))   # [S,Q,K,G,P,PS]
        v = v.reshape(num_seqs, kv_heads, parts, partition_size, head_size)
        tmp_out, max_logits, exp_sums = _normalised_partial(               # [S,Q,K,G,P(,D)]
            logits, v, "sqkgpt,skptd->sqkgpd")
        p0 = jnp.arange(parts) * partition_size
        exists = ((p0[None, None, :] < ends[..., None])
                  & (p0[None, None, :] + partition_size > starts[..., None]))  # [S, Q, P]
        exists = exists[:, :, None, None, :]
        global_max = jnp.max(jnp.where(exists, max_logits, _NEG_FLT_MAX), axis=-1, keepdims=True)
        w = jnp.where(exists, exp_sums * jnp.exp(max_logits - global_max), 0.0)
        total = jnp.sum(w, axis=-1)
        out = jnp.sum(w[..., None] * tmp_out, axis=-2) / (total[..., None] + 1e-6)
        lse = _log_sum_exp(global_max[..., 0], total)
    out = out.reshape(query.shape).astype(query.dtype)
    if not return_lse:
        return out
    lse = lse.reshape(query.shape[:-1])
    return out, lse


def _quantise(x, scale, cache_dtype):
    """x / scale saturated to the fp8 format's largest finite value, rounded to
    nearest even (XLA's conversion); x [T, Hkv, D], scale per KV head."""
    limit = float(jnp.finfo(cache_dtype).max)
    x = x.astype(jnp.float32)
    # A true (correctly rounded) division, as the kernels do: XLA would
    # otherwise rewrite x / broadcast(s) as x * broadcast(1 / s), which rounds
    # differently near fp8 rounding ties.
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale[None, :, None], x.shape))
    return jnp.clip(x / divisor, -limit, limit).astype(cache_dtype)


def fp8_round_trip(x, scale, cache_dtype):
    """What attention reads back for values written to an fp8 cache: ``x`` [T,
    num_kv_heads, head_size] stored as ``reshape_and_cache`` stores it (``x / scale``
    saturated, rounded to nearest even) and read as ``paged_attention`` reads it
    (``value * scale``), in float32. ``scale``: None (= 1), a scalar or
    ``[num_kv_heads]``."""
    x = jnp.asarray(x)
    if not _shapes.is_fp8(cache_dtype):
        raise TypeError(f"cache_dtype must be float8_e4m3fn or float8_e5m2, got "
                        f"{jnp.dtype(cache_dtype).name}")
    s = _per_kv_head(1.0 if scale is None else scale, x.shape[1])
    return _quantise(x, s, cache_dtype).astype(jnp.float32) * s[None, :, None]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None,
                      v_scale=None):
    """Reference cache write; same semantics as :func:`jax_paged.reshape_and_cache`.

    Token ``i`` goes to block ``slot // block_size``, offset ``slot % block_size``;
    slots outside ``[0, num_blocks * block_size)`` are dropped. fp8 caches store
    ``value / scale`` saturated to the format's largest finite value."""
    key, value, key_cache, value_cache, slot_mapping = map(
        jnp.asarray, (key, value, key_cache, value_cache, slot_mapping))
    k_scale = _shapes.check_concrete_scale("k_scale", k_scale, for_write=True)
    v_scale = _shapes.check_concrete_scale("v_scale", v_scale, for_write=True)
    k_scale, v_scale = (None if a is None else jnp.asarray(a) for a in (k_scale, v_scale))
    _shapes.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                    k_scale, v_scale)
    num_blocks, _, _, block_size, x = key_cache.shape
    num_tokens, kv_heads, head_size = key.shape
    if _shapes.is_fp8(key_cache.dtype):
        ones = jnp.ones((kv_heads,), jnp.float32)
        key = _quantise(key, ones if k_scale is None else _per_kv_head(k_scale, kv_heads),
                        key_cache.dtype)
        value = _quantise(value, ones if v_scale is None else _per_kv_head(v_scale, kv_heads),
                          value_cache.dtype)
    valid = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    block = jnp.where(valid, slot_mapping // block_size, num_blocks)  # num_blocks: dropped
    offset = jnp.where(valid, slot_mapping % block_size, 0)
    k = key.reshape(num_tokens, kv_heads, head_size // x, x)
    key_cache = key_cache.at[block, :, :, offset, :].set(k, mode="drop")
    value_cache = value_cache.at[block, :, :, offset].set(value, mode="drop")
    return key_cache, value_cache


def copy_blocks(key_cache, value_cache, block_mapping):
    """Reference block copy: ``cache[dst] = cache[src]`` for each (src, dst) row of
    ``block_mapping``; rows with an id outside ``[0, num_blocks)`` are skipped.
    Defined when no destination repeats and no destination is also a source."""
    key_cache, value_cache, block_mapping = map(jnp.asarray,
                                                (key_cache, value_cache, block_mapping))
    _shapes.check_copy_blocks(key_cache, value_cache, block_mapping)
    num_blocks = key_cache.shape[0]
    if num_blocks == 0:  # an empty pool: every pair is skipped
        return key_cache, value_cache
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    valid = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = jnp.where(valid, src, 0)
    dst = jnp.where(valid, dst, num_blocks)  # out of range: dropped
    key_cache = key_cache.at[dst].set(key_cache[src], mode="drop")
    value_cache = value_cache.at[dst].set(value_cache[src], mode="drop")
    return key_cache, value_cache
