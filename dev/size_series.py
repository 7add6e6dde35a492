#!/usr/bin/env python3
"""Per-call time against bytes read at B=1: jax_paged and a one-kernel XLA read.

At one sequence the bytes of a call are few (fp8, L=32768: 67 MB, 16 us at the
copy rate), so a fixed cost per call weighs on the figure of merit. This script
measures that cost with the benchmark's own loop method (jitted fori_loop, each
output fed back as the next input, median of samples, inputs rotated so that
every call reads from HBM, not L2), for:

* ``jax_paged`` ``impl="auto"`` at B=1 (32 query heads, 8 KV heads, head 128,
  block 16) over a range of lengths, bf16 and fp8 e4m3 caches;
* an XLA reduction reading the same number of bytes (``sum`` of a bf16 array
  tied to the loop carry): one fused XLA kernel that only streams, the
  simplest competitor a call of that size could have.

Each series is fitted by ``time = a + bytes / r``: ``a`` is the per-call fixed
cost, ``r`` the streaming rate. Both are printed with the same-run copy
bandwidth (2 GiB ``y = x + 1``, the benchmark's reference).

    python3 dev/size_series.py --lengths 4096,8192,16384,32768,65536
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_paged_attention as bench  # noqa: E402

import jax_paged as jp  # noqa: E402


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of time_s = a + bytes / r; returns (a in us, r in TB/s)."""
    x = np.array([b for b, _ in points], float)
    y = np.array([t for _, t in points], float)
    slope, a = np.polyfit(x, y, 1)
    return a * 1e6, (1.0 / slope / 1e12 if slope > 0 else float("inf"))


def read_series(sizes_mb: list[float], args) -> list[dict]:
    """An XLA reduction over `size` bytes of bf16 per call (rotated arrays)."""
    rows = []
    for mb in sizes_mb:
        n = int(mb * 1e6) // 2
        n_sets = min(64, max(1, math.ceil(args.rotate_mb * 2 ** 20 / (2 * n))))
        gen = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.bfloat16))
        sets = [(bench.block(gen(bench.rkey(1000 + s))),) for s in range(n_sets)]

        def step(c, x):
            # The carry enters the reduction, so XLA can neither hoist it out
            # of the loop nor share it between calls.
            s = jnp.sum(x.astype(jnp.float32) + c[0, 0, 0].astype(jnp.float32) * 1e-30)
            return c + (s * 1e-30).astype(c.dtype)

        c0 = jnp.ones((1, 32, 128), jnp.bfloat16)
        t = bench.time_loop(step, c0, sets, args)["median_s"]
        rows.append(dict(series="xla_read_bf16", mb=2 * n / 1e6, bytes=2 * n, us=t * 1e6,
                         n_sets=n_sets))
        del sets
    return rows


def attention_series(lengths: list[int], kv: str, args) -> list[dict]:
    rows = []
    for L in lengths:
        cfg = bench.parse_config(f"1,32,8,{L}", "bfloat16")
        plan = bench.plan_config(cfg, args)
        q, sets = bench.make_sets(cfg, plan, args)
        scale = cfg.head_size ** -0.5
        sets, kwargs, nbytes = bench.cache_variant(sets, kv, plan["kv_bytes"])
        step = bench.jax_paged_step(jp, "auto", scale, args.partition_size, **kwargs)
        truth = bench.block(bench.ground_truth(q, *sets[0], scale, **kwargs))
        err = bench.compare(bench.block(jax.jit(step)(q, *sets[0])), truth)["rel_l2_err"]
        t = bench.time_loop(step, q, sets, args)["median_s"]
        rows.append(dict(series=f"jax_paged_{kv}", L=L, mb=nbytes / 1e6, bytes=nbytes,
                         us=t * 1e6, n_sets=plan["n_sets"], rel_err=err))
        del sets
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--kv", default="bf16,fp8e4m3", help="comma-separated: bf16, fp8e4m3, fp8e5m2, cap<c>")
    ap.add_argument("--read-mb", default="8.4,16.8,33.6,67.1,134.2,268.4",
                    help="sizes of the XLA read series, MB")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--copy-gb", default=None, help="GiB of the copy-bandwidth array "
                    "(default: the benchmark's)")
    ap.add_argument("--json", default=None)
    cli = ap.parse_args()
    # The benchmark's defaults, with enough rotated sets that small inputs come from HBM.
    _, args = bench.parse_args(["--no-pallas", "--no-reference", "--reps", str(cli.reps),
                                "--rotate-mb", "512", "--max-sets", "64"]
                               + (["--copy-gb", cli.copy_gb] if cli.copy_gb else []))
    copy_tbps = bench.measure_copy_bandwidth(args)["tbps"]
    lengths = [int(x) for x in cli.lengths.split(",")]
    rows = []
    for kv in cli.kv.split(","):
        rows += attention_series(lengths, kv, args)
    rows += read_series([float(x) for x in cli.read_mb.split(",")], args)

    print(f"same-run copy bandwidth {copy_tbps:.2f} TB/s "
          f"({jax.devices()[0].device_kind}, jax {jax.__version__})")
    print(f"{'series':<20} {'L':>6} {'MB':>7} {'us':>8} {'TB/s':>6} {'% copy':>7} {'sets':>5}")
    fits = {}
    for name in dict.fromkeys(r["series"] for r in rows):
        pts = [r for r in rows if r["series"] == name]
        for r in pts:
            tbps = r["bytes"] / (r["us"] * 1e-6) / 1e12
            r["pct_copy"] = 100 * tbps / copy_tbps
            print(f"{name:<20} {r.get('L', ''):>6} {r['mb']:7.1f} {r['us']:8.1f} {tbps:6.2f} "
                  f"{r['pct_copy']:6.1f}% {r['n_sets']:5d}"
                  + (f"  err {r['rel_err']:.1e}" if "rel_err" in r else ""))
        a_us, r_tbps = fit([(r["bytes"], r["us"] * 1e-6) for r in pts])
        fits[name] = dict(a_us=a_us, r_tbps=r_tbps)
        print(f"{name:<20} fit: time = {a_us:.1f} us + bytes / {r_tbps:.2f} TB/s")
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(dict(copy_tbps=copy_tbps, device=jax.devices()[0].device_kind,
                           jax=jax.__version__, rows=rows, fits=fits), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
