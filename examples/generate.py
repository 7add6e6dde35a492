#!/usr/bin/env python
"""Greedy generation with continuous batching on a paged KV cache (jax_paged's main job).

With no arguments it runs on the CPU in seconds: a tiny random Llama-style model serves a queue
of mixed-length requests, then the script reports throughput, the peak number of cache blocks in
use against what a max-length reservation would need, and whether the greedy tokens equal those
of a dense-cache implementation of the same model.

Examples::

    python examples/generate.py                                  # tiny model, CPU, float32
    python examples/generate.py --attn-impl reference            # same loop, jnp attention
    python examples/generate.py --model llama3-8b --layers 4 --dtype bfloat16 \\
        --max-batch 64 --num-requests 256 --max-seq-len 1024 --num-blocks 4096 --skip-dense-check
    python examples/generate.py --checkpoint ~/Llama-3.2-1B --prompt "The capital of France is"
    python examples/generate.py --checkpoint ~/Qwen2.5-0.5B-Instruct --chat --prompt "Hi!"
    python examples/generate.py --model small --tp 2                # tensor parallel, 2 GPUs
    python examples/generate.py --kv-cache-dtype float8_e4m3fn   # fp8 KV cache: half the bytes
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/generate.py --tp 2  # on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import jax_paged
from jax_paged.cache import kv_cache_bytes
from jax_paged.serving.engine import Engine, EngineConfig
from jax_paged.primitives import CUDA_HEAD_SIZES
from jax_paged.serving.loader import CheckpointError, load_checkpoint
from jax_paged.serving.model import (
    PRESETS, TP_AXIS, ModelConfig, check_tensor_parallel, generate_dense, init_params,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KV_CACHE_DTYPES = {"model": None, "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
DEFAULT_TEXT_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "In 1969, the first humans",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=sorted(PRESETS), default="tiny",
                   help="random-weight model shapes: tiny (default, CPU), small, llama3.2-1b, llama3-8b")
    m.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    m.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="Hugging Face checkpoint directory (Llama 2/3.x, Mistral, Qwen2/2.5, "
                        "Qwen3, Gemma 2: config.json + safetensors); with tokenizer.json and "
                        "the `tokenizers` package, prompts are text")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights, activations and KV cache")
    m.add_argument("--seed", type=int, default=0, help="weights and random prompts")
    r = p.add_argument_group("requests")
    r.add_argument("--num-requests", type=int, default=None,
                   help="requests to serve (default: 24 random prompts, or one per given prompt; "
                        "given prompts are repeated to fill a larger count)")
    r.add_argument("--prompt-len", type=int, nargs=2, default=[4, 48], metavar=("MIN", "MAX"),
                   help="random prompt lengths (token-id mode)")
    r.add_argument("--max-new-tokens", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"),
                   help="random per-request budgets (given prompts: MAX each)")
    r.add_argument("--prompt", action="append", default=None,
                   help="text prompt (repeatable; needs --checkpoint with tokenizer.json)")
    r.add_argument("--chat", action="store_true",
                   help="wrap each text prompt as a user message in the checkpoint's chat "
                        "template (chat_template.jinja or tokenizer_config.json; needs jinja2)")
    r.add_argument("--prompt-ids", action="append", default=None,
                   help="a prompt as comma-separated token ids (repeatable)")
    r.add_argument("--eos-id", type=int, action="append", default=None,
                   help="stop token, repeatable (default: every eos_token_id of the checkpoint's "
                        "generation_config.json, none for random models)")
    e = p.add_argument_group("engine")
    e.add_argument("--attn-impl", choices=["auto", "reference"], default="auto",
                   help="paged attention: native kernels (CUDA on GPU) or the jnp reference")
    e.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel over N devices (mesh axis 'tp'): attention heads and MLP "
                        "split Megatron-style, each layer's paged cache split on its KV heads; "
                        "heads, KV heads and intermediate size must divide by N. On CPU, set "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    e.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="model",
                   help="paged KV cache dtype: the model's (--dtype), or fp8 (half the bytes of a "
                        "16-bit cache per token; prompts attend their own K/V unquantised, decode "
                        "steps the fp8 cache)")
    e.add_argument("--kv-scale", type=float, default=1.0,
                   help="fp8 caches: K and V are stored as value / kv-scale, every layer")
    e.add_argument("--max-batch", type=int, default=8, help="decode slots")
    e.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    e.add_argument("--max-seq-len", type=int, default=128, help="per-sequence capacity")
    e.add_argument("--num-blocks", type=int, default=None,
                   help="cache blocks (default: 3/4 of a max-length reservation for every slot)")
    e.add_argument("--steps-per-loop", type=int, default=64, help="max decode steps per jitted loop")
    e.add_argument("--prefill-min-rows", type=int, default=None,
                   help="pad prefill batches to at least this many rows (default: max-batch on CPU, "
                        "fewer compilations; 1 on GPU, less padding)")
    o = p.add_argument_group("run")
    o.add_argument("--skip-dense-check", action="store_true",
                   help="do not compare with the dense-cache implementation")
    o.add_argument("--no-warmup", action="store_true",
                   help="time the first run (includes compilation) instead of a second one")
    o.add_argument("--show", type=int, default=None,
                   help="print the outputs of this many requests (default: every given prompt, "
                        "else 3)")
    o.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


class _Progress:
    """tqdm if installed, else a one-line fallback, redrawn in place on a terminal and
    printed once at the end otherwise (a log file gets one line, not every redraw)."""

    def __init__(self, total: int, desc: str):
        self._n, self._total, self._desc = 0, total, desc
        self._tty = sys.stderr.isatty()
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit="tok")
        except ImportError:
            self._bar = None

    def update(self, n: int) -> None:
        self._n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._tty:
            print(f"\r{self._desc}: {self._n}/{self._total} tokens", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._tty:
            print(file=sys.stderr)
        else:
            print(f"{self._desc}: {self._n}/{self._total} tokens", file=sys.stderr)


def load_model(args):
    """(config, params, tokenizer or None, EOS ids, name)."""
    dtype = DTYPES[args.dtype]
    tokenizer, eos = None, tuple(args.eos_id or ())
    if args.checkpoint:
        try:
            ckpt = load_checkpoint(args.checkpoint, dtype)
        except CheckpointError as e:
            sys.exit(f"--checkpoint: {e}")
        config, params = ckpt.config, ckpt.params
        if not args.eos_id:
            eos = ckpt.eos_token_ids
        tok_path = os.path.join(args.checkpoint, "tokenizer.json")
        if os.path.exists(tok_path):
            try:
                from tokenizers import Tokenizer
                tokenizer = Tokenizer.from_file(tok_path)
            except ImportError:
                if args.prompt:
                    sys.exit("--prompt: text needs the `tokenizers` package (pip install "
                             "tokenizers) to read the checkpoint's tokenizer.json")
                print("note: `tokenizers` not installed; using token ids", file=sys.stderr)
        name = f"{os.path.basename(os.path.normpath(args.checkpoint))} ({config.family})"
    else:
        config = ModelConfig.preset(args.model, num_layers=args.layers)
        params = init_params(config, args.seed, dtype)
        name = f"{args.model} (random weights, seed {args.seed})"
    return config, params, tokenizer, eos, name


def _special_token(value):
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def chat_prompt(directory: str, text: str) -> str:
    """``text`` as one user message in the checkpoint's chat template, with the assistant's
    turn opened, rendered with jinja2 as transformers' ``apply_chat_template`` does."""
    tok_cfg = {}
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            tok_cfg = json.load(f)
    template = None
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    elif isinstance(tok_cfg.get("chat_template"), str):
        template = tok_cfg["chat_template"]
    elif isinstance(tok_cfg.get("chat_template"), list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in tok_cfg["chat_template"]}
        template = named.get("default")
    if not template:
        sys.exit(f"--chat: {directory} has no chat template (chat_template.jinja, or "
                 f"chat_template in tokenizer_config.json)")
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        sys.exit("--chat needs the `jinja2` package (pip install jinja2) to render the "
                 "checkpoint's chat template")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent,
                                                                    ensure_ascii=False)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True,
        bos_token=_special_token(tok_cfg.get("bos_token")) or "",
        eos_token=_special_token(tok_cfg.get("eos_token")) or "")


def make_requests(args, config, tokenizer, eos):
    rng = np.random.default_rng(args.seed + 1)
    lo_new, hi_new = args.max_new_tokens
    prompts: list[list[int]] = []
    if args.chat and not (args.checkpoint and tokenizer is not None):
        sys.exit("--chat needs --checkpoint DIR with tokenizer.json and the `tokenizers` package")
    if args.prompt_ids:
        prompts = [[int(t) for t in s.replace(",", " ").split()] for s in args.prompt_ids]
    elif tokenizer is not None:
        texts = args.prompt or DEFAULT_TEXT_PROMPTS
        if args.chat:
            # The template writes the special tokens (BOS included) itself.
            prompts = [tokenizer.encode(chat_prompt(args.checkpoint, t), add_special_tokens=False).ids
                       for t in texts]
        else:
            prompts = [tokenizer.encode(t).ids for t in texts]
    elif args.prompt:
        sys.exit("--prompt needs --checkpoint DIR with tokenizer.json and the `tokenizers` package")
    if prompts:
        # Given prompts are repeated to fill the request count, each with the MAX budget.
        count = max(args.num_requests or 0, len(prompts))
        prompts = [prompts[i % len(prompts)] for i in range(count)]
        budgets = [hi_new] * count
    else:
        lo, hi = args.prompt_len
        prompts = [[int(t) for t in rng.integers(0, config.vocab_size, int(rng.integers(lo, hi + 1)))]
                   for _ in range(args.num_requests or 24)]
        budgets = [int(rng.integers(lo_new, hi_new + 1)) for _ in prompts]
    reqs = []
    for p, n in zip(prompts, budgets):
        n = min(n, args.max_seq_len - len(p))
        if n < 1:
            sys.exit(f"a prompt of {len(p)} tokens does not fit --max-seq-len {args.max_seq_len}")
        reqs.append((p, n, eos))
    return reqs


def make_mesh(config: ModelConfig, tp: int) -> Mesh | None:
    """A 1-D mesh of ``tp`` devices on axis "tp", or None for a single-device run."""
    if tp == 1:
        return None  # the plain ops, unsharded
    devices = jax.devices()
    if tp > len(devices):
        hint = (f"; on CPU run with XLA_FLAGS=--xla_force_host_platform_device_count={tp}"
                if jax.default_backend() == "cpu" else "")
        sys.exit(f"--tp {tp}: only {len(devices)} {jax.default_backend()} device(s){hint}")
    try:
        check_tensor_parallel(config, tp)
    except ValueError as e:
        sys.exit(f"--tp {tp}: {e}")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def serve(config, params, engine_config, reqs, progress: bool, mesh: Mesh | None = None,
          **engine_kwargs):
    """Serve ``reqs`` on a fresh engine: (outputs, engine, seconds, times each request was
    preempted), outputs and counts in request order."""
    engine = Engine(config, params, engine_config, mesh=mesh, **engine_kwargs)
    ids = [engine.add_request(*r) for r in reqs]
    bar = _Progress(sum(n for _, n, _ in reqs), "generating") if progress else None
    t0 = time.perf_counter()
    out = engine.run(on_tokens=bar.update if bar else None)
    elapsed = time.perf_counter() - t0
    if bar:
        bar.close()
    return [out[i] for i in ids], engine, elapsed, [engine.finished[i].num_preemptions for i in ids]


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    if args.dtype == "float32":
        # Exact float32 matmuls (GPUs default to TF32), so greedy tokens can match the dense check.
        jax.config.update("jax_default_matmul_precision", "highest")
    config, params, tokenizer, eos, name = load_model(args)
    mesh = make_mesh(config, args.tp)
    cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    if cache_dtype is None and args.kv_scale != 1.0:
        sys.exit("--kv-scale applies to fp8 caches only (--kv-cache-dtype float8_e4m3fn / float8_e5m2)")
    if not args.kv_scale > 0:
        sys.exit(f"--kv-scale must be positive, got {args.kv_scale}")
    cache = dict(cache_dtype=cache_dtype,
                 kv_scales=None if cache_dtype is None else
                 [(np.float32(args.kv_scale), np.float32(args.kv_scale))] * config.num_layers)
    reqs = make_requests(args, config, tokenizer, eos)
    bs = args.block_size
    max_blocks = math.ceil(args.max_seq_len / bs)
    reservation = args.max_batch * max_blocks
    ec = EngineConfig(
        max_batch=args.max_batch, block_size=bs, max_seq_len=args.max_seq_len,
        num_blocks=args.num_blocks or max(max_blocks, reservation * 3 // 4),
        max_steps_per_loop=args.steps_per_loop, attn_impl=args.attn_impl,
        prefill_min_rows=args.prefill_min_rows or (args.max_batch if backend == "cpu" else 1),
        prefill_min_len=32, max_eos_ids=max(4, len(eos)))
    kernels = ("jnp reference" if args.attn_impl == "reference" else
               f"jnp reference (no CUDA kernel for head_dim {config.head_dim})"
               if backend == "gpu" and config.head_dim not in CUDA_HEAD_SIZES else
               "CUDA kernels" if backend == "gpu" and jax_paged.has_cuda_kernels() else
               f"native {backend} kernels")
    print(f"model: {name}: {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_heads} heads / {config.num_kv_heads} KV heads x {config.head_dim}, "
          f"vocab {config.vocab_size}, {config.num_params() / 1e6:.3g}M params, {args.dtype}")
    devices = (f"{jax.devices()[0].device_kind} ({backend})" if mesh is None else
               f"{args.tp} x {jax.devices()[0].device_kind} ({backend}), tensor parallel: "
               f"{config.num_heads // args.tp} heads / {config.num_kv_heads // args.tp} KV heads "
               f"and {config.intermediate_size // args.tp} MLP columns per device")
    print(f"device: {devices}; paged attention: {kernels}")
    cache_name = (f"{args.dtype} cache" if cache_dtype is None else
                  f"{args.kv_cache_dtype} cache, scale {args.kv_scale:g}")
    print(f"engine: {ec.max_batch} slots, {ec.num_blocks} blocks x {bs} tokens ({cache_name}), "
          f"max_seq_len {ec.max_seq_len}; "
          f"{len(reqs)} requests, prompts {min(len(p) for p, _, _ in reqs)}-{max(len(p) for p, _, _ in reqs)} "
          f"tokens, budgets {min(n for _, n, _ in reqs)}-{max(n for _, n, _ in reqs)}, "
          f"EOS ids {list(eos) or 'none'}")

    if not args.no_warmup:
        t0 = time.perf_counter()
        serve(config, params, ec, reqs, progress=False, mesh=mesh, **cache)  # compiles loop and prefill
        print(f"warm-up run (compilation included): {time.perf_counter() - t0:.1f} s")
    outputs, engine, elapsed, preempted = serve(config, params, ec, reqs, progress=True, mesh=mesh,
                                                **cache)
    st = engine.stats

    print(f"requests served:   {st.requests_served}")
    print(f"tokens generated:  {st.tokens_generated} (+ {st.prompt_tokens} prompt tokens prefilled)")
    print(f"throughput:        {st.tokens_generated / elapsed:.1f} tokens/s "
          f"({elapsed:.2f} s; {st.decode_steps} decode steps in {st.decode_loops} jitted loops, "
          f"{st.prefill_calls} prefills)")
    print(f"peak blocks in use: {st.peak_blocks_used} of {ec.num_blocks} "
          f"(a max-length reservation for {ec.max_batch} slots needs {reservation}; "
          f"{st.peak_blocks_used / reservation:.0%})")
    print(f"preemptions:       {st.preemptions} ({st.recomputed_tokens} tokens recomputed)")
    print(f"KV cache:          {kv_cache_bytes(engine.kv_caches) / 2**20:.2f} MiB ({cache_name})")

    given = len(args.prompt_ids or args.prompt or (DEFAULT_TEXT_PROMPTS if tokenizer else []))
    for i in range(min(args.show if args.show is not None else given or 3, len(reqs))):
        prompt, out = reqs[i][0], outputs[i]
        if tokenizer is not None:
            print(f"  [{i}] {tokenizer.decode(prompt)!r} -> "
                  f"{tokenizer.decode(out, skip_special_tokens=True)!r}"
                  f"{' (EOS)' if out and out[-1] in eos else ''}")
        else:
            print(f"  [{i}] {len(prompt)} prompt tokens -> {out[:12]}{' ...' if len(out) > 12 else ''}")

    result = {
        "model": name, "layers": config.num_layers, "dtype": args.dtype, "attn_impl": args.attn_impl,
        "kv_cache_dtype": args.dtype if cache_dtype is None else args.kv_cache_dtype,
        "kv_scale": None if cache_dtype is None else args.kv_scale,
        "kernels": kernels, "device": jax.devices()[0].device_kind, "tp": args.tp,
        "max_batch": ec.max_batch,
        "block_size": bs, "num_blocks": ec.num_blocks, "max_seq_len": ec.max_seq_len,
        "requests": st.requests_served, "tokens_generated": st.tokens_generated,
        "prompt_tokens": st.prompt_tokens, "seconds": elapsed, "tokens_per_s": st.tokens_generated / elapsed,
        "decode_steps": st.decode_steps, "decode_loops": st.decode_loops, "prefill_calls": st.prefill_calls,
        "peak_blocks_used": st.peak_blocks_used, "max_length_reservation_blocks": reservation,
        "preemptions": st.preemptions, "kv_cache_bytes": kv_cache_bytes(engine.kv_caches),
        "dense_match": None,
    }
    status = 0
    if not args.skip_dense_check:
        dense_len = 1 << (args.max_seq_len - 1).bit_length()  # one compilation for every request
        # On one device with the unsharded weights (the engine sharded its own copy), so with
        # --tp the check compares the tensor-parallel tokens with a single-device run.
        # With an fp8 cache, a dense cache of the same semantics: prompts attend their own K/V,
        # later tokens the fp8 values.
        ref = [generate_dense(params, config, p, n, e, max_len=dense_len, **cache)
               for p, n, e in reqs]
        same = [a == b for a, b in zip(outputs, ref)]
        # A preempted request is recomputed by a dense prefill over its prompt and the tokens it
        # had generated; with an fp8 cache those tokens' K/V are then computed from unquantised
        # attention, not from the fp8 cache as when they were generated, so its later tokens
        # may differ from the reference, which never preempts.
        counted = [s for s, n in zip(same, preempted) if cache_dtype is None or n == 0]
        ok = all(counted)
        result["dense_match"] = f"{sum(same)}/{len(reqs)}"
        note = ""
        if cache_dtype is not None and len(counted) < len(reqs):
            note = (f"; {len(reqs) - len(counted)} preempted requests not counted "
                    f"({sum(s for s, n in zip(same, preempted) if n)} of them equal too)")
        print(f"greedy tokens equal the dense-cache implementation: {'yes' if ok else 'NO'} "
              f"({sum(counted)}/{len(counted)} requests{note})")
        if not ok and args.dtype == "float32":
            status = 1  # float32 must match exactly; lower precisions may differ at near-ties
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
