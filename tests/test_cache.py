"""KV cache allocation and the device-side page pool (free list)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jax_paged.cache import (
    HostBlockAllocator, allocate_blocks, allocate_kv_cache, blocks_in_use,
    check_page_accounting, free_blocks, kv_cache_shapes, make_block_pool,
)


@pytest.mark.parametrize("dtype,x", [(jnp.float32, 4), (jnp.bfloat16, 8), (jnp.float16, 8)])
def test_allocate_kv_cache_layout(dtype, x):
    caches = allocate_kv_cache(3, 10, 2, 64, 16, dtype)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == (10, 2, 64 // x, 16, x) and k.dtype == dtype
        assert v.shape == (10, 2, 64, 16) and v.dtype == dtype
        assert not np.asarray(k).any() and not np.asarray(v).any()
    # Every layer is its own buffer (so each can be updated in place independently).
    ptrs = {a.unsafe_buffer_pointer() for kv in caches for a in kv}
    assert len(ptrs) == 6


def test_kv_cache_shapes_rejects_head_size_not_multiple_of_x():
    with pytest.raises(ValueError):
        kv_cache_shapes(4, 1, 12, 16, jnp.bfloat16)  # 12 % 8 != 0


# Jitted once per shape: eager dispatch of the pool's small ops would dominate the test time.
_alloc_jit = jax.jit(allocate_blocks)
_free_jit = jax.jit(free_blocks)


def test_make_block_pool_and_order():
    pool = make_block_pool(5)
    pool, ids, ok = _alloc_jit(pool, jnp.array([True, False, True, True]))
    assert bool(ok)
    np.testing.assert_array_equal(ids, [0, -1, 1, 2])  # block 0 first, in request order
    assert int(pool.num_free) == 2 and int(blocks_in_use(pool)) == 3 and int(pool.peak_used) == 3
    pool = _free_jit(pool, jnp.array([[2, 0], [1, 7]]), jnp.array([[True, True], [False, False]]))
    assert int(pool.num_free) == 4 and int(pool.peak_used) == 3
    # LIFO: the most recently freed block (0) is handed out first.
    pool, ids, _ = _alloc_jit(pool, jnp.array([True, True, False, False]))
    np.testing.assert_array_equal(ids, [0, 2, -1, -1])


def test_allocate_is_all_or_nothing():
    pool = make_block_pool(5)
    pool, _, _ = _alloc_jit(pool, jnp.array([True, True, False, False]))
    before = jax.tree_util.tree_map(np.asarray, pool)
    pool2, ids, ok = _alloc_jit(pool, jnp.array([True, True, True, True]))
    assert not bool(ok)
    np.testing.assert_array_equal(ids, [-1, -1, -1, -1])
    for a, b in zip(jax.tree_util.tree_leaves(pool2), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([3, 8]), st.lists(st.tuples(st.booleans(), st.lists(st.booleans(), min_size=6, max_size=6)),
                                     min_size=1, max_size=12))
def test_device_pool_matches_host_allocator(num_blocks, ops):
    """Random allocate/free sequences: the jitted pool and the host mirror hand out the same ids,
    never hand out a block twice, and get every block back."""
    pool = make_block_pool(num_blocks)
    host = HostBlockAllocator(num_blocks)
    owned: list[int] = []
    for is_alloc, mask in ops:
        mask = np.array(mask)
        if is_alloc:
            pool, ids, ok = _alloc_jit(pool, jnp.asarray(mask))
            ids = np.asarray(ids)
            h = host.allocate(int(mask.sum()))
            assert bool(ok) == (h is not None)
            if h is not None:
                np.testing.assert_array_equal(ids[mask], h)
                owned.extend(int(i) for i in h)
                assert len(set(owned)) == len(owned), "a block was handed out twice"
        else:
            k = min(len(owned), 6)
            cand = np.full(6, -1, np.int32)
            cand[:k] = owned[:k]
            m = mask & (np.arange(6) < k)
            pool = _free_jit(pool, jnp.asarray(cand), jnp.asarray(m))
            host.free(cand[m])
            owned = [b for i, b in enumerate(owned) if not (i < 6 and m[i])]
        assert int(pool.num_free) == host.num_free == num_blocks - len(owned)
        np.testing.assert_array_equal(np.asarray(pool.free_ids)[: host.num_free], host.free_ids[: host.num_free])
        assert int(pool.peak_used) == host.peak_used
    # Round trip through the host mirror keeps the state.
    again = HostBlockAllocator.from_pool(pool).to_pool()
    np.testing.assert_array_equal(again.free_ids[: host.num_free], host.free_ids[: host.num_free])
    # Free everything: all blocks are back exactly once.
    host.free(owned)
    assert sorted(host.free_ids[: host.num_free].tolist()) == list(range(num_blocks))


def test_pool_inside_jitted_loop():
    """Grow 3 sequences token by token inside one lax.fori_loop: a block is taken exactly when a
    sequence crosses a block boundary, and memory follows the actual lengths."""
    block_size, steps = 4, 10
    lens0 = jnp.array([0, 3, 5], jnp.int32)

    def body(_, carry):
        pool, lens = carry
        pool, _, ok = allocate_blocks(pool, lens % block_size == 0)
        return pool, lens + ok

    pool, lens = jax.jit(lambda p: jax.lax.fori_loop(0, steps, body, (p, lens0)))(make_block_pool(16))
    np.testing.assert_array_equal(lens, lens0 + steps)
    # Blocks taken for positions lens0 .. lens0 + steps - 1, i.e. blocks ceil(lens0/bs) .. ceil(lens/bs).
    expected = int(np.sum(-(-np.asarray(lens) // block_size) - (-(-np.asarray(lens0) // block_size))))
    assert int(blocks_in_use(pool)) == expected == int(pool.peak_used)


def _valid_state():
    # 6 blocks, block_size 4; seq 0 has 5 tokens (blocks 3, 0), seq 2 has 4 tokens (block 5);
    # slot 1 is idle (its stale row must be ignored); free: 1, 2, 4.
    block_tables = np.array([[3, 0, -1], [2, 2, 2], [5, -1, -1]], np.int32)
    seq_lens = np.array([5, 9, 4], np.int32)
    active = np.array([True, False, True])
    free_ids = np.array([1, 4, 2, 9, 9, 9], np.int32)
    return free_ids, 3, block_tables, seq_lens, active


def test_check_page_accounting_accepts_valid():
    check_page_accounting(*_valid_state(), block_size=4)


@pytest.mark.parametrize("corrupt,msg", [
    (lambda f, n, bt, sl, a: (f, n, bt.__setitem__((2, 0), 3) or bt, sl, a), "two live"),   # shared block
    (lambda f, n, bt, sl, a: (f, n, bt.__setitem__((2, 0), 4) or bt, sl, a), "both owned and free"),
    (lambda f, n, bt, sl, a: (f, 2, bt, sl, a), "leaked"),                                  # lost block
    (lambda f, n, bt, sl, a: (f.__setitem__(1, 1) or f, n, bt, sl, a), "twice"),            # double free
    (lambda f, n, bt, sl, a: (f, n, bt.__setitem__((0, 1), -1) or bt, sl, a), "invalid"),
    (lambda f, n, bt, sl, a: (f, n, bt, sl, a.__setitem__(1, True) or a), "two live"),    # stale row live
])
def test_check_page_accounting_detects(corrupt, msg):
    with pytest.raises(AssertionError, match=msg):
        check_page_accounting(*corrupt(*_valid_state()), block_size=4)
