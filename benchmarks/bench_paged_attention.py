#!/usr/bin/env python3
"""Benchmark of paged-attention decode: jax_paged against the jnp reference and Pallas.

One run measures, on the default JAX device (the GPU when there is one):

* the device-to-device copy bandwidth through JAX (bytes read + bytes written);
* ``jax_paged.paged_attention`` with ``impl="auto"``, ``"v1"``, ``"v2"`` (and any
  names given with ``--impls``);
* the jnp reference (``impl="reference"``);
* JAX's Pallas GPU kernel ``jax.experimental.pallas.ops.gpu.paged_attention``
  (Triton lowering; interpret mode on a machine without a GPU) on the same data,
  converted once, outside timing, to Pallas's ``[num_kv_heads, pages, page_size,
  head_dim]`` layout.

Every implementation is first checked against an independent float32 ground truth
(gathered, masked softmax, HIGHEST matmul precision), then timed. The figure of
merit is the effective bandwidth: bytes of K and V of the valid tokens / time.

Output: a progress bar while running, a JSON file of every number (``--json``), a
PNG plot (``--png``) and, printed last, the tables. docs/performance.md describes the
method and holds the committed tables.

Each figure is by default the time of one call among dependent calls inside one jitted
loop (``--method dependent``): each call's output, cast to the query's dtype, is the next
call's query, as in a decode step, so no per-call cost can hide behind the next call.

    python benchmarks/bench_paged_attention.py                  # defaults, on the GPU
    python benchmarks/bench_paged_attention.py --suite peers    # the peer-comparison rows
    python benchmarks/bench_paged_attention.py --quick          # tiny CPU smoke run
    python benchmarks/bench_paged_attention.py --config 16,40,8,4096,128,32 --config ragged:64,32,8,4096
    python benchmarks/bench_paged_attention.py --fp8 e4m3 --fp8 e5m2 --soft-cap 30 --window 1024

Exit status: 0 when every jax_paged implementation (reference included) ran and
matched the ground truth; 1 when one failed or mismatched (Pallas failures are
recorded, never fatal); 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import inspect
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------
# Figures quoted from issue 4 (same card model, NOT measured by this benchmark).
# bf16, head 128, block 16, all sequences of length L. (µs per call, TB/s).
# ---------------------------------------------------------------------------
QUOTED_SOURCE = ("issue 4 'Performance: beat FlashInfer on the H200' (H200, bf16, head 128, "
                 "block 16; copy bandwidth there 4.22 TB/s); quoted, not measured by this run")
QUOTED_COPY_TBPS = 4.22
QUOTED = {
    (64, 32, 8, 4096): {"reference": (1144, 0.94), "pallas": (470, 2.28), "vllm_v1": (1056, 1.02),
                        "vllm_v2": (858, 1.25), "flashinfer": (385, 2.79)},
    (256, 32, 8, 1024): {"reference": (1174, 0.91), "pallas": (492, 2.18), "vllm_v1": (882, 1.22),
                         "vllm_v2": (866, 1.24), "flashinfer": (367, 2.92)},
    (1, 32, 8, 32768): {"reference": (124, 1.08), "pallas": (84, 1.59), "vllm_v1": (1996, 0.07),
                        "vllm_v2": (146, 0.92), "flashinfer": (57, 2.37)},
    (8, 32, 8, 8192): {"reference": (309, 0.87), "pallas": (136, 1.97), "vllm_v1": (523, 0.51),
                       "vllm_v2": (244, 1.10), "flashinfer": (101, 2.66)},
    (32, 32, 32, 2048): {"reference": (923, 1.16), "pallas": (475, 2.26), "vllm_v1": (347, 3.09),
                         "vllm_v2": (317, 3.39), "flashinfer": (257, 4.18)},
    (128, 64, 8, 2048): {"reference": (1183, 0.91), "pallas": (479, 2.24), "vllm_v1": (1695, 0.63),
                         "vllm_v2": (1619, 0.66), "flashinfer": (658, 1.63)},
}

DEFAULT_CONFIGS = [
    "64,32,8,4096", "256,32,8,1024", "1,32,8,32768", "8,32,8,8192",
    "32,32,32,2048", "128,64,8,2048", "ragged:64,32,8,4096",
]
QUICK_CONFIGS = ["2,4,2,40", "ragged:3,8,2,100,64,8", "2,6,6,33,128,32", "1,10,2,700"]

# Presets (--suite): configurations, the fp8 formats their variant rows run, and the cache cap
# (--max-cache-gb unless given) that lets the longest rows run. "peers": the rows of the peer
# comparison, then small batches at long contexts (B = 1, 2, 4 at 8k-128k tokens; B = 8, 16 at
# 4k-16k); every row also runs on an fp8 e4m3 cache. Its largest pool, 4 x 128k tokens, holds
# 2 GiB of bf16 K and V (4 GiB with the Pallas copy), well inside an 80 GB card.
SUITES = {
    "peers": dict(
        configs=(["64,32,8,4096", "256,32,8,1024", "1,32,8,32768", "8,32,8,8192",
                  "32,32,32,2048", "128,64,8,2048"]
                 + [f"{b},32,8,{n}" for b in (1, 2, 4) for n in (8192, 32768, 131072)]
                 + [f"{b},32,8,{n}" for b in (8, 16) for n in (4096, 16384)]),
        fp8=["e4m3"],
        max_cache_gb=16.0),
}

DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float16": jnp.float16,
          "fp16": jnp.float16, "half": jnp.float16, "float32": jnp.float32, "fp32": jnp.float32}
# Relative L2 error ||out - truth|| / ||truth|| above which a result is flagged.
TOLERANCE = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 2e-3}  # f32: Pallas may use tf32

PALLAS_DEFAULTS = dict(block_h=16, pages_per_compute_block=8, k_splits=16, num_warps=8, num_stages=2)

METHOD_TEXT = {
    "dependent": ("dependent: each sample times one call of a jitted lax.fori_loop with a static trip "
                  "count R whose carry is the query: each iteration calls the implementation on the "
                  "n_sets rotated input sets in turn, passing over them until at least "
                  "--min-calls-per-iter calls, and each call's output, cast to the query's dtype, is "
                  "the next call's query (attention outputs are convex combinations of V rows, so the "
                  "chain stays bounded). No call can start before the previous one has finished, as "
                  "in a decode step, so whatever a call costs beyond its own kernels (launch, ramp, "
                  "its reduce, its tail) is counted. Loop lengths, slope pairs and medians as the "
                  "loop method: time per call = (time of 2R - time of R) / (R * "
                  "calls_per_iteration), median of --reps interleaved pairs after compilation and "
                  "warm-up."),
    "loop": ("loop: each sample times one call of a jitted lax.fori_loop with a static trip count "
             "R; each iteration calls the implementation on the n_sets rotated input sets in turn, "
             "passing over them until at least --min-calls-per-iter calls (the loop's own "
             "per-iteration cost is then spread over those calls), and feeds each output back as "
             "the next query (a true data dependency: XLA can neither "
             "drop nor hoist a call). Host clock around the call + block_until_ready; time per call "
             "from pairs of samples of two loop lengths, R and 2R iterations (R a power of two, raised "
             "from 2 by timed probes until a sample of 2R lasts about --target-ms, and raised again once "
             "if the measured R samples last under 0.4x half the target, i.e. the probes ran slow: "
             "'probe_R' in the JSON is the probes' R): (time of 2R - time "
             "of R) / (R * calls_per_iteration), so that whatever a sample costs once (dispatch, "
             "sync, setup of the loop) cancels "
             "instead of being spread over the sample's calls; reported figure = median of --reps "
             "pairs, taken after compilation and a warm-up run of both loops ('average_per_call_s': "
             "the 2R samples divided by their calls, which carries that cost; "
             "'fixed_per_sample_s': the cost that cancelled)."),
    "dispatch": ("dispatch: each sample dispatches N back-to-back calls of the jitted single call "
                 "(asynchronously, output fed back as the next query, rotating input sets) and "
                 "synchronises once with block_until_ready; time per call = sample / N; median of "
                 "--reps samples after warm-up."),
}


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    batch: int
    num_heads: int
    num_kv_heads: int
    seq_len: int
    head_size: int = 128
    block_size: int = 16
    ragged: bool = False
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        s = ("ragged:" if self.ragged else "") + f"{self.batch},{self.num_heads},{self.num_kv_heads},{self.seq_len}"
        if self.head_size != 128 or self.block_size != 16:
            s += f",{self.head_size},{self.block_size}"
        return s

    @property
    def quoted_key(self):
        if (not self.ragged and self.head_size == 128 and self.block_size == 16
                and self.dtype == "bfloat16"):
            return (self.batch, self.num_heads, self.num_kv_heads, self.seq_len)
        return None


def parse_config(text: str, dtype: str) -> Config:
    s = text.strip()
    ragged = False
    if s.startswith("ragged:"):
        ragged, s = True, s[len("ragged:"):]
    parts = [p for p in re.split(r"[,x ]+", s) if p]
    if not 4 <= len(parts) <= 6:
        raise ValueError(f"config {text!r}: want [ragged:]B,Hq,Hkv,L[,head_size[,block_size]]")
    vals = [int(p) for p in parts]
    cfg = Config(*vals[:4], *(vals[4:]), ragged=ragged, dtype=dtype)
    if min(vals) <= 0:
        raise ValueError(f"config {text!r}: all numbers must be positive")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"config {text!r}: Hq must be a multiple of Hkv")
    return cfg


# ---------------------------------------------------------------------------
# Small utilities
# ---------------------------------------------------------------------------
class _TextBar:
    """Fallback progress bar when tqdm is missing: one line per step on stderr."""

    def __init__(self, total, desc=""):
        self.total, self.n, self.desc, self.t0 = total, 0, desc, time.time()

    def set_description(self, desc):
        self.desc = desc

    def update(self, k=1):
        self.n += k
        print(f"[{self.n}/{self.total} {time.time() - self.t0:6.1f}s] {self.desc}",
              file=sys.stderr, flush=True)

    def write(self, msg):
        print(msg, file=sys.stderr, flush=True)

    def close(self):
        pass


def progress_bar(total, disable=False):
    if disable:
        bar = _TextBar(total)
        bar.update = lambda k=1: None  # type: ignore[method-assign]
        return bar
    if not sys.stderr.isatty():      # logs (tee, CI): one plain line per step
        return _TextBar(total)
    try:
        from tqdm import tqdm
        return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
    except Exception:  # pragma: no cover - tqdm is optional
        return _TextBar(total)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def short_error(exc: BaseException, limit: int = 300) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def fmt(v, spec, none="-"):
    """format(v, spec), or `none` right-aligned to the spec's width when v is missing."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        m = re.match(r"\d+", spec)
        return none.rjust(int(m.group())) if m else none
    return format(v, spec)


def fmt_pct(fraction, spec="5.1f"):
    """A fraction as a percentage (without the % sign), or '-' when it is missing."""
    return fmt(None if fraction is None else 100 * fraction, spec, "-")


def fmt_bw(v, width=6):
    """TB/s with 2 decimals, or scientific notation for the tiny figures of CPU smoke runs."""
    if v is None or not math.isfinite(v):
        return f"{'-':>{width}}"
    return f"{v:{width}.2f}" if v >= 0.1 else f"{v:{width}.0e}"


def block(x):
    return jax.block_until_ready(x)


def rkey(seed: int):
    """PRNG key for the benchmark data. 'unsafe_rbg' (XLA's RngBitGenerator) compiles in well
    under a second where threefry takes many seconds on a busy CPU; statistical quality is
    irrelevant here, only that the data are random (never zeros)."""
    return jax.random.key(seed, impl="unsafe_rbg")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(math.ceil(math.log2(max(n, 1)))))


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------
def _wall(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    block(fn())
    return time.perf_counter() - t0


def _loop_fn(step, R: int, n_sets: int, unroll: int):
    def run(carry, sets):
        def body(_, c):
            for _ in range(unroll):
                for s in range(n_sets):
                    c = step(c, *sets[s])
            return c
        return lax.fori_loop(0, R, body, carry)
    return jax.jit(run)


def _dependent_fn(step, R: int, n_sets: int, unroll: int):
    """The loop of METHOD_TEXT['dependent']: R iterations of unroll passes over the sets, the
    carry a query that each call replaces with its own output in the query's dtype."""
    def run(q, sets):
        def body(_, c):
            for _ in range(unroll):
                for s in range(n_sets):
                    c = step(c, *sets[s]).astype(c.dtype)
            return c
        return lax.fori_loop(0, R, body, q)
    return jax.jit(run)


def time_dependent(step, q0, sets, args) -> dict:
    """Per-call time of `step` as dependent calls in one jitted loop (METHOD_TEXT['dependent'])."""
    return time_loop(step, q0, sets, args, method="dependent")


def time_loop(step, carry0, sets, args, method: str = "loop") -> dict:
    """Per-call time of `step` via a jitted fori_loop (METHOD_TEXT[method], "loop" or
    "dependent": the two differ only in the loop they build)."""
    if method not in ("loop", "dependent"):
        raise ValueError(f"time_loop method: got {method!r}, expected 'loop' or 'dependent'")
    build = _dependent_fn if method == "dependent" else _loop_fn
    n = len(sets)
    # Passes over the sets per iteration: a loop iteration has a fixed cost of its own
    # (docs/performance.md), which belongs to no implementation.
    unroll = max(1, -(-args.min_calls_per_iter // n))
    n_calls = n * unroll
    # R is sized so that the short loop lasts half the target, the long one (2R) the target.
    target = args.target_ms * 1e-3 / 2
    R = 2
    f = build(step, R, n, unroll)
    t_compile = _wall(lambda: f(carry0, sets))          # compile + first run
    _wall(lambda: f(carry0, sets))                      # warm-up
    per_call = None
    for _ in range(4):                                  # grow R until a sample lasts ~target
        t = min(_wall(lambda: f(carry0, sets)) for _ in range(2))
        per_call = t / (R * n_calls)
        if t >= 0.5 * target or R >= args.max_loop:
            break
        R_new = min(args.max_loop, next_pow2(math.ceil(R * target / max(t, 1e-9))))
        if R_new <= R:
            break
        R = R_new
        f = build(step, R, n, unroll)
        _wall(lambda: f(carry0, sets))                  # compile + warm-up

    def measure_pairs(f, R):
        f_long = build(step, 2 * R, n, unroll)
        _wall(lambda: f_long(carry0, sets))             # compile + first run
        _wall(lambda: f_long(carry0, sets))             # warm-up
        short, long_ = [], []
        for _ in range(args.reps):                      # interleaved pairs
            short.append(_wall(lambda: f(carry0, sets)))
            long_.append(_wall(lambda: f_long(carry0, sets)))
        return short, long_

    short, long_ = measure_pairs(f, R)
    probe_R = R
    # The probe's samples can run slow (a GPU still raising its clocks after idling), which
    # leaves R too small and the slope pairs spread. If the measured short loop lasts well
    # under what the probe accepted (half the target), size R again from it and measure
    # once more.
    if statistics.median(short) < 0.4 * target:
        R_new = min(args.max_loop,
                    next_pow2(math.ceil(R * target / max(statistics.median(short), 1e-9))))
        if R_new > R:
            R = R_new
            f = build(step, R, n, unroll)
            _wall(lambda: f(carry0, sets))              # compile + warm-up
            short, long_ = measure_pairs(f, R)
    calls = R * n_calls
    samples = slope_per_call(short, long_, calls, 2 * calls)
    average = statistics.median(long_) / (2 * calls)
    median = statistics.median(samples)
    if not median > 0:
        # Noise above the work (a trivial step on a busy CPU): the long loop's average.
        median = average
    return dict(method=method, median_s=median, samples_s=samples,
                R=R, probe_R=probe_R, n_sets=n, calls_per_iteration=n_calls, calls_per_sample=calls,
                average_per_call_s=average,
                fixed_per_sample_s=statistics.median(2 * a - b for a, b in zip(short, long_)),
                probe_per_call_s=per_call,
                first_call_s=t_compile)


def sample_spread(samples: list[float]) -> float | None:
    """(slowest - fastest) / median of a row's timed samples: how far apart one run's
    samples of the same call lie (tens of percent on some rows).
    Shown beside every row, so that a difference smaller than it is not read as a change."""
    if len(samples) < 2:
        return None
    median = statistics.median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else None


def slope_per_call(short: list[float], long_: list[float], calls_short: int,
                   calls_long: int) -> list[float]:
    """Per-call times from paired samples (seconds) of a short and a long loop:
    (long - short) / (calls_long - calls_short). A cost paid once per sample,
    whatever it is, cancels; an average over one loop's calls would carry it."""
    return [(b - a) / (calls_long - calls_short) for a, b in zip(short, long_)]


def time_dispatch(step_jit, carry0, sets, args) -> dict:
    """Per-call time of back-to-back dispatches (see METHOD_TEXT['dispatch'])."""
    n = len(sets)

    def run(count):
        def go():
            c = carry0
            for i in range(count):
                c = step_jit(c, *sets[i % n])
            return c
        return go

    _wall(run(1))
    _wall(run(n))
    probe = min(_wall(run(2 * n)) for _ in range(2)) / (2 * n)
    count = int(min(max(n, math.ceil(args.target_ms * 1e-3 / max(probe, 1e-9))), args.max_loop))
    count = max(n, (count // n) * n)
    samples = [_wall(run(count)) / count for _ in range(args.reps)]
    return dict(method="dispatch", median_s=statistics.median(samples), samples_s=samples,
                calls_per_sample=count, n_sets=n, probe_s=probe)


# --method: the timings each choice runs, the first giving the row's figure.
METHOD_CHOICES = {"dependent": ("dependent",), "loop": ("loop",), "dispatch": ("dispatch",),
                  "both": ("loop", "dispatch"), "all": ("dependent", "loop", "dispatch")}


def run_timing(step, carry0, sets, args, step_jit=None) -> dict:
    """{method: timing} for each method of --method, in METHOD_CHOICES order (the first
    is the row's figure)."""
    out = {}
    for m in METHOD_CHOICES[args.method]:
        if m == "dependent":
            out[m] = time_dependent(step, carry0, sets, args)
        elif m == "loop":
            out[m] = time_loop(step, carry0, sets, args)
        else:
            out[m] = time_dispatch(step_jit or jax.jit(step), carry0, sets, args)
    return out


# ---------------------------------------------------------------------------
# Copy bandwidth
# ---------------------------------------------------------------------------
def _reference_args(args) -> argparse.Namespace:
    """The timing arguments of the two references (copy bandwidth, matrix-product rate).
    One call per loop iteration: XLA fuses unrolled increments into one pass, and a
    matrix product is long enough on its own. At least --ref-target-ms per long sample
    and --ref-reps pairs, whatever the rows take, since every row's fraction divides by
    them: a copy call lasts ~1.4 ms on a 2 GiB array, so at --target-ms 10 its loop would
    stay at R = 2, whose slope pairs (2 against 4 calls) spread several times more than
    the rows' own."""
    return argparse.Namespace(**dict(vars(args), min_calls_per_iter=1,
                                     target_ms=max(args.target_ms, args.ref_target_ms),
                                     reps=max(args.reps, args.ref_reps)))


def measure_copy_bandwidth(args) -> dict:
    """Device-to-device streaming bandwidth through JAX: y = x + 1 on a large float32 array,
    counting bytes read + bytes written. Two variants; the larger figure is the reference."""
    n_elem = max(1, int(args.copy_gb * 2 ** 30) // 4)
    x = block(jax.jit(lambda k: jax.random.normal(k, (n_elem,), jnp.float32))(rkey(args.seed + 12345)))
    nbytes = 2 * n_elem * 4
    res: dict[str, Any] = dict(array_bytes=n_elem * 4, bytes_per_call=nbytes,
                               kernel="y = x + 1 (float32), bytes read + written")
    inc = lambda c: c + jnp.float32(1.0)  # noqa: E731
    ref_args = _reference_args(args)
    res.update(target_ms=ref_args.target_ms, reps=ref_args.reps)
    try:
        t = time_loop(inc, x, [()], ref_args)
        res["loop"] = dict(us=t["median_s"] * 1e6, tbps=nbytes / t["median_s"] / 1e12,
                           R=t["R"], samples_us=[s * 1e6 for s in t["samples_s"]],
                           note="in-place update of the loop carry")
    except Exception as e:  # pragma: no cover
        res["loop"] = dict(error=short_error(e))
    try:
        f = jax.jit(inc)
        t = time_dispatch(f, x, [()], ref_args)
        res["dispatch"] = dict(us=t["median_s"] * 1e6, tbps=nbytes / t["median_s"] / 1e12,
                               calls_per_sample=t["calls_per_sample"],
                               samples_us=[s * 1e6 for s in t["samples_s"]],
                               note="out-of-place, back-to-back jitted calls")
    except Exception as e:  # pragma: no cover
        res["dispatch"] = dict(error=short_error(e))
    del x
    figures = [v["tbps"] for k, v in res.items() if isinstance(v, dict) and "tbps" in v]
    res["tbps"] = max(figures) if figures else None
    return res


# ---------------------------------------------------------------------------
# Matrix-product rate and the roofline bound
# ---------------------------------------------------------------------------
def measure_matmul_rate(args) -> dict:
    """Tensor-core reference measured in the same run, beside the copy bandwidth:
    c <- c @ b for [n, n] matrices of the benchmark's dtype (XLA's own GEMM), 2 n^3
    flops per call, timed by the loop method. With the copy bandwidth it gives each
    row the least time a call could take (see attention_work, roofline_s)."""
    n = args.matmul_n
    res: dict[str, Any] = dict(n=n, dtype=args.dtype, flops_per_call=2 * n ** 3,
                               kernel=f"c @ b, [{n}, {n}] {args.dtype}", tflops=None)
    if n <= 0:
        res["error"] = "not measured (--matmul-n 0)"
        return res
    dtype = DTYPES[args.dtype]
    k1, k2 = jax.random.split(rkey(args.seed + 54321))
    c = block(jax.jit(lambda k: jax.random.normal(k, (n, n), dtype))(k1))
    # Entries of b ~ N(0, 1/n): a product keeps the carry's scale, so the loop
    # neither overflows nor underflows.
    b = block(jax.jit(lambda k: (jax.random.normal(k, (n, n), jnp.float32)
                                 * (1.0 / math.sqrt(n))).astype(dtype))(k2))
    ref_args = _reference_args(args)
    res.update(target_ms=ref_args.target_ms, reps=ref_args.reps)
    try:
        t = time_loop(lambda c, b: c @ b, c, [(b,)], ref_args)
        res.update(us=t["median_s"] * 1e6, tflops=res["flops_per_call"] / t["median_s"] / 1e12,
                   R=t["R"], samples_us=[s * 1e6 for s in t["samples_s"]])
    except Exception as e:  # pragma: no cover
        res["error"] = short_error(e)
    del c, b
    return res


def attention_work(lens, q_len: int, num_heads: int, head_size: int, window: int | None,
                   query_itemsize: int, kv_bytes: int) -> tuple[int, int]:
    """(useful flops, least bytes moved) of one paged_attention call. Flops: 4 *
    head_size per (query head, attended token) pair (2 for q.k, 2 for p.v), the pairs
    being the attended ranges of jax_paged.reference.query_row_ranges (the new token i
    of a sequence of length L attends the tokens up to position L - q_len + i, the last
    `window` of them with a window); padded rows of a tensor-core tile are not counted.
    Bytes: kv_bytes (the K and V a call must read) plus the query read and the output
    written."""
    from jax_paged.reference import query_row_ranges
    lens = np.asarray(lens, np.int32)
    starts, ends = query_row_ranges(jnp.asarray(lens), int(lens.max(initial=0)), q_len, window)
    attended = np.asarray(ends, np.int64) - np.asarray(starts, np.int64)
    flops = 4 * head_size * num_heads * int(attended.sum())
    io_bytes = int(kv_bytes) + 2 * len(lens) * q_len * num_heads * head_size * query_itemsize
    return flops, io_bytes


def roofline_s(flops: int, io_bytes: int, copy_tbps, matmul_tflops) -> float | None:
    """The least time of a call on this device: its bytes at the same-run copy
    bandwidth or its flops at the same-run matrix-product rate, whichever is longer."""
    if not copy_tbps or not matmul_tflops:
        return None
    return max(io_bytes / (copy_tbps * 1e12), flops / (matmul_tflops * 1e12))


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------
def cache_shapes(cfg: Config, num_blocks: int):
    itemsize = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    x = 16 // itemsize
    if cfg.head_size % x:
        raise ValueError(f"head_size {cfg.head_size} not a multiple of x={x}")
    kshape = (num_blocks, cfg.num_kv_heads, cfg.head_size // x, cfg.block_size, x)
    vshape = (num_blocks, cfg.num_kv_heads, cfg.head_size, cfg.block_size)
    return kshape, vshape


def plan_config(cfg: Config, args) -> dict:
    """Lengths, block counts, bytes and the number of rotated input sets."""
    rng = np.random.default_rng([args.seed, 1])
    if cfg.ragged:
        lens = rng.integers(1, cfg.seq_len + 1, size=cfg.batch).astype(np.int32)
    else:
        lens = np.full((cfg.batch,), cfg.seq_len, np.int32)
    bs = cfg.block_size
    nblocks = (lens + bs - 1) // bs
    num_blocks = int(nblocks.sum())
    itemsize = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    pool_bytes = 2 * num_blocks * bs * cfg.num_kv_heads * cfg.head_size * itemsize
    kv_bytes = int(lens.sum()) * cfg.num_kv_heads * cfg.head_size * 2 * itemsize
    n_sets = 1
    if pool_bytes < args.rotate_mb * 2 ** 20:
        n_sets = min(args.max_sets, max(2, math.ceil(args.rotate_mb * 2 ** 20 / max(pool_bytes, 1))))
    copies = 2 if not args.no_pallas else 1          # native + Pallas layout
    cap = args.max_cache_gb * 2 ** 30
    while n_sets > 1 and pool_bytes * n_sets * copies > cap:
        n_sets -= 1
    too_big = pool_bytes * copies > cap
    return dict(lens=lens, nblocks=nblocks, num_blocks=num_blocks, max_blocks=-(-cfg.seq_len // bs),
                pool_bytes=pool_bytes, kv_bytes=kv_bytes, n_sets=n_sets, too_big=too_big,
                alloc_bytes=pool_bytes * n_sets * copies)


def make_sets(cfg: Config, plan: dict, args):
    """Random q and n_sets independent (key_cache, value_cache, block_tables, seq_lens)."""
    dtype = DTYPES[cfg.dtype]
    kshape, vshape = cache_shapes(cfg, plan["num_blocks"])
    gen = jax.jit(lambda kk, kv: (jax.random.normal(kk, kshape, dtype),
                                  jax.random.normal(kv, vshape, dtype)))
    lens, nblocks, N, M = plan["lens"], plan["nblocks"], plan["num_blocks"], plan["max_blocks"]
    seq_lens = jnp.asarray(lens)
    sets, tables = [], []
    for s in range(plan["n_sets"]):
        rng = np.random.default_rng([args.seed, 2, s])
        perm = rng.permutation(N).astype(np.int32)
        bt = rng.integers(0, N, size=(cfg.batch, M), dtype=np.int32)   # padding: valid ids
        off = 0
        for b in range(cfg.batch):
            bt[b, :nblocks[b]] = perm[off:off + nblocks[b]]
            off += nblocks[b]
        kc, vc = gen(rkey(args.seed * 1000 + 17 + 2 * s), rkey(args.seed * 1000 + 18 + 2 * s))
        sets.append((kc, vc, jnp.asarray(bt), seq_lens))
        tables.append(bt)
    q = jax.jit(lambda k: jax.random.normal(k, (cfg.batch, cfg.num_heads, cfg.head_size), dtype))(
        rkey(args.seed * 1000 + 3))
    return block(q), block(sets)


def ground_truth(q, kc, vc, bt, sl, scale: float, *, soft_cap=None, window=None, k_scale=None,
                 v_scale=None):
    """Independent float32 paged attention: gather, mask, softmax, HIGHEST precision (with the
    optional soft cap, sliding window and per-tensor fp8 dequantisation scales). A query
    [B, N, Hq, D] holds N new tokens at positions L - N .. L - 1, each attending the tokens
    up to its own position (causal); a row with nothing to attend gives zeros."""
    multi = q.ndim == 4
    if not multi:
        q = q[:, None]
    B, N, Hq, D = q.shape
    _, Hkv, _, bs, _ = kc.shape
    M = bt.shape[1]
    g = Hq // Hkv
    per_seq = M * bs * Hkv * D * 4 * 2
    chunk = int(max(1, min(B, (1 << 30) // max(per_seq, 1))))
    ks = jnp.float32(1.0) if k_scale is None else jnp.asarray(k_scale, jnp.float32).reshape(())
    vs = jnp.float32(1.0) if v_scale is None else jnp.asarray(v_scale, jnp.float32).reshape(())

    def one(kc, vc, a):
        qs, row, L = a
        k = kc[row].transpose(0, 3, 1, 2, 4).reshape(M * bs, Hkv, D).astype(jnp.float32) * ks
        v = vc[row].transpose(0, 3, 1, 2).reshape(M * bs, Hkv, D).astype(jnp.float32) * vs
        qg = qs.reshape(N, Hkv, g, D).astype(jnp.float32)
        logits = jnp.einsum("nkgd,tkd->nkgt", qg, k, precision=lax.Precision.HIGHEST) * scale
        if soft_cap:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        t = jnp.arange(M * bs)[None, None, None, :]
        pos = (L - N + jnp.arange(N))[:, None, None, None]   # each new token's position
        keep = (t <= pos) & (t < L)
        if window:
            keep = keep & (t > pos - window)
        logits = jnp.where(keep, logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        o = jnp.einsum("nkgt,tkd->nkgd", p, v, precision=lax.Precision.HIGHEST)
        o = jnp.where(keep.any(axis=-1, keepdims=True), o, 0.0)
        return o.reshape(N, Hq, D)

    # The caches are arguments, never closed-over constants.
    out = jax.jit(lambda kc, vc, *a: lax.map(lambda t: one(kc, vc, t), a, batch_size=chunk))(
        kc, vc, q, bt, sl)
    return out if multi else out[:, 0]


def compare(out, truth) -> dict:
    o = np.asarray(jnp.asarray(out, jnp.float32))
    t = np.asarray(truth)
    finite = bool(np.isfinite(o).all())
    d = np.abs(o - t)
    max_abs = float(np.nanmax(d)) if d.size else 0.0
    rel = float(np.linalg.norm(np.nan_to_num(o - t, nan=1e30)) / max(np.linalg.norm(t), 1e-30))
    return dict(max_abs_err=max_abs if finite else float("nan"), rel_l2_err=rel if finite else float("nan"),
                finite=finite, ref_max_abs=float(np.abs(t).max()) if t.size else 0.0)


# ---------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------
def jax_paged_step(jp, impl: str, scale: float, partition_size: int, **kwargs):
    def step(q, kc, vc, bt, sl):
        return jp.paged_attention(q, kc, vc, bt, sl, scale=scale, impl=impl,
                                  partition_size=partition_size, **kwargs)
    return step


# ---------------------------------------------------------------------------
# Feature variants (issue 6): fp8 caches, soft cap, sliding window
# ---------------------------------------------------------------------------
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def variant_list(args) -> list[tuple[str, str, str]]:
    """(row name, impl, feature) for each --fp8 / --soft-cap / --window / --q-len request."""
    feats = [f"fp8{f}" for f in dict.fromkeys(args.fp8)]
    if args.soft_cap:
        feats.append("cap")
    if args.window:
        feats.append(f"win{args.window}")
    feats += [f"q{n}" for n in dict.fromkeys(args.q_len)]
    feats += [f"fp8{f}q{n}" for f in dict.fromkeys(args.fp8) for n in dict.fromkeys(args.fp8_q_len)]
    return [(f"{impl}+{feat}", impl, feat) for feat in feats for impl in args.variant_impls]


def quantise_sets(sets, fmt: str):
    """fp8 copies of every set's caches with one per-tensor scale each for K and V
    (amax of set 0 / the format's max), made once outside timing."""
    dt = FP8_DTYPES[fmt]
    fmax = float(jnp.finfo(dt).max)
    ks = (jnp.max(jnp.abs(sets[0][0].astype(jnp.float32))) / fmax).astype(jnp.float32)
    vs = (jnp.max(jnp.abs(sets[0][1].astype(jnp.float32))) / fmax).astype(jnp.float32)
    x = 16
    conv = jax.jit(lambda c, sc: jnp.clip(c.astype(jnp.float32) / sc, -fmax, fmax).astype(dt))
    out = []
    for kc, vc, bt, sl in sets:
        n, h, dx, bs, xx = kc.shape
        # Re-layout K for x = 16: [N, Hkv, D/x, bs, x] -> [N, Hkv, D/16, bs, 16].
        k_lin = kc.transpose(0, 1, 3, 2, 4).reshape(n, h, bs, dx * xx)
        k16 = k_lin.reshape(n, h, bs, (dx * xx) // x, x).transpose(0, 1, 3, 2, 4)
        out.append((block(conv(k16, ks)), block(conv(vc, vs)), bt, sl))
    return out, ks, vs


def cache_variant(sets, kv: str, kv_bytes: int):
    """The inputs of one cache variant named as the development scripts name them:
    "bf16" (the sets as made), "fp8e4m3" / "fp8e5m2" (quantise_sets; one byte per
    element) or "cap<c>" (soft cap c). Returns (sets, paged_attention kwargs, bytes read)."""
    if kv.startswith("fp8"):
        qsets, ks, vs = quantise_sets(sets, kv[3:])
        return qsets, dict(k_scale=ks, v_scale=vs), kv_bytes // 2
    if kv.startswith("cap"):
        return sets, dict(soft_cap=float(kv[3:])), kv_bytes
    if kv != "bf16":
        raise ValueError(f"cache variant {kv!r}: expected bf16, fp8e4m3, fp8e5m2 or cap<c>")
    return sets, {}, kv_bytes


def tie_to_query(q, block_tables):
    """block_tables + 0, the 0 computed from the query. In a decode loop the cache changes
    every step; here the same input set comes back every n_sets calls, and XLA would compute
    the jnp reference's page gather (which does not depend on the query) once for all the
    calls of a loop iteration on that set. Tied to the query, the gather runs at every call.
    (x * 0 is not folded for floats; the query is finite.)"""
    zero = (q.reshape(-1)[0].astype(jnp.float32) * 0.0).astype(block_tables.dtype)
    return block_tables + zero


def reference_step(jp, scale: float):
    """impl='reference' through the public entry point, else jax_paged.reference."""
    def via_api(q, kc, vc, bt, sl):
        return jp.paged_attention(q, kc, vc, tie_to_query(q, bt), sl, scale=scale,
                                  impl="reference")

    def via_module(q, kc, vc, bt, sl):
        return jp.reference.paged_attention(q, kc, vc, tie_to_query(q, bt), sl, scale=scale)
    return via_api, via_module


def load_pallas():
    from jax.experimental.pallas.ops.gpu import paged_attention as mod
    fn = mod.paged_attention
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        params = set(PALLAS_DEFAULTS) | {"interpret"}
    return fn, params


def pallas_settings(cfg: Config, overrides: dict) -> dict:
    """Valid Pallas settings for this config. Constraints of the kernel (jax 0.10-0.11):
    block_h % 16 == 0 (query heads of a KV head are padded up to block_h);
    pages_per_sequence % k_splits == 0; pages_per_partition % pages_per_compute_block == 0
    after pages_per_compute_block = min(pages_per_compute_block, pages_per_partition);
    Triton tiles want power-of-two sizes and dot operands of >= 16 rows, so
    pages_per_compute_block * block_size is kept a power of two >= 16.
    JAX's defaults are kept where valid (k_splits lowered to the page count, ppcb to the pages
    per split, as the kernel itself does), and the block-table columns are padded (with page 0,
    a valid id masked by `lengths`) up to a multiple of k_splits * ppcb."""
    o = dict(PALLAS_DEFAULTS)
    o.update(overrides)
    pages = -(-cfg.seq_len // cfg.block_size)
    k_splits = max(1, min(int(o["k_splits"]), pages))
    ppcb = max(1, min(int(o["pages_per_compute_block"]), -(-pages // k_splits)))
    ppcb = 1 << (ppcb.bit_length() - 1)                      # power of two, rounded down
    if ppcb * cfg.block_size < 16:
        ppcb = next_pow2(-(-16 // cfg.block_size))
        k_splits = max(1, min(k_splits, -(-pages // ppcb)))
    padded = -(-pages // (k_splits * ppcb)) * (k_splits * ppcb)
    o.update(k_splits=k_splits, pages_per_compute_block=ppcb)
    return dict(kwargs=o, pages_per_sequence=pages, padded_pages_per_sequence=padded)


def to_pallas_layout(kc, vc, bt, padded_pages: int, pool_pages: int | None = None):
    N, Hkv, Dx, bs, x = kc.shape
    D = Dx * x

    def conv(kc, vc, bt):
        kp = kc.transpose(1, 0, 3, 2, 4).reshape(Hkv, N, bs, D)     # [Hkv, N, bs, D]
        vp = vc.transpose(1, 0, 3, 2)                                # [Hkv, N, bs, D]
        if pool_pages is not None and pool_pages > N:
            pad = ((0, 0), (0, pool_pages - N), (0, 0), (0, 0))
            kp, vp = jnp.pad(kp, pad), jnp.pad(vp, pad)
        btp = jnp.pad(bt, ((0, 0), (0, padded_pages - bt.shape[1])))  # page 0: valid, masked
        return kp, vp, btp
    return jax.jit(conv)(kc, vc, bt)


def pallas_step(fn, params: set, kwargs: dict, scale: float, interpret: bool):
    kw = {k: v for k, v in kwargs.items() if k in params}
    if "interpret" in params and interpret:
        kw["interpret"] = True

    def step(q, kp, vp, btp, sl):
        qs = (q.astype(jnp.float32) * scale).astype(q.dtype)   # Pallas takes no scale
        return fn(qs, kp, vp, btp, sl, **kw)
    return step, kw


# ---------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------
def bench_config(cfg: Config, args, jp, impls: list[str], copy_tbps, bar,
                 matmul_tflops=None) -> dict:
    plan = plan_config(cfg, args)
    scale = cfg.head_size ** -0.5
    res: dict[str, Any] = dict(
        config=dataclasses.asdict(cfg), label=cfg.label, kv_bytes=plan["kv_bytes"],
        total_tokens=int(plan["lens"].sum()), num_blocks=plan["num_blocks"],
        max_blocks_per_seq=plan["max_blocks"], pool_bytes=plan["pool_bytes"],
        n_sets=plan["n_sets"], alloc_bytes=plan["alloc_bytes"], scale=scale, impls={},
        quoted=QUOTED.get(cfg.quoted_key) if cfg.quoted_key else None)
    if cfg.ragged:
        res["seq_lens"] = plan["lens"].tolist()
    names = list(impls) + ([] if args.no_reference else ["reference"]) + ([] if args.no_pallas else ["pallas"])
    if plan["too_big"]:
        msg = (f"skipped: needs {plan['pool_bytes'] * (1 if args.no_pallas else 2) / 2**30:.2f} GiB "
               f"of caches > --max-cache-gb {args.max_cache_gb}")
        for n in names:
            res["impls"][n] = dict(error=msg)
        bar.update(len(names) + 1)
        return res

    bar.set_description(f"{cfg.label}: data")
    q, sets = make_sets(cfg, plan, args)
    truth = block(ground_truth(q, *sets[0], scale))
    ref_out = None
    if not args.no_reference:      # the jnp reference's output, for a second comparison
        for fn in reference_step(jp, scale):
            try:
                ref_out = np.asarray(jnp.asarray(block(jax.jit(fn)(q, *sets[0])), jnp.float32))
                break
            except Exception:
                continue
    bar.update(1)
    tol = TOLERANCE[cfg.dtype]

    def measure(name, step, step_sets, extra=None, truth=truth, ref_out=ref_out,
                kv_bytes=plan["kv_bytes"], q=q, q_len=1, window=None):
        bar.set_description(f"{cfg.label}: {name}")
        r: dict[str, Any] = dict(extra or {})
        unquantised = r.pop("unquantised_truth", None)
        try:
            fj = jax.jit(step)
            out = block(fj(q, *step_sets[0]))
            r.update(compare(out, truth))
            if unquantised is not None:   # fp8: also the error against the unquantised data
                r["rel_l2_err_vs_unquantised"] = compare(out, unquantised)["rel_l2_err"]
            if ref_out is not None:
                r["max_abs_diff_vs_reference"] = float(
                    np.nanmax(np.abs(np.asarray(jnp.asarray(out, jnp.float32)) - ref_out)))
            r["ok"] = bool(r["finite"] and r["rel_l2_err"] <= tol)
            del out
            t = run_timing(step, q, step_sets, args, step_jit=fj)
            for m, tm in t.items():
                r[m] = dict(us=tm["median_s"] * 1e6,
                            samples_us=[s * 1e6 for s in tm["samples_s"]],
                            **{k: v for k, v in tm.items() if k not in ("median_s", "samples_s", "method")})
            r["method"] = METHOD_CHOICES[args.method][0]
            main = t[r["method"]]
            r["us"] = main["median_s"] * 1e6
            r["spread"] = sample_spread(main["samples_s"])
            r["kv_bytes"] = kv_bytes
            r["tbps"] = kv_bytes / main["median_s"] / 1e12
            r["frac_copy"] = r["tbps"] / copy_tbps if copy_tbps else None
            r["flops"], r["io_bytes"] = attention_work(
                plan["lens"], q_len, cfg.num_heads, cfg.head_size, window,
                jnp.dtype(q.dtype).itemsize, kv_bytes)
            bound = roofline_s(r["flops"], r["io_bytes"], copy_tbps, matmul_tflops)
            if bound is not None:
                r["roofline_us"] = bound * 1e6
                r["frac_roofline"] = bound / main["median_s"]
        except Exception as e:
            r["error"] = short_error(e)
            r["traceback"] = traceback.format_exc(limit=6)
            if args.verbose:
                bar.write(f"{cfg.label} {name}: {r['traceback']}")
        bar.update(1)
        return r

    # jax_paged implementations (and the reference)
    for name in impls:
        res["impls"][name] = measure(name, jax_paged_step(jp, name, scale, args.partition_size), sets)
    if not args.no_reference:
        via_api, via_module = reference_step(jp, scale)
        r = measure("reference", via_api, sets, dict(entry='paged_attention(impl="reference")'))
        if "error" in r and hasattr(jp, "reference"):
            bar.total += 1
            r2 = measure("reference", via_module, sets, dict(entry="jax_paged.reference.paged_attention",
                                                            api_error=r["error"]))
            r = r2
        res["impls"]["reference"] = r

    # Feature variants (issue 6): each checked against its own ground truth.
    itemsize = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    fp8_sets = {}
    for vname, impl, feat in variant_list(args):
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = dict(variant=feat, impl=impl)
        vsets, vbytes, vq = sets, plan["kv_bytes"], None
        try:
            # "q<N>": N new tokens per sequence (speculative verification, chunked
            # prefill): the same pages as the decode step, so TB/s counts the same bytes.
            # "fp8<fmt>q<N>": the same on the fp8 caches.
            n_new = int(feat.rsplit("q", 1)[1]) if "q" in feat else 0
            if n_new:
                vq = block(jax.random.normal(rkey(args.seed * 1000 + 5 + n_new),
                                             (cfg.batch, n_new, cfg.num_heads, cfg.head_size),
                                             q.dtype))
                extra["q_len"] = n_new
            if feat.startswith("fp8"):
                fmt = feat[3:].split("q")[0]
                if fmt not in fp8_sets:
                    fp8_sets[fmt] = quantise_sets(sets, fmt)
                vsets, ks, vs = fp8_sets[fmt]
                kwargs = dict(k_scale=ks, v_scale=vs)
                vbytes = plan["kv_bytes"] // itemsize            # one byte per element
                extra.update(k_scale=float(ks), v_scale=float(vs))
                if not n_new:   # (the unquantised truth is the decode step's)
                    extra["unquantised_truth"] = truth
                vtruth = block(ground_truth(vq if n_new else q, *vsets[0], scale, k_scale=ks,
                                            v_scale=vs))
            elif n_new:
                vtruth = block(ground_truth(vq, *sets[0], scale))
            elif feat == "cap":
                kwargs = dict(soft_cap=args.soft_cap)
                extra["soft_cap"] = args.soft_cap
                vtruth = block(ground_truth(q, *sets[0], scale, soft_cap=args.soft_cap))
            else:
                kwargs = dict(sliding_window=args.window)
                extra["sliding_window"] = args.window
                # Bandwidth over the tokens inside the window (what the kernels read).
                vbytes = int(np.minimum(plan["lens"], args.window).sum()) * (
                    cfg.num_kv_heads * cfg.head_size * 2 * itemsize)
                vtruth = block(ground_truth(q, *sets[0], scale, window=args.window))
        except Exception as e:
            res["impls"][vname] = dict(error="variant setup failed: " + short_error(e), **extra)
            bar.update(1)
            continue
        res["impls"][vname] = measure(
            vname, jax_paged_step(jp, impl, scale, args.partition_size, **kwargs), vsets,
            extra, truth=vtruth, ref_out=None, kv_bytes=vbytes,
            q=vq if vq is not None else q, q_len=max(1, n_new), window=kwargs.get("sliding_window"))
    del fp8_sets

    # Pallas GPU kernel on the same data, converted once outside timing
    if not args.no_pallas:
        res["impls"]["pallas"] = bench_pallas(cfg, args, q, sets, plan, scale, measure, bar)

    # q, sets, truth and the Pallas copies are freed when this frame and `measure` go away.
    return res


def bench_pallas(cfg, args, q, sets, plan, scale, measure, bar) -> dict:
    try:
        fn, params = load_pallas()
    except Exception as e:
        bar.update(1)
        return dict(error="import failed: " + short_error(e))
    interpret = jax.default_backend() != "gpu"
    st = pallas_settings(cfg, args.pallas_opts)
    info = dict(settings=st["kwargs"], pages_per_sequence=st["pages_per_sequence"],
                padded_pages_per_sequence=st["padded_pages_per_sequence"], interpret=interpret,
                prescaled_query=True)

    def attempt(pool_pages, kwargs, extra, time_it=True):
        psets = [to_pallas_layout(kc, vc, bt, st["padded_pages_per_sequence"], pool_pages)
                 for (kc, vc, bt, _sl) in sets]
        psets = [(kp, vp, btp, sl) for (kp, vp, btp), (_, _, _, sl) in zip(psets, sets)]
        block(psets)
        step, kw = pallas_step(fn, params, kwargs, scale, interpret)
        r = measure("pallas", step, psets, dict(info, **extra, call_kwargs=kw))
        del psets
        return r

    tune = None
    if args.pallas_tune and not interpret:
        tune = pallas_tune(cfg, args, fn, params, q, sets, st, scale, bar)
        if tune.get("best"):
            st["kwargs"].update(tune["best"]["kwargs"])
            st["padded_pages_per_sequence"] = tune["best"]["padded_pages_per_sequence"]
            info.update(settings=st["kwargs"],
                        padded_pages_per_sequence=st["padded_pages_per_sequence"])
    r = attempt(None, st["kwargs"], {})
    N = plan["num_blocks"]
    if "error" in r and N != next_pow2(N):
        # Retry once with the page pool padded to a power of two (Triton block shapes).
        bar.total += 1
        r2 = attempt(next_pow2(N), st["kwargs"], dict(pool_pages=next_pow2(N), first_error=r["error"]))
        if "error" not in r2:
            r = r2
    if tune is not None:
        r["tune"] = tune
    return r


def pallas_tune(cfg, args, fn, params, q, sets, st, scale, bar) -> dict:
    """Small sweep over k_splits x pages_per_compute_block (quick timing, loop method)."""
    out: dict[str, Any] = dict(trials=[])
    kc, vc, bt, sl = sets[0]
    pages = st["pages_per_sequence"]
    quick = argparse.Namespace(**vars(args))
    quick.reps = 3
    best = None
    for ks in (4, 8, 16, 32, 64):
        for pp in (4, 8, 16):
            s2 = pallas_settings(cfg, dict(args.pallas_opts, k_splits=ks, pages_per_compute_block=pp))
            kw = s2["kwargs"]
            if kw["k_splits"] != ks or kw["pages_per_compute_block"] != pp:
                continue
            if s2["padded_pages_per_sequence"] > 2 * pages:
                continue
            bar.set_description(f"{cfg.label}: pallas tune k_splits={ks} ppcb={pp}")
            trial = dict(k_splits=ks, pages_per_compute_block=pp)
            try:
                kp, vp, btp = to_pallas_layout(kc, vc, bt, s2["padded_pages_per_sequence"])
                step, _ = pallas_step(fn, params, kw, scale, False)
                t = time_loop(step, q, [(kp, vp, btp, sl)], quick)
                trial["us"] = t["median_s"] * 1e6
                if best is None or trial["us"] < best["us"]:
                    best = dict(us=trial["us"], kwargs=dict(kw),
                                padded_pages_per_sequence=s2["padded_pages_per_sequence"])
                del kp, vp, btp
            except Exception as e:
                trial["error"] = short_error(e, 160)
            out["trials"].append(trial)
    out["best"] = best
    return out


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------
def copy_bar(cfg: Config) -> float | None:
    """Issue 4's bandwidth bar for a configuration: 90% of the copy bandwidth when B*Hkv >=
    256 (not ragged), 75% at B=1, L=32768; None elsewhere."""
    if cfg.batch * cfg.num_kv_heads >= 256 and not cfg.ragged:
        return 0.90
    if cfg.batch == 1 and cfg.seq_len == 32768:
        return 0.75
    return None


def goal_check(cfg: Config, r: dict, copy_tbps) -> str | None:
    """Issue 4's bar for impl='auto': faster than the quoted FlashInfer figure; >= 90% of the
    copy bandwidth when B*Hkv >= 256; >= 75% for B=1, L=32768."""
    a = r["impls"].get("auto")
    if not a or "us" not in a:
        return None
    if a.get("ok") is False:  # a wrong result meets no goal, however fast
        return "not counted: auto failed the correctness check"
    parts = []
    fi = (r.get("quoted") or {}).get("flashinfer")
    if fi:
        parts.append("beats FI*: " + ("yes" if a["us"] < fi[0] else "NO"))
    need = copy_bar(cfg)
    if need is not None and a.get("frac_copy") is not None:
        parts.append(f">={need:.0%} copy: " + ("yes" if a["frac_copy"] >= need else "NO"))
    if not parts:
        return None
    return ("MET  " if all(p.endswith("yes") for p in parts) else "not met  ") + ", ".join(parts)


def feature_goal_check(cfg: Config, r: dict) -> str | None:
    """Issue 6's speed bars for the auto feature rows: an fp8 decode row against issue 4's
    bandwidth bar (copy_bar; fp8 counts one byte per element), a multi-token row as a
    multiple of its own decode step (auto for +q<N>, auto+fp8<fmt> for +fp8<fmt>q<N>; the
    issue asks for q_len up to 16 "at full speed" and names no ratio, so the multiple is
    reported, not judged). A row that failed the float32 check counts for nothing."""
    imp = r["impls"]
    need = copy_bar(cfg)
    parts = []
    for name, x in imp.items():
        m = re.fullmatch(r"auto\+(fp8\w+?)?(?:q(\d+))?", name)
        if not m or not (m.group(1) or m.group(2)) or "us" not in x:
            continue
        fp8, q = m.group(1), m.group(2)
        label = name[len("auto+"):]
        if x.get("ok") is False:
            parts.append(f"{label}: not counted (failed the check)")
        elif q is None:  # an fp8 decode step
            if need is not None and x.get("frac_copy") is not None:
                met = "yes" if x["frac_copy"] >= need else "NO"
                parts.append(f"{label} >={need:.0%} copy: {met} ({100 * x['frac_copy']:.1f}%)")
        else:
            step = imp.get("auto" + (f"+{fp8}" if fp8 else ""), {})
            if step.get("us"):
                parts.append(f"{label} {x['us'] / step['us']:.2f}x step")
    return ", ".join(parts) or None


def build_tables(results: list[dict], meta: dict, impl_order: list[str]) -> str:
    copy = meta["copy_bandwidth"].get("tbps")
    method = meta["args"]["method"]
    methods = METHOD_CHOICES.get(method, (method,))
    # A second column for the dispatch timing when it ran beside the row's figure.
    disp_col = "dispatch" in methods[1:]
    lines = []
    hdr = (f"{'config':<24} {'impl':<14} {'us':>9} {'spread':>6} {'TB/s':>6} {'%copy':>6} {'%roof':>6} {'xref':>6} "
           f"{'xpallas':>7} {'xFI*':>6} {'max|err|':>9} {'rel err':>8} {'|d ref|':>8}  check")
    if disp_col:
        hdr = hdr.replace(f" {'TB/s':>6}", f" {'us(disp)':>9} {'TB/s':>6}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for r in results:
        imp = r["impls"]
        t_ref = imp.get("reference", {}).get("us")
        t_pal = imp.get("pallas", {}).get("us")
        fi = (r.get("quoted") or {}).get("flashinfer")
        first = True
        for name in impl_order:
            if name not in imp:
                continue
            x = imp[name]
            cfg_col = r["label"] if first else ""
            first = False
            if "us" not in x:
                err = x.get("error", "not run")
                if "rel_l2_err" in x:
                    err = f"(check {'ok' if x.get('ok') else 'MISMATCH'}) " + err
                lines.append(f"{cfg_col:<24} {name:<14} ERROR {err[:150]}")
                continue
            us = x["us"]
            ok = x.get("ok")
            check = "ok" if ok else ("!!! MISMATCH !!!" if x.get("finite", True) else "!!! NaN/Inf !!!")
            row = (f"{cfg_col:<24} {name:<14} {us:9.1f} "
                   f"{fmt_pct(x.get('spread'))}% ")
            if disp_col:
                row += f"{fmt(x.get('dispatch', {}).get('us'), '9.1f')} "
            row += (f"{fmt_bw(x['tbps'])} {fmt_pct(x.get('frac_copy'))}% {fmt_pct(x.get('frac_roofline'))}% "
                    f"{fmt(t_ref / us if t_ref else None, '6.2f')} "
                    f"{fmt(t_pal / us if t_pal else None, '7.2f')} "
                    f"{fmt(fi[0] / us if fi else None, '6.2f')} "
                    f"{fmt(x.get('max_abs_err'), '9.2e')} {fmt(x.get('rel_l2_err'), '8.1e')} "
                    f"{fmt(x.get('max_abs_diff_vs_reference'), '8.1e')}  {check}")
            lines.append(row)
        lines.append("")
    lines.append("spread: (slowest - fastest) / median of the row's timed samples (JSON 'spread'); a "
                 "difference between two rows or runs smaller than their spread is not resolved.")
    lines.append("%roof: the least time a call could take on this device / the row's time, the least "
                 "time being its bytes (K and V read, query read, output written) at the same-run copy "
                 "bandwidth or its useful flops (4 x head_size per attended query-head/token pair) at "
                 "the same-run matrix-product rate, whichever is longer (JSON roofline_us).")
    lines.append("xref / xpallas / xFI*: speed-up of the row over the jnp reference / Pallas GPU / "
                 "FlashInfer* (time of the other / time of the row; > 1 = the row is faster).")
    lines.append("max|err|, rel err = max |out - truth|, ||out - truth|| / ||truth|| against an independent "
                 "float32 ground truth (flagged above " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
                 + "); |d ref| = max |out - jnp reference output|.")
    if any("+" in n for n in impl_order):
        lines.append("impl+fp8<fmt> / +cap / +win<W> / +q<N>: issue 6 feature rows (fp8 caches with "
                     "per-tensor scales, logit soft cap, sliding window, N new query tokens per "
                     "sequence), checked against a ground truth with the same feature; TB/s counts the "
                     "bytes actually read (fp8: 1 byte per element; window: the tokens inside it; q<N>: "
                     "the decode step's bytes). JSON rel_l2_err_vs_unquantised: fp8 output vs the "
                     "unquantised caches.")
    lines.append("")
    # Summary, one row per config.
    sh = (f"{'config':<24} {'kv MB':>8} {'auto us':>9} {'auto TB/s':>9} {'%copy':>6} {'best jax_paged':>20} "
          f"{'pallas us':>9} {'ref us':>8} {'FlashInfer* us/TBps':>20}  goal(issue 4)")
    lines.append(sh)
    lines.append("-" * len(sh))
    for r in results:
        imp = r["impls"]
        a = imp.get("auto", {})
        cands = [(v["us"], k) for k, v in imp.items()
                 if k not in ("reference", "pallas") and "+" not in k and "us" in v]
        best = min(cands) if cands else None
        best_s = (f"{best[1]} {fmt_bw(r['kv_bytes'] / best[0] / 1e6, 0)} TB/s") if best else "-"
        fi = (r.get("quoted") or {}).get("flashinfer")
        fi_s = f"{fi[0]} / {fi[1]:.2f}" if fi else "-"
        cfg = Config(**r["config"])
        lines.append(
            f"{r['label']:<24} {r['kv_bytes'] / 1e6:8.1f} {fmt(a.get('us'), '9.1f')} "
            f"{fmt_bw(a.get('tbps'), 9)} {fmt_pct(a.get('frac_copy'))}% "
            f"{best_s:>20} {fmt(imp.get('pallas', {}).get('us'), '9.1f')} "
            f"{fmt(imp.get('reference', {}).get('us'), '8.1f')} {fi_s:>20}  {goal_check(cfg, r, copy) or '-'}")
    issue6 = [(r["label"], feature_goal_check(Config(**r["config"]), r)) for r in results]
    issue6 = [(label, g) for label, g in issue6 if g]
    if issue6:
        lines.append("")
        lines.append("issue 6: fp8 steps against issue 4's bar; multi-token rows as a multiple of "
                     "their own decode step")
        for label, g in issue6:
            lines.append(f"{label:<24} {g}")
    lines.append("")
    lines.append(f"* FlashInfer 0.6.17 decode: figures QUOTED from {QUOTED_SOURCE}.")
    cb = meta["copy_bandwidth"]
    lines.append(
        f"copy bandwidth (this run): {fmt_bw(copy, 0)} TB/s "
        f"[loop {fmt_bw(cb.get('loop', {}).get('tbps'), 0)}, dispatch {fmt_bw(cb.get('dispatch', {}).get('tbps'), 0)}; "
        f"{cb.get('array_bytes', 0) / 2**30:.2f} GiB float32 y = x + 1, bytes read + written]")
    mm = meta.get("matmul_rate") or {}
    lines.append(f"matrix-product rate (this run): {fmt(mm.get('tflops'), '.3g')} TFLOP/s "
                 f"[{mm.get('kernel', '-')}, loop{'; ' + mm['error'] if mm.get('error') else ''}]")
    for m in ("dependent", "loop"):
        fixed = [v[m]["fixed_per_sample_s"] for r in results for v in r["impls"].values()
                 if isinstance(v, dict) and "fixed_per_sample_s" in v.get(m, {})]
        if fixed:
            lines.append(f"{m} timing: per-sample cost cancelled by the R / 2R slope: median "
                         f"{1e3 * statistics.median(fixed):.2f} ms (range {1e3 * min(fixed):.2f} to "
                         f"{1e3 * max(fixed):.2f}) over {len(fixed)} timings")
    dev_opts = meta.get("jax_paged_development_options") or []
    if dev_opts:
        lines.append("jax_paged built with development options: " + " ".join(dev_opts)
                     + " (not the default kernels)")
    env = meta.get("jax_paged_environment") or {}
    if env:
        lines.append("jax_paged environment: "
                     + " ".join(f"{k}={v}" for k, v in env.items()))
    pairs = methods[0] != "dispatch"  # the loop methods' samples come in (R, 2R) pairs
    lines.append(f"device: {meta['device']} | jax {meta['jax_version']} | {meta['date']} | "
                 f"dtype {meta['args']['dtype']} | timing: {' + '.join(methods)}, median of {meta['args']['reps']}"
                 f"{' (R, 2R) pairs' if pairs else ''}, ~{meta['args']['target_ms']} ms per "
                 f"{'2R ' if pairs else ''}sample (see JSON 'method')")
    return "\n".join(lines)


def make_plot(results, meta, impl_order, path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib unavailable: {short_error(e)}"
    labels = [r["label"] for r in results]
    series = [n for n in impl_order if any("tbps" in r["impls"].get(n, {}) for r in results)]
    has_fi = any((r.get("quoted") or {}).get("flashinfer") for r in results)
    nbar = len(series) + (1 if has_fi else 0)
    width = 0.8 / max(nbar, 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(labels) + 3), 5.0))
    xs = np.arange(len(labels))
    colors = plt.get_cmap("tab10")
    top = 0.0
    for i, name in enumerate(series):
        vals = [r["impls"].get(name, {}).get("tbps", np.nan) for r in results]
        top = max([top] + [v for v in vals if v == v])
        ax.bar(xs - 0.4 + width * (i + 0.5), vals, width, label=name,
               color=colors(impl_order.index(name) % 10))   # fixed colour per impl
    if has_fi:
        vals = [((r.get("quoted") or {}).get("flashinfer") or (None, np.nan))[1] for r in results]
        ax.bar(xs - 0.4 + width * (len(series) + 0.5), vals, width, label="FlashInfer (quoted, issue 4)",
               color="none", edgecolor="black", hatch="//")
        top = max([top] + [v for v in vals if v == v])
    copy = meta["copy_bandwidth"].get("tbps")
    if copy:
        ax.axhline(copy, color="red", linestyle="--", linewidth=1.2,
                   label=f"copy bandwidth {fmt_bw(copy, 0)} TB/s (this run)")
    top = max(top, copy or 0.0)
    if top > 0:
        ax.set_ylim(0, top * 1.3)               # room for the legend above the bars
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("effective K/V bandwidth (TB/s)")
    ax.set_title(f"paged attention decode, {meta['args']['dtype']} - {meta['device']} - jax {meta['jax_version']} "
                 f"- {meta['date'][:10]}", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _jsonable(o):
    if isinstance(o, dict):
        return {(str(k) if not isinstance(k, str) else k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        o = float(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], metavar="[ragged:]B,Hq,Hkv,L[,D[,bs]]",
                   help="extra configuration (repeatable); ragged: lengths uniform in [1, L]")
    p.add_argument("--no-defaults", action="store_true", help="run only the --config ones")
    p.add_argument("--quick", action="store_true",
                   help="tiny configs, few repeats: a smoke run (CPU or GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--impls", action="append", default=[],
                   help="extra jax_paged impl names, comma-separated (auto, v1, v2 always run "
                        "unless --no-classic); "
                        "'all' = every name in jax_paged.primitives.IMPLS")
    p.add_argument("--no-classic", action="store_true",
                   help="skip the classic v1 and v2 rows (feature and A/B runs)")
    p.add_argument("--no-pallas", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--pallas-opt", action="append", default=[], metavar="KEY=INT",
                   help="override a Pallas setting (block_h, pages_per_compute_block, k_splits, "
                        "num_warps, num_stages)")
    p.add_argument("--pallas-tune", action="store_true",
                   help="also sweep Pallas k_splits x pages_per_compute_block per config, keep the best")
    p.add_argument("--method", choices=list(METHOD_CHOICES), default="dependent",
                   help="how a call is timed (JSON meta 'method' describes each): dependent "
                        "(default; each output is the next call's query, in one jitted loop), "
                        "loop, dispatch, both (loop and dispatch) or all; the first of a "
                        "combination gives each row's figure (its JSON 'method')")
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="a preset instead of the default configurations: 'peers' = the peer "
                        "comparison rows plus B = 1, 2, 4 at 8k-128k tokens and B = 8, 16 at "
                        "4k-16k, each also with an fp8 e4m3 cache (--config adds to it)")
    p.add_argument("--reps", type=int, default=None, help="timed samples per measurement (median)")
    p.add_argument("--target-ms", type=float, default=None,
                   help="approximate length of one sample of the long loop (2R iterations)")
    p.add_argument("--max-loop", type=int, default=4096,
                   help="max iterations R of the loop method's short loop (its long one makes 2R); "
                        "max calls per sample of the dispatch method")
    p.add_argument("--copy-gb", type=float, default=None, help="GiB of the copy-bandwidth array")
    p.add_argument("--ref-target-ms", type=float, default=40.0,
                   help="least --target-ms of the two references, the copy bandwidth and the "
                        "matrix-product rate (each row's %%copy and %%roof divide by them)")
    p.add_argument("--ref-reps", type=int, default=9,
                   help="least --reps of the two references")
    p.add_argument("--matmul-n", type=int, default=None,
                   help="size n of the [n, n] matrix product whose same-run rate bounds the rows' "
                        "arithmetic (%%roof; default 8192 on a GPU, 2048 with --quick, 256 elsewhere; 0: "
                        "not measured)")
    p.add_argument("--max-cache-gb", type=float, default=None,
                   help="cap on cache bytes allocated per config (all sets, both layouts; "
                        "default 4, or the --suite's own cap)")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="caches smaller than this are replicated into several rotated input sets")
    p.add_argument("--max-sets", type=int, default=4)
    p.add_argument("--min-calls-per-iter", type=int, default=8,
                   help="calls per loop iteration (passes over the rotated sets); spreads the "
                        "loop's fixed per-iteration cost")
    p.add_argument("--partition-size", type=int, default=512)
    p.add_argument("--fp8", action="append", default=[], choices=sorted(FP8_DTYPES),
                   help="also run the --variant-impls on fp8 copies of the caches (per-tensor "
                        "scales; TB/s counts one byte per element) (repeatable)")
    p.add_argument("--soft-cap", type=float, default=None,
                   help="also run the --variant-impls with this logit soft cap")
    p.add_argument("--window", type=int, default=None,
                   help="also run the --variant-impls with this sliding window (TB/s counts the "
                        "tokens inside the window)")
    p.add_argument("--q-len", action="append", type=int, default=[], metavar="N",
                   help="also run the --variant-impls with N new query tokens per sequence "
                        "(causal among them; TB/s counts the same KV bytes) (repeatable)")
    p.add_argument("--fp8-q-len", action="append", type=int, default=[], metavar="N",
                   help="also run the --variant-impls on the --fp8 caches with N new query tokens "
                        "per sequence (repeatable)")
    p.add_argument("--variant-impls", default="auto",
                   help="comma-separated impls the --fp8 / --soft-cap / --window / --q-len rows "
                        "run (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default out/bench/<date>-<device>.json "
                   "(with --quick: ...-quick.json); benchmarks/make_tables.py reads every file "
                   "in benchmarks/results/, so a run goes there only when named")
    p.add_argument("--png", default=None, help="default: the JSON path with .png")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", "-v", action="store_true")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if args.suite and args.quick:
        p.error(f"--suite {args.suite} and --quick both choose the configurations; give one")
    suite = SUITES.get(args.suite, {})
    if args.max_cache_gb is None:
        args.max_cache_gb = suite.get("max_cache_gb", 4.0)
    args.fp8 = list(dict.fromkeys(list(args.fp8) + suite.get("fp8", [])))
    if args.reps is None:
        args.reps = 5 if args.quick else 15
    if args.target_ms is None:
        args.target_ms = (5.0 if args.quick else 30.0)
    if args.matmul_n is None:
        args.matmul_n = 8192 if (on_gpu and not args.quick) else (2048 if on_gpu else 256)
    if args.copy_gb is None:
        args.copy_gb = 2.0 if (on_gpu and not args.quick) else (0.25 if on_gpu else 0.0625)
    opts = {}
    for item in args.pallas_opt:
        k, _, v = item.partition("=")
        if k not in PALLAS_DEFAULTS:
            p.error(f"--pallas-opt {item!r}: key must be one of {sorted(PALLAS_DEFAULTS)}")
        opts[k] = int(v)
    args.pallas_opts = opts
    args.dtype = jnp.dtype(DTYPES[args.dtype]).name
    extra = []
    for item in args.impls:
        extra += [s.strip() for s in item.split(",") if s.strip()]
    args.extra_impls = [e for e in dict.fromkeys(extra) if e not in ("auto", "v1", "v2", "reference")]
    args.variant_impls = [e.strip() for e in args.variant_impls.split(",") if e.strip()]
    if args.soft_cap is not None and not args.soft_cap > 0:
        p.error("--soft-cap must be positive")
    if args.window is not None and args.window < 1:
        p.error("--window must be at least 1")
    if any(n < 2 for n in args.q_len):
        p.error(f"--q-len must be at least 2 (1 is the decode step itself), got {args.q_len}")
    if any(n < 2 for n in args.fp8_q_len):
        p.error(f"--fp8-q-len must be at least 2 (1 is the decode step itself), got {args.fp8_q_len}")
    if args.fp8_q_len and not args.fp8:
        p.error("--fp8-q-len needs --fp8 (the fp8 formats to run it on)")
    return p, args


def config_specs(args) -> list[str]:
    """The configuration strings a run measures: the --suite's, --quick's or the defaults
    (none with --no-defaults), then each --config."""
    if args.suite:
        base = SUITES[args.suite]["configs"]
    else:
        base = QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS
    return ([] if args.no_defaults else list(base)) + list(args.config)


def main(argv=None) -> int:
    p, args = parse_args(argv)
    try:
        configs = list(dict.fromkeys(parse_config(s, args.dtype) for s in config_specs(args)))
    except ValueError as e:
        p.error(str(e))
    if not configs:
        p.error("no configurations (use --config or drop --no-defaults)")

    try:
        import jax_paged as jp
    except Exception as e:
        print(f"cannot import jax_paged: {short_error(e)}", file=sys.stderr)
        return 1

    dev = jax.devices()[0]
    device_name = getattr(dev, "device_kind", str(dev))
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{now:%Y-%m-%d}-{slug(device_name)}"
    # By default out/ (git-ignored): benchmarks/make_tables.py reads every file in
    # benchmarks/results/, so a run goes there only when --json names it.
    json_path = args.json or os.path.join(REPO_ROOT, "out", "bench",
                                          stem + ("-quick" if args.quick else "") + ".json")
    png_path = args.png or os.path.splitext(json_path)[0] + ".png"
    if "all" in args.extra_impls:     # every impl the package declares
        declared = list(getattr(getattr(jp, "primitives", None), "IMPLS", ()))
        args.extra_impls = [n for n in dict.fromkeys(
            [e for e in args.extra_impls if e != "all"] + declared)
            if n not in ("auto", "v1", "v2", "reference")]
    impls = ["auto"] + ([] if args.no_classic else ["v1", "v2"]) + args.extra_impls
    variants = [v[0] for v in variant_list(args)]
    impl_order = impls + variants + ["reference", "pallas"]

    n_impl = (len(impls) + len(variants) + (0 if args.no_reference else 1)
              + (0 if args.no_pallas else 1))
    bar = progress_bar(1 + len(configs) * (n_impl + 1), disable=args.no_progress)
    bar.set_description("copy bandwidth")
    copy = measure_copy_bandwidth(args)
    bar.set_description("matrix-product rate")
    matmul = measure_matmul_rate(args)
    bar.update(1)

    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except Exception:  # pragma: no cover
        jaxlib_version = None
    meta = dict(
        date=now.isoformat(timespec="seconds"), device=device_name, platform=jax.default_backend(),
        devices=[str(d) for d in jax.devices()], jax_version=jax.__version__, jaxlib_version=jaxlib_version,
        jax_paged_version=getattr(jp, "__version__", None),
        jax_paged_file=getattr(jp, "__file__", None),
        jax_paged_cuda_kernels=(jp.has_cuda_kernels() if hasattr(jp, "has_cuda_kernels") else None),
        # A probe's or a candidate's build must never pass for the default kernels.
        jax_paged_development_options=list(jp._native.cuda_development_options()),
        # Development options (JAX_PAGED_DEV_OPTIONS) change which kernels run.
        jax_paged_environment={k: v for k, v in sorted(os.environ.items())
                               if k.startswith("JAX_PAGED_")},
        python=platform.python_version(),
        copy_bandwidth=copy,
        matmul_rate=matmul,
        method={m: METHOD_TEXT[m] for m in METHOD_CHOICES[args.method]},
        bandwidth_definition=("effective TB/s = sum over sequences of seq_len * num_kv_heads * "
                              "head_size * 2 (K and V) * itemsize, divided by the time per call"),
        roofline_definition=("roofline_us = max(io_bytes / copy bandwidth, flops / matrix-product "
                             "rate), both measured in this run; io_bytes = the K and V bytes above + "
                             "the query read + the output written; flops = 4 * head_size per "
                             "(query head, attended token) pair, causal among a multi-token "
                             "query's new tokens, window applied; frac_roofline = roofline_us / "
                             "the row's time"),
        correctness=("each impl once per config against an independent float32 ground truth "
                     "(gathered K/V, masked softmax, HIGHEST precision matmuls); tolerance on the "
                     "relative L2 error: " + json.dumps(TOLERANCE)),
        data=("q, K, V ~ N(0, 1) from jax.random (never zeros); block tables: a random permutation "
              "of the physical blocks, padding entries random valid ids; caches under --rotate-mb "
              "replicated into n_sets independent sets rotated inside each sample"),
        pallas=("jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(q * scale, k_pages, "
                "v_pages, block_tables_padded, lengths, **settings); layouts converted once outside "
                "timing; interpret=True when the backend is not a GPU"),
        quoted_source=QUOTED_SOURCE, quoted_copy_tbps=QUOTED_COPY_TBPS,
        args={k: v for k, v in vars(args).items()},
        argv=sys.argv[1:] if argv is None else list(argv),
    )

    results = []
    for cfg in configs:
        try:
            r = bench_config(cfg, args, jp, impls, copy.get("tbps"), bar,
                             matmul_tflops=matmul.get("tflops"))
        except Exception as e:  # setup failed (e.g. out of memory)
            r = dict(config=dataclasses.asdict(cfg), label=cfg.label, kv_bytes=0, impls={},
                     error=short_error(e), traceback=traceback.format_exc(limit=6),
                     quoted=QUOTED.get(cfg.quoted_key) if cfg.quoted_key else None)
            for n in impl_order:
                r["impls"][n] = dict(error="config setup failed: " + short_error(e))
        results.append(r)
        gc.collect()
        # Partial results after each configuration (a run cut short keeps them).
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path + ".partial", "w") as f:
            json.dump(_jsonable(dict(meta=dict(meta, partial=True), results=results)), f,
                      indent=1)
    bar.set_description("done")
    bar.close()

    # Failures: any jax_paged impl (reference included) that errored or mismatched.
    failures = []
    for r in results:
        for name, x in r["impls"].items():
            if name == "pallas":
                continue
            if "error" in x and not x["error"].startswith("skipped"):
                failures.append(f"{r['label']} {name}: {x['error']}")
            elif "ok" in x and not x["ok"]:
                failures.append(f"{r['label']} {name}: MISMATCH rel err {x.get('rel_l2_err')} "
                                f"max abs err {x.get('max_abs_err')}")
    meta["failures"] = failures
    for r in results:
        cfg = Config(**r["config"])
        r["goal_issue4"] = goal_check(cfg, r, copy.get("tbps"))
        r["goal_issue6"] = feature_goal_check(cfg, r)

    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(_jsonable(dict(meta=meta, results=results)), f, indent=1)
    if os.path.exists(json_path + ".partial"):
        os.remove(json_path + ".partial")
    plot_err = make_plot(results, meta, impl_order, png_path)

    print(f"JSON: {json_path}")
    print(f"PNG:  {png_path}" if plot_err is None else f"PNG:  not written ({plot_err})")
    pallas_errs = [(r["label"], r["impls"]["pallas"]["error"]) for r in results
                   if "error" in r["impls"].get("pallas", {})]
    for label, err in pallas_errs:
        print(f"pallas failed on {label}: {err}")
    ps = next((r["impls"]["pallas"] for r in results if "settings" in r["impls"].get("pallas", {})), None)
    if ps:
        print("pallas settings (per config; block-table columns padded from -> to):")
        for r in results:
            x = r["impls"].get("pallas", {})
            if "settings" in x:
                print(f"  {r['label']:<24} {json.dumps(x.get('call_kwargs', x.get('settings')))} "
                      f"pages/seq {x.get('pages_per_sequence')}->{x.get('padded_pages_per_sequence')}"
                      + (f" pool padded to {x['pool_pages']}" if "pool_pages" in x else ""))
    print("method: " + " ".join(meta["method"].values()))
    print()
    if failures:
        print("!" * 78)
        print("!!! FAILURES (jax_paged implementation errors or mismatches against the ground truth):")
        for fl in failures:
            print("!!!   " + fl[:300])
        print("!" * 78)
        print()
    print(build_tables(results, meta, impl_order))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
