"""Argument errors of the features: scales, soft cap, window, query rank, fp8 head
sizes and the quantised write; each names the argument, what it got and what was
expected."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged


def _specs(cache_dtype=jnp.float8_e4m3fn, query_dtype=np.float32, head_size=64, q_len=None,
           num_kv_heads=2):
    x = 16 // np.dtype(cache_dtype).itemsize
    qshape = (3, 8, head_size) if q_len is None else (3, q_len, 8, head_size)
    return dict(
        query=jax.ShapeDtypeStruct(qshape, query_dtype),
        key_cache=jax.ShapeDtypeStruct((10, num_kv_heads, head_size // x, 16, x), cache_dtype),
        value_cache=jax.ShapeDtypeStruct((10, num_kv_heads, head_size, 16), cache_dtype),
        block_tables=jax.ShapeDtypeStruct((3, 4), np.int32),
        seq_lens=jax.ShapeDtypeStruct((3,), np.int32))


@pytest.mark.parametrize("specs,kwargs,error,match", [
    (dict(), dict(k_scale=jax.ShapeDtypeStruct((3,), np.float32)), ValueError,
     r"k_scale must have shape \(\), \(1,\) or \[num_kv_heads\] = \(2,\), got \(3,\)"),
    (dict(), dict(v_scale=jax.ShapeDtypeStruct((2, 1), np.float32)), ValueError,
     r"v_scale must have shape"),
    (dict(), dict(k_scale=jax.ShapeDtypeStruct((), np.float16)), TypeError,
     r"k_scale must be float32, got float16"),
    (dict(cache_dtype=jnp.bfloat16, query_dtype=jnp.bfloat16),
     dict(k_scale=jax.ShapeDtypeStruct((), np.float32)), ValueError,
     r"k_scale applies to float8 caches .* only; the caches are bfloat16"),
    (dict(cache_dtype=jnp.float8_e4m3fn, query_dtype=jnp.float8_e4m3fn), dict(), TypeError,
     r"query must be float32, float16 or bfloat16, got float8_e4m3fn"),
    (dict(cache_dtype=np.int8), dict(), TypeError, r"key_cache must be float32, float16, "
                                                   r"bfloat16, float8_e4m3fn or float8_e5m2"),
    (dict(), dict(soft_cap=-1.0), ValueError, r"soft_cap must be positive"),
    (dict(), dict(soft_cap=float("inf")), ValueError, r"soft_cap must be positive and finite"),
    (dict(), dict(soft_cap="5"), TypeError, r"soft_cap must be a static Python number"),
    (dict(), dict(sliding_window=0), ValueError, r"sliding_window must be in \[1, 2\^31\)"),
    (dict(), dict(sliding_window=-3), ValueError, r"sliding_window must be in"),
    (dict(), dict(sliding_window=4.0), TypeError, r"sliding_window must be a static Python int"),
    (dict(q_len=0), dict(), ValueError, r"q_len \(query.shape\[1\]\) must be at least 1"),
])
def test_feature_errors(specs, kwargs, error, match):
    args = _specs(**specs)
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.ShapeDtypeStruct)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda a, s: jax_paged.paged_attention(**a, **s, **static), args, arrays)


def test_traced_soft_cap_or_window_is_refused():
    args = _specs(cache_dtype=np.float32)
    with pytest.raises(TypeError, match=r"soft_cap must be a static Python number"):
        jax.eval_shape(lambda a, c: jax_paged.paged_attention(**a, soft_cap=c), args,
                       jax.ShapeDtypeStruct((), np.float32))
    with pytest.raises(TypeError, match=r"sliding_window must be a static Python int"):
        jax.eval_shape(lambda a, w: jax_paged.paged_attention(**a, sliding_window=w), args,
                       jax.ShapeDtypeStruct((), np.int32))


def test_fp8_head_size_must_be_a_multiple_of_16():
    args = _specs(head_size=120)
    args["key_cache"] = jax.ShapeDtypeStruct((10, 2, 7, 16, 16), jnp.float8_e4m3fn)
    args["value_cache"] = jax.ShapeDtypeStruct((10, 2, 112, 16), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8 caches need head_size to be a multiple of 16"):
        jax.eval_shape(lambda a: jax_paged.paged_attention(**a), args)


def test_five_d_query_is_refused():
    args = _specs()
    args["query"] = jax.ShapeDtypeStruct((3, 1, 1, 8, 64), np.float32)
    with pytest.raises(ValueError, match=r"query must be \[num_seqs, num_heads, head_size\] or "
                                         r"\[num_seqs, q_len, num_heads, head_size\]"):
        jax.eval_shape(lambda a: jax_paged.paged_attention(**a), args)


def test_fp8_write_errors():
    kc = jax.ShapeDtypeStruct((10, 2, 4, 16, 16), jnp.float8_e5m2)
    vc = jax.ShapeDtypeStruct((10, 2, 64, 16), jnp.float8_e5m2)
    k = jax.ShapeDtypeStruct((5, 2, 64), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((5,), np.int32)
    write = jax_paged.reshape_and_cache
    jax.eval_shape(lambda *a: write(*a), k, k, kc, vc, slots)  # fine: bf16 keys, fp8 caches
    with pytest.raises(ValueError, match=r"k_scale must have shape .* got \(5,\)"):
        jax.eval_shape(lambda *a, s: write(*a, k_scale=s), k, k, kc, vc, slots,
                       s=jax.ShapeDtypeStruct((5,), np.float32))
    with pytest.raises(ValueError, match=r"v_scale applies to float8 caches"):
        kc32 = jax.ShapeDtypeStruct((10, 2, 16, 16, 4), np.float32)
        vc32 = jax.ShapeDtypeStruct((10, 2, 64, 16), np.float32)
        k32 = jax.ShapeDtypeStruct((5, 2, 64), np.float32)
        jax.eval_shape(lambda *a, s: write(*a, v_scale=s), k32, k32, kc32, vc32, slots,
                       s=jax.ShapeDtypeStruct((1,), np.float32))
    with pytest.raises(ValueError, match=r"key_cache must be \[num_blocks, num_kv_heads, "
                                         r"head_size // 16, block_size, 16\]"):
        jax.eval_shape(lambda *a: write(*a), k, k,
                       jax.ShapeDtypeStruct((10, 2, 8, 16, 8), jnp.float8_e5m2), vc, slots)
