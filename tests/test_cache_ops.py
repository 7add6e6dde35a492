"""reshape_and_cache and copy_blocks against the reference, in place under donation."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import reference
from paged_inputs import DTYPES, on, reference_on_cpu


def random_caches(rng, num_blocks, num_kv_heads, head_size, block_size, dtype):
    x = 16 // np.dtype(dtype).itemsize
    kc = rng.standard_normal((num_blocks, num_kv_heads, head_size // x, block_size, x))
    vc = rng.standard_normal((num_blocks, num_kv_heads, head_size, block_size))
    return kc.astype(dtype), vc.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_matches_reference(platform, dtype, block_size):
    rng = np.random.default_rng(block_size)
    num_blocks, kv_heads, head_size = 10, 2, 64
    kc, vc = random_caches(rng, num_blocks, kv_heads, head_size, block_size, dtype)
    num_slots = num_blocks * block_size
    # Distinct valid slots, plus skipped ones: negative, exactly one past the
    # end, and far past the end.
    slots = rng.choice(num_slots, size=12, replace=False).astype(np.int32)
    slots[[2, 5, 9]] = [-1, num_slots, 2 ** 31 - 1]
    key = rng.standard_normal((12, kv_heads, head_size)).astype(dtype)
    value = rng.standard_normal((12, kv_heads, head_size)).astype(dtype)
    out = jax_paged.reshape_and_cache(*on(platform, key, value, kc, vc, slots))
    expected = reference_on_cpu(reference.reshape_and_cache, key, value, kc, vc, slots)
    for got, want in zip(out, expected):
        np.testing.assert_array_equal(np.asarray(got), want)
    # The write is visible to attention: token 0 read back from its slot.
    blk, off = divmod(int(slots[0]), block_size)
    np.testing.assert_array_equal(np.asarray(out[1])[blk, :, :, off], value[0])


def test_reshape_and_cache_in_place_under_donation(platform):
    rng = np.random.default_rng(1)
    kc, vc = random_caches(rng, 64, 4, 128, 16, np.float32)
    key = rng.standard_normal((3, 4, 128)).astype(np.float32)
    value = rng.standard_normal((3, 4, 128)).astype(np.float32)
    slots = np.array([5, 100, -1], np.int32)
    kc_d, vc_d, key_d, value_d, slots_d = on(platform, kc, vc, key, value, slots)
    kc_ptr, vc_ptr = kc_d.unsafe_buffer_pointer(), vc_d.unsafe_buffer_pointer()
    write = jax.jit(jax_paged.reshape_and_cache, donate_argnums=(2, 3))
    kc2, vc2 = write(key_d, value_d, kc_d, vc_d, slots_d)
    assert kc_d.is_deleted() and vc_d.is_deleted()
    # Same buffers: updated in place, no copy of the cache.
    assert kc2.unsafe_buffer_pointer() == kc_ptr and vc2.unsafe_buffer_pointer() == vc_ptr
    expected = reference.reshape_and_cache(key, value, kc, vc, slots)
    np.testing.assert_array_equal(np.asarray(kc2), np.asarray(expected[0]))
    np.testing.assert_array_equal(np.asarray(vc2), np.asarray(expected[1]))
    # Without donation the caller's array is untouched.
    kc_d, vc_d = on(platform, kc, vc)
    jax.jit(jax_paged.reshape_and_cache)(key_d, value_d, kc_d, vc_d, slots_d)
    np.testing.assert_array_equal(np.asarray(kc_d), kc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(platform, dtype):
    rng = np.random.default_rng(2)
    num_blocks = 12
    kc, vc = random_caches(rng, num_blocks, 2, 64, 16, dtype)
    mapping = np.array([[0, 5], [3, 7], [-1, 2], [4, num_blocks], [11, 1], [6, 6]], np.int32)
    out = jax_paged.copy_blocks(*on(platform, kc, vc, mapping))
    expected = reference_on_cpu(reference.copy_blocks, kc, vc, mapping)
    for got, want, orig in zip(out, expected, (kc, vc)):
        got = np.asarray(got)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got[5], orig[0])
        np.testing.assert_array_equal(got[1], orig[11])
        np.testing.assert_array_equal(got[2], orig[2])   # skipped pair left it alone


def test_copy_blocks_in_place_under_donation(platform):
    rng = np.random.default_rng(3)
    kc, vc = random_caches(rng, 8, 2, 64, 16, np.float32)
    mapping = np.array([[1, 2]], np.int32)
    kc_d, vc_d, m_d = on(platform, kc, vc, mapping)
    ptr = kc_d.unsafe_buffer_pointer()
    kc2, _ = jax.jit(jax_paged.copy_blocks, donate_argnums=(0, 1))(kc_d, vc_d, m_d)
    assert kc_d.is_deleted() and kc2.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(kc2)[2], kc[1])


def test_empty_inputs(platform):
    rng = np.random.default_rng(4)
    kc, vc = random_caches(rng, 4, 2, 64, 16, np.float32)
    key = np.zeros((0, 2, 64), np.float32)
    out = jax_paged.reshape_and_cache(*on(platform, key, key, kc, vc, np.zeros((0,), np.int32)))
    np.testing.assert_array_equal(np.asarray(out[0]), kc)
    out = jax_paged.copy_blocks(*on(platform, kc, vc, np.zeros((0, 2), np.int32)))
    np.testing.assert_array_equal(np.asarray(out[1]), vc)
    q = np.zeros((0, 4, 64), np.float32)
    o = jax_paged.paged_attention(*on(platform, q, kc, vc, np.zeros((0, 3), np.int32),
                                      np.zeros((0,), np.int32)))
    assert o.shape == (0, 4, 64)
