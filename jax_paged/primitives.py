"""JAX primitives around the native kernels.

Each op is a ``jax.extend.core.Primitive`` with
* an abstract-evaluation rule that validates shapes and dtypes at trace time
  (``_shapes``), so mistakes fail before anything runs;
* a lowering per platform: "cpu" -> the native CPU FFI handlers, "cuda" -> the
  CUDA handlers when they were built, anything else -> the jnp reference;
* a batching rule that folds a ``vmap`` axis into the sequence (and block)
  axes, so ``vmap`` is one kernel call, not a loop.

The public ops bind them through :func:`attention`, :func:`write_cache` and
:func:`copy_cache_blocks`: a ``custom_partitioning`` rule (each device runs the
kernel on its own heads and sequences, no collective) inside a ``custom_vmap``
whose rule is the primitive's batching rule (``custom_partitioning`` has none).

V2's workspace (partial outputs, max logits, exp-sums) is returned by the FFI
call as extra results allocated by XLA and dropped here, which keeps the
handlers free of allocation (CUDA-graph compatible).
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.core import ShapedArray
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _native, _shapes, reference

NOT_MAPPED = None  # how batching rules mark an unbatched operand
IMPLS = ("auto", "v1", "v2", "grouped", "reference")
# Head sizes the CUDA kernels are instantiated for (from the native module; block sizes:
# _shapes.SUPPORTED_BLOCK_SIZES).
CUDA_HEAD_SIZES = _shapes.CUDA_HEAD_SIZES


def cuda_has_head_size(impl: str, head_size: int, cache_dtype=None) -> bool:
    """Whether the CUDA kernels run a call of this head size (and cache dtype: fp8 caches
    have their own list, the head sizes that are multiples of 16). Where they have no
    instantiation, ``impl="auto"`` falls back to the jnp reference with a warning
    (the call works, slowly, and says so), ``"reference"`` is the reference anyway, and
    any other ``impl`` names a kernel that cannot run the call: a ``ValueError``."""
    fp8 = cache_dtype is not None and _shapes.is_fp8(cache_dtype)
    sizes = _shapes.CUDA_FP8_HEAD_SIZES if fp8 else CUDA_HEAD_SIZES
    if head_size in sizes:
        return True
    if impl == "reference":
        return False
    which = "with fp8 caches (head sizes that are multiples of 16) " if fp8 else ""
    if impl != "auto":
        raise ValueError(f"the CUDA kernels {which}support head_size in {sizes}, got "
                         f"{head_size} with impl={impl!r} (use impl='auto' or 'reference', or "
                         f"pad the heads)")
    warnings.warn(f"jax_paged: no CUDA kernel {which}for head_size {head_size} (built for "
                  f"{sizes}); impl='auto' runs the jnp reference on the GPU",
                  stacklevel=2)
    return False


def ffi_attrs(**attrs) -> dict:
    """FFI attributes with exact numpy types: a Python float would arrive as F64
    and fail a handler bound with ``Attr<float>`` (see JAX_FFI_NOTES)."""
    converted = {}
    for name, value in attrs.items():
        if isinstance(value, (bool, np.bool_)):
            converted[name] = np.bool_(value)
        elif isinstance(value, (float, np.floating)):
            converted[name] = np.float32(value)
        elif isinstance(value, (int, np.integer)):
            converted[name] = np.int64(value)
        else:
            raise TypeError(f"unsupported FFI attribute {name}={value!r}")
    return converted


# --------------------------------------------------------------------------
# impl="auto"
# --------------------------------------------------------------------------

def _cpu_threads() -> int:
    """Worker threads of the CPU kernels, as the native module counts them
    (JAX_PAGED_CPU_THREADS, else the cores this process may use)."""
    return _native.cpu_module.cpu_threads()


def _num_sms() -> int:
    """Multiprocessors of the first GPU (132 on an H200 if it cannot be read)."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, AttributeError, IndexError, TypeError, ValueError):
        return 132


def grouped_partition_size(platform: str, dims: _shapes.AttentionDims,
                           sliding_window: int = 0, ctas_per_sm: int = 2,
                           rows_per_cta: int = 16) -> int:
    """Partition length for impl="grouped" (split-KV): enough partitions that
    every SM (or core) gets work, each at least 256 tokens, a multiple of
    block_size. Chosen from static shapes, so no recompilation per length.
    With a sliding window a call that splits splits the window's blocks (the
    CUDA grid holds only the partitions a window touches, GroupedGridPartitions;
    on CPU the others exit at once); one that needs no split on CUDA gets one
    partition of the table's capacity. ``ctas_per_sm``, ``rows_per_cta``:
    resident CTAs per SM and query rows per CTA of the CUDA kernel the call runs
    (grouped_ctas_per_sm, grouped_rows_per_cta)."""
    # Rounding the split count down beats rounding up (a partial extra wave of
    # CTAs costs more than it gains), and one split is best once the CTAs fill
    # every SM's slots (docs/development.md).
    workers = ctas_per_sm * _num_sms() if platform == "cuda" else _cpu_threads()
    # CTAs per partition: one per (sequence, KV head, chunk of rows_per_cta query rows).
    chunks = -(-_rows_per_kv_head(dims) // rows_per_cta) if platform == "cuda" else 1
    items = max(1, dims.num_seqs * dims.num_kv_heads * chunks)
    context = _context_tokens(dims, sliding_window)
    splits = max(1, min(workers // items, -(-context // 256)))
    if platform == "cuda" and splits == 1:
        # One partition of the whole table, also with a window: each CTA reads
        # its own window's blocks (from the window's first one), with no reduce,
        # where partitions of the window's length would put most windows across
        # two of them, with empty ones around (a CTA each; docs/development.md).
        return dims.capacity
    size = -(-context // splits)
    return max(dims.block_size, -(-size // dims.block_size) * dims.block_size)


def _context_tokens(dims: _shapes.AttentionDims, sliding_window: int) -> int:
    """Tokens one query row can attend at most (the table's capacity, or the
    blocks a sliding window can touch)."""
    if not sliding_window:
        return dims.capacity
    window_blocks = -(-sliding_window // dims.block_size) + 1
    return min(dims.capacity, window_blocks * dims.block_size)


def resolve_impl(impl: str, platform: str, dims: _shapes.AttentionDims,
                 partition_size: int, sliding_window: int = 0, grouped_ok: bool = True) -> str:
    """Turns "auto" into "grouped", "v1" or "v2" for a platform; shapes are
    static, so the choice is made once at trace time (no data-dependent
    branch on device). ``grouped_ok``: the CUDA grouped kernel supports the
    call (see grouped_supports); otherwise CUDA picks between V1 and V2."""
    if impl != "auto":
        return impl
    if platform == "cuda" and grouped_ok:
        # The split-KV grouped kernel reads each page once per KV head and
        # sizes its split to the GPU; it beat V1 and V2 on every measured
        # configuration (docs/performance.md).
        return "grouped"
    context = _context_tokens(dims, sliding_window)
    if max(1, -(-context // partition_size)) == 1:
        return "v1"
    if platform == "cuda":
        # Crossover measured on the H200 (docs/development.md):
        # V1 only for short contexts over a large grid; vLLM 0.6.0's wider
        # rule (V1 up to 8192 tokens) was 7% slower at 64 x 32 heads x 4k.
        if context <= 2048 and dims.num_seqs * dims.q_len * dims.num_heads >= 1024:
            return "v1"
        return "v2"
    # CPU: one V1 work item per (sequence, KV head); split the context only
    # when that leaves cores idle.
    return "v2" if dims.num_seqs * dims.num_kv_heads < _cpu_threads() else "v1"


def _rows_per_kv_head(dims: _shapes.AttentionDims) -> int:
    """Query rows of one KV head in a call: q_len * group (the grouped kernel's rows)."""
    return dims.q_len * (dims.num_heads // dims.num_kv_heads)


def _grouped_layout_args(dims: _shapes.AttentionDims, query_dtype) -> tuple:
    query_itemsize = np.dtype(query_dtype).itemsize
    cache_itemsize = (query_itemsize if dims.cache_dtype is None
                      else np.dtype(dims.cache_dtype).itemsize)
    return (query_itemsize, cache_itemsize, dims.head_size, _rows_per_kv_head(dims), dims.q_len,
            dims.num_seqs * dims.num_kv_heads)


def grouped_ctas_per_sm(dims: _shapes.AttentionDims, query_dtype) -> int:
    """CTAs of the CUDA grouped kernel resident per SM for this call's dtypes,
    head size, query rows and (sequence, KV head) pairs, from the CUDA module
    (the kernel's own configuration: up to 4 when a pipeline stage is at most
    16 KiB, else up to 2, fewer where the shared memory does not fit them; fp8
    decode calls with few (sequence, KV head) pairs run 2, see the module's
    kFp8TwoCtasMaxWorkItems); 2 without the module."""
    module = _native.cuda_module
    if module is None:
        return 2
    return module.grouped_ctas_per_sm(*_grouped_layout_args(dims, query_dtype)) or 2


def grouped_rows_per_cta(dims: _shapes.AttentionDims, query_dtype) -> int:
    """Query rows per CTA of the CUDA grouped kernel this call runs: 16 (one
    tensor-core row tile), or 32 or 64 for multi-token queries with more than
    16 rows per KV head (the row split, 16-bit queries: 32 or 64 rows at head sizes
    <= 128, 64 at larger heads, there for fp8 caches only above 32 rows per KV head;
    the development option row_split=0 switches it off); 16 without the module."""
    module = _native.cuda_module
    if module is None:
        return 16
    return module.grouped_rows_per_cta(*_grouped_layout_args(dims, query_dtype)) or 16


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first GPU, or None where it cannot be read."""
    try:
        major, minor = str(jax.devices("gpu")[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (RuntimeError, AttributeError, IndexError, TypeError, ValueError):
        return None


def grouped_form() -> str | None:
    """Which grouped kernel impl="grouped" runs on this process's GPU (the CUDA
    handler's rule, csrc/ffi/cuda_grouped.cu): "hopper" on compute capability 9.x,
    "portable" on 8.x and newer GPUs (or anywhere under the development option
    ``portable``), None below 8.0, where only V1 and V2 run."""
    cc = gpu_compute_capability()
    module = _native.cuda_module
    forced = module is not None and bool(module.kernel_options().get("portable", False))
    if cc is None:
        return "portable" if forced else "hopper"
    if cc[0] < 8:
        return None
    return "hopper" if cc[0] == 9 and not forced else "portable"


def grouped_supports(dims: _shapes.AttentionDims, query_dtype) -> bool:
    """Whether the CUDA grouped kernel takes the call on this GPU: every feature,
    except fp8 caches under a float32 query (the fp8 path runs 16-bit tensor-core
    products) and, on the portable kernel, float32 queries; impl="grouped" then
    runs classic V2. Below compute capability 8.0 it takes none."""
    form = grouped_form()
    if form is None:
        return False
    f32 = jnp.dtype(query_dtype) == jnp.float32
    fp8 = dims.cache_dtype is not None and _shapes.is_fp8(dims.cache_dtype)
    return not (f32 and (fp8 or form == "portable"))


# --------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------

# Operands: query, key_cache, value_cache, block_tables, seq_lens, alibi
# ([num_heads] or [0] = none), k_scale, v_scale ([1], [num_kv_heads] or [0] =
# none). Params: scale, impl, partition_size, soft_cap (0.0 = off),
# sliding_window (0 = off), return_lse. Results: [out] or [out, lse].
paged_attention_p = Primitive("jax_paged_attention")
paged_attention_p.multiple_results = True


def to_operand(a):
    """An optional array (ALiBi slopes, scales) as a primitive operand: a
    [0]-shaped float32 array for None, else the array flattened."""
    return jnp.zeros((0,), jnp.float32) if a is None else jnp.reshape(a, (-1,))


def from_operand(a):
    """The inverse of to_operand: None for a [0]-shaped operand."""
    return a if a.shape[0] else None


def _attention_dims(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                    v_scale):
    return _shapes.check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         from_operand(alibi), from_operand(k_scale), from_operand(v_scale))


def _lse_shape(query):
    return query.shape[:-1]


def _attention_abstract(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                        v_scale, *, scale, impl, partition_size, soft_cap, sliding_window,
                        return_lse):
    dims = _attention_dims(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                           v_scale)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _shapes.check_partition_size(partition_size, dims.block_size)
    _shapes.check_soft_cap(soft_cap or None)
    _shapes.check_sliding_window(sliding_window or None)
    out = [ShapedArray(query.shape, query.dtype)]
    if return_lse:
        out.append(ShapedArray(_lse_shape(query), jnp.float32))
    return out


def _attention_reference(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                         v_scale, *, scale, impl, partition_size, soft_cap, sliding_window,
                         return_lse):
    result = reference.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
        alibi_slopes=from_operand(alibi), impl=impl, partition_size=partition_size,
        k_scale=from_operand(k_scale), v_scale=from_operand(v_scale), soft_cap=soft_cap or None,
        sliding_window=sliding_window or None, return_lse=return_lse)
    return list(result) if return_lse else [result]


def _attention_native(platform, query, key_cache, value_cache, block_tables, seq_lens, alibi,
                      k_scale, v_scale, *, scale, impl, partition_size, soft_cap, sliding_window,
                      return_lse):
    dims = _attention_dims(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                           v_scale)
    if platform == "cuda" and not cuda_has_head_size(impl, dims.head_size, dims.cache_dtype):
        return _attention_reference(query, key_cache, value_cache, block_tables, seq_lens, alibi,
                                    k_scale, v_scale, scale=scale, impl="v1",
                                    partition_size=partition_size, soft_cap=soft_cap,
                                    sliding_window=sliding_window, return_lse=return_lse)
    grouped_ok = grouped_supports(dims, query.dtype)
    if platform == "cuda" and impl == "grouped" and grouped_form() is None:
        cc = gpu_compute_capability()
        raise ValueError(
            f"paged_attention: impl='grouped' needs a GPU of compute capability 8.0 or newer, "
            f"this one has {cc[0]}.{cc[1]}; use impl='auto' or 'v2'")
    impl = resolve_impl(impl, platform, dims, partition_size, sliding_window, grouped_ok)
    params = dict(scale=scale, impl=impl, partition_size=partition_size, soft_cap=soft_cap,
                  sliding_window=sliding_window, return_lse=return_lse)
    if impl == "reference":
        return _attention_reference(query, key_cache, value_cache, block_tables, seq_lens, alibi,
                                    k_scale, v_scale, **dict(params, impl="v1"))
    out_type = jax.ShapeDtypeStruct(query.shape, query.dtype)
    target_v2 = "jax_paged_attention_v2"
    if impl == "grouped":
        impl = "v2"
        if platform != "cuda" or grouped_ok:
            # Split-KV with all query rows of a KV head in one CTA: V2's
            # contract with a partition size sized to the machine. The CPU V2
            # kernel is already grouped, so only CUDA has a separate kernel.
            partition_size = grouped_partition_size(platform, dims, sliding_window,
                                                    grouped_ctas_per_sm(dims, query.dtype),
                                                    grouped_rows_per_cta(dims, query.dtype))
            if platform == "cuda":
                target_v2 = "jax_paged_attention_grouped"
        # else: fp8 under a float32 query: classic V2 with the caller's
        # partition size, never a kernel that cannot run the call.
    # Partitions past the table's capacity are empty: any size >= capacity is one
    # partition, so the kernels never see a size near the int32 limit.
    partition_size = min(partition_size, max(dims.block_size, dims.capacity))
    # V1, V2 and grouped share the extended FFI contract.
    operands = (query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale)
    lse_type = jax.ShapeDtypeStruct(_lse_shape(query) if return_lse else (0,), jnp.float32)
    attrs = dict(scale=scale, soft_cap=float(soft_cap), sliding_window=int(sliding_window))
    if impl == "v1":
        results = jax.ffi.ffi_call("jax_paged_attention_v1", (out_type, lse_type))(
            *operands, **ffi_attrs(**attrs))
    else:
        parts = dims.num_partitions(partition_size)
        rows = (dims.num_seqs, dims.q_len, dims.num_heads, parts)
        workspace = (jax.ShapeDtypeStruct(rows, jnp.float32),                     # exp_sums
                     jax.ShapeDtypeStruct(rows, jnp.float32),                     # max_logits
                     jax.ShapeDtypeStruct(rows + (dims.head_size,), jnp.float32))  # tmp_out
        results = jax.ffi.ffi_call(target_v2, (out_type, lse_type) + workspace)(
            *operands, **ffi_attrs(partition_size=partition_size, **attrs))
    if not return_lse:
        return [results[0]]
    return [results[0], nan_lse_where_out_is_nan(results[0], results[1])]


def nan_lse_where_out_is_nan(out, lse):
    """The kernels report lse = -inf ("nothing attended") for a row whose exp-sum is NaN
    (a NaN query or key): such a row's output has a NaN, and its lse must be NaN too, or
    merge_attention_states would drop the row as empty. A row with a NaN only in its
    values keeps its finite lse (the reference's semantics)."""
    bad = jnp.isneginf(lse) & jnp.any(jnp.isnan(out), axis=-1)
    return jnp.where(bad, jnp.nan, lse)


def _move_batch(x, bdim, size):
    """Puts the batch axis first, broadcasting unbatched operands to ``size``."""
    if bdim is NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, bdim, 0)


def _offset_ids(ids, num_ids_per_batch):
    """Makes per-batch-element ids (batch axis first) global after folding the
    batch into the id space. Invalid ids stay invalid (-1): folding must not
    turn an out-of-range id into another batch element's valid one."""
    n = ids.shape[0]
    if n * num_ids_per_batch >= 2 ** 31:
        raise ValueError(f"vmap over {n} caches of {num_ids_per_batch} ids each overflows int32 "
                         "indices; vmap fewer caches at once")
    valid = (ids >= 0) & (ids < num_ids_per_batch)
    offset = (jnp.arange(n, dtype=jnp.int32) * num_ids_per_batch).reshape(
        (n,) + (1,) * (ids.ndim - 1))
    return jnp.where(valid, ids + offset, -1)


def _batch_size(args, dims):
    return next(a.shape[d] for a, d in zip(args, dims) if d is not NOT_MAPPED)


def _attention_batch(args, dims, **params):
    query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale = args
    n = _batch_size(args, dims)
    q_d, kc_d, vc_d, bt_d, sl_d, al_d, ks_d, vs_d = dims
    n_out = 2 if params["return_lse"] else 1
    if any(d is not NOT_MAPPED for d in (al_d, ks_d, vs_d)):
        # Per-element ALiBi slopes or scales cannot be folded into the
        # sequence axis: one call per element.
        moved = [_move_batch(a, d, n) for a, d in zip(args, dims)]
        outs = jax.lax.map(lambda xs: paged_attention_p.bind(*xs, **params), moved)
        return list(outs), [0] * n_out
    query = _move_batch(query, q_d, n)
    block_tables = _move_batch(block_tables, bt_d, n)
    seq_lens = _move_batch(seq_lens, sl_d, n)
    if kc_d is not NOT_MAPPED or vc_d is not NOT_MAPPED:
        # Stacked independent caches: fold them into one pool of n * num_blocks.
        key_cache = _move_batch(key_cache, kc_d, n)
        value_cache = _move_batch(value_cache, vc_d, n)
        num_blocks = key_cache.shape[1]
        block_tables = _offset_ids(block_tables, num_blocks)
        key_cache = key_cache.reshape((n * num_blocks,) + key_cache.shape[2:])
        value_cache = value_cache.reshape((n * num_blocks,) + value_cache.shape[2:])
    s = query.shape[1]
    outs = paged_attention_p.bind(
        query.reshape((n * s,) + query.shape[2:]), key_cache, value_cache,
        block_tables.reshape((n * s,) + block_tables.shape[2:]), seq_lens.reshape(n * s), alibi,
        k_scale, v_scale, **params)
    return [o.reshape((n, s) + o.shape[1:]) for o in outs], [0] * n_out


# --------------------------------------------------------------------------
# reshape_and_cache and copy_blocks (in place through aliasing)
# --------------------------------------------------------------------------

reshape_and_cache_p = Primitive("jax_paged_reshape_and_cache")
reshape_and_cache_p.multiple_results = True
copy_blocks_p = Primitive("jax_paged_copy_blocks")
copy_blocks_p.multiple_results = True


def _cache_avals(key_cache, value_cache):
    return [ShapedArray(key_cache.shape, key_cache.dtype),
            ShapedArray(value_cache.shape, value_cache.dtype)]


# Operands: key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
# ([1], [num_kv_heads] or [0] = none; fp8 caches only).
def _write_abstract(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    _shapes.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                    from_operand(k_scale), from_operand(v_scale))
    return _cache_avals(key_cache, value_cache)


def _write_native(platform, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    out_types = (jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
                 jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype))
    return jax.ffi.ffi_call("jax_paged_reshape_and_cache", out_types,
                            input_output_aliases={2: 0, 3: 1})(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _write_reference(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    return list(reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                            k_scale=from_operand(k_scale),
                                            v_scale=from_operand(v_scale)))


def _fold_caches(key_cache, value_cache):
    n, num_blocks = key_cache.shape[:2]
    return (key_cache.reshape((n * num_blocks,) + key_cache.shape[2:]),
            value_cache.reshape((n * num_blocks,) + value_cache.shape[2:]), n, num_blocks)


def _write_batch(args, dims):
    n = _batch_size(args, dims)
    if dims[5] is not NOT_MAPPED or dims[6] is not NOT_MAPPED:
        # Per-element scales: one call per element.
        moved = [_move_batch(a, d, n) for a, d in zip(args, dims)]
        outs = jax.lax.map(lambda xs: reshape_and_cache_p.bind(*xs), moved)
        return list(outs), [0, 0]
    k_scale, v_scale = args[5:]
    key, value, key_cache, value_cache, slot_mapping = (
        _move_batch(a, d, n) for a, d in zip(args[:5], dims[:5]))
    key_cache, value_cache, n, num_blocks = _fold_caches(key_cache, value_cache)
    block_size = key_cache.shape[3]
    slots = _offset_ids(slot_mapping, num_blocks * block_size)
    t = key.shape[1]
    kc, vc = reshape_and_cache_p.bind(key.reshape((n * t,) + key.shape[2:]),
                                      value.reshape((n * t,) + value.shape[2:]),
                                      key_cache, value_cache, slots.reshape(n * t), k_scale,
                                      v_scale)
    return [kc.reshape((n, num_blocks) + kc.shape[1:]),
            vc.reshape((n, num_blocks) + vc.shape[1:])], [0, 0]


def _copy_abstract(key_cache, value_cache, block_mapping):
    _shapes.check_copy_blocks(key_cache, value_cache, block_mapping)
    return _cache_avals(key_cache, value_cache)


def _copy_native(platform, key_cache, value_cache, block_mapping):
    out_types = (jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
                 jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype))
    return jax.ffi.ffi_call("jax_paged_copy_blocks", out_types,
                            input_output_aliases={0: 0, 1: 1})(
        key_cache, value_cache, block_mapping)


def _copy_reference(key_cache, value_cache, block_mapping):
    return list(reference.copy_blocks(key_cache, value_cache, block_mapping))


def _copy_batch(args, dims):
    n = _batch_size(args, dims)
    key_cache, value_cache, block_mapping = (_move_batch(a, d, n) for a, d in zip(args, dims))
    key_cache, value_cache, n, num_blocks = _fold_caches(key_cache, value_cache)
    mapping = _offset_ids(block_mapping, num_blocks)
    # A pair is valid only if both ids are; _offset_ids marks each id alone.
    mapping = jnp.where(jnp.all(mapping >= 0, axis=-1, keepdims=True), mapping, -1)
    kc, vc = copy_blocks_p.bind(key_cache, value_cache, mapping.reshape(-1, 2))
    return [kc.reshape((n, num_blocks) + kc.shape[1:]),
            vc.reshape((n, num_blocks) + vc.shape[1:])], [0, 0]


# --------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------

def _eager_impl(prim):
    # Eager binds run through jit, which lowers with the rules below.
    def impl(*args, **params):
        return jax.jit(functools.partial(prim.bind, **params))(*args)
    return impl


def _register(prim, abstract, native, ref, batch, multiple_results):
    prim.def_impl(_eager_impl(prim))
    prim.def_abstract_eval(abstract)
    batching.primitive_batchers[prim] = batch
    # Default lowering (any platform without native kernels): the reference.
    mlir.register_lowering(prim, mlir.lower_fun(ref, multiple_results=multiple_results))
    platforms = ("cpu", "cuda") if _native.has_cuda_kernels() else ("cpu",)
    for platform in platforms:
        # `native(platform, ...)`: the same FFI target names are registered
        # for each platform; the platform only steers choices like impl="auto".
        mlir.register_lowering(prim, mlir.lower_fun(functools.partial(native, platform),
                                                    multiple_results=multiple_results),
                               platform=platform)


_register(paged_attention_p, _attention_abstract, _attention_native, _attention_reference,
          _attention_batch, multiple_results=True)
_register(reshape_and_cache_p, _write_abstract, _write_native, _write_reference, _write_batch,
          multiple_results=True)
_register(copy_blocks_p, _copy_abstract, _copy_native, _copy_reference, _copy_batch,
          multiple_results=True)


# --------------------------------------------------------------------------
# Sharding under plain jit, and vmap around it
# --------------------------------------------------------------------------
# Each op is a custom_partitioning call with a Shardy sharding rule: heads (the
# caches' KV heads, the query's heads as (KV head, group)) and sequences pass
# through; every other dimension must be replicated. Its partition callback runs
# the primitive on each device's heads and sequences with no collective. Outside
# a multi-device jit (one device, shard_map) JAX inlines the primitive.

def _spec_entry(sharding, dim: int):
    """The mesh axis (name, tuple of names or None) sharding dimension ``dim``."""
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) <= dim:
        return None
    entry = spec[dim]
    if isinstance(entry, tuple):
        return entry if len(entry) > 1 else (entry[0] if entry else None)
    return entry


def _axis_size(mesh, axis) -> int:
    names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    return int(np.prod([mesh.shape[name] for name in names], dtype=np.int64))


def _axis_names(axis) -> set:
    return set() if axis is None else set(axis if isinstance(axis, tuple) else (axis,))


def head_split(op: str, mesh, axis, num_kv_heads: int, num_heads: int | None = None):
    """The mesh axis the KV heads of the caches are split over (None: caches replicated),
    after checking that the heads divide evenly. A single KV head (MQA) stays replicated
    while the query heads split."""
    n = _axis_size(mesh, axis)
    if n == 1:
        return None
    if num_heads is not None and num_heads % n:
        raise ValueError(f"jax_paged.{op}: num_heads ({num_heads}) does not divide evenly over "
                         f"mesh axis {axis!r} of size {n}")
    if num_kv_heads % n == 0:
        return axis
    if num_heads is not None and num_kv_heads == 1:
        return None
    raise ValueError(f"jax_paged.{op}: num_kv_heads ({num_kv_heads}) does not divide evenly over "
                     f"mesh axis {axis!r} of size {n}")


def _seq_split(mesh, axis, num_seqs: int, heads_axis):
    """The mesh axis the sequences are split over, or None (replicated) where it does not
    divide them evenly or overlaps the heads' axis."""
    n = _axis_size(mesh, axis)
    if n == 1 or num_seqs % n or _axis_names(axis) & _axis_names(heads_axis):
        return None
    return axis


def _named(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


def _optional_factor(size: int, num: int, factor: str, name: str) -> str:
    """Rule factor of an optional per-head operand: the heads' factor when it has
    one element per head, else a factor of its own (replicated)."""
    return factor if size == num else name


def _heads_factor(num_heads: int, num_kv_heads: int) -> tuple[str, dict]:
    """The query heads' factor: KV head major, group minor; a factor of their own with a
    single KV head (MQA: the query heads split, the caches stay whole)."""
    group = num_heads // max(num_kv_heads, 1)
    if num_kv_heads == 1:
        return "h", {}
    return ("(k g)", {"g": group}) if group > 1 else ("k", {})


_ATTENTION_REPLICATED = ("q", "d", "n", "c", "b", "x", "m", "za", "zk", "zv")


def _attention_rule(scale, impl, partition_size, soft_cap, sliding_window, return_lse, mesh,
                    operand_types, result_types):
    query, key_cache = operand_types[0].shape, operand_types[1].shape
    num_heads, num_kv_heads = query[-2], key_cache[1]
    heads, sizes = _heads_factor(num_heads, num_kv_heads)
    rows = "s q" if len(query) == 4 else "s"
    alibi, k_scale, v_scale = (t.shape[0] for t in operand_types[5:8])
    operands = [f"{rows} {heads} d", "n k c b x", "n k d b", "s m", "s",
                _optional_factor(alibi, num_heads, heads, "za"),
                _optional_factor(k_scale, num_kv_heads, "k", "zk"),
                _optional_factor(v_scale, num_kv_heads, "k", "zv")]
    results = [f"{rows} {heads} d"] + ([f"{rows} {heads}"] if return_lse else [])
    used = " ".join(operands + results)
    replicated = tuple(f for f in _ATTENTION_REPLICATED if f in used.replace("(", " ").split())
    return (", ".join(operands) + " -> " + ", ".join(results),
            dict(sizes, need_replication_factors=replicated))


def _attention_shardings(mesh, arg_shapes, return_lse):
    query, key_cache = arg_shapes[0], arg_shapes[1]
    heads_dim = len(query.shape) - 2
    num_heads, num_kv_heads = query.shape[heads_dim], key_cache.shape[1]
    axis = _spec_entry(key_cache.sharding, 1) or _spec_entry(query.sharding, heads_dim)
    cache_axis = head_split("paged_attention", mesh, axis, num_kv_heads, num_heads)
    heads_axis = axis if _axis_size(mesh, axis) > 1 else None
    seq_axis = _seq_split(mesh, _spec_entry(query.sharding, 0), query.shape[0], heads_axis)
    rows = (seq_axis, None) if heads_dim == 2 else (seq_axis,)

    def per_head(a, count, ax):
        return _named(mesh, ax) if a.shape[0] == count else _named(mesh)
    args = (_named(mesh, *rows, heads_axis, None), _named(mesh, None, cache_axis),
            _named(mesh, None, cache_axis), _named(mesh, seq_axis), _named(mesh, seq_axis),
            per_head(arg_shapes[5], num_heads, heads_axis),
            per_head(arg_shapes[6], num_kv_heads, cache_axis),
            per_head(arg_shapes[7], num_kv_heads, cache_axis))
    results = (args[0],) + ((_named(mesh, *rows, heads_axis),) if return_lse else ())
    return args, results


def _bind_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                    v_scale, scale, impl, partition_size, soft_cap, sliding_window, return_lse):
    return tuple(paged_attention_p.bind(
        query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale,
        scale=scale, impl=impl, partition_size=partition_size, soft_cap=soft_cap,
        sliding_window=sliding_window, return_lse=return_lse))


def _attention_partition(scale, impl, partition_size, soft_cap, sliding_window, return_lse, mesh,
                         arg_shapes, result_shape):
    args, results = _attention_shardings(mesh, arg_shapes, return_lse)

    def lower(*operands):
        return _bind_attention(*operands, scale, impl, partition_size, soft_cap, sliding_window,
                               return_lse)
    return mesh, lower, results, args


def _attention_infer(scale, impl, partition_size, soft_cap, sliding_window, return_lse, mesh,
                     arg_shapes, result_shape):
    return _attention_shardings(mesh, arg_shapes, return_lse)[1]


_partitioned_attention = custom_partitioning(_bind_attention, static_argnums=tuple(range(8, 14)))
_partitioned_attention.def_partition(partition=_attention_partition,
                                     infer_sharding_from_operands=_attention_infer,
                                     sharding_rule=_attention_rule)


def _vmapped(partitioned, plain):
    """``partitioned`` (a custom_partitioning call, which has no batching rule) under a
    custom_vmap whose rule vmaps ``plain``, the bare primitive bind (one folded call)."""
    @custom_vmap
    def call(*operands):
        return partitioned(*operands)

    @call.def_vmap
    def rule(axis_size, in_batched, *operands):
        outs = jax.vmap(plain, in_axes=tuple(0 if b else None for b in in_batched),
                        axis_size=axis_size)(*operands)
        return outs, tuple(True for _ in outs)
    return call


def attention(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale, *,
              scale, impl, partition_size, soft_cap, sliding_window, return_lse):
    """paged_attention_p on checked operands (alibi and scales as to_operand gives them),
    partitioned over heads and sequences under jit, batched by the primitive under vmap.
    Returns the tuple (out,) or (out, lse)."""
    static = (scale, impl, partition_size, soft_cap, sliding_window, return_lse)
    call = _vmapped(lambda *ops: _partitioned_attention(*ops, *static),
                    lambda *ops: _bind_attention(*ops, *static))
    return tuple(call(query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale,
                      v_scale))


# ---- reshape_and_cache and copy_blocks: KV heads split, everything else replicated ----

def _cache_shardings(op, mesh, cache, *others):
    """The KV-head sharding of the caches and of ``others`` (arrays [*, num_kv_heads, ...])."""
    axis = _spec_entry(cache.sharding, 1)
    for other in others:
        axis = axis or _spec_entry(other.sharding, 1)
    axis = head_split(op, mesh, axis, cache.shape[1])
    return axis, _named(mesh, None, axis)


def _bind_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    return tuple(reshape_and_cache_p.bind(key, value, key_cache, value_cache, slot_mapping,
                                          k_scale, v_scale))


def _write_partition(mesh, arg_shapes, result_shape):
    axis, heads = _cache_shardings("reshape_and_cache", mesh, arg_shapes[2], arg_shapes[0])
    num_kv_heads = arg_shapes[2].shape[1]

    def scale(a):
        return _named(mesh, axis) if a.shape[0] == num_kv_heads else _named(mesh)
    args = (heads, heads, heads, heads, _named(mesh), scale(arg_shapes[5]), scale(arg_shapes[6]))
    return mesh, _bind_write, (heads, heads), args


def _write_infer(mesh, arg_shapes, result_shape):
    _, heads = _cache_shardings("reshape_and_cache", mesh, arg_shapes[2], arg_shapes[0])
    return (heads, heads)


def _write_rule(mesh, operand_types, result_types):
    num_kv_heads = operand_types[2].shape[1]
    k_scale, v_scale = (t.shape[0] for t in operand_types[5:7])
    operands = ["t k d", "t k d", "n k c b x", "n k d b", "t",
                _optional_factor(k_scale, num_kv_heads, "k", "zk"),
                _optional_factor(v_scale, num_kv_heads, "k", "zv")]
    used = set(" ".join(operands).split())
    replicated = tuple(f for f in ("t", "d", "n", "c", "b", "x", "zk", "zv") if f in used)
    return (", ".join(operands) + " -> n k c b x, n k d b",
            dict(need_replication_factors=replicated))


_partitioned_write = custom_partitioning(_bind_write)
_partitioned_write.def_partition(partition=_write_partition,
                                 infer_sharding_from_operands=_write_infer,
                                 sharding_rule=_write_rule)
_write_call = _vmapped(_partitioned_write, _bind_write)


def write_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    """reshape_and_cache_p on checked operands, partitioned over KV heads under jit."""
    return tuple(_write_call(key, value, key_cache, value_cache, slot_mapping, k_scale,
                             v_scale))


def _bind_copy(key_cache, value_cache, block_mapping):
    return tuple(copy_blocks_p.bind(key_cache, value_cache, block_mapping))


def _copy_partition(mesh, arg_shapes, result_shape):
    _, heads = _cache_shardings("copy_blocks", mesh, arg_shapes[0], arg_shapes[1])
    return mesh, _bind_copy, (heads, heads), (heads, heads, _named(mesh))


def _copy_infer(mesh, arg_shapes, result_shape):
    return (_cache_shardings("copy_blocks", mesh, arg_shapes[0], arg_shapes[1])[1],) * 2


_partitioned_copy = custom_partitioning(_bind_copy)
_partitioned_copy.def_partition(
    partition=_copy_partition, infer_sharding_from_operands=_copy_infer,
    sharding_rule="n k c b x, n k d b, p two -> n k c b x, n k d b",
    need_replication_factors=("n", "c", "b", "x", "d", "p", "two"))
_copy_call = _vmapped(_partitioned_copy, _bind_copy)


def copy_cache_blocks(key_cache, value_cache, block_mapping):
    """copy_blocks_p on checked operands, partitioned over KV heads under jit."""
    return tuple(_copy_call(key_cache, value_cache, block_mapping))
