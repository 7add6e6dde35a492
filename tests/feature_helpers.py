"""Helpers of the feature tests (soft cap, window, LSE, multi-token queries, fp8 caches,
the grouped kernel's forms): inputs with a separate query dtype, kernel-vs-reference
comparison, an independent float64 oracle, and pytest runs under development options.

Unused cache slots are NaN (make_paged_inputs), so a kernel that reads what it must not
read produces NaN.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import jax
import jax.numpy as jnp

import jax_paged
from jax_paged import reference
from paged_inputs import assert_close, make_paged_inputs, on, reference_on_cpu

FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
IMPLS = ["v1", "v2", "grouped"]

# lse tolerance (absolute and relative): every kernel computes it in float32.
LSE_TOL = 2e-5

# The development options variable read by the native module (once per process).
DEV_OPTIONS = "JAX_PAGED_DEV_OPTIONS"


def dev_options(environ=None) -> dict:
    """JAX_PAGED_DEV_OPTIONS as a dict (name -> value string)."""
    text = (os.environ if environ is None else environ).get(DEV_OPTIONS, "")
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        options[name.strip()] = value.strip()
    return options


def dev_options_env(**options) -> dict:
    """os.environ with these development options added to (or replacing those in)
    JAX_PAGED_DEV_OPTIONS."""
    merged = {**dev_options(), **{k: str(v) for k, v in options.items()}}
    return dict(os.environ, **{DEV_OPTIONS: ",".join(f"{k}={v}" for k, v in merged.items())})


def run_in_own_process(test_file, cases, **options):
    """Runs test cases of test_file in a pytest process of its own under these
    development options (the native module reads them once per process); asserts that
    all of them passed and returns the process (-s: the kernels' notices reach its
    stderr)."""
    env = dict(dev_options_env(**options), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           *(f"{test_file}::{c}" for c in cases)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and f"{len(cases)} passed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-2000:])
    return proc


def make_inputs(rng, lens, num_heads, num_kv_heads, head_size, block_size, cache_dtype,
                query_dtype=None, q_len=None, **kwargs):
    """make_paged_inputs with a separate query dtype (fp8 caches take a float
    query) and optionally a 4-D [S, q_len, H, D] query."""
    inp = make_paged_inputs(rng, lens, num_heads, num_kv_heads, head_size, block_size,
                            cache_dtype, **kwargs)
    if query_dtype is None:
        query_dtype = np.float32 if np.dtype(cache_dtype) in map(np.dtype, FP8) else cache_dtype
    shape = ((len(lens), num_heads, head_size) if q_len is None
             else (len(lens), q_len, num_heads, head_size))
    inp.query = rng.standard_normal(shape).astype(query_dtype)
    return inp


def kv_scales(kind, num_kv_heads, rng):
    """fp8 scales: None, a scalar, a one-element array, or one per KV head."""
    if kind is None:
        return None
    if kind == "scalar":
        return np.float32(0.5)
    if kind == "one":
        return np.array([1.75], np.float32)
    return rng.uniform(0.25, 2.0, size=num_kv_heads).astype(np.float32)


def ref_impl(impl):
    return "v2" if impl == "v2" else "v1"


def attend(platform, inp, impl, **kwargs):
    return jax_paged.paged_attention(*on(platform, *inp.args()), impl=impl, **kwargs)


def attend_on_poisoned_memory(platform, inp, impl, **kwargs):
    """attend(), its call made right after buffers of the output's size were filled with
    NaN and freed on the platform's device, so that the allocator's reuse of them
    (likely, not certain) leaves NaN wherever the kernel writes nothing."""
    dev = jax.devices(platform)[0]
    for _ in range(4):
        poison = jax.device_put(np.full(inp.query.shape, np.nan, inp.query.dtype), dev)
        poison.block_until_ready()
        del poison
    got = attend(platform, inp, impl, **kwargs)
    jax.block_until_ready(got)
    return got


def compare(platform, inp, impl, poisoned=False, **kwargs):
    """Kernel vs reference (out and, with return_lse, lse); returns the kernel's result.
    poisoned: the call through attend_on_poisoned_memory."""
    got = (attend_on_poisoned_memory if poisoned else attend)(platform, inp, impl, **kwargs)
    want = reference_on_cpu(reference.paged_attention, *inp.args(), impl=ref_impl(impl),
                            **kwargs)
    dtype = inp.query.dtype
    if kwargs.get("return_lse"):
        (out, lse), (want_out, want_lse) = got, want
        assert lse.dtype == jnp.float32 and lse.shape == inp.query.shape[:-1]
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=LSE_TOL, rtol=LSE_TOL,
                                   err_msg=f"{impl} lse vs reference")
    else:
        out, want_out = got, want
    assert out.shape == inp.query.shape and out.dtype == dtype
    assert_close(out, want_out, dtype, f"{impl} vs reference")
    return got


def oracle(query, keys, values, scale, *, slopes=None, soft_cap=None, window=None):
    """Independent float64 attention over each logical sequence, with the
    multi-token causal mask, sliding window, ALiBi and soft cap; returns
    (out, lse) with lse = log(sum_t exp(l_t)) (-inf for an empty range)."""
    query = np.asarray(query, np.float64)
    q4 = query if query.ndim == 4 else query[:, None]
    num_seqs, q_len, num_heads, head_size = q4.shape
    out = np.zeros(q4.shape)
    lse = np.full(q4.shape[:-1], -np.inf)
    for s in range(num_seqs):
        k, v = keys[s].astype(np.float64), values[s].astype(np.float64)
        L = k.shape[0]
        group = num_heads // k.shape[1]
        for i in range(q_len):
            end = max(0, L - q_len + 1 + i)
            start = max(0, end - window) if window else 0
            if end <= start:
                continue
            for h in range(num_heads):
                t = np.arange(start, end)
                logits = scale * k[start:end, h // group] @ q4[s, i, h]
                if slopes is not None:
                    logits = logits + slopes[h] * (t - (end - 1))
                if soft_cap:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                m = logits.max()
                p = np.exp(logits - m)
                out[s, i, h] = p @ v[start:end, h // group] / p.sum()
                lse[s, i, h] = m + np.log(p.sum())
    return out.reshape(query.shape), lse.reshape(query.shape[:-1])


def fp8_rows_per_cta_17_to_32(head_size: int) -> int:
    """The CUDA grouped kernel's rows per CTA for fp8 caches with 17-32 query rows per
    KV head (RowBlocks in grouped_launch.h): 32-row CTAs at head sizes up to 128,
    16-row CTAs above (the wide row split has 64-row CTAs only, slower there); 16 with
    the development option row_split=0."""
    if dev_options().get("row_split") == "0":
        return 16
    return 32 if head_size <= 128 else 16
