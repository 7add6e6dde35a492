"""KV cache allocation and the page pool (free list of cache blocks).

Cache layout (the seed's, see ``BRIEF.md``), per layer::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x],  x = 16 // itemsize
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

:func:`allocate_kv_cache` returns a *list* with one ``(key_cache, value_cache)`` pair per layer
rather than one stacked ``[num_layers, ...]`` array. Each layer's cache is then a buffer of its
own, which ``reshape_and_cache`` can update in place (input/output aliasing, and donation through
``jit`` and ``while_loop``). With a stacked array every layer would be a slice, and a slice
passed to a custom call and written back is a copy of a whole layer's cache per step.

The page pool is a stack of free block ids held in jnp arrays of fixed shape, so allocation and
freeing run inside a jitted decode loop with no host round-trip:

    BlockPool.free_ids  int32 [num_blocks]  entries [0, num_free) are the free blocks; the top
                                            of the stack is free_ids[num_free - 1]
    BlockPool.num_free  int32 []
    BlockPool.peak_used int32 []            most blocks ever in use at once (for reporting)

:func:`allocate_blocks` and :func:`free_blocks` are pure functions (pool in, pool out).
:class:`HostBlockAllocator` implements the same stack on numpy arrays for the host-side admission
step; ``HostBlockAllocator.from_pool(pool)`` / ``.to_pool()`` convert, so both sides share one
free list and pop/push blocks in the same order.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

KVCaches = list[tuple[jax.Array, jax.Array]]


def cache_x(dtype: Any) -> int:
    """Elements per 16-byte chunk of the key cache's last axis: ``16 // itemsize``."""
    return 16 // jnp.dtype(dtype).itemsize


def kv_cache_shapes(
    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes ``(key_cache_shape, value_cache_shape)`` of one layer's cache."""
    x = cache_x(dtype)
    if head_size % x:
        raise ValueError(f"head_size={head_size} must be a multiple of x={x} for dtype {jnp.dtype(dtype)}")
    return ((num_blocks, num_kv_heads, head_size // x, block_size, x),
            (num_blocks, num_kv_heads, head_size, block_size))


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: Any = jnp.float32,
    *,
    device: Optional[jax.Device] = None,
    sharding: Optional[jax.sharding.Sharding] = None,
) -> KVCaches:
    """Zero-filled paged KV caches for ``num_layers`` layers.

    Returns a list of ``num_layers`` pairs ``(key_cache, value_cache)`` of ``dtype`` with the
    shapes of :func:`kv_cache_shapes`. Pass the list to jitted functions with it donated
    (``donate_argnums``) so that cache writes happen in place.

    ``sharding`` (e.g. ``NamedSharding(mesh, P(None, "tp"))``: KV heads split over the mesh axis
    "tp", as tensor parallelism needs) places both caches of every layer; each device then
    allocates only its own shard.
    """
    if device is not None and sharding is not None:
        raise ValueError("pass device or sharding, not both")
    k_shape, v_shape = kv_cache_shapes(num_blocks, num_kv_heads, head_size, block_size, dtype)
    if sharding is not None:
        # Zeros made by a jitted function with out_shardings: every device writes its shard in
        # place, and no device ever holds the whole (possibly larger than one device) cache.
        zeros = jax.jit(lambda: (jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)),
                        out_shardings=(sharding, sharding))
        return [zeros() for _ in range(num_layers)]
    caches = []
    for _ in range(num_layers):
        k = jnp.zeros(k_shape, dtype)
        v = jnp.zeros(v_shape, dtype)
        if device is not None:
            k, v = jax.device_put(k, device), jax.device_put(v, device)
        caches.append((k, v))
    return caches


def kv_cache_bytes(caches: KVCaches) -> int:
    """Total bytes of all layers' K and V caches."""
    return sum(k.nbytes + v.nbytes for k, v in caches)


# --------------------------------------------------------------------------------------------
# Device-side page pool
# --------------------------------------------------------------------------------------------


class BlockPool(NamedTuple):
    """Free list of cache blocks (a pytree; see the module docstring for the fields)."""

    free_ids: jax.Array  # int32 [num_blocks]
    num_free: jax.Array  # int32 []
    peak_used: jax.Array  # int32 []


def make_block_pool(num_blocks: int) -> BlockPool:
    """A pool with every block free. Block 0 is on top (popped first), then 1, 2, ..."""
    return BlockPool(free_ids=jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32),
                     num_free=jnp.int32(num_blocks), peak_used=jnp.int32(0))


def blocks_in_use(pool: BlockPool) -> jax.Array:
    """int32 scalar: number of blocks not in the free list."""
    return jnp.int32(pool.free_ids.shape[0]) - pool.num_free


def allocate_blocks(pool: BlockPool, need: jax.Array) -> tuple[BlockPool, jax.Array, jax.Array]:
    """Pop one block for every ``True`` in ``need`` (all-or-nothing; jit-friendly).

    Args:
      pool: the pool.
      need: bool ``[n]``.

    Returns:
      ``(pool, block_ids int32 [n], ok bool [])``. If there are fewer free blocks than requests,
      ``ok`` is False, the pool is returned unchanged and every id is -1 (a partial allocation
      would leave the caller with some sequences unable to step anyway). Ids are -1 where
      ``need`` is False. Requests are served in index order from the top of the stack.
    """
    need = need.astype(bool)
    total = jnp.sum(need, dtype=jnp.int32)
    ok = total <= pool.num_free
    rank = jnp.cumsum(need, dtype=jnp.int32) - 1  # i-th requester takes the i-th block from the top
    src = jnp.clip(pool.num_free - 1 - rank, 0, pool.free_ids.shape[0] - 1)
    ids = jnp.where(need & ok, pool.free_ids[src], -1)
    num_free = jnp.where(ok, pool.num_free - total, pool.num_free)
    used = jnp.int32(pool.free_ids.shape[0]) - num_free
    return BlockPool(pool.free_ids, num_free, jnp.maximum(pool.peak_used, used)), ids, ok


def free_blocks(pool: BlockPool, block_ids: jax.Array, mask: jax.Array) -> BlockPool:
    """Push ``block_ids[mask]`` back on the free list (jit-friendly; any shapes, flattened).

    The caller guarantees the masked ids are distinct, in use, and valid; ids are pushed in
    row-major order of ``block_ids``.
    """
    ids = block_ids.reshape(-1).astype(jnp.int32)
    mask = mask.reshape(-1).astype(bool)
    n = pool.free_ids.shape[0]
    dst = pool.num_free + jnp.cumsum(mask, dtype=jnp.int32) - 1
    dst = jnp.where(mask, dst, n)  # out of range -> dropped
    free_ids = pool.free_ids.at[dst].set(ids, mode="drop")
    return BlockPool(free_ids, pool.num_free + jnp.sum(mask, dtype=jnp.int32), pool.peak_used)


# --------------------------------------------------------------------------------------------
# Host-side mirror (admission and preemption run on the host between decode loops)
# --------------------------------------------------------------------------------------------


class HostBlockAllocator:
    """The same stack as :class:`BlockPool`, on numpy, for host-side admission/preemption."""

    def __init__(self, num_blocks: int):
        self.free_ids = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self.num_free = num_blocks
        self.peak_used = 0

    @property
    def num_blocks(self) -> int:
        return int(self.free_ids.shape[0])

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @classmethod
    def from_pool(cls, pool: BlockPool) -> "HostBlockAllocator":
        """Copy a (device or host) :class:`BlockPool` into a host allocator."""
        self = cls.__new__(cls)
        self.free_ids = np.array(pool.free_ids, dtype=np.int32)  # writable copy
        self.num_free = int(pool.num_free)
        self.peak_used = int(pool.peak_used)
        return self

    def to_pool(self) -> BlockPool:
        """The allocator's state as a :class:`BlockPool` of numpy arrays (device_put it)."""
        return BlockPool(self.free_ids.copy(), np.int32(self.num_free), np.int32(self.peak_used))

    def allocate(self, n: int) -> Optional[np.ndarray]:
        """Pop ``n`` blocks (int32 ``[n]``, first popped first), or ``None`` if fewer are free."""
        if n > self.num_free:
            return None
        ids = self.free_ids[self.num_free - n: self.num_free][::-1].copy()
        self.num_free -= n
        self.peak_used = max(self.peak_used, self.num_used)
        return ids

    def free(self, ids: Sequence[int] | np.ndarray) -> None:
        """Push ``ids`` back (in order)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        self.free_ids[self.num_free: self.num_free + ids.size] = ids
        self.num_free += ids.size


def check_page_accounting(
    free_ids: np.ndarray,
    num_free: int,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    active: np.ndarray,
    block_size: int,
) -> None:
    """Assert the pool and the block tables partition the blocks exactly.

    Each live sequence ``b`` (``active[b]``) owns ``block_tables[b, :ceil(seq_lens[b] /
    block_size)]``. Checks that owned ids are valid, that no block is owned by two sequences (or
    twice by one), that no owned block is also free, that the free list has no duplicates, and that
    owned + free covers every block (nothing leaked). Raises ``AssertionError`` with a reason.
    """
    free_ids = np.asarray(free_ids)
    num_blocks = free_ids.shape[0]
    free = np.asarray(free_ids[: int(num_free)])
    owned = [np.asarray(block_tables[b, : -(-int(seq_lens[b]) // block_size)])
             for b in range(len(active)) if active[b]]
    owned = np.concatenate(owned) if owned else np.zeros(0, np.int32)
    if owned.size and (owned.min() < 0 or owned.max() >= num_blocks):
        raise AssertionError(f"invalid block id in a live block table: {owned}")
    if free.size and (free.min() < 0 or free.max() >= num_blocks):
        raise AssertionError(f"invalid block id in the free list: {free}")
    if len(np.unique(owned)) != owned.size:
        raise AssertionError("a block is owned by two live sequences")
    if len(np.unique(free)) != free.size:
        raise AssertionError("a block is in the free list twice")
    if np.intersect1d(owned, free).size:
        raise AssertionError(f"blocks both owned and free: {np.intersect1d(owned, free)}")
    if owned.size + free.size != num_blocks:
        raise AssertionError(f"{num_blocks - owned.size - free.size} block(s) leaked "
                             f"(owned {owned.size} + free {free.size} != {num_blocks})")
