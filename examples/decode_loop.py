"""A jitted decode loop over a paged KV cache, checked against dense attention.

Sequences of different lengths share one pool of physical blocks in random
order. Each step of a `lax.fori_loop` writes every sequence's new key/value
into its pages (`reshape_and_cache`) and attends over them
(`paged_attention`); the caches are donated, so the loop updates them in
place. The outputs are compared with ordinary attention over contiguous
per-sequence K/V.

    python examples/decode_loop.py [--steps 32] [--dtype bfloat16] [--impl auto]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import jax
import jax.numpy as jnp

import jax_paged


def build_block_tables(rng, final_lens, block_size, num_blocks):
    """Random, disjoint physical blocks for each sequence, -1 past its last block."""
    needed = [-(-int(n) // block_size) for n in final_lens]
    max_blocks = max(needed)
    ids = rng.permutation(num_blocks)
    tables = np.full((len(final_lens), max_blocks), -1, np.int32)
    pos = 0
    for s, n in enumerate(needed):
        tables[s, :n] = ids[pos:pos + n]
        pos += n
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--impl", default="auto", choices=["auto", "v1", "v2", "reference"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    prompt_lens = np.array([1, 17, 130, 600], np.int32)      # ragged batch
    num_seqs, dtype = len(prompt_lens), jnp.dtype(args.dtype)
    final_lens = prompt_lens + args.steps
    rng = np.random.default_rng(args.seed)
    num_blocks = sum(-(-int(n) // block_size) for n in final_lens) + 8
    tables = build_block_tables(rng, final_lens, block_size, num_blocks)
    x = jax_paged.x_for_dtype(dtype)
    key_cache = jnp.full((num_blocks, num_kv_heads, head_size // x, block_size, x), jnp.nan, dtype)
    value_cache = jnp.full((num_blocks, num_kv_heads, head_size, block_size), jnp.nan, dtype)

    total = int(final_lens.max())
    keys = jnp.asarray(rng.standard_normal((num_seqs, total, num_kv_heads, head_size)), dtype)
    values = jnp.asarray(rng.standard_normal((num_seqs, total, num_kv_heads, head_size)), dtype)
    queries = jnp.asarray(rng.standard_normal((args.steps, num_seqs, num_heads, head_size)), dtype)

    # Prefill: write every prompt token with one reshape_and_cache.
    seq = np.concatenate([np.full(n, s) for s, n in enumerate(prompt_lens)])
    pos = np.concatenate([np.arange(n) for n in prompt_lens])
    slots = (tables[seq, pos // block_size] * block_size + pos % block_size).astype(np.int32)
    key_cache, value_cache = jax_paged.reshape_and_cache(keys[seq, pos], values[seq, pos],
                                                         key_cache, value_cache, slots)

    def decode(key_cache, value_cache, block_tables, seq_lens, keys, values, queries):
        def step(i, carry):
            key_cache, value_cache, outs = carry
            lens = seq_lens + i                       # tokens already cached
            block = jnp.take_along_axis(block_tables, (lens // block_size)[:, None], 1)[:, 0]
            slot = block * block_size + lens % block_size
            rows = jnp.arange(num_seqs)
            key_cache, value_cache = jax_paged.reshape_and_cache(
                keys[rows, lens], values[rows, lens], key_cache, value_cache, slot)
            out = jax_paged.paged_attention(queries[i], key_cache, value_cache, block_tables,
                                            lens + 1, impl=args.impl)
            return key_cache, value_cache, outs.at[i].set(out)
        outs = jnp.zeros(queries.shape, queries.dtype)
        return jax.lax.fori_loop(0, queries.shape[0], step, (key_cache, value_cache, outs))

    decode_donated = jax.jit(decode, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    key_cache, value_cache, outs = decode_donated(key_cache, value_cache, tables, prompt_lens,
                                                  keys, values, queries)
    outs = np.asarray(outs, np.float32)
    elapsed = time.perf_counter() - t0

    # Dense check: ordinary attention over contiguous K/V of each sequence.
    group = num_heads // num_kv_heads
    k32, v32 = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    q32 = np.asarray(queries, np.float32)
    worst = 0.0
    for i in range(args.steps):
        for s in range(num_seqs):
            n = int(prompt_lens[s]) + i + 1
            k = np.repeat(k32[s, :n], group, axis=1)          # [n, H, D]
            v = np.repeat(v32[s, :n], group, axis=1)
            logits = np.einsum("hd,nhd->hn", q32[i, s], k) / np.sqrt(head_size)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            dense = np.einsum("hn,nhd->hd", p / p.sum(-1, keepdims=True), v)
            worst = max(worst, float(np.max(np.abs(outs[i, s] - dense))))
    tol = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}[args.dtype]

    print(f"device: {jax.devices()[0].platform}, CUDA kernels built: "
          f"{jax_paged.has_cuda_kernels()}, impl={args.impl}, dtype={args.dtype}")
    print(f"{num_seqs} sequences, prompt lengths {prompt_lens.tolist()} -> "
          f"{final_lens.tolist()} after {args.steps} decode steps")
    print(f"pool of {num_blocks} blocks x {block_size} tokens, physical order randomised, "
          f"unused slots NaN")
    print(f"decode loop (compile + run): {elapsed:.2f} s")
    print(f"max |paged - dense| = {worst:.2e} (tolerance {tol:g}): "
          f"{'OK' if worst <= tol else 'MISMATCH'}")
    if worst > tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
