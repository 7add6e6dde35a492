"""return_lse (log-sum-exp of each row's logits) against the reference and the oracle, and
merge_attention_states: a shared prefix merged with each suffix equals the whole
sequence."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

import jax_paged
from feature_helpers import IMPLS, attend, compare, make_inputs, oracle
from paged_inputs import TOLERANCES, assert_close, on


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_matches_reference(platform, impl):
    rng = np.random.default_rng(6)
    inp = make_inputs(rng, [0, 1, 31, 513, 1100], 8, 2, 64, 16, np.float32)
    out, lse = compare(platform, inp, impl, return_lse=True)
    lse = np.asarray(lse)
    assert np.all(np.isneginf(lse[0])) and np.all(np.isfinite(lse[1:]))
    assert np.all(np.asarray(out)[0] == 0)
    # Same output as without LSE (on the GPU, impl="grouped" without LSE runs
    # the grouped kernel, with LSE classic V2: equal up to rounding).
    plain = np.asarray(attend(platform, inp, impl))
    assert_close(out, plain, np.float32, "with and without lse")
    # The definition: lse ~ log sum_t exp(logit_t).
    _, want = oracle(inp.query, inp.keys, inp.values, 64 ** -0.5)
    np.testing.assert_allclose(lse, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_with_all_features(platform, impl):
    rng = np.random.default_rng(7)
    inp = make_inputs(rng, [0, 2, 40, 600], 8, 4, 64, 16, np.float32, q_len=3)
    slopes = rng.random(8).astype(np.float32)
    compare(platform, inp, impl, alibi_slopes=slopes, soft_cap=5.0, sliding_window=100,
            return_lse=True, partition_size=128)


def _prefix_suffix_inputs(rng, num_seqs, prefix_blocks, suffix_lens, num_heads, num_kv_heads,
                          head_size, block_size, dtype):
    """One set of prefix pages shared by all sequences, then each sequence's own
    suffix pages; NaN everywhere else. Returns (query, caches, full tables and
    lengths, prefix tables and lengths, suffix tables and lengths)."""
    x = 16 // np.dtype(dtype).itemsize
    suffix_blocks = [-(-n // block_size) for n in suffix_lens]
    max_suffix = max(max(suffix_blocks), 1)
    num_blocks = prefix_blocks + sum(suffix_blocks) + 2
    kc = np.full((num_blocks, num_kv_heads, head_size // x, block_size, x), np.nan, np.float32)
    vc = np.full((num_blocks, num_kv_heads, head_size, block_size), np.nan, np.float32)
    perm = rng.permutation(num_blocks)
    prefix_ids = perm[:prefix_blocks]
    prefix_len = prefix_blocks * block_size
    for j, blk in enumerate(prefix_ids):
        kc[blk] = rng.standard_normal(kc[blk].shape)
        vc[blk] = rng.standard_normal(vc[blk].shape)
    pos = prefix_blocks
    suffix_tables = np.full((num_seqs, max_suffix), -1, np.int32)
    for s, n in enumerate(suffix_lens):
        for j in range(suffix_blocks[s]):
            blk = perm[pos]
            pos += 1
            suffix_tables[s, j] = blk
            used = min(block_size, n - j * block_size)
            kc[blk, :, :, :used] = rng.standard_normal(kc[blk, :, :, :used].shape)
            vc[blk, :, :, :used] = rng.standard_normal(vc[blk, :, :, :used].shape)
    prefix_tables = np.tile(prefix_ids.astype(np.int32), (num_seqs, 1))
    full_tables = np.concatenate([prefix_tables, suffix_tables], axis=1)
    suffix_lens = np.asarray(suffix_lens, np.int32)
    query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(dtype)
    return (query, kc.astype(dtype), vc.astype(dtype), full_tables, suffix_lens + prefix_len,
            prefix_tables, np.full(num_seqs, prefix_len, np.int32), suffix_tables, suffix_lens)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_shared_prefix_merge_equals_whole_sequence(platform, impl, dtype):
    """Attention over a shared prefix (one set of pages, attended once per
    sequence with the prefix table) merged with each sequence's own suffix
    equals attention over the whole sequence."""
    rng = np.random.default_rng(8)
    (query, kc, vc, full_t, full_l, pre_t, pre_l, suf_t, suf_l) = _prefix_suffix_inputs(
        rng, 5, 40, [0, 1, 17, 300, 600], 8, 2, 64, 16, dtype)
    query, kc, vc = on(platform, query, kc, vc)
    kw = dict(impl=impl, return_lse=True)
    o_pre, lse_pre = jax_paged.paged_attention(query, kc, vc, pre_t, pre_l, **kw)
    o_suf, lse_suf = jax_paged.paged_attention(query, kc, vc, suf_t, suf_l, **kw)
    o, lse = jax_paged.merge_attention_states(o_pre, lse_pre, o_suf, lse_suf)
    o_full, lse_full = jax_paged.paged_attention(query, kc, vc, full_t, full_l, **kw)
    assert o.dtype == o_full.dtype
    # Both sides round partial outputs to the dtype once more than the direct
    # path: allow two units in the last place.
    atol, rtol = TOLERANCES[np.dtype(dtype)]
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_full, np.float32),
                               atol=2 * atol, rtol=2 * rtol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_full), atol=1e-5, rtol=1e-5)
    # Sequence 0 has an empty suffix (lse = -inf): merging is a no-op.
    assert np.all(np.isneginf(np.asarray(lse_suf)[0]))
    np.testing.assert_array_equal(np.asarray(o)[0], np.asarray(o_pre)[0])
    np.testing.assert_array_equal(np.asarray(lse)[0], np.asarray(lse_pre)[0])


def test_merge_attention_states_edge_cases():
    rng = np.random.default_rng(9)
    o1 = rng.standard_normal((3, 4, 8)).astype(np.float32)
    o2 = rng.standard_normal((3, 4, 8)).astype(np.float32)
    lse1 = rng.standard_normal((3, 4)).astype(np.float32) * 50
    lse2 = rng.standard_normal((3, 4)).astype(np.float32) * 50
    o, lse = jax_paged.merge_attention_states(o1, lse1, o2, lse2)
    w1 = 1 / (1 + np.exp(lse2.astype(np.float64) - lse1))
    np.testing.assert_allclose(np.asarray(o), w1[..., None] * o1 + (1 - w1[..., None]) * o2,
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.logaddexp(lse1, lse2), atol=1e-5, rtol=1e-6)
    # Symmetric.
    o_b, lse_b = jax_paged.merge_attention_states(o2, lse2, o1, lse1)
    np.testing.assert_allclose(np.asarray(o_b), np.asarray(o), atol=1e-6, rtol=1e-6)
    # -inf is a no-op, even with NaN in the empty part's output; huge values
    # do not overflow.
    empty = np.full((3, 4), -np.inf, np.float32)
    o_nan = np.full_like(o2, np.nan)
    o, lse = jax_paged.merge_attention_states(o1, lse1, o_nan, empty)
    np.testing.assert_array_equal(np.asarray(o), o1)
    np.testing.assert_array_equal(np.asarray(lse), lse1)
    o, lse = jax_paged.merge_attention_states(o_nan, empty, o1, lse1 + 1e4)
    np.testing.assert_array_equal(np.asarray(o), o1)
    np.testing.assert_array_equal(np.asarray(lse), lse1 + 1e4)
    o, lse = jax_paged.merge_attention_states(o_nan, empty, o_nan, empty)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
    # bfloat16 outputs stay bfloat16.
    o, _ = jax_paged.merge_attention_states(o1.astype(jnp.bfloat16), lse1,
                                            o2.astype(jnp.bfloat16), lse2)
    assert o.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"lse2 must have shape o1.shape\[:-1\] = \(3, 4\)"):
        jax_paged.merge_attention_states(o1, lse1, o2, lse2[:, :2])
    with pytest.raises(ValueError, match=r"o1 and o2 must have one shape"):
        jax_paged.merge_attention_states(o1, lse1, o2[:2], lse2)
