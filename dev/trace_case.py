#!/usr/bin/env python3
"""Per-CTA timeline of grouped-kernel calls (development builds only).

Where does a call's time go beyond bytes / bandwidth (at B=1, L=32768 about
8 us of a 40 us kernel)? The grouped kernel, built with tracing, stamps each
CTA's entry, the arrival of its first pipeline stage, the end of its tile
loop and its exit (%globaltimer, ns) plus its SM, and stamps between them
that split the start (first copies issued, query rows staged) and the end
(every warp's tiles done, merge buffer written). This script runs one
configuration a few times and prints, per call, the kernel's span (first
entry to last exit) and the distribution over CTAs of each phase.

    CMAKE_ARGS="-DJAX_PAGED_DEV=ON -DJAX_PAGED_TRACE=ON" \
        python3 -m pip install --no-build-isolation --no-deps -e .
    python3 dev/trace_case.py --config 1,32,8,32768
    python3 dev/trace_case.py --config 256,32,8,1024 --q-len 16   # the row split
    CMAKE_ARGS="-DJAX_PAGED_DEV=OFF" \
        python3 -m pip install --no-build-isolation --no-deps -e .   # back to the default build

Command buffers are turned off (XLA_FLAGS) so that every call goes through
the handler, which passes the current trace buffer to the kernel. The V2
reduce, when the call has one, is not traced.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_enable_command_buffer=").strip()

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_paged as jp  # noqa: E402
from jax_paged import _native  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_case import FP8, build_case, fp8_case  # noqa: E402

# Per CTA: entry, first stage, loop end (thread 0), exit (ns), SM, tiles, cycles to
# loop end, cycles after, every warp's loop done, merge buffer written, first copies
# issued (thread 0), query rows staged (ns).
WORDS = 12


def pct(values: np.ndarray, qs=(0, 50, 90, 100)) -> str:
    return " / ".join(f"{np.percentile(values, q) / 1e3:6.2f}" for q in qs)


def trace_once(fn, args, capacity: int) -> np.ndarray:
    """Runs fn(*args) once with a fresh zeroed trace buffer; rows of CTAs
    that reached their exit (an empty partition's early exit leaves the exit
    word zero: thread 0 writes a row's words as it takes them)."""
    buf = jax.block_until_ready(jnp.zeros((capacity * WORDS * 2,), jnp.uint32))  # on the GPU
    _native.cuda_module.set_grouped_trace(buf.unsafe_buffer_pointer(), capacity)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        _native.cuda_module.set_grouped_trace(0, 0)
    rows = np.asarray(buf).view(np.uint64).reshape(capacity, WORDS)
    return rows[rows[:, 3] != 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="1,32,8,32768", help="B,Hq,Hkv,L[,head_size[,block_size]]")
    ap.add_argument("--kv", default="bf16", choices=["bf16"] + sorted(FP8),
                    help="cache type (fp8: random values over per-tensor scales)")
    ap.add_argument("--q-len", type=int, default=1,
                    help="new query tokens per sequence (multi-token queries: the row-split kernel)")
    ap.add_argument("--calls", type=int, default=5, help="traced calls (after two untraced)")
    ap.add_argument("--capacity", type=int, default=1 << 16, help="CTAs the buffer holds")
    args = ap.parse_args()
    module = _native.cuda_module
    if module is None or not hasattr(module, "set_grouped_trace"):
        print("trace_case: this build has no tracing; rebuild with "
              'CMAKE_ARGS="-DJAX_PAGED_DEV=ON -DJAX_PAGED_TRACE=ON" (see the docstring)')
        return 2
    case, kwargs = build_case(args.config, args.q_len), {}
    if args.kv != "bf16":
        case, kwargs = fp8_case(case, args.kv)
    q, kc, vc, bt, sl = case
    # K and V of the valid tokens: tokens x KV heads x head size x 2 x bytes.
    kv_bytes = int(np.sum(np.asarray(sl))) * vc.shape[1] * vc.shape[2] * 2 * vc.dtype.itemsize
    fn = jax.jit(lambda *a: jp.paged_attention(*a, impl="grouped", **kwargs))
    for _ in range(2):
        jax.block_until_ready(fn(*case))
    print(f"config {args.config} {args.kv} q_len {args.q_len}: K+V of the valid tokens "
          f"{kv_bytes / 1e6:.1f} MB; per call, over CTAs, percentiles 0 / 50 / 90 / 100 in us")
    for i in range(args.calls):
        rows = trace_once(fn, case, args.capacity).astype(np.int64)
        if len(rows) == 0:
            print("no CTA wrote a trace row (command buffers on? impl not grouped?)")
            return 1
        (entry, first, loop_end, exit_, sm, tiles, cyc_loop, cyc_epi, all_loops,
         merged, issued, staged) = (rows[:, j] for j in range(WORDS))
        t0, t_end = entry.min(), exit_.max()
        span = (t_end - t0) / 1e3
        print(f"call {i}: {len(rows)} CTAs on {len(np.unique(sm))} SMs, span {span:.2f} us "
              f"({kv_bytes / (span * 1e-6) / 1e12:.2f} TB/s), tiles/CTA {tiles.min()}-{tiles.max()}")
        print(f"  entry after first entry   {pct(entry - t0)}")
        print(f"  entry -> first stage      {pct(first - entry)}")
        # The start of the CTA, split at thread 0's first copies and the staged query.
        print(f"    first copies issued     {pct(issued - entry)}")
        print(f"    query rows staged       {pct(staged - issued)}")
        print(f"    first stage's data      {pct(first - staged)}")
        print(f"  first stage -> loop end   {pct(loop_end - first)}")
        print(f"  loop end -> exit          {pct(exit_ - loop_end)}")
        # The end of the CTA, split at the merge's two barriers.
        print(f"    waiting for other warps {pct(all_loops - loop_end)}")
        print(f"    merge buffer, row stats {pct(merged - all_loops)}")
        print(f"    output stores           {pct(exit_ - merged)}")
        print(f"  exit before last exit     {pct(t_end - exit_)}")
        # The SM clock, calibrated on the long entry -> loop end phase.
        ns_per_cycle = float(np.median((loop_end - entry) / np.maximum(cyc_loop, 1)))
        print(f"  loop end -> exit, cycles  {pct(cyc_epi * 1e3)} (x 1e3; "
              f"{ns_per_cycle:.3f} ns/cycle: {pct(cyc_epi * ns_per_cycle)} us)")
        # Last exit per SM (np.unique: in SM-id order): a slow group of SMs shows as a run.
        last = np.array([exit_[sm == s].max() for s in np.unique(sm)])
        print(f"  SMs' last exit before the kernel's: {pct(t_end - last, (0, 10, 25, 50, 75, 90, 100))}")
        if i == 0:
            by_sm = zip(np.unique(sm).tolist(), ((t_end - last) / 1e3).round(1).tolist())
            print("  per SM (id: us before the end):", " ".join(f"{a}:{b}" for a, b in by_sm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
