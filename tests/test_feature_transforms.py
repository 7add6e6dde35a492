"""vmap, jit and grad over calls with the features (soft cap, window, LSE, multi-token
queries, fp8 scales)."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

import jax_paged
from jax_paged import primitives, reference
from feature_helpers import make_inputs
from paged_inputs import assert_close, count_prims, on, reference_on_cpu


def test_vmap_with_features_is_one_call(platform):
    rng = np.random.default_rng(20)
    inp = make_inputs(rng, [5, 40, 0], 8, 2, 64, 16, jnp.float8_e4m3fn, q_len=2)
    queries = rng.standard_normal((3,) + inp.query.shape).astype(np.float32)
    kw = dict(k_scale=np.float32(0.5), soft_cap=4.0, sliding_window=9, return_lse=True)
    f = jax.vmap(lambda q, kc, vc, bt, sl: jax_paged.paged_attention(q, kc, vc, bt, sl, **kw),
                 in_axes=(0, None, None, None, None))
    args = on(platform, queries, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens)
    assert count_prims(jax.make_jaxpr(f)(*args).jaxpr, primitives.paged_attention_p) == 1
    out, lse = f(*args)
    assert out.shape == queries.shape and lse.shape == queries.shape[:-1]
    for i in range(3):
        want, want_lse = reference_on_cpu(reference.paged_attention, queries[i],
                                          *inp.args()[1:], **kw)
        assert_close(np.asarray(out)[i], want, np.float32, f"vmap element {i}")
        np.testing.assert_allclose(np.asarray(lse)[i], want_lse, atol=2e-5, rtol=2e-5)


def test_vmap_over_per_element_scales(platform):
    rng = np.random.default_rng(21)
    inp = make_inputs(rng, [5, 40], 4, 2, 64, 16, jnp.float8_e5m2)
    scales = rng.uniform(0.5, 2, size=(3, 2)).astype(np.float32)
    f = jax.vmap(lambda ks: jax_paged.paged_attention(*on(platform, *inp.args()), k_scale=ks,
                                                      v_scale=ks))
    out = np.asarray(f(on(platform, scales)[0]))
    for i in range(3):
        want = reference_on_cpu(reference.paged_attention, *inp.args(), k_scale=scales[i],
                                v_scale=scales[i])
        assert_close(out[i], want, np.float32, f"element {i}")
    # And for the quantised write.
    key = rng.standard_normal((3, 2, 2, 64)).astype(np.float32)
    kc, vc = inp.key_cache, inp.value_cache
    slots = np.array([1, 2], np.int32)
    w = jax.vmap(lambda k, ks: jax_paged.reshape_and_cache(k, k, kc, vc, slots, k_scale=ks,
                                                           v_scale=ks))
    got = w(key, scales)
    for i in range(3):
        want = reference.reshape_and_cache(key[i], key[i], kc, vc, slots, k_scale=scales[i],
                                           v_scale=scales[i])
        for g, r in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g)[i].view(np.uint8),
                                          np.asarray(r).view(np.uint8))


def test_grad_with_features():
    from jax.test_util import check_grads
    rng = np.random.default_rng(22)
    inp = make_inputs(rng, [3, 20, 0], 4, 2, 16, 8, np.float32, q_len=2)
    slopes = rng.random(4).astype(np.float32)
    q, kc, vc = (jnp.asarray(a) for a in inp.args()[:3])
    kw = dict(alibi_slopes=slopes, soft_cap=3.0, sliding_window=6)

    def loss(q, kc, vc):
        out, lse = jax_paged.paged_attention(q, kc, vc, inp.block_tables, inp.seq_lens,
                                             return_lse=True, **kw)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, kc, vc)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    for g, cache in zip(grads[1:], (inp.key_cache, inp.value_cache)):
        g = np.asarray(g)
        assert np.all(g[np.isnan(cache)] == 0)
    check_grads(lambda q, kc, vc: jax_paged.paged_attention(
        q, kc, vc, inp.block_tables, inp.seq_lens, **kw),
        (q, jnp.nan_to_num(kc), jnp.nan_to_num(vc)), order=1, modes=["rev"], atol=2e-2,
        rtol=2e-2, eps=1e-2)


def test_grad_wrt_query_with_fp8_cache():
    rng = np.random.default_rng(23)
    inp = make_inputs(rng, [3, 20], 4, 2, 16, 8, jnp.float8_e4m3fn)
    ks = np.float32(0.5)

    def loss(q, ks):
        out = jax_paged.paged_attention(q, *inp.args()[1:], k_scale=ks, v_scale=ks)
        return jnp.sum(out ** 2)

    def loss_ref(q, ks):
        out = reference.paged_attention(q, *inp.args()[1:], k_scale=ks, v_scale=ks)
        return jnp.sum(out ** 2)

    q = jnp.asarray(inp.query)
    d_q, d_ks = jax.grad(loss, argnums=(0, 1))(q, ks)
    want_q, want_ks = jax.grad(loss_ref, argnums=(0, 1))(q, ks)
    np.testing.assert_allclose(np.asarray(d_q), np.asarray(want_q), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(d_ks), np.asarray(want_ks), atol=1e-4, rtol=1e-4)
