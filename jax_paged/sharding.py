"""Multi-device use of the paged ops.

Tensor parallel over heads
    ``paged_attention``, ``reshape_and_cache`` and ``copy_blocks`` here have the
    signatures of the top-level ops but carry a partitioning rule
    (``jax.experimental.custom_partitioning`` with a Shardy sharding rule): under
    plain ``jax.jit`` with the query sharded on its heads axis and both caches on
    their KV-heads axis (tables and lengths replicated), each device runs the
    kernel on its local heads, with no collective and no gather of the cache; the
    output stays sharded on heads. Heads that do not divide evenly over the mesh
    axis raise ``ValueError``. (The top-level ops are plain primitives: they
    support ``vmap``, which ``custom_partitioning`` does not, and under a sharded
    ``jit`` XLA would replicate their operands.)

Data parallel over sequences
    :func:`data_parallel` gives each device its own block pool and its own
    sequences: caches sharded on the blocks axis, query / tables / lengths on
    the sequence axis, block ids local to each device's pool (``shard_map``).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from . import api

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "data_parallel"]


def _spec_axis(sharding, dim: int):
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) <= dim:
        return None
    return spec[dim]


def _axis_size(mesh, axis) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def _heads_axis(mesh, cache_sharding, *head_counts):
    """The mesh axis sharding the KV-heads dim of the cache, checked to divide
    every head count evenly."""
    axis = _spec_axis(cache_sharding, 1)
    n = _axis_size(mesh, axis)
    for what, count in head_counts:
        if count % n:
            raise ValueError(f"jax_paged.sharding: {what} ({count}) does not divide evenly over "
                             f"mesh axis {axis!r} of size {n}")
    return axis


def _named(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


def _scale_per_kv_head(scale, num_kv_heads: int):
    """One operand layout for the partitioners: a k_scale / v_scale of shape
    (), (1,) or [num_kv_heads] (None = 1) as float32 [num_kv_heads], sharded
    with the KV heads."""
    scale = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale)
    if scale.ndim > 1 or scale.size not in (1, num_kv_heads):
        raise ValueError(f"k_scale / v_scale must have shape (), (1,) or [num_kv_heads] = "
                         f"({num_kv_heads},), got {tuple(scale.shape)}")
    return jnp.broadcast_to(scale.reshape(-1), (num_kv_heads,))


# ---- paged_attention -------------------------------------------------------------

def _local_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                     k_scale, v_scale, scale, impl, partition_size, soft_cap, sliding_window,
                     has_scales):
    return api.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                               scale=scale, alibi_slopes=alibi_slopes, impl=impl,
                               partition_size=partition_size,
                               k_scale=k_scale if has_scales else None,
                               v_scale=v_scale if has_scales else None, soft_cap=soft_cap,
                               sliding_window=sliding_window)


_attention = custom_partitioning(_local_attention, static_argnums=(8, 9, 10, 11, 12, 13))


def _attention_infer(scale, impl, partition_size, soft_cap, sliding_window, has_scales, mesh,
                     arg_shapes, result_shape):
    axis = _spec_axis(arg_shapes[1].sharding, 1)
    return _named(mesh, None, axis, None)


def _attention_partition(scale, impl, partition_size, soft_cap, sliding_window, has_scales, mesh,
                         arg_shapes, result_shape):
    query, key_cache = arg_shapes[0], arg_shapes[1]
    axis = _heads_axis(mesh, key_cache.sharding, ("num_heads", query.shape[1]),
                       ("num_kv_heads", key_cache.shape[1]))
    arg_shardings = (_named(mesh, None, axis, None), _named(mesh, None, axis),
                     _named(mesh, None, axis), _named(mesh), _named(mesh), _named(mesh, axis),
                     _named(mesh, axis), _named(mesh, axis))

    def lower(*args):
        return _local_attention(*args, scale, impl, partition_size, soft_cap, sliding_window,
                                has_scales)
    return mesh, lower, _named(mesh, None, axis, None), arg_shardings


_attention.def_partition(
    infer_sharding_from_operands=_attention_infer, partition=_attention_partition,
    sharding_rule="s h d, n k c b x, n k d2 b, s m, s, h, k, k -> s h d")


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None,
                    alibi_slopes=None, impl: str = "auto", partition_size: int = 512,
                    k_scale=None, v_scale=None, soft_cap=None, sliding_window=None):
    """:func:`jax_paged.paged_attention` with a tensor-parallel partitioning rule
    (heads sharded, no collectives). Same arguments and result, for decode
    queries ``[num_seqs, num_heads, head_size]`` (no ``return_lse``; for
    multi-token queries or LSE use :func:`data_parallel` or ``shard_map``).
    ``k_scale`` / ``v_scale`` (fp8 caches) are sharded with the KV heads."""
    query = jnp.asarray(query)
    if query.ndim != 3:
        raise ValueError(f"jax_paged.sharding.paged_attention takes decode queries [num_seqs, "
                         f"num_heads, head_size], got shape {tuple(query.shape)}")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if alibi_slopes is None:
        # Zero slopes add exactly 0.0 to every logit: the same result as no ALiBi,
        # with one operand list for the partitioner.
        alibi_slopes = jnp.zeros((query.shape[1],), jnp.float32)
    num_kv_heads = jnp.shape(key_cache)[1]
    has_scales = k_scale is not None or v_scale is not None
    return _attention(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                      _scale_per_kv_head(k_scale, num_kv_heads),
                      _scale_per_kv_head(v_scale, num_kv_heads), float(scale), impl,
                      int(partition_size), soft_cap, sliding_window, has_scales)


# ---- reshape_and_cache and copy_blocks ------------------------------------------

@custom_partitioning
def _write(key, value, key_cache, value_cache, slot_mapping):
    return api.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _write_with_scales(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    return api.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                 k_scale=k_scale, v_scale=v_scale)


_write_scaled = custom_partitioning(_write_with_scales)


def _write_infer(mesh, arg_shapes, result_shape):
    axis = _spec_axis(arg_shapes[2].sharding, 1)
    return (_named(mesh, None, axis), _named(mesh, None, axis))


def _cache_heads(mesh, cache):
    """The KV-head mesh axis of a cache operand and the sharding of an array
    [*, num_kv_heads, ...] on it."""
    axis = _heads_axis(mesh, cache.sharding, ("num_kv_heads", cache.shape[1]))
    return axis, _named(mesh, None, axis)


def _write_partition(mesh, arg_shapes, result_shape):
    _, heads = _cache_heads(mesh, arg_shapes[2])
    return (mesh, api.reshape_and_cache, (heads, heads),
            (heads, heads, heads, heads, _named(mesh)))


_write.def_partition(infer_sharding_from_operands=_write_infer, partition=_write_partition,
                     sharding_rule="t k d, t k d, n k c b x, n k d b, t -> n k c b x, n k d b")


def _write_scaled_partition(mesh, arg_shapes, result_shape):
    axis, heads = _cache_heads(mesh, arg_shapes[2])
    return (mesh, _write_with_scales, (heads, heads),
            (heads, heads, heads, heads, _named(mesh), _named(mesh, axis), _named(mesh, axis)))


_write_scaled.def_partition(
    infer_sharding_from_operands=_write_infer, partition=_write_scaled_partition,
    sharding_rule="t k d, t k d, n k c b x, n k d b, t, k, k -> n k c b x, n k d b")


@custom_partitioning
def _copy(key_cache, value_cache, block_mapping):
    return api.copy_blocks(key_cache, value_cache, block_mapping)


def _copy_infer(mesh, arg_shapes, result_shape):
    axis = _spec_axis(arg_shapes[0].sharding, 1)
    return (_named(mesh, None, axis), _named(mesh, None, axis))


def _copy_partition(mesh, arg_shapes, result_shape):
    _, heads = _cache_heads(mesh, arg_shapes[0])
    return mesh, api.copy_blocks, (heads, heads), (heads, heads, _named(mesh))


_copy.def_partition(infer_sharding_from_operands=_copy_infer, partition=_copy_partition,
                    sharding_rule="n k c b x, n k d b, p two -> n k c b x, n k d b")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None,
                      v_scale=None):
    """:func:`jax_paged.reshape_and_cache` with a tensor-parallel partitioning rule
    (KV heads sharded, slots replicated; in place under donation per shard).
    ``k_scale`` / ``v_scale`` (fp8 caches) are sharded with the KV heads."""
    if k_scale is None and v_scale is None:
        return _write(key, value, key_cache, value_cache, slot_mapping)
    num_kv_heads = jnp.shape(key_cache)[1]
    return _write_scaled(key, value, key_cache, value_cache, slot_mapping,
                         _scale_per_kv_head(k_scale, num_kv_heads),
                         _scale_per_kv_head(v_scale, num_kv_heads))


def copy_blocks(key_cache, value_cache, block_mapping):
    """:func:`jax_paged.copy_blocks` with a tensor-parallel partitioning rule."""
    return _copy(key_cache, value_cache, block_mapping)


# ---- data parallel ---------------------------------------------------------------

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
