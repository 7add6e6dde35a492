"""Beyond one decode step: an fp8 KV cache, a shared prefix merged through the
LSE output, and speculative-decoding verification with multi-token queries.

Each part builds a small paged cache with `reshape_and_cache`, runs
`paged_attention` and checks the result against an independent computation
(it raises if a check fails):

1. fp8 cache: the same keys/values written into a bfloat16 cache and into
   float8_e4m3fn caches with per-KV-head scales (quantised on write,
   dequantised on read); the fp8 output is compared with the bf16 one.
2. Shared prefix: one set of pages holds a prompt prefix shared by every
   sequence; each sequence's own tokens live in its own pages. Attention over
   the prefix and over the suffix, each with `return_lse=True`, merged with
   `merge_attention_states`, equals attention over the whole sequence.
3. Speculative verification: the last `q_len` (draft) tokens are already in
   the cache; one call with a [num_seqs, q_len, num_heads, head_size] query
   scores them all, causally. Row i equals a plain decode step at length
   L - q_len + i + 1.

    python examples/features.py [--impl auto] [--seed 0]
"""
from __future__ import annotations

import argparse

import numpy as np
import jax
import jax.numpy as jnp

import jax_paged

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16


def empty_caches(num_blocks: int, dtype):
    """NaN-filled caches: a read of a slot never written would show."""
    x = jax_paged.x_for_dtype(dtype)
    return (jnp.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x), jnp.nan, dtype),
            jnp.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE), jnp.nan, dtype))


def write_tokens(key_cache, value_cache, keys, values, table, start: int = 0, **scales):
    """Writes keys/values [n, num_kv_heads, head_size] to token positions
    start..start+n of a sequence whose pages are `table`."""
    pos = np.arange(start, start + keys.shape[0])
    slots = jnp.asarray(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, jnp.int32)
    return jax_paged.reshape_and_cache(keys, values, key_cache, value_cache, slots, **scales)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fp8_cache(rng, impl: str) -> None:
    lens = [5, 40, 300]
    tables = rng.permutation(64)[:3 * 19].reshape(3, 19).astype(np.int32)   # 19 pages each
    bf16 = empty_caches(64, jnp.bfloat16)
    fp8 = empty_caches(64, jnp.float8_e4m3fn)
    kv = [(rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)),
           rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE))) for n in lens]
    # Per-KV-head scales from the data's amax: value / scale fits e4m3's +-448.
    amax = lambda i: np.max([np.abs(p[i]).max(axis=(0, 2)) for p in kv], axis=0)  # noqa: E731
    scales = dict(k_scale=jnp.asarray(amax(0) / 448.0, jnp.float32),
                  v_scale=jnp.asarray(amax(1) / 448.0, jnp.float32))
    for s, (k, v) in enumerate(kv):
        k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
        bf16 = write_tokens(*bf16, k, v, tables[s])
        fp8 = write_tokens(*fp8, k, v, tables[s], **scales)
    query = jnp.asarray(rng.standard_normal((3, NUM_HEADS, HEAD_SIZE)), jnp.bfloat16)
    args = (jnp.asarray(tables), jnp.asarray(lens, jnp.int32))
    out_bf16 = jax_paged.paged_attention(query, *bf16, *args, impl=impl)
    out_fp8 = jax_paged.paged_attention(query, *fp8, *args, impl=impl, **scales)
    err = rel_err(out_fp8.astype(jnp.float32), out_bf16.astype(jnp.float32))
    print(f"1. fp8 e4m3 cache ({fp8[0].nbytes + fp8[1].nbytes} bytes vs "
          f"{bf16[0].nbytes + bf16[1].nbytes} for bf16): relative error vs the bf16 cache "
          f"{err:.3f}")
    assert err < 0.1, err   # e4m3 keeps 3 mantissa bits: a few percent is expected


def shared_prefix(rng, impl: str) -> None:
    prefix_len, suffix_lens = 3 * BLOCK_SIZE, [1, 20, 70]   # prefix fills whole pages
    caches = empty_caches(32, jnp.float32)
    prefix_pages = np.array([7, 3, 12], np.int32)
    suffix_tables = np.full((3, 5), -1, np.int32)
    free = iter([p for p in rng.permutation(32) if p not in prefix_pages])
    prefix_kv = [jnp.asarray(rng.standard_normal((prefix_len, NUM_KV_HEADS, HEAD_SIZE)),
                             jnp.float32) for _ in range(2)]
    caches = write_tokens(*caches, *prefix_kv, prefix_pages)
    for s, n in enumerate(suffix_lens):
        suffix_tables[s, :-(-n // BLOCK_SIZE)] = [next(free) for _ in range(-(-n // BLOCK_SIZE))]
        k, v = (jnp.asarray(rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)), jnp.float32)
                for _ in range(2))
        caches = write_tokens(*caches, k, v, suffix_tables[s])
    query = jnp.asarray(rng.standard_normal((3, NUM_HEADS, HEAD_SIZE)), jnp.float32)
    kw = dict(impl=impl, return_lse=True)
    o_pre, lse_pre = jax_paged.paged_attention(
        query, *caches, jnp.asarray(np.tile(prefix_pages, (3, 1))),
        jnp.full((3,), prefix_len, jnp.int32), **kw)
    o_suf, lse_suf = jax_paged.paged_attention(
        query, *caches, jnp.asarray(suffix_tables), jnp.asarray(suffix_lens, jnp.int32), **kw)
    merged, _ = jax_paged.merge_attention_states(o_pre, lse_pre, o_suf, lse_suf)
    # The whole sequence: prefix pages, then the sequence's own pages.
    full_tables = np.concatenate([np.tile(prefix_pages, (3, 1)), suffix_tables], axis=1)
    full_lens = jnp.asarray([prefix_len + n for n in suffix_lens], jnp.int32)
    whole = jax_paged.paged_attention(query, *caches, jnp.asarray(full_tables), full_lens,
                                      impl=impl)
    err = float(jnp.max(jnp.abs(merged - whole)))
    print(f"2. shared {prefix_len}-token prefix + own suffixes, merged via LSE: max |merged - "
          f"whole| = {err:.1e}")
    assert err < 1e-5, err


def speculative_verification(rng, impl: str, q_len: int = 4) -> None:
    lens = np.array([q_len, 37, 129], np.int32)               # each ends with q_len drafts
    tables = rng.permutation(40)[:3 * 9].reshape(3, 9).astype(np.int32)
    caches = empty_caches(40, jnp.float32)
    for s, n in enumerate(lens):
        k, v = (jnp.asarray(rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)), jnp.float32)
                for _ in range(2))
        caches = write_tokens(*caches, k, v, tables[s])
    query = jnp.asarray(rng.standard_normal((3, q_len, NUM_HEADS, HEAD_SIZE)), jnp.float32)
    out = jax_paged.paged_attention(query, *caches, jnp.asarray(tables), jnp.asarray(lens),
                                    impl=impl)
    worst = 0.0
    for i in range(q_len):   # row i sees the cache up to its own position
        step = jax_paged.paged_attention(query[:, i], *caches, jnp.asarray(tables),
                                         jnp.asarray(lens - q_len + i + 1), impl=impl)
        worst = max(worst, float(jnp.max(jnp.abs(out[:, i] - step))))
    print(f"3. {q_len} draft tokens verified in one call: max |row - decode step| = {worst:.1e}")
    assert worst < 1e-5, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="auto", choices=["auto", "v1", "v2", "grouped",
                                                           "reference"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"device: {jax.devices()[0]}, impl={args.impl}")
    fp8_cache(rng, args.impl)
    shared_prefix(rng, args.impl)
    speculative_verification(rng, args.impl)
    print("all checks passed")


if __name__ == "__main__":
    main()
