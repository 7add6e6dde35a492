"""Public API of jax_paged: paged attention, the cache write, block copies,
and an input checker for block tables."""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental import checkify

from . import _shapes, primitives, reference

ArrayLike = jax.typing.ArrayLike


def paged_attention(query: ArrayLike, key_cache: ArrayLike, value_cache: ArrayLike,
                    block_tables: ArrayLike, seq_lens: ArrayLike, *,
                    scale: float | None = None, alibi_slopes: ArrayLike | None = None,
                    impl: str = "auto", partition_size: int = 512,
                    k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    return_lse: bool = False):
    """Attention of new queries over a paged KV cache (one decode step, or
    ``q_len`` new tokens per sequence).

    Args:
      query: ``[num_seqs, num_heads, head_size]`` float32 / float16 / bfloat16,
        one new query per sequence and head; or ``[num_seqs, q_len, num_heads,
        head_size]``: the sequence's last ``q_len`` tokens (already written
        into the cache), with a causal mask among them: query row ``i`` sits at
        position ``L - q_len + i`` and attends tokens ``t <= L - q_len + i``
        (speculative-decoding verification, chunked prefill). Rows with no
        token to attend (``L - q_len + i < 0``) give zeros.
      key_cache: ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``,
        ``x = 16 // itemsize`` of the cache dtype: the query's dtype, or
        float8_e4m3fn / float8_e5m2 (``x = 16``; dequantised as ``value *
        k_scale``).
      value_cache: ``[num_blocks, num_kv_heads, head_size, block_size]``, the
        key cache's dtype.
      block_tables: int32 ``[num_seqs, max_blocks_per_seq]``; logical block
        ``t // block_size`` of sequence ``s`` lives in physical block
        ``block_tables[s, t // block_size]``. Entries past a sequence's last
        block, and with a sliding window those of blocks wholly before it, are
        never read (-1 padding is fine); ids outside ``[0, num_blocks)``
        inside the used range are masked, never read.
      seq_lens: int32 ``[num_seqs]``; clamped to ``[0, max_blocks_per_seq *
        block_size]``. A length of 0 gives zeros.
      scale: softmax scale, a static number (compiled into the kernel; fold a
        traced scale into the query); default ``1 / sqrt(head_size)``.
      alibi_slopes: optional float32 ``[num_heads]``; adds ``slope[h] * (t -
        pos)`` to the logits, ``pos`` the query's own position (``L - 1`` for
        a decode query, ``L - q_len + i`` for row ``i``).
      impl: "auto" (per platform), "v1" (one pass over the context), "v2"
        (partitions of ``partition_size`` tokens merged exactly), "grouped"
        (split-KV, all query rows of a KV head together; every feature; on
        the GPU fp8 caches under a float32 query run "v2") or "reference"
        (pure jax.numpy).
      partition_size: V2 partition length, a multiple of ``block_size``.
      k_scale, v_scale: dequantisation scales of fp8 caches: traced float32
        arrays (they may change without recompiling) of shape ``()`` or
        ``(1,)`` (per tensor) or ``[num_kv_heads]`` (per KV head); None means
        1. Only for fp8 caches (an error otherwise).
      soft_cap: static float ``c > 0``: ``logit = c * tanh(logit / c)``, after
        scale and ALiBi, before masking and softmax (Gemma 2, Grok). None: off.
      sliding_window: static int ``w >= 1``: each query attends only its last
        ``w`` tokens (``t >= pos - w + 1``; for a decode query ``t >= L - w``).
        Blocks wholly outside the window are not read. None: off.
      return_lse: also return the log-sum-exp of the logits per (sequence,
        [position,] head), float32 ``[num_seqs, num_heads]`` (``[num_seqs,
        q_len, num_heads]`` for 4-D queries), ``-inf`` where nothing is
        attended. Defined with the output's normalisation (``lse = max +
        log(sum + 1e-6)``), so :func:`merge_attention_states` combines partial
        results (e.g. a shared prefix and each sequence's own suffix) exactly.

    Returns:
      ``out`` in the query's shape and dtype, or ``(out, lse)`` with
      ``return_lse=True``. Query head ``h`` attends KV head ``h // (num_heads
      // num_kv_heads)``. A row whose output holds a NaN from a NaN query or
      key has lse NaN. Differentiable (``grad``, ``jvp``, ``vjp``) w.r.t. the
      query, the caches, the ALiBi slopes and the scales: derivatives are the
      reference's, the forward value the kernel's.

    Under ``jax.jit`` with the query sharded on its heads axis and the caches
    on their KV-heads axis (and / or the query, tables and lengths on the
    sequence axis), each device attends its own heads and sequences with no
    collective, and the output keeps that sharding (docs/jax_integration.md).
    """
    if impl not in primitives.IMPLS:
        raise ValueError(f"impl must be one of {primitives.IMPLS}, got {impl!r}")
    if impl == "reference":
        k_scale = _shapes.check_concrete_scale("k_scale", k_scale)
        v_scale = _shapes.check_concrete_scale("v_scale", v_scale)
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale=scale, alibi_slopes=alibi_slopes,
                                         partition_size=partition_size, k_scale=k_scale,
                                         v_scale=v_scale, soft_cap=soft_cap,
                                         sliding_window=sliding_window, return_lse=return_lse)
    query, key_cache, value_cache, block_tables, seq_lens = map(
        jnp.asarray, (query, key_cache, value_cache, block_tables, seq_lens))
    k_scale = _shapes.check_concrete_scale("k_scale", k_scale)
    v_scale = _shapes.check_concrete_scale("v_scale", v_scale)
    alibi, k_scale, v_scale = (None if a is None else jnp.asarray(a)
                               for a in (alibi_slopes, k_scale, v_scale))
    dims = _shapes.check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi, k_scale, v_scale)
    partition_size = _shapes.check_partition_size(partition_size, dims.block_size)
    soft_cap = _shapes.check_soft_cap(soft_cap)
    sliding_window = _shapes.check_sliding_window(sliding_window)
    scale = _shapes.check_softmax_scale(scale, dims.head_size)
    alibi, k_scale, v_scale = map(primitives.to_operand, (alibi, k_scale, v_scale))
    results = _differentiable_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                        alibi, k_scale, v_scale, scale, impl, int(partition_size),
                                        soft_cap, sliding_window, bool(return_lse))
    return tuple(results) if return_lse else results[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _differentiable_attention(query, key_cache, value_cache, block_tables, seq_lens, alibi,
                              k_scale, v_scale, scale, impl, partition_size, soft_cap,
                              sliding_window, return_lse):
    return primitives.attention(
        query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale,
        scale=scale, impl=impl, partition_size=partition_size, soft_cap=soft_cap,
        sliding_window=sliding_window, return_lse=return_lse)


def _tangent_inputs(primals, tangents):
    """The float operands with a nonzero tangent: (indices, primals, tangents)."""
    picked = [(i, p, t) for i, (p, t) in enumerate(zip(primals, tangents))
              if not isinstance(t, SymbolicZero)]
    return tuple(zip(*picked)) if picked else ((), (), ())


def _attention_jvp(scale, impl, partition_size, soft_cap, sliding_window, return_lse, primals,
                   tangents):
    # The value is the kernel's; the derivative is the reference's (same semantics), linear
    # in the tangents, so reverse mode transposes it. Zero tangents stay symbolic: a
    # gradient w.r.t. the query alone never builds cache-sized tangents.
    out = _differentiable_attention(*primals, scale, impl, partition_size, soft_cap,
                                    sliding_window, return_lse)
    query, key_cache, value_cache, block_tables, seq_lens, alibi, k_scale, v_scale = primals
    float_primals = (query, key_cache, value_cache, alibi, k_scale, v_scale)
    float_tangents = tuple(tangents[i] for i in (0, 1, 2, 5, 6, 7))
    which, live_primals, live_tangents = _tangent_inputs(float_primals, float_tangents)

    def forward(*live):
        args = list(float_primals)
        for i, a in zip(which, live):
            args[i] = a
        query, key_cache, value_cache, alibi, k_scale, v_scale = args
        result = reference.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
            alibi_slopes=primitives.from_operand(alibi),
            k_scale=primitives.from_operand(k_scale), v_scale=primitives.from_operand(v_scale),
            soft_cap=soft_cap or None, sliding_window=sliding_window or None,
            return_lse=return_lse)
        return tuple(result) if return_lse else (result,)

    if not which:
        return out, tuple(jnp.zeros(o.shape, o.dtype) for o in out)
    _, out_tangents = jax.jvp(forward, live_primals, live_tangents)
    return out, out_tangents


_differentiable_attention.defjvp(_attention_jvp, symbolic_zeros=True)


def _with_reference_jvp(kernel, ref):
    """``kernel`` with the derivatives of ``ref`` (same semantics): the value is the
    kernel's, tangents come from the reference, zero ones stay symbolic."""
    fn = jax.custom_jvp(kernel)

    def jvp(primals, tangents):
        out = fn(*primals)
        live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]
        if not live:
            return out, tuple(jnp.zeros(o.shape, o.dtype) for o in out)

        def forward(*xs):
            args = list(primals)
            for i, x in zip(live, xs):
                args[i] = x
            return tuple(ref(*args))
        _, out_tangents = jax.jvp(forward, tuple(primals[i] for i in live),
                                  tuple(tangents[i] for i in live))
        return out, out_tangents

    fn.defjvp(jvp, symbolic_zeros=True)
    return fn


_differentiable_write = _with_reference_jvp(
    primitives.write_cache,
    lambda key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                    k_scale=primitives.from_operand(k_scale),
                                    v_scale=primitives.from_operand(v_scale)))
_differentiable_copy = _with_reference_jvp(primitives.copy_cache_blocks, reference.copy_blocks)


def merge_attention_states(o1: ArrayLike, lse1: ArrayLike, o2: ArrayLike, lse2: ArrayLike
                           ) -> tuple[jax.Array, jax.Array]:
    """Combines two partial attention results over disjoint token sets exactly.

    ``(o1, lse1)`` and ``(o2, lse2)`` are :func:`paged_attention` results with
    ``return_lse=True`` for the same queries over two disjoint parts of the
    context (e.g. a shared prefix and each sequence's own suffix). Returns
    ``(o, lse)`` of attention over the union:

        M = max(lse1, lse2);  w_i = exp(lse_i - M)
        o = (w1 * o1 + w2 * o2) / (w1 + w2);  lse = M + log(w1 + w2)

    computed in float32 (numerically stable; ``o`` in ``o1``'s dtype). An
    empty part (``lse = -inf``) has weight 0: merging with it returns the
    other result unchanged (its ``o``, zeros from the kernels, is not read);
    two empty parts give zeros and ``-inf``. NaN propagates: a NaN (or
    ``+inf``) ``lse`` in either part makes that row's ``o`` and ``lse`` NaN,
    and a NaN in the ``o`` of a part that is not empty reaches ``o``, however
    small its weight.

    Args:
      o1, o2: ``[..., head_size]`` of one shape.
      lse1, lse2: ``o1.shape[:-1]``, float.
    """
    o1, lse1, o2, lse2 = map(jnp.asarray, (o1, lse1, o2, lse2))
    if o1.shape != o2.shape:
        raise ValueError(f"o1 and o2 must have one shape, got {tuple(o1.shape)} and "
                         f"{tuple(o2.shape)}")
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        if tuple(lse.shape) != tuple(o1.shape[:-1]):
            raise ValueError(f"{name} must have shape o1.shape[:-1] = {tuple(o1.shape[:-1])}, "
                             f"got {tuple(lse.shape)}")
        if not jnp.issubdtype(lse.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {lse.dtype}")
    lse1 = lse1.astype(jnp.float32)
    lse2 = lse2.astype(jnp.float32)
    m = jnp.maximum(lse1, lse2)                      # NaN if either is NaN
    m = jnp.where(jnp.isneginf(m), 0.0, m)           # both empty: any finite shift
    w1 = jnp.exp(lse1 - m)                           # 0 for an empty part, NaN for NaN / +inf
    w2 = jnp.exp(lse2 - m)
    total = w1 + w2                                  # 0 only when both parts are empty
    # Only an empty part is skipped outright (0 * NaN would be NaN); any other part's
    # NaN reaches o even where its weight underflows to 0.
    part1 = jnp.where(jnp.isneginf(lse1)[..., None], 0.0, o1.astype(jnp.float32) * w1[..., None])
    part2 = jnp.where(jnp.isneginf(lse2)[..., None], 0.0, o2.astype(jnp.float32) * w2[..., None])
    empty = total == 0
    o = (part1 + part2) / jnp.where(empty, 1.0, total)[..., None]
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))
    return o.astype(o1.dtype), lse


def reshape_and_cache(key: ArrayLike, value: ArrayLike, key_cache: ArrayLike,
                      value_cache: ArrayLike, slot_mapping: ArrayLike, *,
                      k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Writes new tokens' keys and values into the paged cache.

    Args:
      key, value: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype
        (any of float32 / float16 / bfloat16 for fp8 caches).
      key_cache, value_cache: the paged caches (layouts as in
        :func:`paged_attention`).
      slot_mapping: int32 ``[num_tokens]``; token ``i`` goes to block
        ``slot // block_size`` at offset ``slot % block_size``. Slots < 0 or
        >= ``num_blocks * block_size`` are skipped (nothing outside the cache
        is ever written).
      k_scale, v_scale: fp8 caches only: traced float32 scales of shape
        ``()``, ``(1,)`` or ``[num_kv_heads]`` (None = 1). The cache stores
        ``value / scale`` rounded to nearest even and saturated to the
        format's largest finite value (448 for float8_e4m3fn, 57344 for
        float8_e5m2); use the same scales in :func:`paged_attention`.

    Returns:
      The updated ``(key_cache, value_cache)``. Under
      ``jax.jit(..., donate_argnums=...)`` with the caches donated the update
      happens in place, with no copy of the cache. Caches sharded on their
      KV-heads axis are written on each device, with no collective.
    """
    args = tuple(map(jnp.asarray, (key, value, key_cache, value_cache, slot_mapping)))
    k_scale = _shapes.check_concrete_scale("k_scale", k_scale, for_write=True)
    v_scale = _shapes.check_concrete_scale("v_scale", v_scale, for_write=True)
    k_scale, v_scale = (None if a is None else jnp.asarray(a) for a in (k_scale, v_scale))
    _shapes.check_reshape_and_cache(*args, k_scale, v_scale)
    k_scale, v_scale = map(primitives.to_operand, (k_scale, v_scale))
    return _differentiable_write(*args, k_scale, v_scale)


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
    return _differentiable_copy(*args)


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
