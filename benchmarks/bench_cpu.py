"""CPU kernels vs the jnp reference (both jitted, on the CPU), median of repeats.

    python benchmarks/bench_cpu.py [--seqs 8] [--len 2048] [--repeats 7]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    print(f"CPU threads available: {jax_paged.primitives._cpu_threads()}, jax {jax.__version__}")
    print(f"{a.seqs} seqs x {a.len} tokens, {a.heads} heads / {a.kv_heads} KV heads, "
          f"head {a.head_size}, block {a.block_size}")
    for dtype in (jnp.float32, jnp.bfloat16):
        x = 16 // jnp.dtype(dtype).itemsize
        blocks_per_seq = -(-a.len // a.block_size)
        n = a.seqs * blocks_per_seq
        with jax.default_device(cpu):
            kc = jnp.asarray(rng.standard_normal(
                (n, a.kv_heads, a.head_size // x, a.block_size, x)), dtype)
            vc = jnp.asarray(rng.standard_normal((n, a.kv_heads, a.head_size, a.block_size)),
                             dtype)
            q = jnp.asarray(rng.standard_normal((a.seqs, a.heads, a.head_size)), dtype)
            bt = jnp.asarray(rng.permutation(n).reshape(a.seqs, blocks_per_seq), jnp.int32)
            sl = jnp.full((a.seqs,), a.len, jnp.int32)
            row = {}
            for impl in ("auto", "v1", "v2", "reference"):
                f = jax.jit(lambda *args, impl=impl: jax_paged.paged_attention(*args, impl=impl))
                row[impl] = median_seconds(f, q, kc, vc, bt, sl, repeats=a.repeats)
        ref = row["reference"]
        print(f"{jnp.dtype(dtype).name:>8}: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms ({ref / v:.2f}x vs reference)" for k, v in row.items()))


if __name__ == "__main__":
    main()
