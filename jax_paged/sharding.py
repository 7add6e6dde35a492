"""Multi-device use of the paged ops.

Tensor parallel over heads (and sequences)
    Nothing to import: the top-level ``jax_paged.paged_attention``,
    ``reshape_and_cache`` and ``copy_blocks`` carry a partitioning rule. Under
    plain ``jax.jit`` with the query sharded on its heads axis and the caches on
    their KV-heads axis (and / or the query, tables and lengths on the sequence
    axis), each device runs the kernel on its own heads and sequences, with no
    collective and no gather of the cache; the output keeps the sharding. The
    names below are the same functions, for code written against this module.

Data parallel over sequences, each device with its own block pool
    :func:`data_parallel`: caches sharded on the blocks axis, block ids local to
    each device's pool (``shard_map``). This is a different contract from a
    sharded jit (where block ids index the one global pool), so it stays here.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from . import api

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "data_parallel"]

paged_attention = api.paged_attention
reshape_and_cache = api.reshape_and_cache
copy_blocks = api.copy_blocks


def data_parallel(mesh: jax.sharding.Mesh, axis: str) -> Callable:
    """Returns ``paged_attention`` run per device on its own block pool.

    Shard ``query``, ``block_tables`` and ``seq_lens`` on their sequence axis
    (dim 0) and both caches on their blocks axis (dim 0) over ``axis``; block ids
    in each device's table rows index that device's local blocks
    (``0 .. num_blocks // n - 1``). The result is sharded on sequences.
    Keyword arguments (``scale``, ``impl``, ``k_scale``, ``soft_cap``,
    ``sliding_window``, ``return_lse``, ...) pass through; array-valued ones
    (``alibi_slopes``, ``k_scale``, ``v_scale``) are replicated. 4-D
    multi-token queries work too (sharded on their sequence axis).

        attend = jax_paged.sharding.data_parallel(mesh, "dp")
        out = jax.jit(attend)(query, key_cache, value_cache, block_tables, seq_lens)
    """
    def attend(query, key_cache, value_cache, block_tables, seq_lens, **kwargs):
        fn = functools.partial(api.paged_attention, **kwargs)
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(axis),) * 5, out_specs=P(axis))(
            query, key_cache, value_cache, block_tables, seq_lens)
    return attend
