"""Multi-token queries ([num_seqs, q_len, num_heads, head_size], causal among the new
tokens) against the reference and the oracle, alone and with the other features."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

import jax_paged
from feature_helpers import IMPLS, attend, compare, make_inputs, oracle
from paged_inputs import on


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
@pytest.mark.parametrize("q_len", [1, 3, 16, 20])
def test_multi_token(platform, impl, q_len):
    """Lengths below q_len (early rows see nothing), equal to q_len, and
    across block and 512-token partition boundaries."""
    rng = np.random.default_rng(10 + q_len)
    lens = [0, 1, q_len - 1 if q_len > 1 else 2, q_len, 31, 513, 530]
    inp = make_inputs(rng, lens, 8, 2, 64, 16, jnp.bfloat16, q_len=q_len)
    out = compare(platform, inp, impl)
    want, _ = oracle(inp.query.astype(np.float32), inp.keys, inp.values, 64 ** -0.5)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2, rtol=3e-2)
    # Rows with no token to attend give zeros.
    assert np.all(np.asarray(out, np.float32)[0] == 0)


@pytest.mark.parametrize("num_heads,num_kv_heads,q_len", [(32, 1, None), (80, 1, None),
                                                          (8, 1, 3), (2, 1, 16), (16, 2, 5),
                                                          (8, 2, 17)])
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (120, 32), (128, 16)])
def test_many_query_rows_per_kv_head(platform, num_heads, num_kv_heads, q_len, head_size,
                                     block_size):
    """More than 16 query rows per KV head (q_len * group = 32, 80, 24, 32, 40,
    68): a decode step takes several 16-row CTAs per KV head; multi-token
    queries take the row split's CTAs of 32 or 64 rows (24: a 32-row CTA whose
    second row block is half empty; 40, 34 + 34: 64-row CTAs with a partly
    empty and an idle row block). Plain decode, the soft-capped plain step
    and LSE, split over partitions and not; multi-token also with a window, and
    with ALiBi + window + soft cap."""
    rng = np.random.default_rng(num_heads + head_size + block_size + (q_len or 0))
    for lens in ([0, 1, q_len or 2, 511, 513, 1100], list(rng.integers(0, 200, size=24))):
        inp = make_inputs(rng, lens, num_heads, num_kv_heads, head_size, block_size,
                          jnp.bfloat16, q_len=q_len)
        compare(platform, inp, "grouped", return_lse=True)
        compare(platform, inp, "grouped", soft_cap=5.0)
        if q_len:  # the row split's general kernel: per-row ranges, ALiBi, window
            # A window without ALiBi: the row split's passes wholly inside every row's
            # range skip the per-token tests (those at the window's edges do not).
            compare(platform, inp, "grouped", sliding_window=300)
            slopes = (2.0 ** -rng.uniform(0, 8, size=num_heads)).astype(np.float32)
            compare(platform, inp, "grouped", alibi_slopes=slopes, sliding_window=100,
                    soft_cap=5.0, return_lse=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_multi_token_with_alibi_window_and_cap(platform, impl):
    rng = np.random.default_rng(11)
    inp = make_inputs(rng, [3, 16, 100, 600], 8, 2, 64, 16, np.float32, q_len=5)
    slopes = (2.0 ** -rng.uniform(0, 8, size=8)).astype(np.float32)
    for window in (None, 1, 7, 64):
        compare(platform, inp, impl, alibi_slopes=slopes, soft_cap=20.0, sliding_window=window,
                partition_size=64, return_lse=True)


def test_single_row_query_equals_decode(platform):
    rng = np.random.default_rng(12)
    inp = make_inputs(rng, [0, 9, 300], 8, 2, 64, 16, np.float32)
    q4 = inp.query[:, None]
    for impl in IMPLS:
        out3 = np.asarray(attend(platform, inp, impl))
        out4 = np.asarray(jax_paged.paged_attention(
            *on(platform, q4, *inp.args()[1:]), impl=impl))
        np.testing.assert_array_equal(out4[:, 0], out3)


def test_multi_token_rows_equal_decode_at_their_length(platform):
    """Row i of a q_len query equals a decode query with seq_len L - q_len + 1 + i."""
    rng = np.random.default_rng(13)
    q_len = 4
    inp = make_inputs(rng, [4, 50, 530], 8, 2, 64, 16, np.float32, q_len=q_len)
    slopes = rng.random(8).astype(np.float32)
    multi = np.asarray(attend(platform, inp, "v2", alibi_slopes=slopes, sliding_window=30))
    for i in range(q_len):
        lens = inp.seq_lens - q_len + 1 + i
        dec = jax_paged.paged_attention(*on(platform, inp.query[:, i], inp.key_cache,
                                            inp.value_cache, inp.block_tables, lens),
                                        impl="v2", alibi_slopes=slopes, sliding_window=30)
        np.testing.assert_allclose(multi[:, i], np.asarray(dec), atol=2e-5, rtol=2e-5)
