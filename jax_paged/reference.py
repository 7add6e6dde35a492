"""Pure ``jax.numpy`` reference with the kernels' exact semantics.

Every native kernel is tested against these functions; they mirror the
kernels step for step (see ``cuda/cpu/paged_attention_cpu.h``):

* effective length ``L = clip(seq_len, 0, max_blocks_per_seq * block_size)``;
* query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
* ``logit_t = scale * q.k_t + slope[h] * (t - (L - 1))`` for ``t < L``;
* tokens whose physical block id is outside ``[0, num_blocks)`` are masked,
  like tokens at or past ``L`` (they never enter max or sum, and their V is
  replaced by zeros because ``0 * NaN = NaN``);
* ``p_t = exp(logit_t - max) / (sum + 1e-6)``, max starting at ``-FLT_MAX``,
  so an empty sequence gives zeros;
* V2 splits the context into partitions of ``partition_size`` tokens, each
  normalised on its own, merged with the global max; partitions starting at or
  past ``L`` are left out of the merge.

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

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks"]


def _gather_kv(key_cache, value_cache, block_tables, dims):
    """Logical K/V per sequence: [num_seqs, num_kv_heads, capacity, head_size] float32,
    plus the validity of each token's physical block [num_seqs, capacity]."""
    num_blocks = dims.num_blocks
    block_valid = (block_tables >= 0) & (block_tables < num_blocks)
    safe = jnp.where(block_valid, block_tables, 0)
    s, m = block_tables.shape
    k = key_cache[safe]          # [S, M, Hkv, D/x, B, x]
    k = k.transpose(0, 2, 1, 4, 3, 5).reshape(s, dims.num_kv_heads, m * dims.block_size,
                                               dims.head_size)
    v = value_cache[safe]        # [S, M, Hkv, D, B]
    v = v.transpose(0, 2, 1, 4, 3).reshape(s, dims.num_kv_heads, m * dims.block_size,
                                           dims.head_size)
    token_block_valid = jnp.repeat(block_valid, dims.block_size, axis=1)
    return k.astype(jnp.float32), v.astype(jnp.float32), token_block_valid


def _normalised_partial(logits, v):
    """Softmax-weighted V over the last axis of ``logits`` (masked entries are -inf).

    Returns (out = sum p v / (sum + 1e-6), max logit, exp-sum)."""
    m = jnp.maximum(jnp.max(logits, axis=-1), _NEG_FLT_MAX)
    p = jnp.exp(logits - m[..., None])
    s = jnp.sum(p, axis=-1)
    acc = jnp.einsum("...gt,...td->...gd", p, v, precision=_HIGHEST)
    return acc / (s[..., None] + 1e-6), m, s


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None,
                    alibi_slopes=None, impl: str = "auto", partition_size: int = 512):
    """Reference paged attention; same signature and semantics as
    :func:`jax_paged.paged_attention`. ``impl="v2"`` follows the partitioned
    V2 computation, anything else the single-pass V1 computation."""
    query, key_cache, value_cache, block_tables, seq_lens = map(
        jnp.asarray, (query, key_cache, value_cache, block_tables, seq_lens))
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes)
    dims = _shapes.check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi_slopes)
    if scale is None:
        scale = dims.head_size ** -0.5
    num_seqs, num_heads, head_size = query.shape
    kv_heads, group = dims.num_kv_heads, num_heads // dims.num_kv_heads
    capacity = dims.capacity

    k, v, token_block_valid = _gather_kv(key_cache, value_cache, block_tables, dims)
    lens = jnp.clip(seq_lens, 0, capacity)                                   # effective L
    t = jnp.arange(capacity, dtype=jnp.int32)
    mask = (t[None, :] < lens[:, None]) & token_block_valid                  # [S, T]

    # Zero masked K and V (0 * NaN = NaN): unused slots may hold anything, and
    # the gradient must not see them either.
    k = jnp.where(mask[:, None, :, None], k, 0.0)
    v = jnp.where(mask[:, None, :, None], v, 0.0)
    q = query.astype(jnp.float32).reshape(num_seqs, kv_heads, group, head_size)
    logits = scale * jnp.einsum("skgd,sktd->skgt", q, k, precision=_HIGHEST)
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(kv_heads, group)
        rel = (t[None, :] - (lens[:, None] - 1)).astype(jnp.float32)         # [S, T]
        logits = logits + slopes[None, :, :, None] * rel[:, None, None, :]
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)

    if impl != "v2":
        out, _, _ = _normalised_partial(logits, v)
    else:
        _shapes.check_partition_size(partition_size, dims.block_size)
        parts = dims.num_partitions(partition_size)
        pad = parts * partition_size - capacity
        logits = jnp.pad(logits, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
        logits = logits.reshape(num_seqs, kv_heads, group, parts, partition_size)
        logits = logits.transpose(0, 1, 3, 2, 4)                             # [S,K,P,G,PS]
        v = v.reshape(num_seqs, kv_heads, parts, partition_size, head_size)
        tmp_out, max_logits, exp_sums = _normalised_partial(logits, v)       # [S,K,P,G,(D)]
        exists = (jnp.arange(parts) * partition_size)[None, :] < lens[:, None]   # [S, P]
        exists = exists[:, None, :, None]
        global_max = jnp.max(jnp.where(exists, max_logits, _NEG_FLT_MAX), axis=2, keepdims=True)
        w = jnp.where(exists, exp_sums * jnp.exp(max_logits - global_max), 0.0)
        out = jnp.sum(w[..., None] * tmp_out, axis=2) / (jnp.sum(w, axis=2)[..., None] + 1e-6)
    return out.reshape(num_seqs, num_heads, head_size).astype(query.dtype)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Reference cache write; same semantics as :func:`jax_paged.reshape_and_cache`.

    Token ``i`` goes to block ``slot // block_size``, offset ``slot % block_size``;
    slots outside ``[0, num_blocks * block_size)`` are dropped."""
    key, value, key_cache, value_cache, slot_mapping = map(
        jnp.asarray, (key, value, key_cache, value_cache, slot_mapping))
    _shapes.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    num_blocks, _, _, block_size, x = key_cache.shape
    num_tokens, kv_heads, head_size = key.shape
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
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    valid = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = jnp.where(valid, src, 0)
    dst = jnp.where(valid, dst, num_blocks)  # out of range: dropped
    key_cache = key_cache.at[dst].set(key_cache[src], mode="drop")
    value_cache = value_cache.at[dst].set(value_cache[src], mode="drop")
    return key_cache, value_cache
