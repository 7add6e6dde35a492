"""fp8 KV caches (float8_e4m3fn, float8_e5m2) with scalar or per-KV-head scales:
attention against the reference in every kernel, the quantised write, block copies,
accuracy against unquantised data, negative and zero softmax scales, and a jitted
write-then-attend loop with donation."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import reference
from feature_helpers import FP8, IMPLS, compare, kv_scales, make_inputs
from paged_inputs import assert_close, on, reference_on_cpu


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("query_dtype", [np.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("scale_kind", [None, "scalar", "one", "per_head"])
def test_fp8_attention(platform, cache_dtype, query_dtype, scale_kind):
    rng = np.random.default_rng(14)
    inp = make_inputs(rng, [0, 1, 31, 513, 700], 8, 2, 64, 16, cache_dtype,
                      query_dtype=query_dtype)
    ks, vs = kv_scales(scale_kind, 2, rng), kv_scales(scale_kind, 2, rng)
    for impl in IMPLS:
        compare(platform, inp, impl, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_fp8_block_and_head_sizes(platform, cache_dtype, block_size, head_size):
    rng = np.random.default_rng(block_size + head_size)
    inp = make_inputs(rng, [1, block_size, 77, 600], 8, 4, head_size, block_size, cache_dtype,
                      query_dtype=jnp.bfloat16)
    ks = kv_scales("per_head", 4, rng)
    for impl in IMPLS:
        compare(platform, inp, impl, k_scale=ks, v_scale=np.float32(0.8))


def test_fp8_with_every_feature(platform):
    rng = np.random.default_rng(15)
    inp = make_inputs(rng, [2, 40, 600], 8, 2, 64, 16, jnp.float8_e4m3fn,
                      query_dtype=jnp.bfloat16, q_len=3)
    slopes = rng.random(8).astype(np.float32)
    for impl in IMPLS:
        compare(platform, inp, impl, k_scale=np.float32(0.7), v_scale=kv_scales("per_head", 2, rng),
                alibi_slopes=slopes, soft_cap=10.0, sliding_window=100, return_lse=True,
                partition_size=128)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("magnitude", [1e6, 1e-6])
def test_fp8_bf16_query_outside_the_f16_range(platform, cache_dtype, magnitude):
    """The grouped CUDA kernel runs fp8 caches on the f16 tensor cores and
    stages a bf16 query as f16 times a power of two: queries far above f16's
    range (65504) or deep in its subnormals still give the reference's
    result (the softmax scale compensates, so the logits are ordinary)."""
    rng = np.random.default_rng(34)
    inp = make_inputs(rng, [1, 37, 600], 8, 2, 64, 16, cache_dtype, query_dtype=jnp.bfloat16)
    inp.query = (inp.query.astype(np.float32) * magnitude).astype(jnp.bfloat16)
    for impl in IMPLS:
        compare(platform, inp, impl, scale=0.125 / magnitude)


@pytest.mark.parametrize("cache_dtype,query_dtype,scale,k_scale", [
    (jnp.bfloat16, jnp.bfloat16, -0.125, None),
    (jnp.bfloat16, jnp.bfloat16, 0.0, None),
    (jnp.float8_e4m3fn, jnp.bfloat16, -0.125, None),
    (jnp.float8_e4m3fn, jnp.float16, -0.125, None),
    (jnp.float8_e4m3fn, jnp.bfloat16, 0.0, None),
    (jnp.float8_e5m2, jnp.float16, 0.125, [-0.5, 1.5]),
    (jnp.float8_e4m3fn, jnp.bfloat16, 0.125, [0.0, 0.75]),
], ids=["bf16-neg", "bf16-zero", "e4m3-bf16q-neg", "e4m3-f16q-neg", "e4m3-zero",
        "e5m2-neg-head", "e4m3-zero-head"])
def test_negative_and_zero_scales(platform, cache_dtype, query_dtype, scale, k_scale):
    """A negative or zero softmax scale (or a per-head k_scale of either
    sign) is legal and matches the reference in every kernel, lse included
    (a zero scale gives uniform weights, lse = log(L)). Guards kernels that
    reorder the scale's multiply: a grouped kernel that kept fp8 logits unscaled
    until the exponent would need the scale's sign staged in the query and a zero
    scale kept away from 0 * -inf."""
    rng = np.random.default_rng(41)
    inp = make_inputs(rng, [1, 31, 513, 700], 8, 2, 64, 16, cache_dtype, query_dtype=query_dtype)
    kw = {} if k_scale is None else dict(k_scale=np.asarray(k_scale, np.float32))
    for impl in IMPLS:
        out, lse = compare(platform, inp, impl, scale=scale, return_lse=True, **kw)
        assert np.all(np.isfinite(np.asarray(out, np.float32))), impl
        if scale == 0.0:
            np.testing.assert_allclose(np.asarray(lse)[:, 0], np.log([1, 31, 513, 700]),
                                       atol=2e-5, rtol=1e-5, err_msg=impl)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("key_dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale_kind", [None, "scalar", "per_head"])
def test_fp8_reshape_and_cache(platform, cache_dtype, key_dtype, scale_kind):
    """Quantisation on write is bit-exact with the reference: value / scale,
    round to nearest even, saturated to the largest finite value."""
    rng = np.random.default_rng(16)
    num_blocks, kv_heads, head_size, block_size = 6, 2, 64, 16
    kc = np.zeros((num_blocks, kv_heads, head_size // 16, block_size, 16), cache_dtype)
    vc = np.zeros((num_blocks, kv_heads, head_size, block_size), cache_dtype)
    key = (rng.standard_normal((7, kv_heads, head_size)) * 100).astype(key_dtype)
    value = (rng.standard_normal((7, kv_heads, head_size)) * 100).astype(key_dtype)
    fmax = float(jnp.finfo(cache_dtype).max)
    key[0, 0, :4] = [1e6, -1e6, np.inf, -np.inf]          # saturate, never inf / NaN
    key[1, 1, :3] = [fmax * 1.01, fmax, -fmax * 1.2]
    slots = np.array([3, 17, -1, 95, 40, num_blocks * block_size, 64], np.int32)
    ks, vs = kv_scales(scale_kind, kv_heads, rng), kv_scales(scale_kind, kv_heads, rng)
    got = jax_paged.reshape_and_cache(*on(platform, key, value, kc, vc, slots), k_scale=ks,
                                      v_scale=vs)
    want = reference_on_cpu(reference.reshape_and_cache, key, value, kc, vc, slots, k_scale=ks,
                            v_scale=vs)
    for g, w in zip(got, want):
        assert g.dtype == np.dtype(cache_dtype)
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))
    kc_out = np.asarray(got[0]).astype(np.float32)
    assert np.all(np.isfinite(kc_out)) and np.abs(kc_out).max() == fmax
    # Independent check of one element: ml_dtypes' conversion of clip(x / s).
    s = 1.0 if ks is None else float(np.asarray(ks).reshape(-1)[0])
    x = np.float32(np.float32(key[1, 0, 5]) / np.float32(s))
    blk, off = divmod(17, block_size)
    assert kc_out[blk, 0, 0, off, 5] == np.float32(np.clip(x, -fmax, fmax).astype(cache_dtype))


@pytest.mark.parametrize("cache_dtype,tol", [(jnp.float8_e4m3fn, 0.11), (jnp.float8_e5m2, 0.2)],
                         ids=["e4m3fn", "e5m2"])
def test_fp8_accuracy_against_unquantised(platform, cache_dtype, tol):
    """fp8 round trip (write with per-head scales = amax / fp8 max, read back)
    against the unquantised float32 result, and bfloat16 caches of the same
    data for comparison. Printed with -s.

    Metric: relative L2 error of the whole output. e4m3 keeps 3 mantissa bits
    (relative rounding error <= 2^-4, RMS ~ 3.6%), e5m2 keeps 2 (RMS ~ 7.2%).
    The logit errors scale with the logits: head group 0 has N(0, 1) keys
    (logit std ~ 1), head group 1 keys x 3 (std ~ 3, a sharper softmax, few
    tokens dominate, V errors do not average out). A float64 NumPy
    simulation of the same rounding gives ~3.8% / 7.5% (std 1) and 7.7% /
    12.2% (std 3); this test measures 7.1% (e4m3) and 12.8% (e5m2) on CPU.
    The bounds, 11% and 20%, are ~1.5x that: they catch a wrong scale or a
    mis-decoded format (errors of order 100%), not noise. bfloat16 caches
    (8 bits) must do at least 4x better."""
    rng = np.random.default_rng(17)
    num_seqs, num_heads, kv_heads, head_size, block_size = 4, 8, 2, 128, 16
    lens = np.array([64, 300, 700, 1024], np.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = num_seqs * max_blocks
    tables = rng.permutation(num_blocks).reshape(num_seqs, max_blocks).astype(np.int32)
    tokens = [(s, t) for s in range(num_seqs) for t in range(lens[s])]
    slots = np.array([tables[s, t // block_size] * block_size + t % block_size
                      for s, t in tokens], np.int32)
    key = rng.standard_normal((len(tokens), kv_heads, head_size)).astype(np.float32)
    value = rng.standard_normal((len(tokens), kv_heads, head_size)).astype(np.float32)
    key *= np.array([1.0, 3.0], np.float32)[None, :, None]   # per-head ranges differ
    query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(np.float32)
    fmax = float(jnp.finfo(cache_dtype).max)
    k_scale = (np.abs(key).max(axis=(0, 2)) / fmax).astype(np.float32)
    v_scale = (np.abs(value).max(axis=(0, 2)) / fmax).astype(np.float32)

    def run(dtype, **scales):
        x = 16 // np.dtype(dtype).itemsize
        kc = np.zeros((num_blocks, kv_heads, head_size // x, block_size, x), dtype)
        vc = np.zeros((num_blocks, kv_heads, head_size, block_size), dtype)
        k, v = (key, value) if dtype in FP8 else (key.astype(dtype), value.astype(dtype))
        kc, vc = jax_paged.reshape_and_cache(*on(platform, k, v, kc, vc, slots), **scales)
        q = query if dtype in FP8 or dtype == np.float32 else query.astype(dtype)
        out = jax_paged.paged_attention(*on(platform, q), kc, vc, *on(platform, tables, lens),
                                        **scales)
        return np.asarray(out, np.float32)

    exact = run(np.float32)
    quant = run(cache_dtype, k_scale=k_scale, v_scale=v_scale)
    bf16 = run(jnp.bfloat16)
    rel = np.linalg.norm(quant - exact) / np.linalg.norm(exact)
    rel_bf16 = np.linalg.norm(bf16 - exact) / np.linalg.norm(exact)
    print(f"\n{np.dtype(cache_dtype).name}: relative L2 error {rel:.4f} "
          f"(max abs {np.abs(quant - exact).max():.4f}); bfloat16 {rel_bf16:.5f}")
    assert rel < tol
    assert rel_bf16 < rel / 4


def test_fp8_copy_blocks(platform):
    rng = np.random.default_rng(18)
    kc = rng.standard_normal((5, 2, 4, 16, 16)).astype(jnp.float8_e5m2)
    vc = rng.standard_normal((5, 2, 64, 16)).astype(jnp.float8_e5m2)
    mapping = np.array([[0, 3], [1, 4], [2, 9]], np.int32)
    got = jax_paged.copy_blocks(*on(platform, kc, vc, mapping))
    want = reference.copy_blocks(kc, vc, mapping)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_fp8_write_then_attend_in_jitted_loop_with_donation(platform):
    rng = np.random.default_rng(19)
    num_blocks, kv_heads, head_size, block_size = 8, 2, 64, 16
    kc = np.zeros((num_blocks, kv_heads, head_size // 16, block_size, 16), jnp.float8_e4m3fn)
    vc = np.zeros((num_blocks, kv_heads, head_size, block_size), jnp.float8_e4m3fn)
    tables = np.array([[3, 5, 1], [0, 2, 7]], np.int32)
    steps = 20
    keys = rng.standard_normal((steps, 2, kv_heads, head_size)).astype(jnp.bfloat16)
    values = rng.standard_normal((steps, 2, kv_heads, head_size)).astype(jnp.bfloat16)
    queries = rng.standard_normal((steps, 2, 4, head_size)).astype(jnp.bfloat16)
    ks, vs = np.array([0.01, 0.02], np.float32), np.float32(0.015)

    def decode(kc, vc, ks, vs):
        t, k_all, v_all, q_all = map(jnp.asarray, (tables, keys, values, queries))

        def step(i, carry):
            kc, vc, outs = carry
            lens = jnp.full((2,), i, jnp.int32)
            slot = t[jnp.arange(2), lens // block_size] * block_size + lens % block_size
            kc, vc = jax_paged.reshape_and_cache(k_all[i], v_all[i], kc, vc, slot,
                                                 k_scale=ks, v_scale=vs)
            out = jax_paged.paged_attention(q_all[i], kc, vc, t, lens + 1, k_scale=ks,
                                            v_scale=vs, sliding_window=8)
            return kc, vc, outs.at[i].set(out)
        outs = jnp.zeros(queries.shape, queries.dtype)
        return jax.lax.fori_loop(0, steps, step, (kc, vc, outs))

    args = on(platform, kc, vc, ks, vs)
    kc_ptr = args[0].unsafe_buffer_pointer()
    kc2, vc2, outs = jax.jit(decode, donate_argnums=(0, 1))(*args)
    assert kc2.unsafe_buffer_pointer() == kc_ptr
    # Step by step with the reference.
    rkc, rvc = jnp.asarray(kc), jnp.asarray(vc)
    with jax.default_device(jax.devices("cpu")[0]):
        for i in range(steps):
            lens = np.full(2, i, np.int32)
            slot = tables[np.arange(2), lens // block_size] * block_size + lens % block_size
            rkc, rvc = reference.reshape_and_cache(keys[i], values[i], rkc, rvc, slot,
                                                   k_scale=ks, v_scale=vs)
            want = reference.paged_attention(queries[i], rkc, rvc, tables, lens + 1, k_scale=ks,
                                             v_scale=vs, sliding_window=8)
            assert_close(np.asarray(outs)[i], want, jnp.bfloat16, f"step {i}")
    np.testing.assert_array_equal(np.asarray(kc2).view(np.uint8), np.asarray(rkc).view(np.uint8))
