#!/usr/bin/env python3
"""One paged-attention call per implementation, for a kernel profiler (ncu).

Builds one configuration (bf16, random data, permuted block tables) and calls
each implementation `--calls` times (default 2: the first compiles; ncu profiles
every launch, so `ncu --kernel-name regex:...` sees each kernel of a call that
often), plus (with `--copy`) a device-to-device copy of the same number of
bytes as K and V (the reference rate under the same profiler). Prints nothing
the profiler needs; it exists so that kernel durations (gpu__time_duration) can
be read without any loop or dispatch overhead around them.

    ncu --clock-control none --metrics gpu__time_duration.sum python3 dev/profile_case.py \
        --config 1,32,8,32768

With `--kv bf16,fp8e4m3` each implementation also runs on an fp8 copy of the
caches (random data in the x = 16 layout, per-tensor scales), e.g. to compare
the grouped kernel's issue and pipe statistics on bf16 and fp8 caches:

    ncu --clock-control none --kernel-name regex:GroupedAttentionKernel \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        python3 dev/profile_case.py --config 64,32,8,4096 --impls grouped --kv bf16,fp8e4m3

`--q-len 1,16` runs each case with one and with 16 new query tokens per sequence
(the row-split kernel of multi-token queries against the decode step).
"""
from __future__ import annotations

import argparse

import numpy as np

import jax
import jax.numpy as jnp

import jax_paged as jp


def build_case(config: str, q_len: int = 1):
    """(query, key_cache, value_cache, block_tables, seq_lens) for
    "B,Hq,Hkv,L[,head_size[,block_size]]": bf16, random N(0,1) data, every
    sequence of length L, block tables a random permutation of the blocks; the
    query [B, Hq, D], or [B, q_len, Hq, D] when q_len > 1 (multi-token)."""
    parts = [int(v) for v in config.split(",")]
    B, hq, hkv, L = parts[:4]
    D = parts[4] if len(parts) > 4 else 128
    bs = parts[5] if len(parts) > 5 else 16
    dtype = jnp.bfloat16
    x = 16 // jnp.dtype(dtype).itemsize
    nblk = L // bs
    rng = np.random.default_rng(0)
    num_blocks = B * nblk
    tables = rng.permutation(num_blocks).reshape(B, nblk).astype(np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (B, hq, D) if q_len == 1 else (B, q_len, hq, D), dtype)
    kc = jax.random.normal(k2, (num_blocks, hkv, D // x, bs, x), dtype)
    vc = jax.random.normal(k3, (num_blocks, hkv, D, bs), dtype)
    return q, kc, vc, jnp.asarray(tables), jnp.full((B,), L, jnp.int32)


FP8 = {"fp8e4m3": jnp.float8_e4m3fn, "fp8e5m2": jnp.float8_e5m2}


def fp8_case(case, kv: str):
    """The case's caches as `kv` (fp8e4m3 / fp8e5m2): random N(0,1) values over a
    per-tensor scale (amax / the format's max), K in the x = 16 layout; returns the
    case and the keyword arguments (k_scale, v_scale) of paged_attention."""
    q, kc, vc, bt, sl = case
    n, hkv, _, bs, _ = kc.shape
    D = vc.shape[2]
    dt = FP8[kv]
    fmax = float(jnp.finfo(dt).max)
    k1, k2 = jax.random.split(jax.random.key(1))
    k = jax.random.normal(k1, (n, hkv, D // 16, bs, 16), jnp.float32)
    v = jax.random.normal(k2, vc.shape, jnp.float32)
    k_scale = jnp.max(jnp.abs(k)) / fmax
    v_scale = jnp.max(jnp.abs(v)) / fmax
    kc8, vc8 = (k / k_scale).astype(dt), (v / v_scale).astype(dt)
    return (q, kc8, vc8, bt, sl), dict(k_scale=k_scale, v_scale=v_scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="1,32,8,32768", help="B,Hq,Hkv,L[,head_size[,block_size]]")
    ap.add_argument("--impls", default="grouped,v2", help="comma-separated impl names")
    ap.add_argument("--kv", default="bf16", help="comma-separated cache dtypes: bf16, fp8e4m3, fp8e5m2")
    ap.add_argument("--copy", action="store_true", help="also one copy of the K+V bytes")
    ap.add_argument("--calls", type=int, default=2,
                    help="calls of each implementation (the first compiles; ncu profiles each)")
    ap.add_argument("--q-len", default="1",
                    help="comma-separated query lengths (new tokens per sequence), each a case")
    args = ap.parse_args()
    for q_len in (int(v) for v in args.q_len.split(",")):
        run_case(args, build_case(args.config, q_len), q_len)


def run_case(args, case, q_len: int) -> None:
    q, kc, vc, bt, sl = case
    for kv in args.kv.split(","):
        args_kv, kwargs = (case, {}) if kv == "bf16" else fp8_case(case, kv)
        for impl in args.impls.split(","):
            f = jax.jit(lambda q, kc, vc, bt, sl, kwargs, impl=impl:
                        jp.paged_attention(q, kc, vc, bt, sl, impl=impl, **kwargs))
            for _ in range(args.calls):
                jax.block_until_ready(f(*args_kv, kwargs))
            print(f"ran {impl} on {kv} caches, q_len {q_len}", flush=True)
    if args.copy:
        both = jnp.concatenate([kc.reshape(-1), vc.reshape(-1)])
        cp = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
        jax.block_until_ready(cp(both))
        jax.block_until_ready(cp(both))
        print(f"copied {both.size * both.dtype.itemsize / 1e6:.1f} MB (read) + same written", flush=True)


if __name__ == "__main__":
    main()
