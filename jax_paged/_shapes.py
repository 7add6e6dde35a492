"""Trace-time shape and dtype checks shared by the primitives and the reference.

Every error names the argument, what it got and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import jax
import jax.numpy as jnp

from . import _native

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# KV-cache-only dtypes: dequantised on read (value * scale), quantised on write.
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
# The kernels' size lists live in C++ (csrc/sizes.h); the native module exports them.
SUPPORTED_BLOCK_SIZES = tuple(_native.cpu_module.block_sizes)
MAX_HEAD_SIZE = int(_native.cpu_module.max_head_size)
CUDA_HEAD_SIZES = tuple(_native.cpu_module.head_sizes)
CUDA_FP8_HEAD_SIZES = tuple(_native.cpu_module.fp8_head_sizes)
# Static integers reach the kernels as int32 (sizes, windows, partitions).
INT32_LIMIT = 2 ** 31
_F32 = np.finfo(np.float32)


def x_for_dtype(dtype) -> int:
    """Elements per 16-byte chunk of the key-cache layout: ``16 // itemsize``."""
    return 16 // np.dtype(dtype).itemsize


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def _dt(a) -> np.dtype:
    return np.dtype(a.dtype)


def _name(dtype) -> str:
    return np.dtype(dtype).name


@dataclass(frozen=True)
class AttentionDims:
    num_seqs: int
    num_heads: int
    head_size: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    max_blocks_per_seq: int
    q_len: int = 1               # new tokens per sequence (4-D query), 1 for decode
    cache_dtype: np.dtype | None = None

    @property
    def capacity(self) -> int:
        """Tokens a block-table row can address."""
        return self.max_blocks_per_seq * self.block_size

    def num_partitions(self, partition_size: int) -> int:
        return max(1, -(-self.capacity // partition_size))


def _check_float(name: str, a) -> None:
    if _dt(a) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {_name(a.dtype)}")


def _check_int32(name: str, a) -> None:
    if _dt(a) != np.int32:
        raise TypeError(f"{name} must be int32, got {_name(a.dtype)}")


def check_caches(key_cache, value_cache, *, num_kv_heads: int | None = None,
                 head_size: int | None = None, dtype=None) -> tuple[int, int, int, int]:
    """Checks the paged cache pair; returns (num_blocks, num_kv_heads, head_size, block_size).

    ``dtype`` (the query's or the keys') must equal the caches' dtype, unless
    the caches are fp8 (float8_e4m3fn / float8_e5m2), which any float query
    may read."""
    if _dt(key_cache) not in CACHE_DTYPES:
        raise TypeError(f"key_cache must be float32, float16, bfloat16, float8_e4m3fn or "
                        f"float8_e5m2, got {_name(key_cache.dtype)}")
    if _dt(value_cache) != _dt(key_cache):
        raise TypeError(f"value_cache dtype {_name(value_cache.dtype)} differs from key_cache "
                        f"dtype {_name(key_cache.dtype)}")
    if dtype is not None and _dt(key_cache) != np.dtype(dtype) and not is_fp8(key_cache.dtype):
        raise TypeError(f"key_cache dtype {_name(key_cache.dtype)} differs from the "
                        f"query/key dtype {_name(dtype)}")
    x = x_for_dtype(key_cache.dtype)
    if key_cache.ndim != 5 or key_cache.shape[4] != x:
        raise ValueError(
            f"key_cache must be [num_blocks, num_kv_heads, head_size // {x}, block_size, {x}] "
            f"for {_name(key_cache.dtype)}, got shape {tuple(key_cache.shape)}")
    num_blocks, kv_heads, chunks, block_size, _ = key_cache.shape
    cache_head_size = chunks * x
    if value_cache.ndim != 4 or tuple(value_cache.shape) != (num_blocks, kv_heads, cache_head_size,
                                                            block_size):
        raise ValueError(
            f"value_cache must be [num_blocks, num_kv_heads, head_size, block_size] = "
            f"{(num_blocks, kv_heads, cache_head_size, block_size)} to match key_cache "
            f"{tuple(key_cache.shape)}, got {tuple(value_cache.shape)}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size (key_cache.shape[3]) must be one of "
                         f"{SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if num_kv_heads is not None and kv_heads != num_kv_heads:
        raise ValueError(f"key_cache has {kv_heads} KV heads (shape[1]) but the keys have "
                         f"{num_kv_heads}")
    if head_size is not None and cache_head_size != head_size:
        if is_fp8(key_cache.dtype) and head_size % x:
            raise ValueError(f"head_size {head_size}: fp8 caches need head_size to be a "
                             f"multiple of {x} ({_name(key_cache.dtype)} keys are stored in "
                             f"chunks of {x}; key_cache head size shape[2] * shape[4] = "
                             f"{cache_head_size}); pad the heads")
        raise ValueError(f"key_cache head size (shape[2] * shape[4] = {cache_head_size}) "
                         f"differs from head_size {head_size}")
    if kv_heads < 1:
        raise ValueError(f"key_cache must have at least one KV head, got {kv_heads}")
    return num_blocks, kv_heads, cache_head_size, block_size


def check_head_size(head_size: int) -> None:
    if head_size % 8 != 0 or not 8 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size must be a multiple of 8 in [8, {MAX_HEAD_SIZE}], "
                         f"got {head_size}")


def check_concrete_scale(name: str, scale, *, for_write: bool = False):
    """k_scale / v_scale given as host values (Python or NumPy numbers or arrays): every
    element finite and, unless 0, a normal float32 (a denormal one is flushed by some
    kernels and not by others). Reads take any sign and 0 (logits or values times the
    scale); writes (``for_write``) divide by it, so 0 is refused there. Device arrays and
    traced values are not inspected (that would wait for the device). Returns the scale,
    a Python number as a float32."""
    if scale is None or isinstance(scale, (jax.Array, jax.core.Tracer)):
        return scale
    try:
        values = np.asarray(scale, dtype=np.float64)
    except (TypeError, ValueError):
        return scale  # the dtype check reports it
    magnitude = np.abs(values)
    normal = (magnitude >= float(_F32.tiny)) & (magnitude <= float(_F32.max))
    bad = ~(normal | ((magnitude == 0) & (not for_write)))
    if np.any(bad):
        allowed = ("nonzero and finite, each of magnitude in" if for_write
                   else "finite, each 0 or of magnitude in")
        why = "; the write divides by it" if for_write else ""
        raise ValueError(f"{name} must be {allowed} [{_F32.tiny:.4g}, {_F32.max:.4g}] "
                         f"(normal float32{why}), got {values[bad].ravel()[0]!r}")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return np.float32(scale)
    return scale


def check_scale(name: str, scale, num_kv_heads: int, cache_dtype) -> None:
    """k_scale / v_scale: float32 of shape (), (1,) or (num_kv_heads,), for fp8 caches."""
    if scale is None:
        return
    if not is_fp8(cache_dtype):
        raise ValueError(f"{name} applies to float8 caches (float8_e4m3fn, float8_e5m2) only; "
                         f"the caches are {_name(cache_dtype)}")
    if _dt(scale) != np.float32:
        raise TypeError(f"{name} must be float32, got {_name(scale.dtype)}")
    if tuple(scale.shape) not in ((), (1,), (num_kv_heads,)):
        raise ValueError(f"{name} must have shape (), (1,) or [num_kv_heads] = "
                         f"({num_kv_heads},), got {tuple(scale.shape)}")


def _static_number(name: str, value, none_means: str) -> float:
    """``value`` as a float, for an argument compiled into the kernel (an attribute, not an
    operand): a Python or NumPy number or a concrete 0-d array. A traced value, a string or an
    array of more elements raises a TypeError that names the argument."""
    expected = f"{name} must be a static Python number or None ({none_means})"
    if isinstance(value, (bool, np.bool_, str, bytes)) or np.ndim(value) != 0:
        raise TypeError(f"{expected}, got {type(value).__name__}")
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(f"{expected}, got a traced value; it is compiled into the "
                        f"kernel") from None
    except (TypeError, ValueError) as e:
        raise TypeError(f"{expected}, got {type(value).__name__}") from e


def check_softmax_scale(scale, head_size: int) -> float:
    """None (``1 / sqrt(head_size)``) or a static number the kernels can hold as a float32:
    0 or a magnitude in [float32 tiny, float32 max] (a larger one would be inf, a smaller
    one a denormal that CPU and GPU flush differently); returns it as a float. (A traced
    scale can be folded into the query instead.)"""
    if scale is None:
        return float(head_size) ** -0.5
    value = _static_number("scale", scale, "1 / sqrt(head_size)")
    if not (value == 0 or float(_F32.tiny) <= abs(value) <= float(_F32.max)):
        raise ValueError(f"scale must be 0 or finite with magnitude in [{_F32.tiny:.4g}, "
                         f"{_F32.max:.4g}] (a normal float32), got {scale!r}")
    return value


# The kernels multiply by 1 / soft_cap: both it and the cap must be normal float32s.
SOFT_CAP_RANGE = (float(_F32.tiny), float(1 / _F32.tiny))


def check_soft_cap(soft_cap) -> float:
    """None or 0 (off), or a static number in SOFT_CAP_RANGE (``[2^-126, 2^126]``, where the
    cap and its reciprocal are normal float32s, so kernel and reference agree); returns it
    as a float (0.0 = off)."""
    if soft_cap is None:
        return 0.0
    value = _static_number("soft_cap", soft_cap, "off")
    if value == 0:
        return 0.0
    lo, hi = SOFT_CAP_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"soft_cap must be positive and finite, in [2^-126, 2^126] = "
                         f"[{lo:.4g}, {hi:.4g}] (None or 0 = off), got {soft_cap!r}")
    return value


def check_sliding_window(sliding_window) -> int:
    """None (off) or a positive static int below 2^31; returns it as an int (0 = off)."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, (bool, np.bool_)) or not isinstance(sliding_window,
                                                                       (int, np.integer)):
        raise TypeError(f"sliding_window must be a static Python int or None, got "
                        f"{type(sliding_window).__name__}")
    if not 0 < int(sliding_window) < INT32_LIMIT:
        raise ValueError(f"sliding_window must be in [1, 2^31) (None = off), got "
                         f"{sliding_window!r}")
    return int(sliding_window)


def check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          alibi_slopes=None, k_scale=None, v_scale=None) -> AttentionDims:
    """Validates paged_attention operands (shapes and dtypes only)."""
    _check_float("query", query)
    if query.ndim not in (3, 4):
        raise ValueError(f"query must be [num_seqs, num_heads, head_size] or [num_seqs, q_len, "
                         f"num_heads, head_size], got shape {tuple(query.shape)}")
    if query.ndim == 4:
        num_seqs, q_len, num_heads, head_size = query.shape
        if q_len < 1:
            raise ValueError(f"q_len (query.shape[1]) must be at least 1, got {q_len}")
    else:
        (num_seqs, num_heads, head_size), q_len = query.shape, 1
    check_head_size(head_size)
    num_blocks, num_kv_heads, _, block_size = check_caches(
        key_cache, value_cache, head_size=head_size, dtype=query.dtype)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}, query.shape[{query.ndim - 2}]) must be a "
                         f"multiple of num_kv_heads ({num_kv_heads}, key_cache.shape[1])")
    _check_int32("block_tables", block_tables)
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq], "
                         f"got shape {tuple(block_tables.shape)}")
    _check_int32("seq_lens", seq_lens)
    if tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs] = ({num_seqs},), got shape "
                         f"{tuple(seq_lens.shape)}")
    if alibi_slopes is not None:
        if _dt(alibi_slopes) != np.float32:
            raise TypeError(f"alibi_slopes must be float32, got {_name(alibi_slopes.dtype)}")
        if tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(f"alibi_slopes must be [num_heads] = ({num_heads},), got shape "
                             f"{tuple(alibi_slopes.shape)}")
    check_scale("k_scale", k_scale, num_kv_heads, key_cache.dtype)
    check_scale("v_scale", v_scale, num_kv_heads, key_cache.dtype)
    return AttentionDims(num_seqs, num_heads, head_size, num_blocks, num_kv_heads, block_size,
                         block_tables.shape[1], q_len, _dt(key_cache))


def check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                            v_scale=None) -> None:
    _check_float("key", key)
    if key.ndim != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_size], got shape "
                         f"{tuple(key.shape)}")
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape "
                         f"{tuple(key.shape)}")
    if _dt(value) != _dt(key):
        raise TypeError(f"value dtype {_name(value.dtype)} differs from key dtype "
                        f"{_name(key.dtype)}")
    num_tokens, num_kv_heads, head_size = key.shape
    check_head_size(head_size)
    check_caches(key_cache, value_cache, num_kv_heads=num_kv_heads, head_size=head_size,
                 dtype=key.dtype)
    _check_int32("slot_mapping", slot_mapping)
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens] = ({num_tokens},), got shape "
                         f"{tuple(slot_mapping.shape)}")
    check_scale("k_scale", k_scale, num_kv_heads, key_cache.dtype)
    check_scale("v_scale", v_scale, num_kv_heads, key_cache.dtype)


def check_copy_blocks(key_cache, value_cache, block_mapping) -> None:
    check_caches(key_cache, value_cache)
    _check_int32("block_mapping", block_mapping)
    if block_mapping.ndim != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2] (src, dst), got shape "
                         f"{tuple(block_mapping.shape)}")


def check_partition_size(partition_size: int, block_size: int) -> int:
    """A static int, a positive multiple of block_size below 2^31; returns it as an int."""
    if isinstance(partition_size, (bool, np.bool_)) or not isinstance(partition_size,
                                                                       (int, np.integer)):
        raise TypeError(f"partition_size must be a static Python int, got "
                        f"{type(partition_size).__name__}")
    if not 0 < int(partition_size) < INT32_LIMIT or partition_size % block_size != 0:
        raise ValueError(f"partition_size must be a positive multiple of block_size "
                         f"({block_size}) below 2^31, got {partition_size!r}")
    return int(partition_size)
