#!/usr/bin/env python3
"""A small GPU case for compute-sanitizer: every jax_paged kernel once, checked.

Runs paged_attention V1, V2 and grouped (several dtypes, head sizes, block sizes, GQA/MHA/MQA,
ALiBi, multi-partition V2, -1 padding in the block tables, poisoned unused blocks; all
three also with 3 query rows, soft cap, sliding window and LSE output, and with fp8
caches),
reshape_and_cache (with skipped and out-of-range slots, caches donated) and
copy_blocks (with out-of-range pairs, caches donated), each against
jax_paged.reference. Small inputs: under the sanitizer every launch is slow.

    compute-sanitizer --tool memcheck --target-processes all python3 dev/sanitizer_case.py

--impls / --head-sizes / --no-cache-ops narrow it to some kernels, for the slower tools:
e.g. racecheck (shared-memory hazards) of the grouped kernel at head size 256 only:

    compute-sanitizer --tool racecheck python3 dev/sanitizer_case.py --impls grouped \
        --head-sizes 256 --no-cache-ops

Run it with XLA_PYTHON_CLIENT_ALLOCATOR=platform (dev/gpu_check.sh does): then
every XLA buffer is its own cudaMalloc, so memcheck sees an access past a buffer's end
instead of landing silently in XLA's memory pool.

Exit status 0: all outputs matched; 1: a mismatch or an exception; 2: no GPU (unless
--platform cpu, which runs the same checks on the CPU kernels).
"""
from __future__ import annotations

import argparse
import sys
import traceback

import numpy as np

import jax
import jax.numpy as jnp

import jax_paged as jp
from jax_paged import reference as ref

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}   # relative L2 error vs reference

ATTENTION_CASES = [
    # dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi
    ("bfloat16", 128, 16, 8, 2, [1, 17, 300, 1100], False),   # GQA, V2 with 3 partitions
    ("float16", 64, 8, 4, 4, [5, 513, 1024], True),           # MHA, ALiBi, block 8
    ("float32", 256, 32, 6, 1, [33, 700], False),             # MQA, head 256, block 32
    ("bfloat16", 80, 16, 5, 1, [1000, 2], False),             # odd head size and group
    ("float16", 64, 32, 24, 1, [3, 100, 530], False),         # 24 (q_len 3: 72) rows per KV head
    # Group 8 at head 256: q_len 3 gives 24 rows per KV head, which the wide row
    # split runs as one 64-row CTA (two row blocks idle).
    ("bfloat16", 256, 16, 16, 2, [1, 40, 530], False),
    # Group 12 at head 192: q_len 3 gives 36 rows per KV head, one 64-row CTA of the
    # wide row split, fp8 caches included.
    ("bfloat16", 192, 16, 12, 1, [1, 40, 530], False),
    # Group 8 at head 128: q_len 3 gives 24 rows per KV head, a 32-row CTA (two row
    # blocks, the second half empty), fp8 caches included.
    ("bfloat16", 128, 16, 8, 1, [1, 40, 530], False),
    # Group 16 at head 96: q_len 3 gives 48 rows per KV head, one 64-row CTA (the
    # fourth row block empty); on compute capability 9.0 its wgmma form, whose V pages
    # come through the value cache's tensor map.
    ("float16", 96, 16, 32, 2, [1, 40, 530], False),
    # Group 48 at head 128: q_len 3 gives 144 rows per KV head: on compute capability
    # 9.0 a 128-row CTA of two warpgroups and a chunk of 16 rows (the default), or
    # under JAX_PAGED_DEV_OPTIONS=wgmma_128=0 three 64-row CTAs; 2100 tokens split into
    # partitions.
    ("bfloat16", 128, 16, 48, 1, [1, 40, 2100], False),
]


def rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def paged_inputs(rng, dtype, head, bs, hq, hkv, lens, dev):
    itemsize = np.dtype(jnp.dtype(dtype)).itemsize
    x = 16 // itemsize
    lens = np.asarray(lens, np.int32)
    nb = (lens + bs - 1) // bs
    used = int(nb.sum())
    num_blocks = used + 3                                   # 3 blocks nobody uses
    max_blocks = int(nb.max()) + 1                          # one -1 padding column at least
    perm = rng.permutation(num_blocks).astype(np.int32)
    bt = np.full((len(lens), max_blocks), -1, np.int32)
    off = 0
    for i, n in enumerate(nb):
        bt[i, :n] = perm[off:off + n]
        off += n
    unused = perm[used:]
    kc = rng.standard_normal((num_blocks, hkv, head // x, bs, x)).astype(np.float32)
    vc = rng.standard_normal((num_blocks, hkv, head, bs)).astype(np.float32)
    kc[unused] = 1000.0                                     # reading these would show
    vc[unused] = 1000.0
    q = rng.standard_normal((len(lens), hq, head)).astype(np.float32)
    cast = lambda a: jax.device_put(jnp.asarray(a, dtype), dev)  # noqa: E731
    return (cast(q), cast(kc), cast(vc), jax.device_put(jnp.asarray(bt), dev),
            jax.device_put(jnp.asarray(lens), dev))


def relayout_key(kc, x: int):
    """[n, h, D // x0, bs, x0] -> [n, h, D // x, bs, x] (the same keys)."""
    n, h, c, bs, x0 = kc.shape
    dims = kc.transpose(0, 1, 2, 4, 3).reshape(n, h, c * x0, bs)       # [n, h, D, bs]
    return dims.reshape(n, h, c * x0 // x, x, bs).transpose(0, 1, 2, 4, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--impls", default="v1,v2,grouped",
                   help="comma-separated paged_attention implementations to check")
    p.add_argument("--head-sizes", default="",
                   help="comma-separated head sizes of the attention cases (default: all)")
    p.add_argument("--no-cache-ops", action="store_true",
                   help="skip reshape_and_cache and copy_blocks")
    args = p.parse_args()
    impls = tuple(i for i in args.impls.split(",") if i)
    bad = set(impls) - {"v1", "v2", "grouped"}
    if bad:
        p.error(f"--impls: unknown implementation(s) {sorted(bad)}; expected v1, v2, grouped")
    head_sizes = {int(h) for h in args.head_sizes.split(",") if h}
    try:
        dev = jax.devices(args.platform)[0]
    except RuntimeError as e:
        print(f"no {args.platform} device: {e}")
        return 2
    print(f"device: {dev} ({getattr(dev, 'device_kind', '')}), jax {jax.__version__}, "
          f"jax_paged cuda kernels: {jp.has_cuda_kernels()}")
    if args.platform == "gpu" and not jp.has_cuda_kernels():
        print("FAIL: jax_paged was built without its CUDA kernels")
        return 1
    rng = np.random.default_rng(1234)
    failures = 0

    def report(name, err, tol):
        nonlocal failures
        ok = err <= tol
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:g})", flush=True)

    for dtype, head, bs, hq, hkv, lens, alibi in ATTENTION_CASES:
        if head_sizes and head not in head_sizes:
            continue
        name = f"{dtype} head {head} block {bs} heads {hq}/{hkv} lens {lens}{' alibi' if alibi else ''}"
        try:
            q, kc, vc, bt, sl = paged_inputs(rng, dtype, head, bs, hq, hkv, lens, dev)
            slopes = (jax.device_put(jnp.asarray(2.0 ** -(np.arange(hq) + 1.0), jnp.float32), dev)
                      if alibi else None)
            want = jax.jit(lambda *a: ref.paged_attention(*a, alibi_slopes=slopes))(q, kc, vc, bt, sl)
            for impl in impls:
                got = jax.jit(lambda *a, impl=impl: jp.paged_attention(
                    *a, alibi_slopes=slopes, impl=impl))(q, kc, vc, bt, sl)
                got = jax.block_until_ready(got)
                report(f"paged_attention {impl} {name}", rel_err(got, want), TOL[dtype])
            # A decode step whose only feature is the soft cap (the grouped
            # kernel's plain capped variant with 16-bit caches).
            if "grouped" in impls:
                want = jax.jit(lambda *a: ref.paged_attention(*a, alibi_slopes=slopes, soft_cap=5.0))(
                    q, kc, vc, bt, sl)
                got = jax.jit(lambda *a: jp.paged_attention(
                    *a, alibi_slopes=slopes, soft_cap=5.0, impl="grouped"))(q, kc, vc, bt, sl)
                report(f"paged_attention grouped soft cap {name}",
                       rel_err(jax.block_until_ready(got), want), TOL[dtype])
            # The issue-6 paths of the classic kernels: 3 query rows per sequence
            # (causal among them), soft cap, a sliding window, the LSE output.
            q3 = jnp.repeat(q[:, None], 3, axis=1) * jnp.asarray([1.0, -0.5, 0.25], q.dtype)[
                None, :, None, None]
            # (A 300-token window splits its blocks: the grouped grid then holds
            # only the partitions a window touches, offset per sequence.)
            def features(window):
                return dict(alibi_slopes=slopes, soft_cap=20.0, sliding_window=window,
                            return_lse=True)

            for window in (2 * bs + 3, 300):
                kwargs = features(window)
                want = jax.jit(lambda *a: ref.paged_attention(*a, **kwargs))(q3, kc, vc, bt, sl)
                for impl in impls:
                    got = jax.jit(lambda *a, impl=impl: jp.paged_attention(
                        *a, impl=impl, **kwargs))(q3, kc, vc, bt, sl)
                    got = jax.block_until_ready(got)
                    report(f"paged_attention {impl} q_len 3 soft cap window {window} lse {name}",
                           max(rel_err(got[0], want[0]),
                               rel_err(jnp.exp(got[1]), jnp.exp(want[1]))), TOL[dtype])
            if dtype != "float32" and head % 16 == 0:
                # fp8 caches (16-bit query), per-KV-head scales, every feature
                # (the splitting window).
                kwargs = features(300)
                for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
                    k8, v8 = relayout_key(kc, 16).astype(fp8), vc.astype(fp8)
                    scales = dict(k_scale=jnp.linspace(0.5, 1.5, hkv, dtype=jnp.float32),
                                  v_scale=jnp.float32(0.75))
                    want = jax.jit(lambda *a: ref.paged_attention(*a, **kwargs, **scales))(
                        q3, k8, v8, bt, sl)
                    for impl in impls:
                        got = jax.jit(lambda *a, impl=impl: jp.paged_attention(
                            *a, impl=impl, **kwargs, **scales))(q3, k8, v8, bt, sl)
                        got = jax.block_until_ready(got)
                        report(f"paged_attention {impl} {jnp.dtype(fp8).name} q_len 3 all "
                               f"features {name}",
                               max(rel_err(got[0], want[0]),
                                   rel_err(jnp.exp(got[1]), jnp.exp(want[1]))), TOL[dtype])
        except Exception:
            failures += 1
            print(f"FAIL paged_attention {name}: exception\n{traceback.format_exc()}", flush=True)

    # reshape_and_cache: distinct valid slots, one skipped (-1), one past the cache end.
    reshape_cases = () if args.no_cache_ops else (("bfloat16", 128, 16, 2), ("float32", 64, 8, 3))
    for dtype, head, bs, hkv in reshape_cases:
        name = f"{dtype} head {head} block {bs} kv heads {hkv}"
        try:
            _, kc, vc, _, _ = paged_inputs(rng, dtype, head, bs, hkv, hkv, [3 * bs], dev)
            num_slots = kc.shape[0] * bs
            slots = rng.choice(num_slots, size=7, replace=False).astype(np.int32)
            slots = np.concatenate([slots, [-1, num_slots]]).astype(np.int32)
            t = len(slots)
            key = jax.device_put(jnp.asarray(rng.standard_normal((t, hkv, head)), dtype), dev)
            val = jax.device_put(jnp.asarray(rng.standard_normal((t, hkv, head)), dtype), dev)
            sm = jax.device_put(jnp.asarray(slots), dev)
            wk, wv = jax.jit(ref.reshape_and_cache)(key, val, kc, vc, sm)
            wk, wv = jax.block_until_ready((wk, wv))
            gk, gv = jax.jit(jp.reshape_and_cache, donate_argnums=(2, 3))(
                key, val, jnp.copy(kc), jnp.copy(vc), sm)
            gk, gv = jax.block_until_ready((gk, gv))
            ok = bool(jnp.array_equal(gk, wk)) and bool(jnp.array_equal(gv, wv))
            report(f"reshape_and_cache {name}", 0.0 if ok else float("inf"), 0.0)
        except Exception:
            failures += 1
            print(f"FAIL reshape_and_cache {name}: exception\n{traceback.format_exc()}", flush=True)

    # copy_blocks: valid pairs plus pairs with an id out of range (skipped).
    copy_cases = () if args.no_cache_ops else (("float16", 128, 16), ("float32", 256, 32))
    for dtype, head, bs in copy_cases:
        name = f"{dtype} head {head} block {bs}"
        try:
            _, kc, vc, _, _ = paged_inputs(rng, dtype, head, bs, 2, 2, [4 * bs], dev)
            n = kc.shape[0]                                   # 7 blocks
            mapping = np.array([[0, 5], [3, 6], [-1, 2], [1, n], [n + 5, 4]], np.int32)
            bm = jax.device_put(jnp.asarray(mapping), dev)
            wk, wv = jax.block_until_ready(jax.jit(ref.copy_blocks)(kc, vc, bm))
            gk, gv = jax.jit(jp.copy_blocks, donate_argnums=(0, 1))(jnp.copy(kc), jnp.copy(vc), bm)
            gk, gv = jax.block_until_ready((gk, gv))
            ok = bool(jnp.array_equal(gk, wk)) and bool(jnp.array_equal(gv, wv))
            report(f"copy_blocks {name}", 0.0 if ok else float("inf"), 0.0)
        except Exception:
            failures += 1
            print(f"FAIL copy_blocks {name}: exception\n{traceback.format_exc()}", flush=True)

    print(f"sanitizer case: {'all ok' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
