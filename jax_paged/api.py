"""Public API of jax_paged: paged attention, the cache write, block copies,
and an input checker for block tables."""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from . import _shapes, primitives, reference

ArrayLike = jax.typing.ArrayLike


def paged_attention(query: ArrayLike, key_cache: ArrayLike, value_cache: ArrayLike,
                    block_tables: ArrayLike, seq_lens: ArrayLike, *,
                    scale: float | None = None, alibi_slopes: ArrayLike | None = None,
                    impl: str = "auto", partition_size: int = 512) -> jax.Array:
    """One decode step of attention over a paged KV cache.

    Args:
      query: ``[num_seqs, num_heads, head_size]`` float32 / float16 / bfloat16,
        one new query per sequence and head.
      key_cache: ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``,
        ``x = 16 // itemsize`` (the query's dtype).
      value_cache: ``[num_blocks, num_kv_heads, head_size, block_size]``.
      block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; logical block
        ``t // block_size`` of sequence ``s`` lives in physical block
        ``block_tables[s, t // block_size]``. Entries past a sequence's last
        block are never read (-1 padding is fine); ids outside
        ``[0, num_blocks)`` inside the used range are masked, never read.
      seq_lens: int32 ``[num_seqs]``; clamped to ``[0, max_blocks_per_seq *
        block_size]``. A length of 0 gives zeros.
      scale: softmax scale; default ``1 / sqrt(head_size)``.
      alibi_slopes: optional float32 ``[num_heads]``; adds
        ``slope[h] * (t - (seq_len - 1))`` to the logits.
      impl: "auto" (per platform), "v1" (one pass over the context), "v2"
        (partitions of ``partition_size`` tokens merged exactly) or
        "reference" (pure jax.numpy).
      partition_size: V2 partition length, a multiple of ``block_size``.

    Returns:
      ``[num_seqs, num_heads, head_size]`` in the query's dtype. Query head
      ``h`` attends KV head ``h // (num_heads // num_kv_heads)``.
    """
    if impl not in primitives.IMPLS:
        raise ValueError(f"impl must be one of {primitives.IMPLS}, got {impl!r}")
    if impl == "reference":
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale=scale, alibi_slopes=alibi_slopes,
                                         partition_size=partition_size)
    query, key_cache, value_cache, block_tables, seq_lens = map(
        jnp.asarray, (query, key_cache, value_cache, block_tables, seq_lens))
    alibi = (jnp.zeros((0,), jnp.float32) if alibi_slopes is None
             else jnp.asarray(alibi_slopes))
    dims = _shapes.check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi if alibi_slopes is not None else None)
    _shapes.check_partition_size(partition_size, dims.block_size)
    scale = float(dims.head_size ** -0.5 if scale is None else scale)
    return _differentiable_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi,
                                     scale, impl, int(partition_size))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _differentiable_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi,
                              scale, impl, partition_size):
    return primitives.paged_attention_p.bind(
        query, key_cache, value_cache, block_tables, seq_lens, alibi, scale=scale, impl=impl,
        partition_size=partition_size)


def _attention_fwd(query, key_cache, value_cache, block_tables, seq_lens, alibi, scale, impl,
                   partition_size):
    out = _differentiable_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi,
                                    scale, impl, partition_size)
    return out, (query, key_cache, value_cache, block_tables, seq_lens, alibi)


def _attention_bwd(scale, impl, partition_size, residuals, out_grad):
    # The backward pass differentiates the reference (same semantics): it
    # recomputes the forward in jnp, which is fine for fine-tuning-sized use.
    query, key_cache, value_cache, block_tables, seq_lens, alibi = residuals

    def forward(query, key_cache, value_cache, alibi):
        return reference.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
            alibi_slopes=alibi if alibi.shape[0] else None)

    _, vjp = jax.vjp(forward, query, key_cache, value_cache, alibi)
    d_query, d_key_cache, d_value_cache, d_alibi = vjp(out_grad)
    return d_query, d_key_cache, d_value_cache, None, None, d_alibi


_differentiable_attention.defvjp(_attention_fwd, _attention_bwd)


def reshape_and_cache(key: ArrayLike, value: ArrayLike, key_cache: ArrayLike,
                      value_cache: ArrayLike, slot_mapping: ArrayLike
                      ) -> tuple[jax.Array, jax.Array]:
    """Writes new tokens' keys and values into the paged cache.

    Args:
      key, value: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype.
      key_cache, value_cache: the paged caches (layouts as in
        :func:`paged_attention`).
      slot_mapping: int32 ``[num_tokens]``; token ``i`` goes to block
        ``slot // block_size`` at offset ``slot % block_size``. Slots < 0 or
        >= ``num_blocks * block_size`` are skipped (nothing outside the cache
        is ever written).

    Returns:
      The updated ``(key_cache, value_cache)``. Under
      ``jax.jit(..., donate_argnums=...)`` with the caches donated the update
      happens in place, with no copy of the cache.
    """
    args = tuple(map(jnp.asarray, (key, value, key_cache, value_cache, slot_mapping)))
    _shapes.check_reshape_and_cache(*args)
    kc, vc = primitives.reshape_and_cache_p.bind(*args)
    return kc, vc


def copy_blocks(key_cache: ArrayLike, value_cache: ArrayLike, block_mapping: ArrayLike
                ) -> tuple[jax.Array, jax.Array]:
    """Copies whole blocks, ``cache[dst] = cache[src]``, in both caches, in place
    under donation (copy-on-write of shared prefixes, beam search).

    Args:
      key_cache, value_cache: the paged caches.
      block_mapping: int32 ``[num_pairs, 2]`` rows of (src, dst). Rows with an
        id outside ``[0, num_blocks)`` are skipped. The result is defined when
        no destination repeats and no destination is also a source.
    """
    args = tuple(map(jnp.asarray, (key_cache, value_cache, block_mapping)))
    _shapes.check_copy_blocks(*args)
    kc, vc = primitives.copy_blocks_p.bind(*args)
    return kc, vc


def _input_problems(block_tables, seq_lens, num_blocks: int, block_size: int):
    """Per-sequence masks: (bad block id among used blocks, negative length,
    length beyond the table's capacity)."""
    capacity = block_tables.shape[1] * block_size
    used_blocks = (jnp.clip(seq_lens, 0, capacity) + block_size - 1) // block_size
    used = jnp.arange(block_tables.shape[1])[None, :] < used_blocks[:, None]
    bad_id = used & ((block_tables < 0) | (block_tables >= num_blocks))
    return jnp.any(bad_id, axis=1), seq_lens < 0, seq_lens > capacity


def check_inputs(block_tables: ArrayLike, seq_lens: ArrayLike, num_blocks: int,
                 block_size: int) -> None:
    """Checks block-table values that shapes cannot catch.

    Reports, by sequence index, block ids outside ``[0, num_blocks)`` among the
    blocks a sequence uses, negative lengths, and lengths beyond the table's
    capacity (``max_blocks_per_seq * block_size``). Eagerly it raises
    ``ValueError`` listing the sequences; under ``jax.jit`` it emits
    ``checkify.check``\\ s (wrap the function with ``checkify.checkify``).
    The kernels never read out of bounds either way; this tells you why an
    output looks wrong.
    """
    block_tables = jnp.asarray(block_tables)
    seq_lens = jnp.asarray(seq_lens)
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables must be [num_seqs, max_blocks_per_seq] and seq_lens "
                         f"[num_seqs]; got {tuple(block_tables.shape)} and "
                         f"{tuple(seq_lens.shape)}")
    bad_id, negative, too_long = _input_problems(block_tables, seq_lens, num_blocks, block_size)
    capacity = block_tables.shape[1] * block_size
    if isinstance(block_tables, jax.core.Tracer) or isinstance(seq_lens, jax.core.Tracer):
        first = lambda m: jnp.argmax(m)  # noqa: E731 - index of the first offender
        checkify.check(~jnp.any(bad_id), "block_tables: sequence {i} uses a block id outside "
                       f"[0, {num_blocks})", i=first(bad_id))
        checkify.check(~jnp.any(negative), "seq_lens: sequence {i} has a negative length",
                       i=first(negative))
        checkify.check(~jnp.any(too_long), "seq_lens: sequence {i} is longer than the table's "
                       f"capacity {capacity}", i=first(too_long))
        return
    problems = []
    for name, mask, what in ((
            "block_tables", bad_id, f"use block ids outside [0, {num_blocks})"),
            ("seq_lens", negative, "have negative lengths"),
            ("seq_lens", too_long, f"are longer than the table's capacity {capacity}")):
        idx = np.flatnonzero(np.asarray(mask))
        if idx.size:
            problems.append(f"{name}: sequences {idx.tolist()} {what}")
    if problems:
        raise ValueError("; ".join(problems))
