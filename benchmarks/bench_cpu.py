"""CPU kernels vs the jnp reference (both jitted, on the CPU), median of repeats.

    python benchmarks/bench_cpu.py [--seqs 8] [--len 2048] [--repeats 7] [--no-features]

Rows: a decode step with float32 and bfloat16 caches (`auto`, `v1`, `v2`, the
reference), then issue 6's paths with a bfloat16 query (`auto` against the
reference): an fp8 e4m3 cache, soft cap 30, a 256-token window, LSE output,
and multi-token queries of 4 and 16 tokens. Random N(0, 1) data, block tables
a random permutation, every sequence of length --len.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import jax
import jax.numpy as jnp

import jax_paged


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(a, rng, cache_dtype, query_dtype, q_len=None):
    x = jax_paged.x_for_dtype(cache_dtype)
    blocks_per_seq = -(-a.len // a.block_size)
    n = a.seqs * blocks_per_seq
    kc = jnp.asarray(rng.standard_normal((n, a.kv_heads, a.head_size // x, a.block_size, x)),
                     jnp.float32).astype(cache_dtype)
    vc = jnp.asarray(rng.standard_normal((n, a.kv_heads, a.head_size, a.block_size)),
                     jnp.float32).astype(cache_dtype)
    qshape = ((a.seqs, a.heads, a.head_size) if q_len is None
              else (a.seqs, q_len, a.heads, a.head_size))
    q = jnp.asarray(rng.standard_normal(qshape), query_dtype)
    bt = jnp.asarray(rng.permutation(n).reshape(a.seqs, blocks_per_seq), jnp.int32)
    sl = jnp.full((a.seqs,), a.len, jnp.int32)
    return q, kc, vc, bt, sl


def time_impls(args, impls, repeats, **kwargs):
    row = {}
    for impl in impls:
        f = jax.jit(lambda *xs, impl=impl: jax_paged.paged_attention(*xs, impl=impl, **kwargs))
        row[impl] = median_seconds(f, *args, repeats=repeats)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-features", action="store_true", help="decode rows only")
    a = p.parse_args()
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    print(f"CPU threads available: {jax_paged.primitives._cpu_threads()}, jax {jax.__version__}")
    print(f"{a.seqs} seqs x {a.len} tokens, {a.heads} heads / {a.kv_heads} KV heads, "
          f"head {a.head_size}, block {a.block_size}")
    with jax.default_device(cpu):
        for dtype in (jnp.float32, jnp.bfloat16):
            args = make_inputs(a, rng, dtype, dtype)
            row = time_impls(args, ("auto", "v1", "v2", "reference"), a.repeats)
            ref = row["reference"]
            print(f"{jnp.dtype(dtype).name:>8} decode: " + ", ".join(
                f"{k} {v * 1e3:.2f} ms ({ref / v:.2f}x vs reference)" for k, v in row.items()),
                flush=True)
        if a.no_features:
            return
        scale = jnp.float32(0.5)
        features = [
            ("fp8 e4m3 cache", dict(cache_dtype=jnp.float8_e4m3fn),
             dict(k_scale=scale, v_scale=scale)),
            ("soft cap 30", {}, dict(soft_cap=30.0)),
            ("window 256", {}, dict(sliding_window=256)),
            ("return_lse", {}, dict(return_lse=True)),
            ("q_len 4", dict(q_len=4), {}),
            ("q_len 16", dict(q_len=16), {}),
        ]
        for name, make_kw, call_kw in features:
            args = make_inputs(a, rng, make_kw.get("cache_dtype", jnp.bfloat16), jnp.bfloat16,
                               make_kw.get("q_len"))
            row = time_impls(args, ("auto", "reference"), a.repeats, **call_kw)
            print(f"bfloat16 {name}: auto {row['auto'] * 1e3:.2f} ms, reference "
                  f"{row['reference'] * 1e3:.2f} ms ({row['reference'] / row['auto']:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
