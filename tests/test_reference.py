"""The jnp reference against independent NumPy oracles."""
import numpy as np
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import reference
from paged_inputs import dense_attention, make_paged_inputs, page_walk_attention


@pytest.mark.parametrize("impl", ["v1", "v2"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("use_alibi", [False, True])
def test_reference_matches_page_walk(impl, num_heads, num_kv_heads, use_alibi):
    rng = np.random.default_rng(0)
    inp = make_paged_inputs(rng, [0, 1, 16, 45, 70], num_heads, num_kv_heads, 32, 16,
                            poison=False)
    slopes = rng.random(num_heads).astype(np.float32) if use_alibi else None
    scale = 0.3
    out = reference.paged_attention(*inp.args(), scale=scale, alibi_slopes=slopes, impl=impl,
                                    partition_size=32)
    expected = page_walk_attention(*inp.args(), scale, slopes)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)
    # Paging only changes addresses: equal to attention over the logical sequence.
    np.testing.assert_allclose(expected, dense_attention(inp.query, inp.keys, inp.values, scale,
                                                         slopes), atol=1e-10)


def test_reference_ignores_poison_and_padding():
    rng = np.random.default_rng(1)
    inp = make_paged_inputs(rng, [5, 33, 0], 4, 2, 16, 8, padding="garbage", poison=True)
    out = np.asarray(reference.paged_attention(*inp.args(), impl="v2", partition_size=16))
    assert np.all(np.isfinite(out))
    assert np.all(out[2] == 0)
    expected = dense_attention(inp.query, inp.keys, inp.values, 16 ** -0.5)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_reshape_and_cache_layout():
    rng = np.random.default_rng(2)
    num_blocks, kv_heads, head_size, block_size = 4, 2, 16, 8
    x = 4
    kc = jnp.zeros((num_blocks, kv_heads, head_size // x, block_size, x)) + 7.0
    vc = jnp.zeros((num_blocks, kv_heads, head_size, block_size)) + 7.0
    key = rng.standard_normal((3, kv_heads, head_size)).astype(np.float32)
    value = rng.standard_normal((3, kv_heads, head_size)).astype(np.float32)
    slots = np.array([13, -1, num_blocks * block_size], np.int32)
    kc2, vc2 = reference.reshape_and_cache(key, value, kc, vc, slots)
    kc2, vc2 = np.array(kc2), np.array(vc2)
    for kvh in range(kv_heads):
        for d in range(head_size):
            assert kc2[1, kvh, d // x, 5, d % x] == key[0, kvh, d]
            assert vc2[1, kvh, d, 5] == value[0, kvh, d]
    # Everything but token 0's slot is untouched (token 1 and 2 are skipped).
    kc2[1, :, :, 5, :] = 7.0
    vc2[1, :, :, 5] = 7.0
    assert np.all(kc2 == 7.0) and np.all(vc2 == 7.0)


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_round_trip_is_a_cache_write_read_back(cache_dtype):
    """reference.fp8_round_trip(x, scale) equals x written by reshape_and_cache (value /
    scale, saturated) and read back as value * scale, saturation included."""
    rng = np.random.default_rng(0)
    tokens, heads, head_size, block_size = 24, 2, 32, 8
    x = rng.normal(size=(tokens, heads, head_size)).astype(np.float32) * 300.0
    x[0, :, 0] = [1e6, -1e6]  # beyond both formats' range under either scale
    scale = np.array([0.5, 3.0], np.float32)
    kshape = (tokens // block_size, heads, head_size // 16, block_size, 16)
    vshape = (tokens // block_size, heads, head_size, block_size)
    _, vc = reference.reshape_and_cache(x, x, jnp.zeros(kshape, cache_dtype),
                                        jnp.zeros(vshape, cache_dtype),
                                        jnp.arange(tokens, dtype=jnp.int32), k_scale=scale,
                                        v_scale=scale)
    stored = np.asarray(vc.astype(jnp.float32)).transpose(0, 3, 1, 2).reshape(tokens, heads, head_size)
    got = np.asarray(reference.fp8_round_trip(x, scale, cache_dtype))
    np.testing.assert_array_equal(got, stored * scale[None, :, None])
    limit = float(jnp.finfo(cache_dtype).max)
    assert got[0, 0, 0] == limit * scale[0] and got[0, 1, 0] == -limit * scale[1]  # saturated
    with pytest.raises(TypeError, match="cache_dtype must be float8_e4m3fn or float8_e5m2, got float32"):
        reference.fp8_round_trip(x, scale, jnp.float32)


@pytest.mark.parametrize("num_blocks,max_blocks", [(0, 2), (5, 0), (0, 0)])
@pytest.mark.parametrize("impl", ["v1", "v2"])
def test_reference_empty_pool_and_table_like_the_kernels(num_blocks, max_blocks, impl):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    kc = np.ones((num_blocks, 2, 16, 16, 4), np.float32)
    vc = np.ones((num_blocks, 2, 64, 16), np.float32)
    bt = np.zeros((2, max_blocks), np.int32)
    sl = np.array([5, 0], np.int32)
    for fn in (reference.paged_attention, jax_paged.paged_attention):
        out, lse = fn(q, kc, vc, bt, sl, impl=impl, partition_size=32, return_lse=True)
        assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    kc2, vc2 = reference.copy_blocks(kc, vc, np.array([[0, 1]], np.int32))
    assert kc2.shape == kc.shape and vc2.shape == vc.shape


def test_reference_partition_sizes_past_the_capacity_are_one_partition():
    rng = np.random.default_rng(4)
    inp = make_paged_inputs(rng, [5, 40], 4, 2, 64, 16, np.float32)
    one = reference.paged_attention(*inp.args(), impl="v2", partition_size=48)  # capacity 48
    for size in (64, 2 ** 31 - 16):
        np.testing.assert_array_equal(np.asarray(reference.paged_attention(
            *inp.args(), impl="v2", partition_size=size)), np.asarray(one))
        np.testing.assert_allclose(np.asarray(jax_paged.paged_attention(
            *inp.args(), impl="v2", partition_size=size)), np.asarray(one), atol=2e-5)
