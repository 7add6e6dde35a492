#!/usr/bin/env python3
"""Decode-step benchmark of the serving engine against its memory roofline.

At Llama-3-8B shapes by default (all layers, bf16, random weights), one run:

1. times the device's copy bandwidth (jitted ``x -> x + 1`` over a float32 array, bytes read +
   bytes written);
2. prefills ``--num-seqs`` random prompts of ``--context`` tokens with the engine's jitted
   prefill (:func:`jax_paged.serving.engine.make_prefill`), ``--prefill-rows`` prompts per call,
   and times it;
3. for each ``--attn-impl``, times steady-state decode steps of the engine's own jitted decode
   loop (:func:`jax_paged.serving.engine.make_decode_loop`) with every slot live, and divides
   the step time by the step's memory roofline: (weights read once + K/V read + K/V written) /
   the copy bandwidth of step 1;
4. splits a step: the layers' cache writes and paged attention alone, and everything else
   (embedding rows, projections, MLP, norms, RoPE, LM head, argmax) alone, each in its own jitted
   loop; the rest of the step is the loop's bookkeeping and what the split loses.

Every loop is timed as the median of ``--reps`` pairs of one loop of N iterations and one of 2N
(N = ``--steps``), per iteration = (time of 2N - time of N) / N, so that a cost paid once per
loop (dispatch, synchronisation) cancels.

    python benchmarks/bench_decode.py --json out.json                         # GPU, ~2 minutes
    python benchmarks/bench_decode.py --model tiny --num-seqs 4 --context 64 --steps 4   # CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

import jax_paged
from jax_paged.cache import HostBlockAllocator, allocate_kv_cache
from jax_paged.serving import model as M
from jax_paged.serving.engine import (
    DecodeState, EngineConfig, init_decode_state, make_decode_loop, make_prefill,
)

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
KV_CACHE_DTYPES = {"model": None, "float8_e4m3fn": jnp.float8_e4m3fn,
                   "float8_e5m2": jnp.float8_e5m2}
IMPLS = ("auto", "reference")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(M.PRESETS), default="llama3-8b",
                   help="random-weight model shapes")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="weights and activations")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="model",
                   help="paged KV cache dtype: the model's, or fp8")
    p.add_argument("--num-seqs", type=int, default=64, help="requests, all decoded together")
    p.add_argument("--context", type=int, default=2000, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=16,
                   help="N: iterations of the short timed loop (the long one runs 2N)")
    p.add_argument("--reps", type=int, default=5, help="timed (N, 2N) pairs per loop; median")
    p.add_argument("--attn-impl", default=",".join(IMPLS),
                   help="comma-separated paged-attention impls to time in this run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partition-size", type=int, default=512)
    p.add_argument("--prefill-rows", type=int, default=8,
                   help="prompts per prefill call (dense prefill attention holds a float32 "
                        "[rows, heads, context, context] array)")
    p.add_argument("--copy-gib", type=float, default=None,
                   help="copy-bandwidth array size in GiB (default: 2 on an accelerator, "
                        "1/16 on the CPU)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the split of a step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure here")
    args = p.parse_args(argv)
    args.impls = [s.strip() for s in args.attn_impl.split(",") if s.strip()]
    bad = [s for s in args.impls if s not in IMPLS]
    if bad or not args.impls:
        p.error(f"--attn-impl: expected a comma-separated subset of {IMPLS}, got {args.attn_impl!r}")
    for name in ("num_seqs", "context", "steps", "reps", "prefill_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    return args


# ---------------------------------------------------------------------------------------------
# Roofline arithmetic
# ---------------------------------------------------------------------------------------------
def weight_bytes(params: M.Params, config: M.ModelConfig, num_seqs: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, except that an untied
    embedding table contributes only the ``num_seqs`` rows gathered (a tied one is read whole
    as the LM head, and counted once)."""
    total = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(params))
    if not config.tie_word_embeddings:
        embed = params["embed"]
        total += num_seqs * embed.shape[1] * embed.dtype.itemsize - int(embed.nbytes)
    return total


def kv_token_bytes(config: M.ModelConfig, cache_itemsize: int) -> int:
    """Bytes of K and V of one token in one layer."""
    return 2 * config.num_kv_heads * config.head_dim * cache_itemsize


def kv_read_bytes(config: M.ModelConfig, cache_itemsize: int, ctx_lens) -> int:
    """K/V bytes a step's attention reads: every layer reads each sequence's context (the
    new token included), or its last ``sliding_window`` tokens on window layers."""
    tokens = 0
    for layer in range(config.num_layers):
        window = config.layer_window(layer)
        tokens += sum(min(c, window) if window else c for c in ctx_lens)
    return tokens * kv_token_bytes(config, cache_itemsize)


def step_context_lens(context: int, num_seqs: int, first_step: int, num_steps: int):
    """Attended lengths of the timed steps ``first_step .. first_step + num_steps - 1`` (0 =
    the first step after prefill, which attends ``context + 1`` tokens), per step."""
    return [[context + k + 1] * num_seqs for k in range(first_step, first_step + num_steps)]


def roofline(weights: int, kv_read: float, kv_written: int, copy_bytes_per_s: float) -> dict:
    total = weights + kv_read + kv_written
    return dict(weights=weights, kv_read=kv_read, kv_written=kv_written, total=total,
                time_s=total / copy_bytes_per_s)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def slope_timing(run: Callable[[int], float], n: int, reps: int) -> dict:
    """``run(k)`` executes a loop of ``k`` iterations and returns its wall time (synchronised).
    One call of each length first (compilation, warm-up), then ``reps`` interleaved pairs;
    per iteration = median over pairs of (t(2n) - t(n)) / n."""
    t0 = time.perf_counter()
    run(n)
    first = time.perf_counter() - t0
    run(2 * n)
    short, long_ = [], []
    for _ in range(reps):
        short.append(run(n))
        long_.append(run(2 * n))
    slopes = [(b - a) / n for a, b in zip(short, long_)]
    per_iter = statistics.median(slopes)
    method = "slope"
    if not per_iter > 0:  # noise above the work (tiny shapes on a busy CPU)
        per_iter, method = statistics.median(long_) / (2 * n), "average of the 2N loop"
    return dict(per_iter_s=per_iter, method=method, samples_s=slopes, short_s=short,
                long_s=long_, first_call_s=first, n=n)


def copy_bandwidth(gib: float, steps: int, reps: int) -> dict:
    """y = x + 1 on a float32 array, in a jitted loop with a traced trip count (one full pass
    per iteration); bytes read + written per iteration."""
    n_elem = max(1024, int(gib * 2 ** 30) // 4)
    x = jax.block_until_ready(jnp.zeros((n_elem,), jnp.float32))
    loop = jax.jit(lambda x, k: lax.fori_loop(0, k, lambda _, c: c + 1.0, x), donate_argnums=0)
    holder = [x]

    def run(k):
        t0 = time.perf_counter()
        holder[0] = jax.block_until_ready(loop(holder[0], jnp.int32(k)))
        return time.perf_counter() - t0

    t = slope_timing(run, max(steps, 8), reps)
    del holder
    nbytes = 2 * n_elem * 4
    return dict(array_bytes=n_elem * 4, bytes_per_iter=nbytes, per_iter_s=t["per_iter_s"],
                bytes_per_s=nbytes / t["per_iter_s"], method=t["method"],
                samples_s=t["samples_s"], kernel="y = x + 1 (float32), bytes read + written")


# ---------------------------------------------------------------------------------------------
# Set-up: caches, prompts, prefill
# ---------------------------------------------------------------------------------------------
def prefill_all(config, params, caches, ec: EngineConfig, args, rng):
    """Prefill every prompt (``--prefill-rows`` per call) through the engine's jitted prefill;
    returns (caches, host DecodeState with every slot live, timing dict)."""
    b, ctx, bs = args.num_seqs, args.context, ec.block_size
    state = init_decode_state(ec)
    alloc = HostBlockAllocator.from_pool(state.pool)
    n_blocks = -(-ctx // bs)
    prompts = rng.integers(0, config.vocab_size, size=(b, ctx), dtype=np.int32)
    slots = np.empty((b, ctx), np.int32)
    pos = np.arange(ctx)
    for i in range(b):
        ids = alloc.allocate(n_blocks)
        state.block_tables[i, :n_blocks] = ids
        slots[i] = ids[pos // bs] * bs + pos % bs
    prefill = make_prefill(config)
    rows = min(args.prefill_rows, b)
    chunks = [(lo, min(lo + rows, b)) for lo in range(0, b, rows)]

    def chunk_args(lo, hi):
        # The last chunk is padded to the same row count (padding rows: length 0, no slots).
        tok = np.zeros((rows, ctx), np.int32)
        sl = np.full((rows, ctx), -1, np.int32)
        lens = np.zeros(rows, np.int32)
        tok[: hi - lo], sl[: hi - lo], lens[: hi - lo] = prompts[lo:hi], slots[lo:hi], ctx
        return jnp.asarray(tok), jnp.asarray(lens), jnp.asarray(sl)

    # Compilation and a warm-up call on the first chunk (it rewrites the same slots later).
    t0 = time.perf_counter()
    _, caches = prefill(params, caches, *chunk_args(*chunks[0]))
    caches = jax.block_until_ready(caches)
    first = time.perf_counter() - t0
    inputs = [chunk_args(lo, hi) for lo, hi in chunks]
    jax.block_until_ready(inputs)
    firsts = []
    t0 = time.perf_counter()
    for tok, lens, sl in inputs:
        ft, caches = prefill(params, caches, tok, lens, sl)
        firsts.append(ft)
    caches = jax.block_until_ready(caches)
    total = time.perf_counter() - t0
    first_tokens = np.concatenate([np.asarray(f) for f in firsts])[:b]

    state.tokens[:] = first_tokens
    state.seq_lens[:] = ctx
    state.active[:] = True
    state.num_generated[:] = 1
    state.max_new_tokens[:] = ec.max_seq_len  # never reached: no slot finishes while timed
    state.generated[:, 0] = first_tokens
    state = state._replace(pool=alloc.to_pool())
    tokens = b * ctx
    timing = dict(total_s=total, tokens=tokens, per_token_us=total / tokens * 1e6,
                  tokens_per_s=tokens / total, calls=len(chunks), rows_per_call=rows,
                  first_call_s=first)
    return caches, state, timing


# ---------------------------------------------------------------------------------------------
# The step and its parts
# ---------------------------------------------------------------------------------------------
def time_decode(config, params, caches, host_state: DecodeState, ec: EngineConfig, args):
    """Per-step time of the engine's decode loop; every loop starts from the post-prefill
    state (a fresh device copy: the loop donates it), so the 2N loop's last N steps are the
    ones the slope measures. Returns (caches, timing, device state after a 2N loop)."""
    loop = make_decode_loop(config, ec)
    holder = {"caches": caches, "state": None}
    exit_after = np.int32(args.num_seqs + 1)  # never exit for finished sequences

    def run(k):
        st = jax.block_until_ready(jax.device_put(host_state))
        t0 = time.perf_counter()
        caches, st, steps = loop(params, holder["caches"], st, np.int32(k), exit_after, None)
        steps = int(steps)  # synchronises
        dt = time.perf_counter() - t0
        holder["caches"], holder["state"] = caches, st
        if steps != k:
            raise RuntimeError(f"decode loop ran {steps} steps, expected {k} (a slot finished "
                               f"or the block pool ran out)")
        return dt

    t = slope_timing(run, args.steps, args.reps)
    return holder["caches"], t, holder["state"]


def _attention_loop(config, attn_impl, partition_size):
    """The decode step's cache ops alone: per layer one ``reshape_and_cache`` and one
    ``paged_attention`` with the step's arguments; the output feeds the next layer's query
    (a true dependency, nothing hoisted)."""
    def run(caches, q, block_tables, slot_mapping, ctx_lens, k):
        def body(_, carry):
            caches, q = carry
            new = []
            for i, (kc, vc) in enumerate(caches):
                kv = q[:, : config.num_kv_heads]
                kc, vc = jax_paged.reshape_and_cache(
                    M._cache_input(kv, kc), M._cache_input(kv, vc), kc, vc, slot_mapping)
                q = jax_paged.paged_attention(
                    M._cache_input(q, kc), kc, vc, block_tables, ctx_lens,
                    scale=config.attn_scale, soft_cap=config.attn_soft_cap,
                    sliding_window=config.layer_window(i), impl=attn_impl,
                    partition_size=partition_size).astype(q.dtype)
                new.append((kc, vc))
            return new, q
        return lax.fori_loop(0, k, body, (caches, q))
    return jax.jit(run, donate_argnums=0)


def _dense_loop(config):
    """The decode step without its cache ops: embedding rows, every layer's norms,
    projections, RoPE and MLP (the attention output replaced by the query, same shape), final
    norm, LM head and argmax; the argmax feeds the next iteration's tokens."""
    inv_freq = M.rope_inv_freq(config)

    def run(params, tokens, positions, k):
        def body(_, carry):
            tokens, positions = carry
            b = tokens.shape[0]
            x = M._embed(params, tokens, config)
            for layer in params["layers"]:
                q, _, _ = M._qkv(layer, x, config, positions, inv_freq)
                x = M._attn_residual(layer, x, q.reshape(b, -1), config)
                x = M._mlp_residual(layer, x, config)
            nxt = jnp.argmax(M._lm_head(params, x, config), axis=-1).astype(jnp.int32)
            return nxt, positions + 1
        return lax.fori_loop(0, k, body, (tokens, positions))[0]
    return jax.jit(run)


def time_attention(config, caches, dev_state: DecodeState, ctx_len: int, impl: str, args, rng):
    """Per-step time of the attention part over the block tables of ``dev_state`` (which
    cover ``ctx_len`` tokens), every sequence attending ``ctx_len`` tokens."""
    b = args.num_seqs
    loop = _attention_loop(config, impl, args.partition_size)
    dtype = DTYPES[args.dtype]
    q = jnp.asarray(rng.standard_normal((b, config.num_heads, config.head_dim)), dtype)
    bt = dev_state.block_tables
    ctx = jnp.full((b,), ctx_len, jnp.int32)
    # The new token's slot: position ctx_len - 1 of each sequence (already its own).
    bs = args.block_size
    slot = bt[jnp.arange(b), (ctx_len - 1) // bs] * bs + (ctx_len - 1) % bs
    holder = [caches]

    def run(k):
        t0 = time.perf_counter()
        holder[0], out = jax.block_until_ready(loop(holder[0], q, bt, slot, ctx, jnp.int32(k)))
        return time.perf_counter() - t0

    t = slope_timing(run, args.steps, args.reps)
    return holder[0], t


def time_dense(config, params, dev_state: DecodeState, args):
    loop = _dense_loop(config)
    tokens, positions = dev_state.tokens, dev_state.seq_lens

    def run(k):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(params, tokens, positions, jnp.int32(k)))
        return time.perf_counter() - t0

    return slope_timing(run, args.steps, args.reps)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _part(seconds: float, step_s: float, roof_s: float | None = None) -> dict:
    out = dict(us=seconds * 1e6, pct_of_step=100.0 * seconds / step_s)
    if roof_s is not None:
        out.update(roofline_us=roof_s * 1e6, pct_of_roofline=100.0 * roof_s / seconds)
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def print_table(res: dict) -> None:
    c, pf = res["copy"], res["prefill"]
    print(f"\n{res['device_kind']} ({res['platform']}), jax {res['jax_version']}: "
          f"{res['model']['name']}, {res['model']['num_layers']} layers, {res['dtype']}, "
          f"KV cache {res['kv_cache_dtype']}; {res['num_seqs']} sequences x {res['context']} "
          f"tokens")
    print(f"copy bandwidth {c['bytes_per_s'] / 1e12:.3f} TB/s "
          f"({c['array_bytes'] / 2 ** 30:.3g} GiB float32, x -> x + 1)")
    print(f"prefill: {pf['total_s'] * 1e3:.1f} ms for {pf['tokens']} tokens "
          f"({pf['per_token_us']:.2f} us/token, {pf['calls']} calls of {pf['rows_per_call']} rows)")
    for impl, d in res["decode"].items():
        r = d["roofline"]
        print(f"\ndecode, attn impl {impl!r}: {d['step_us']:.1f} us/step, roofline "
              f"{r['time_s'] * 1e6:.1f} us ({_mb(r['total'])}: weights {_mb(r['weights'])}, "
              f"K/V read {_mb(r['kv_read'])}, written {_mb(r['kv_written'])}) -> "
              f"{d['pct_of_roofline']:.1f}% of roofline, {d['tokens_per_s']:.0f} tokens/s")
        if d.get("breakdown"):
            print(f"  {'part':<40}{'us':>10}{'% step':>9}{'roofline us':>13}{'% roofline':>12}")
            for name, p in d["breakdown"].items():
                roof = f"{p['roofline_us']:13.1f}{p['pct_of_roofline']:11.1f}%" if "roofline_us" in p else ""
                print(f"  {name:<40}{p['us']:10.1f}{p['pct_of_step']:8.1f}%{roof}")


def main(argv=None) -> int:
    args = parse_args(argv)
    config = M.ModelConfig.preset(args.model, num_layers=args.layers)
    dtype = DTYPES[args.dtype]
    cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] or dtype
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    gib = args.copy_gib if args.copy_gib is not None else (1 / 16 if on_cpu else 2.0)
    rng = np.random.default_rng(args.seed)
    b, n = args.num_seqs, args.steps
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    log(f"copy bandwidth ({gib:.3g} GiB)...")
    copy = copy_bandwidth(gib, n, args.reps)
    bw = copy["bytes_per_s"]

    log("weights...")
    params = jax.block_until_ready(M.init_params(config, args.seed, dtype))
    # Capacity: the prompt, 2N decode steps and the one step the slope never reaches.
    max_seq_len = args.context + 2 * n + 1
    ec_base = EngineConfig(max_batch=b, block_size=args.block_size, max_seq_len=max_seq_len,
                           num_blocks=b * -(-max_seq_len // args.block_size),
                           partition_size=args.partition_size)
    caches = allocate_kv_cache(config.num_layers, ec_base.num_blocks, config.num_kv_heads,
                               config.head_dim, ec_base.block_size, cache_dtype)
    log(f"prefill ({b} x {args.context} tokens)...")
    caches, host_state, prefill = prefill_all(config, params, caches, ec_base, args, rng)

    itemsize = jnp.dtype(cache_dtype).itemsize
    w_bytes = weight_bytes(params, config, b)
    # The slope measures steps N .. 2N - 1 of the 2N loop.
    lens = step_context_lens(args.context, b, n, n)
    kv_read = sum(kv_read_bytes(config, itemsize, ls) for ls in lens) / len(lens)
    kv_written = b * config.num_layers * kv_token_bytes(config, itemsize)
    roof = roofline(w_bytes, kv_read, kv_written, bw)
    mid_ctx = args.context + n + (n + 1) // 2  # the middle timed step's attended length

    decode: dict[str, Any] = {}
    dense = None
    for impl in args.impls:
        log(f"decode loop, attn impl {impl!r}...")
        ec = dataclasses.replace(ec_base, attn_impl=impl)
        caches, t, dev_state = time_decode(config, params, caches, host_state, ec, args)
        step = t["per_iter_s"]
        d = dict(step_us=step * 1e6, step_timing=t, tokens_per_s=b / step,
                 roofline=roof, pct_of_roofline=100.0 * roof["time_s"] / step)
        if not args.no_breakdown:
            log(f"  attention alone ({impl!r})...")
            caches, ta = time_attention(config, caches, dev_state, mid_ctx, impl, args, rng)
            if dense is None:
                log("  step without attention...")
                dense = time_dense(config, params, dev_state, args)
            att_s, dense_s = ta["per_iter_s"], dense["per_iter_s"]
            att_roof = (kv_read_bytes(config, itemsize, [mid_ctx] * b) + kv_written) / bw
            d["breakdown"] = {
                f"cache write + paged_attention x{config.num_layers}": _part(att_s, step, att_roof),
                "everything else (GEMMs, norms, ...)": _part(dense_s, step, w_bytes / bw),
                "rest (loop bookkeeping, overlap)": _part(step - att_s - dense_s, step),
            }
            d["breakdown_timing"] = dict(attention=ta, dense=dense, attention_ctx_len=mid_ctx)
        decode[impl] = d
    if len(decode) == 2:
        decode["reference_over_auto"] = decode["reference"]["step_us"] / decode["auto"]["step_us"]

    res = dict(
        device_kind=device.device_kind, platform=device.platform, jax_version=jax.__version__,
        model=dict(name=args.model, num_layers=config.num_layers, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_heads=config.num_heads,
                   num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                   vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings,
                   num_params=config.num_params()),
        dtype=args.dtype, kv_cache_dtype=jnp.dtype(cache_dtype).name,
        cache_itemsize=itemsize, num_seqs=b, context=args.context, steps=n, reps=args.reps,
        block_size=args.block_size, partition_size=args.partition_size,
        command=" ".join(["python", "benchmarks/bench_decode.py"] + list(
            sys.argv[1:] if argv is None else argv)),
        copy=copy, prefill=prefill,
        timed_steps=dict(first=n, last=2 * n - 1,
                         mean_context=sum(ls[0] for ls in lens) / len(lens)),
        decode={k: v for k, v in decode.items() if isinstance(v, dict)},
    )
    if "reference_over_auto" in decode:
        res["reference_over_auto"] = decode["reference_over_auto"]
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
