"""Random paged-attention inputs for tests.

Physical blocks are a random permutation; table entries past a sequence's
last block are -1 (or garbage, on request); every cache slot that is not part
of some sequence (unused blocks and the tail of each last block) is NaN, so a
kernel that reads what it must not read produces NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import jax
import jax.numpy as jnp

# Kernel vs reference tolerances per dtype (absolute, relative). Both compute
# in float32 and round once to the output dtype; differences come from the
# summation order, so they are about one unit in the last place of the output
# dtype (bf16: 2^-8 relative, f16: 2^-11) at |out| <= ~2.
TOLERANCES = {
    np.dtype(np.float32): (2e-5, 2e-5),
    np.dtype(jnp.float16): (2e-3, 2e-3),
    np.dtype(jnp.bfloat16): (1.6e-2, 1e-2),
}

DTYPES = (np.float32, jnp.float16, jnp.bfloat16)


@dataclass
class PagedInputs:
    query: np.ndarray         # [S, H, D]
    key_cache: np.ndarray     # [N, Hkv, D/x, B, x]
    value_cache: np.ndarray   # [N, Hkv, D, B]
    block_tables: np.ndarray  # [S, M] int32
    seq_lens: np.ndarray      # [S] int32
    keys: list                # per sequence [L, Hkv, D] float32 (logical order)
    values: list

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens)


def make_paged_inputs(rng: np.random.Generator, seq_lens, num_heads: int, num_kv_heads: int,
                      head_size: int, block_size: int, dtype=np.float32, extra_blocks: int = 3,
                      max_blocks_per_seq: int | None = None, padding: str = "minus_one",
                      poison: bool = True) -> PagedInputs:
    dtype = np.dtype(dtype)
    x = 16 // dtype.itemsize
    seq_lens = np.asarray(seq_lens, np.int32)
    num_seqs = len(seq_lens)
    used = [-(-int(L) // block_size) for L in seq_lens]
    m = max_blocks_per_seq or max(1, max(used, default=1))
    num_blocks = sum(used) + extra_blocks
    perm = rng.permutation(num_blocks).astype(np.int32)

    key_cache = rng.standard_normal((num_blocks, num_kv_heads, head_size // x, block_size, x))
    value_cache = rng.standard_normal((num_blocks, num_kv_heads, head_size, block_size))
    if poison:
        key_cache[:] = np.nan
        value_cache[:] = np.nan
    tables = np.full((num_seqs, m), -1, np.int32)
    if padding == "garbage":
        tables = rng.integers(-2 ** 31, 2 ** 31 - 1, size=(num_seqs, m), dtype=np.int64)
        tables = tables.astype(np.int32)
    keys, values = [], []
    pos = 0
    for s, L in enumerate(seq_lens):
        k = rng.standard_normal((int(L), num_kv_heads, head_size))
        v = rng.standard_normal((int(L), num_kv_heads, head_size))
        # Round through the dtype so the logical copy equals what the cache holds.
        k = k.astype(dtype).astype(np.float32)
        v = v.astype(dtype).astype(np.float32)
        keys.append(k)
        values.append(v)
        for j in range(used[s]):
            blk = perm[pos]
            pos += 1
            tables[s, j] = blk
            n = min(block_size, int(L) - j * block_size)
            kb = k[j * block_size:j * block_size + n]            # [n, Hkv, D]
            key_cache[blk, :, :, :n, :] = kb.reshape(n, num_kv_heads, head_size // x,
                                                     x).transpose(1, 2, 0, 3)
            value_cache[blk, :, :, :n] = v[j * block_size:j * block_size + n].transpose(1, 2, 0)
    query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(dtype)
    return PagedInputs(query, key_cache.astype(dtype), value_cache.astype(dtype), tables,
                       seq_lens, keys, values)


def dense_attention(query, keys, values, scale, alibi_slopes=None) -> np.ndarray:
    """Ordinary attention over each logical sequence (float64 NumPy)."""
    num_seqs, num_heads, head_size = query.shape
    out = np.zeros((num_seqs, num_heads, head_size))
    for s in range(num_seqs):
        k, v = keys[s].astype(np.float64), values[s].astype(np.float64)
        L = k.shape[0]
        if L == 0:
            continue
        group = num_heads // k.shape[1]
        for h in range(num_heads):
            logits = scale * k[:, h // group, :] @ query[s, h].astype(np.float64)
            if alibi_slopes is not None:
                logits = logits + alibi_slopes[h] * (np.arange(L) - (L - 1))
            p = np.exp(logits - logits.max())
            out[s, h] = (p / p.sum()) @ v[:, h // group, :]
    return out


def on(platform: str, *arrays):
    """Places arrays on the first device of a platform.

    On the CPU, device_put of a 64-byte-aligned NumPy array aliases NumPy's
    memory, and such a buffer cannot be donated (XLA copies instead): the
    copy makes every array JAX-owned, so donation tests do not depend on
    where NumPy happened to allocate."""
    dev = jax.devices(platform)[0]
    put = (lambda a: jax.device_put(a, dev).copy()) if dev.platform == "cpu" else (
        lambda a: jax.device_put(a, dev))
    return tuple(put(a) for a in arrays)


def reference_on_cpu(fn, *args, **kwargs):
    """Runs a reference function on the CPU, whatever the default device."""
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.tree.map(np.asarray, fn(*args, **kwargs))


def assert_close(actual, expected, dtype, what=""):
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values in the output"
    atol, rtol = TOLERANCES[np.dtype(dtype)]
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol, err_msg=what)


def page_walk_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                        alibi_slopes=None) -> np.ndarray:
    """Independent oracle: walks each sequence's pages token by token (float64 NumPy)."""
    query = np.asarray(query, np.float64)
    key_cache = np.asarray(key_cache, np.float64)
    value_cache = np.asarray(value_cache, np.float64)
    num_seqs, num_heads, head_size = query.shape
    block_size = key_cache.shape[3]
    group = num_heads // key_cache.shape[1]
    out = np.zeros_like(query)
    for s in range(num_seqs):
        L = int(seq_lens[s])
        for h in range(num_heads):
            kvh = h // group
            logits, vs = [], []
            for t in range(L):
                blk, off = block_tables[s, t // block_size], t % block_size
                k = key_cache[blk, kvh, :, off, :].reshape(head_size)
                logit = scale * float(query[s, h] @ k)
                if alibi_slopes is not None:
                    logit += float(alibi_slopes[h]) * (t - (L - 1))
                logits.append(logit)
                vs.append(value_cache[blk, kvh, :, off])
            if L:
                p = np.exp(np.array(logits) - max(logits))
                out[s, h] = (p / p.sum()) @ np.array(vs)
    return out


def count_prims(jaxpr, prim) -> int:
    """Occurrences of a primitive in a jaxpr, nested jaxprs (custom_vjp, jit) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive is prim
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    n += count_prims(sub, prim)
    return n
