"""merge_attention_states and NaN: a NaN in either part reaches the merged row; a NaN
query or key gives a NaN lse (kernels and reference alike), so merging never hides it."""
import numpy as np
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import reference
from paged_inputs import make_paged_inputs, on

NAN, INF = float("nan"), float("inf")


def parts(lse1, lse2):
    o1 = np.full((1, 4), 1.0, np.float32)
    o2 = np.full((1, 4), 3.0, np.float32)
    return o1, np.array([lse1], np.float32), o2, np.array([lse2], np.float32)


@pytest.mark.parametrize("lse1,lse2", [(NAN, 0.0), (0.0, NAN), (NAN, -INF), (INF, 0.0),
                                       (0.0, INF), (NAN, NAN)])
def test_nan_or_inf_lse_poisons_the_row(lse1, lse2):
    o, lse = jax_paged.merge_attention_states(*parts(lse1, lse2))
    assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(lse)).all()


def test_nan_output_of_a_part_with_tiny_weight_is_not_dropped():
    o1, lse1, o2, lse2 = parts(0.0, -500.0)   # exp(-500) underflows to 0 in float32
    o2[0, 1] = NAN
    o, lse = jax_paged.merge_attention_states(o1, lse1, o2, lse2)
    assert np.isnan(np.asarray(o)[0, 1]) and not np.isnan(np.asarray(o)[0, 0])
    assert float(lse[0]) == 0.0


def test_empty_parts():
    o, lse = jax_paged.merge_attention_states(*parts(-INF, 0.5))
    np.testing.assert_allclose(np.asarray(o), 3.0)
    np.testing.assert_allclose(np.asarray(lse), 0.5)
    o, lse = jax_paged.merge_attention_states(*parts(-INF, -INF))
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()
    o, lse = jax_paged.merge_attention_states(*parts(0.0, np.log(3.0)))
    np.testing.assert_allclose(np.asarray(o), 2.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.log(4.0), rtol=1e-6)


@pytest.mark.parametrize("impl", ["v1", "v2", "grouped"])
@pytest.mark.parametrize("poison", ["query", "key"])
def test_nan_query_or_key_gives_nan_lse(platform, impl, poison):
    rng = np.random.default_rng(0)
    inp = make_paged_inputs(rng, [5, 40, 0], 4, 2, 64, 16, np.float32, poison=False)
    query, key_cache = inp.query.copy(), inp.key_cache.copy()
    if poison == "query":
        query[0, 1] = NAN                       # sequence 0, head 1
    else:
        key_cache[inp.block_tables[0, 0], 0, 3, 2, 1] = NAN   # sequence 0, KV head 0, token 2
    args = (query, key_cache, inp.value_cache, inp.block_tables, inp.seq_lens)
    out, lse = (np.asarray(a) for a in jax_paged.paged_attention(
        *on(platform, *args), impl=impl, partition_size=16, return_lse=True))
    ref_out, ref_lse = (np.asarray(a) for a in reference.paged_attention(
        *args, impl="v2" if impl != "v1" else "v1", partition_size=16, return_lse=True))
    bad = (0, 1) if poison == "query" else (0, slice(0, 2))   # heads 0, 1 read KV head 0
    assert np.isnan(lse[bad]).all() and np.isnan(ref_lse[bad]).all()
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    assert np.isneginf(lse[2]).all()            # the empty sequence stays -inf
    # Merging the NaN row with a valid part keeps the NaN.
    merged, merged_lse = jax_paged.merge_attention_states(out, lse, jnp.ones_like(out),
                                                         jnp.zeros_like(lse))
    assert np.isnan(np.asarray(merged_lse)[bad]).all()
