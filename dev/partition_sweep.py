#!/usr/bin/env python3
"""Per-call time of the grouped kernel for several partition sizes.

The grouped kernel's split (jax_paged.primitives.grouped_partition_size) is
chosen from static shapes: enough partitions to fill every SM's CTA slots once.
This development script replaces that rule by each given size in turn and
times the call with the benchmark's own method (jitted fori_loop, median of
samples, the benchmark's data), each output checked against the float32
ground truth. It answers "would more (or fewer) partitions be faster here?"
without rebuilding anything.

    python3 dev/partition_sweep.py --config 1,32,8,32768 --kv bf16,fp8e4m3 \
        --sizes 128,256,512,1024,2048

`auto` in --sizes is the library's own choice. The same-run copy bandwidth is
measured once, so every row is also given as a fraction of it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_paged_attention as bench  # noqa: E402

import jax_paged as jp  # noqa: E402
from jax_paged import primitives  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", required=True,
                    help="B,Hq,Hkv,L[,head_size[,block_size]] (repeatable)")
    ap.add_argument("--kv", default="bf16", help="comma-separated: bf16, fp8e4m3, fp8e5m2, cap<c>")
    ap.add_argument("--sizes", default="auto,256,512,1024", help="comma-separated partition sizes")
    ap.add_argument("--impl", default="auto", help="auto (grouped on the GPU) or grouped")
    ap.add_argument("--reps", type=int, default=9)
    cli = ap.parse_args()
    # The benchmark's defaults for everything its helpers read.
    _, args = bench.parse_args(["--no-pallas", "--no-reference", "--reps", str(cli.reps)])
    copy_tbps = bench.measure_copy_bandwidth(args)["tbps"]
    print(f"same-run copy bandwidth {copy_tbps:.2f} TB/s; per-call us (loop median), % of copy")
    rule = primitives.grouped_partition_size
    for text in cli.config:
        cfg = bench.parse_config(text, args.dtype)
        plan = bench.plan_config(cfg, args)
        q, sets = bench.make_sets(cfg, plan, args)
        scale = cfg.head_size ** -0.5
        for kv in cli.kv.split(","):
            vsets, kwargs, nbytes = bench.cache_variant(sets, kv, plan["kv_bytes"])
            truth = bench.block(bench.ground_truth(q, *vsets[0], scale, **kwargs))
            step = bench.jax_paged_step(jp, cli.impl, scale, 512, **kwargs)
            line = []
            for size in cli.sizes.split(","):
                if size == "auto":
                    primitives.grouped_partition_size = rule
                else:
                    primitives.grouped_partition_size = lambda *a, _s=int(size), **k: _s
                # The library caches its lowering: without this the first size sticks.
                jax.clear_caches()
                try:
                    fj = jax.jit(step)
                    used = re.findall(r"partition_size = (\d+)", fj.lower(q, *vsets[0]).as_text())
                    if size != "auto" and used != [size]:
                        raise RuntimeError(f"lowered with partition_size {used}, not {size}")
                    err = bench.compare(bench.block(fj(q, *vsets[0])), truth)["rel_l2_err"]
                    t = bench.time_loop(step, q, vsets, args)["median_s"]
                    line.append(f"{size} ({used[0] if used else '?'}): {t * 1e6:7.1f} us "
                                f"{nbytes / t / 1e12 / copy_tbps:6.1%} (err {err:.1e})")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{size}: {bench.short_error(e, 80)}")
                finally:
                    primitives.grouped_partition_size = rule
            print(f"{cfg.label} {kv}:")
            for item in line:
                print("   ", item)
            sys.stdout.flush()
        del q, sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
