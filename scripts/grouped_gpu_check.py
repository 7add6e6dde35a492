#!/usr/bin/env python3
"""GPU check of the grouped split-KV decode kernel (impl="grouped"): correctness
against the jnp reference on NaN-poisoned random data, then timing on the
configurations of issue 4 with a same-run copy bandwidth.

    python3 scripts/grouped_gpu_check.py correct      # correctness only
    python3 scripts/grouped_gpu_check.py bench        # timing only
    python3 scripts/grouped_gpu_check.py              # both

Calls the FFI target "jax_paged_attention_grouped" directly (so any partition
size can be forced) and through jax_paged.paged_attention(impl="grouped").
Writes $OUT/grouped_check.json (or /tmp) and prints short tables.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jax_paged  # noqa: E402
from jax_paged import _shapes, primitives, reference  # noqa: E402
from paged_inputs import TOLERANCES, make_paged_inputs, reference_on_cpu  # noqa: E402

OUT = os.environ.get("OUT") or "/tmp"
RESULTS: dict = {"correct": [], "bench": [], "copy": None}
FAILURES: dict = {}  # small failing cases, saved to $OUT/grouped_failures.npz


def grouped_ffi(q, kc, vc, bt, sl, alibi, *, scale, partition_size):
    S, H, D = q.shape
    cap = bt.shape[1] * kc.shape[3]
    P = max(1, -(-cap // partition_size))
    none = jnp.zeros((0,), jnp.float32)  # no k_scale / v_scale; no lse wanted
    outs = (jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((0,), jnp.float32),
            jax.ShapeDtypeStruct((S, H, P), jnp.float32),
            jax.ShapeDtypeStruct((S, H, P), jnp.float32),
            jax.ShapeDtypeStruct((S, H, P, D), jnp.float32))
    return jax.ffi.ffi_call("jax_paged_attention_grouped", outs)(
        q, kc, vc, bt, sl, alibi, none, none,
        **primitives.ffi_attrs(scale=float(scale), soft_cap=0.0, sliding_window=0,
                               partition_size=int(partition_size)))[0]


@functools.lru_cache(maxsize=None)
def jitted(scale, partition_size):
    return jax.jit(functools.partial(grouped_ffi, scale=scale, partition_size=partition_size))


def auto_partition(q, kc, vc, bt, sl, alibi):
    dims = _shapes.check_paged_attention(q, kc, vc, bt, sl, alibi)
    return primitives.grouped_partition_size("cuda", dims)


# ---------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------
def check(name, inp, dtype, partitions=("auto",), scale=None, alibi=None):
    dtype = np.dtype(dtype)
    D = inp.query.shape[2]
    scale = D ** -0.5 if scale is None else scale
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(a, gpu) for a in inp.args()]
    al = jnp.zeros((0,), jnp.float32) if alibi is None else jnp.asarray(alibi, jnp.float32)
    al_gpu = jax.device_put(al, gpu)
    atol, rtol = TOLERANCES[dtype]
    for part in partitions:
        rec = dict(name=name, dtype=str(dtype), partition=str(part))
        try:
            if part == "auto":
                ps = auto_partition(*inp.args(), alibi)
                out = jax_paged.paged_attention(*args, impl="grouped", scale=scale,
                                                alibi_slopes=None if alibi is None else al_gpu)
            else:
                ps = int(part)
                out = jitted(float(scale), ps)(*args, al_gpu)
            out = np.asarray(jax.block_until_ready(out), np.float32)
            rec["ps"] = ps
            exp2 = np.asarray(reference_on_cpu(reference.paged_attention, *inp.args(), scale=scale,
                                               alibi_slopes=alibi, impl="v2",
                                               partition_size=ps), np.float32)
            exp1 = np.asarray(reference_on_cpu(reference.paged_attention, *inp.args(), scale=scale,
                                               alibi_slopes=alibi, impl="v1"), np.float32)
            finite = bool(np.all(np.isfinite(out)))
            err2 = float(np.max(np.abs(out - exp2))) if out.size else 0.0
            err1 = float(np.max(np.abs(out - exp1))) if out.size else 0.0
            ok2 = bool(np.all(np.abs(out - exp2) <= atol + rtol * np.abs(exp2)))
            ok1 = bool(np.all(np.abs(out - exp1) <= atol + rtol * np.abs(exp1)))
            rel = float(np.linalg.norm(out - exp2) / max(np.linalg.norm(exp2), 1e-30))
            zero_ok = True
            lens = np.asarray(inp.seq_lens)
            for s in np.nonzero(lens <= 0)[0]:
                zero_ok &= bool(np.all(out[s] == 0))
            rec.update(finite=finite, max_err_v2=err2, max_err_v1=err1, rel_l2=rel,
                       ok=finite and ok2 and ok1 and zero_ok)
            if not rec["ok"] and len(FAILURES) < 40 and out.size < 200000:
                tag = "".join(ch if ch.isalnum() else "_" for ch in f"{len(FAILURES) // 4:02d}_{name}_{dtype}_{part}")
                FAILURES[tag + "_out"] = out
                FAILURES[tag + "_v2"] = exp2
                FAILURES[tag + "_lens"] = np.asarray(inp.seq_lens)
                FAILURES[tag + "_bad"] = np.argwhere(
                    ~(np.abs(out - exp2) <= atol + rtol * np.abs(exp2)))[:200]
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=2)
        RESULTS["correct"].append(rec)
        flag = "ok  " if rec.get("ok") else "FAIL"
        print(f"{flag} {name:42s} {rec['dtype']:8s} ps={rec.get('ps', part)!s:6s} "
              f"err_v2={rec.get('max_err_v2', float('nan')):.2e} "
              f"err_v1={rec.get('max_err_v1', float('nan')):.2e} "
              f"rel={rec.get('rel_l2', float('nan')):.1e} {rec.get('error', '')}", flush=True)


def run_correctness():
    rng = np.random.default_rng(0)
    lengths = [0, 1, 16, 31, 64, 511, 512, 513, 700, 1500]
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, np.float32
    for dtype in (f32, f16, bf16):
        for bs in (8, 16, 32):
            inp = make_paged_inputs(rng, lengths, 8, 2, 64, bs, dtype)
            check(f"lens G=4 D=64 bs={bs}", inp, dtype, ("auto", 256, 4096))
    for dtype in (bf16, f16, f32):
        for D in (64, 80, 96, 112, 120, 128, 192, 256):
            inp = make_paged_inputs(rng, [1, 17, 300, 600, 2000], 8, 2, D, 16, dtype)
            check(f"head D={D} G=4 bs=16", inp, dtype, ("auto", 512))
    for hq, hkv in ((8, 8), (32, 8), (40, 8), (64, 8), (16, 1), (24, 1), (17, 1), (128, 4)):
        inp = make_paged_inputs(rng, [3, 129, 520, 1100], hq, hkv, 128, 16, bf16)
        check(f"gqa {hq}/{hkv} D=128 bs=16", inp, bf16, ("auto", 512, 4096))
    for hq, hkv, D, bs in ((16, 1, 256, 32), (12, 1, 128, 8), (40, 8, 80, 16)):
        inp = make_paged_inputs(rng, [70, 600, 5], hq, hkv, D, bs, f32)
        check(f"f32 {hq}/{hkv} D={D} bs={bs}", inp, f32, ("auto", 256))
    for dtype in (f32, bf16):
        inp = make_paged_inputs(rng, [1, 40, 513, 1200], 8, 4, 64, 16, dtype)
        slopes = (2.0 ** -rng.uniform(0, 8, size=8)).astype(np.float32)
        check("alibi+scale G=2", inp, dtype, ("auto", 64), scale=0.07, alibi=slopes)
    for dtype in (f32, bf16):
        inp = make_paged_inputs(rng, [40, 40, 40], 4, 4, 64, 16, dtype)
        inp.block_tables[0, 1] = -7
        inp.block_tables[1, 0] = 2 ** 31 - 1
        inp.block_tables[2, 2] = inp.key_cache.shape[0]
        check("invalid ids", inp, dtype, ("auto", 32, 64))
        inp = make_paged_inputs(rng, [7, 16, 100, 0, 33], 4, 2, 64, 16, dtype,
                                max_blocks_per_seq=12, padding="garbage")
        check("garbage padding", inp, dtype, ("auto", 64, 192))
    inp = make_paged_inputs(rng, [20000, 5, 9000], 16, 2, 128, 16, bf16)
    check("long G=8 D=128", inp, bf16, ("auto", 2048, 32768))
    inp = make_paged_inputs(rng, [30000], 32, 8, 128, 16, f16)
    check("long B=1 G=4 f16", inp, f16, ("auto",))
    bad = [r for r in RESULTS["correct"] if not r.get("ok")]
    print(f"correctness: {len(RESULTS['correct']) - len(bad)}/{len(RESULTS['correct'])} passed",
          flush=True)
    if FAILURES:
        np.savez_compressed(os.path.join(OUT, "grouped_failures.npz"), **FAILURES)


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
def wall(fn):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def time_loop(step, q, args, R, reps=5):
    f = jax.jit(lambda q, *a: lax.fori_loop(0, R, lambda i, c: step(c, *a), q))
    wall(lambda: f(q, *args))
    wall(lambda: f(q, *args))
    samples = [wall(lambda: f(q, *args)) / R for _ in range(reps)]
    return statistics.median(samples), samples


def copy_bandwidth():
    n = (4 << 30) // 4
    x = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32))(jax.random.PRNGKey(1))
    t, s = time_loop(lambda c: c + jnp.float32(1.0), x, (), R=20)
    del x
    tbps = 2 * n * 4 / t / 1e12
    RESULTS["copy"] = dict(us=t * 1e6, tbps=tbps, samples_us=[v * 1e6 for v in s])
    print(f"copy bandwidth (x + 1, 4 GiB f32, read + write): {t * 1e6:.0f} us  {tbps:.3f} TB/s",
          flush=True)
    return tbps


def bench_config(B, Hq, Hkv, L, D=128, bs=16, dtype=jnp.bfloat16, variants=("rule",), copy=None,
                 ragged=False, impls=()):
    key = jax.random.PRNGKey(B * 7 + Hq * 13 + L)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    x = 16 // jnp.dtype(dtype).itemsize
    nbps = -(-L // bs)
    nb = B * nbps
    kc = jax.random.normal(k1, (nb, Hkv, D // x, bs, x), jnp.float32).astype(dtype)
    vc = jax.random.normal(k2, (nb, Hkv, D, bs), jnp.float32).astype(dtype)
    bt = jax.random.permutation(k3, nb).astype(jnp.int32).reshape(B, nbps)
    if ragged:
        sl = jax.random.randint(k5, (B,), 1, L + 1, jnp.int32)
    else:
        sl = jnp.full((B,), L, jnp.int32)
    q = jax.random.normal(k4, (B, Hq, D), jnp.float32).astype(dtype)
    al = jnp.zeros((0,), jnp.float32)
    tokens = int(jnp.sum(sl))
    kv_bytes = 2 * tokens * Hkv * D * jnp.dtype(dtype).itemsize
    dims = _shapes.check_paged_attention(q, kc, vc, bt, sl, None)
    cap = nbps * bs
    items = B * Hkv
    ps_rule = primitives.grouped_partition_size("cuda", dims)
    chosen = {}
    for v in variants:
        if v == "rule":
            ps = ps_rule
        else:  # "splits=N"
            n = int(v.split("=")[1])
            ps = -(-(-(-cap // n)) // bs) * bs
        chosen.setdefault(ps, v)
    scale = D ** -0.5
    label = f"{'ragged ' if ragged else ''}B={B} Hq={Hq} Hkv={Hkv} L={L} D={D} bs={bs} {jnp.dtype(dtype).name}"
    R = int(min(400, max(20, 20e-3 / max(kv_bytes / 4e12, 5e-6))))
    for ps, v in chosen.items():
        P = -(-cap // ps)
        rec = dict(config=label, variant=v, partition_size=ps, parts=P, ctas=items * P,
                   kv_bytes=kv_bytes, R=R)
        try:
            step = lambda c, kc, vc, bt, sl, al, ps=ps: grouped_ffi(  # noqa: E731
                c, kc, vc, bt, sl, al, scale=scale, partition_size=ps)
            t, s = time_loop(step, q, (kc, vc, bt, sl, al), R)
            rec.update(us=t * 1e6, tbps=kv_bytes / t / 1e12, samples_us=[v_ * 1e6 for v_ in s])
            if copy:
                rec["frac_copy"] = rec["tbps"] / copy
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        RESULTS["bench"].append(rec)
        print(f"{label:52s} {v:9s} ps={ps:6d} P={P:3d} ctas={items * P:5d} "
              f"{rec.get('us', float('nan')):8.1f} us {rec.get('tbps', float('nan')):5.2f} TB/s "
              f"{rec.get('frac_copy', float('nan')):5.1%} {rec.get('error', '')}", flush=True)
    try:  # full-size cross-check against the classic V2 kernel (partition 512)
        g = grouped_ffi(q, kc, vc, bt, sl, al, scale=scale, partition_size=ps_rule)
        v2 = jax_paged.paged_attention(q, kc, vc, bt, sl, impl="v2", scale=scale,
                                       partition_size=512)
        g, v2 = np.asarray(g, np.float32), np.asarray(v2, np.float32)
        rel = float(np.linalg.norm(g - v2) / np.linalg.norm(v2))
        xc = dict(config=label, variant="check_vs_v2", rel_l2=rel, finite=bool(np.isfinite(g).all()),
                  max_abs=float(np.max(np.abs(g - v2))))
    except Exception as e:  # noqa: BLE001
        xc = dict(config=label, variant="check_vs_v2", error=f"{type(e).__name__}: {str(e)[:200]}")
    RESULTS["bench"].append(xc)
    print(f"{label:52s} vs v2: rel_l2={xc.get('rel_l2', float('nan')):.2e} "
          f"max_abs={xc.get('max_abs', float('nan')):.2e} finite={xc.get('finite')} "
          f"{xc.get('error', '')}", flush=True)
    for impl in impls:  # the classic kernels through the API, for comparison
        rec = dict(config=label, variant=f"impl={impl}", kv_bytes=kv_bytes, R=R)
        try:
            step = lambda c, kc, vc, bt, sl, al, impl=impl: jax_paged.paged_attention(  # noqa: E731
                c, kc, vc, bt, sl, impl=impl, scale=scale)
            t, s = time_loop(step, q, (kc, vc, bt, sl, al), R)
            rec.update(us=t * 1e6, tbps=kv_bytes / t / 1e12)
            if copy:
                rec["frac_copy"] = rec["tbps"] / copy
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        RESULTS["bench"].append(rec)
        print(f"{label:52s} {'impl=' + impl:9s} {'':26s} {rec.get('us', float('nan')):8.1f} us "
              f"{rec.get('tbps', float('nan')):5.2f} TB/s {rec.get('frac_copy', float('nan')):5.1%} "
              f"{rec.get('error', '')}", flush=True)
    del kc, vc


def run_bench():
    copy = copy_bandwidth()
    sweep = ("rule", "splits=1", "splits=2", "splits=4")
    bench_config(64, 32, 8, 4096, variants=("rule", "splits=2"), copy=copy)
    bench_config(256, 32, 8, 1024, variants=("rule", "splits=2"), copy=copy)
    bench_config(1, 32, 8, 32768, variants=("rule", "splits=16", "splits=33", "splits=66"),
                 copy=copy)
    bench_config(8, 32, 8, 8192, variants=("rule", "splits=4", "splits=8"), copy=copy)
    bench_config(32, 32, 32, 2048, variants=("rule", "splits=2", "splits=4"), copy=copy)
    bench_config(128, 64, 8, 2048, variants=("rule", "splits=2"), copy=copy)
    bench_config(64, 32, 8, 4096, D=64, copy=copy)
    bench_config(64, 32, 8, 4096, D=256, copy=copy)
    bench_config(64, 32, 8, 4096, bs=8, copy=copy)
    bench_config(64, 32, 8, 4096, bs=32, copy=copy)
    bench_config(64, 40, 8, 4096, copy=copy)
    bench_config(64, 32, 8, 4096, ragged=True, copy=copy)
    del sweep


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    print("jax", jax.__version__, jax.devices(), flush=True)
    from jax_paged import _native
    mod = _native.cuda_module
    regs = sorted(mod.registrations()) if mod is not None else []
    print("cuda module:", getattr(mod, "__file__", None), regs, flush=True)
    if "jax_paged_attention_grouped" not in regs:
        print("the grouped target is not in the loaded CUDA module: stale build?", flush=True)
        sys.exit(2)
    try:
        if what == "tiny":  # one small case (for compute-sanitizer)
            rng = np.random.default_rng(1)
            inp = make_paged_inputs(rng, [1, 40, 300], 8, 2, 64, 16, jnp.bfloat16)
            check("tiny G=4 D=64 bs=16", inp, jnp.bfloat16, (64, 4096))
        if what in ("all", "correct"):
            run_correctness()
        if what in ("all", "bench"):
            run_bench()
    finally:
        with open(os.path.join(OUT, f"grouped_check_{what}.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    bad = [r for r in RESULTS["correct"] if not r.get("ok")]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
