"""Primitive behaviour: trace-time errors, vmap as one kernel call, use inside
jit + fori_loop with donation, check_inputs, and a property test over shapes."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.experimental import checkify

import jax_paged
from jax_paged import primitives, reference
from paged_inputs import (TOLERANCES, assert_close, count_prims, dense_attention,
                          make_paged_inputs, on, reference_on_cpu)


# ---- vmap ------------------------------------------------------------------

def test_vmap_over_query_is_one_call(platform):
    rng = np.random.default_rng(0)
    inp = make_paged_inputs(rng, [5, 40, 0], 8, 2, 64, 16, np.float32)
    queries = rng.standard_normal((4,) + inp.query.shape).astype(np.float32)
    f = jax.vmap(lambda q, kc, vc, bt, sl: jax_paged.paged_attention(q, kc, vc, bt, sl),
                 in_axes=(0, None, None, None, None))
    args = on(platform, queries, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens)
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    assert count_prims(jaxpr, primitives.paged_attention_p) == 1
    out = np.asarray(f(*args))
    for i in range(4):
        expected = reference_on_cpu(reference.paged_attention, queries[i], *inp.args()[1:])
        assert_close(out[i], expected, np.float32, f"vmap element {i}")


def test_vmap_over_stacked_caches_is_one_call(platform):
    rng = np.random.default_rng(1)
    inputs = [make_paged_inputs(rng, [9, 33], 4, 2, 64, 16, np.float32, extra_blocks=2)
              for _ in range(3)]
    # Same shapes for all three (same lengths); tables differ per cache.
    stacked = [np.stack(a) for a in zip(*(i.args() for i in inputs))]
    f = jax.vmap(jax_paged.paged_attention)
    args = on(platform, *stacked)
    assert count_prims(jax.make_jaxpr(f)(*args).jaxpr, primitives.paged_attention_p) == 1
    out = np.asarray(f(*args))
    for i, inp in enumerate(inputs):
        expected = dense_attention(inp.query, inp.keys, inp.values, 64 ** -0.5)
        np.testing.assert_allclose(out[i], expected, atol=2e-5, rtol=2e-5)


def test_vmap_cache_write_and_copy(platform):
    rng = np.random.default_rng(2)
    n, num_blocks, kv_heads, head_size, block_size = 3, 6, 2, 64, 8
    x = 4
    kc = rng.standard_normal((n, num_blocks, kv_heads, head_size // x, block_size, x)
                             ).astype(np.float32)
    vc = rng.standard_normal((n, num_blocks, kv_heads, head_size, block_size)).astype(np.float32)
    key = rng.standard_normal((n, 4, kv_heads, head_size)).astype(np.float32)
    value = rng.standard_normal((n, 4, kv_heads, head_size)).astype(np.float32)
    slots = np.array([[0, 9, -1, 47], [47, 48, 3, 2], [1, 2, 3, 4]], np.int32)
    write = jax.vmap(jax_paged.reshape_and_cache)
    args = on(platform, key, value, kc, vc, slots)
    assert count_prims(jax.make_jaxpr(write)(*args).jaxpr, primitives.reshape_and_cache_p) == 1
    got = write(*args)
    for i in range(n):
        want = reference.reshape_and_cache(key[i], value[i], kc[i], vc[i], slots[i])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g)[i], np.asarray(w))
    mapping = np.array([[[0, 1]], [[5, 6]], [[2, -1]]], np.int32)  # [5, 6]: 6 out of range
    got = jax.vmap(jax_paged.copy_blocks)(*on(platform, kc, vc, mapping))
    for i in range(n):
        want = reference.copy_blocks(kc[i], vc[i], mapping[i])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g)[i], np.asarray(w))


# ---- a jitted decode loop -------------------------------------------------------

def test_jitted_fori_loop_decode_matches_dense(platform):
    """Each step writes one new token per sequence into its pages, then attends;
    the caches are donated through the whole loop."""
    rng = np.random.default_rng(3)
    num_seqs, num_heads, num_kv_heads, head_size, block_size = 3, 8, 2, 64, 8
    steps, start = 20, np.array([0, 5, 17], np.int32)
    max_blocks = -(-(int(start.max()) + steps) // block_size)
    num_blocks = num_seqs * max_blocks + 2
    tables = rng.permutation(num_blocks)[:num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    tables = tables.astype(np.int32)
    x = 4
    kc = np.full((num_blocks, num_kv_heads, head_size // x, block_size, x), np.nan, np.float32)
    vc = np.full((num_blocks, num_kv_heads, head_size, block_size), np.nan, np.float32)
    total = int(start.max()) + steps
    keys = rng.standard_normal((num_seqs, total, num_kv_heads, head_size)).astype(np.float32)
    values = rng.standard_normal((num_seqs, total, num_kv_heads, head_size)).astype(np.float32)
    queries = rng.standard_normal((steps, num_seqs, num_heads, head_size)).astype(np.float32)
    # Prefill the first `start` tokens of each sequence.
    pos = np.concatenate([np.arange(L) for L in start])
    seq = np.concatenate([np.full(L, s) for s, L in enumerate(start)])
    slots = (tables[seq, pos // block_size] * block_size + pos % block_size).astype(np.int32)
    kc, vc = jax_paged.reshape_and_cache(keys[seq, pos], values[seq, pos], kc, vc, slots)

    def decode(kc, vc, tables, start, keys, values, queries):
        def step(i, carry):
            kc, vc, outs = carry
            lens = start + i
            slot = jnp.take_along_axis(tables, (lens // block_size)[:, None], 1)[:, 0]
            slot = slot * block_size + lens % block_size
            idx = jnp.arange(num_seqs)
            kc, vc = jax_paged.reshape_and_cache(keys[idx, lens], values[idx, lens], kc, vc, slot)
            out = jax_paged.paged_attention(queries[i], kc, vc, tables, lens + 1)
            return kc, vc, outs.at[i].set(out)
        outs = jnp.zeros(queries.shape, queries.dtype)
        return jax.lax.fori_loop(0, steps, step, (kc, vc, outs))

    args = on(platform, kc, vc, tables, start, keys, values, queries)
    kc_ptr = args[0].unsafe_buffer_pointer()
    kc2, _, outs = jax.jit(decode, donate_argnums=(0, 1))(*args)
    assert args[0].is_deleted() and kc2.unsafe_buffer_pointer() == kc_ptr
    outs = np.asarray(outs)
    for i in range(steps):
        lens = start + i + 1
        expected = dense_attention(queries[i], [keys[s, :lens[s]] for s in range(num_seqs)],
                                   [values[s, :lens[s]] for s in range(num_seqs)],
                                   head_size ** -0.5)
        np.testing.assert_allclose(outs[i], expected, atol=2e-5, rtol=2e-5)


# ---- trace-time errors --------------------------------------------------------

def _valid(dtype=np.float32, num_heads=8, num_kv_heads=2, head_size=64, block_size=16):
    x = 16 // np.dtype(dtype).itemsize
    return dict(
        query=jax.ShapeDtypeStruct((3, num_heads, head_size), dtype),
        key_cache=jax.ShapeDtypeStruct((10, num_kv_heads, head_size // x, block_size, x), dtype),
        value_cache=jax.ShapeDtypeStruct((10, num_kv_heads, head_size, block_size), dtype),
        block_tables=jax.ShapeDtypeStruct((3, 4), np.int32),
        seq_lens=jax.ShapeDtypeStruct((3,), np.int32))


def _trace(**overrides):
    args = _valid()
    kwargs = {k: overrides.pop(k) for k in ("impl", "partition_size", "scale")
              if k in overrides}
    args.update(overrides)
    jax.eval_shape(lambda a: jax_paged.paged_attention(**a, **kwargs), args)


@pytest.mark.parametrize("override,error,match", [
    (dict(query=jax.ShapeDtypeStruct((3, 7, 64), np.float32)), ValueError,
     r"num_heads \(7.*multiple of num_kv_heads \(2"),
    (dict(query=jax.ShapeDtypeStruct((3, 8, 128), np.float32)), ValueError,
     r"head size.*64.*differs from head_size 128"),
    (dict(query=jax.ShapeDtypeStruct((3, 8, 64), np.int32)), TypeError, r"query must be float"),
    (dict(query=jax.ShapeDtypeStruct((3, 8), np.float32)), ValueError, r"query must be \["),
    (dict(block_tables=jax.ShapeDtypeStruct((3, 4), np.int16)), TypeError,
     r"block_tables must be int32, got int16"),
    (dict(block_tables=jax.ShapeDtypeStruct((2, 4), np.int32)), ValueError,
     r"block_tables must be \[num_seqs=3"),
    (dict(seq_lens=jax.ShapeDtypeStruct((4,), np.int32)), ValueError,
     r"seq_lens must be \[num_seqs\] = \(3,\), got shape \(4,\)"),
    (dict(seq_lens=jax.ShapeDtypeStruct((3,), np.float32)), TypeError, r"seq_lens must be int32"),
    (dict(value_cache=jax.ShapeDtypeStruct((10, 2, 64, 8), np.float32)), ValueError,
     r"value_cache must be .* to match key_cache"),
    (dict(value_cache=jax.ShapeDtypeStruct((10, 2, 64, 16), jnp.bfloat16)), TypeError,
     r"value_cache dtype bfloat16 differs from key_cache dtype float32"),
    (dict(key_cache=jax.ShapeDtypeStruct((10, 2, 8, 16, 8), np.float32)), ValueError,
     r"key_cache must be \[num_blocks, num_kv_heads, head_size // 4, block_size, 4\]"),
    (dict(key_cache=jax.ShapeDtypeStruct((10, 2, 16, 12, 4), np.float32),
          value_cache=jax.ShapeDtypeStruct((10, 2, 64, 12), np.float32)), ValueError,
     r"block_size .* must be one of \(8, 16, 32\), got 12"),
    (dict(query=jax.ShapeDtypeStruct((3, 8, 64), jnp.bfloat16)), TypeError,
     r"key_cache dtype float32 differs from the query/key dtype bfloat16"),
    (dict(impl="v3"), ValueError, r"impl must be one of"),
    (dict(partition_size=100), ValueError, r"partition_size must be a positive multiple of "
                                           r"block_size \(16\) below 2\^31, got 100"),
    (dict(alibi_slopes=jax.ShapeDtypeStruct((4,), np.float32)), ValueError,
     r"alibi_slopes must be \[num_heads\] = \(8,\)"),
    (dict(scale=float("nan")), ValueError, r"scale must be 0 or finite .* got nan"),
    (dict(scale="0.5"), TypeError, r"scale must be a static Python number or None .* got str"),
    (dict(scale=np.ones(2, np.float32)), TypeError,
     r"scale must be a static Python number or None .* got ndarray"),
])
def test_attention_errors(override, error, match):
    with pytest.raises(error, match=match):
        _trace(**override)


def test_traced_scale_is_a_clear_error():
    """The softmax scale is compiled into the kernel: a traced one is refused by name
    (not with JAX's generic concretization error); static numbers of any kind pass."""
    with pytest.raises(TypeError, match=r"scale must be a static Python number .* got a "
                                        r"traced value"):
        jax.eval_shape(lambda a, s: jax_paged.paged_attention(**a, scale=s), _valid(),
                       jax.ShapeDtypeStruct((), np.float32))
    for scale in (0.125, 1, np.float32(0.125), np.array(0.125)):
        out = jax.eval_shape(lambda a: jax_paged.paged_attention(**a, scale=scale), _valid())
        assert out.shape == (3, 8, 64)


def test_unsupported_head_size():
    args = _valid(head_size=264)
    with pytest.raises(ValueError, match=r"head_size must be a multiple of 8 in \[8, 256\], "
                                         r"got 264"):
        jax.eval_shape(lambda a: jax_paged.paged_attention(**a), args)


def test_cuda_head_sizes_without_a_kernel():
    """A head size the CUDA kernels are not built for: impl="auto" falls back to the jnp
    reference and warns; a named kernel is a ValueError naming the head size and the impl."""
    assert primitives.cuda_has_head_size("auto", 128)
    assert not primitives.cuda_has_head_size("reference", 16)
    with pytest.warns(UserWarning, match=r"no CUDA kernel for head_size 16 .*runs the jnp"):
        assert not primitives.cuda_has_head_size("auto", 16)
    for impl in ("v1", "v2", "grouped"):
        with pytest.raises(ValueError, match=rf"support head_size in .*got 16 with impl='{impl}'"):
            primitives.cuda_has_head_size(impl, 16)


def test_cache_write_errors():
    kc = jax.ShapeDtypeStruct((10, 2, 16, 16, 4), np.float32)
    vc = jax.ShapeDtypeStruct((10, 2, 64, 16), np.float32)
    k = jax.ShapeDtypeStruct((5, 2, 64), np.float32)
    slots = jax.ShapeDtypeStruct((5,), np.int32)
    write = lambda *a: jax_paged.reshape_and_cache(*a)  # noqa: E731
    with pytest.raises(ValueError, match=r"slot_mapping must be \[num_tokens\] = \(5,\)"):
        jax.eval_shape(write, k, k, kc, vc, jax.ShapeDtypeStruct((4,), np.int32))
    with pytest.raises(TypeError, match=r"slot_mapping must be int32"):
        jax.eval_shape(write, k, k, kc, vc, jax.ShapeDtypeStruct((5,), np.uint32))
    with pytest.raises(ValueError, match=r"key_cache has 2 KV heads .* but the keys have 4"):
        jax.eval_shape(write, jax.ShapeDtypeStruct((5, 4, 64), np.float32),
                       jax.ShapeDtypeStruct((5, 4, 64), np.float32), kc, vc, slots)
    with pytest.raises(ValueError, match=r"value shape \(5, 2, 32\) differs from key shape"):
        jax.eval_shape(write, k, jax.ShapeDtypeStruct((5, 2, 32), np.float32), kc, vc, slots)
    with pytest.raises(TypeError, match=r"differs from the query/key dtype float16"):
        jax.eval_shape(write, jax.ShapeDtypeStruct((5, 2, 64), np.float16),
                       jax.ShapeDtypeStruct((5, 2, 64), np.float16), kc, vc, slots)
    with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
        jax.eval_shape(jax_paged.copy_blocks, kc, vc, jax.ShapeDtypeStruct((5, 3), np.int32))


# ---- check_inputs --------------------------------------------------------------

def test_check_inputs_eager():
    tables = np.array([[0, 1, -1], [2, 9, 3], [4, 5, 6], [7, -1, -1]], np.int32)
    jax_paged.check_inputs(tables, np.array([20, 10, 48, 16], np.int32), 8, 16)  # fine
    with pytest.raises(ValueError) as e:
        jax_paged.check_inputs(tables, np.array([40, 20, -1, 17], np.int32), 8, 16)
    msg = str(e.value)
    assert "block_tables: sequences [0, 1, 3] use block ids outside [0, 8)" in msg
    assert "seq_lens: sequences [2] have negative lengths" in msg
    with pytest.raises(ValueError, match=r"sequences \[1\] are longer than the table's "
                                         r"capacity 48"):
        jax_paged.check_inputs(tables[:2], np.array([1, 49], np.int32), 10, 16)


def test_check_inputs_under_jit_with_checkify():
    tables = np.array([[0, 1], [2, 8]], np.int32)

    @jax.jit
    def f(tables, lens):
        jax_paged.check_inputs(tables, lens, 8, 16)
        return lens.sum()

    checked = checkify.checkify(f)
    err, _ = checked(tables, np.array([32, 10], np.int32))
    assert err.get() is None
    err, _ = checked(tables, np.array([32, 17], np.int32))
    assert "sequence 1 uses a block id outside [0, 8)" in err.get()


# ---- property test over shapes ----------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 5]),
       head_size=st.sampled_from([8, 24, 64]), block_size=st.sampled_from([8, 16, 32]),
       lens=st.lists(st.integers(0, 90), min_size=1, max_size=4),
       dtype=st.sampled_from(["float32", "bfloat16"]), impl=st.sampled_from(["v1", "v2"]),
       seed=st.integers(0, 2 ** 16))
def test_property_cpu_matches_reference(num_kv_heads, group, head_size, block_size, lens, dtype,
                                        impl, seed):
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    inp = make_paged_inputs(rng, lens, num_kv_heads * group, num_kv_heads, head_size,
                            block_size, dtype)
    with jax.default_device(jax.devices("cpu")[0]):
        out = jax_paged.paged_attention(*inp.args(), impl=impl, partition_size=2 * block_size)
        expected = reference.paged_attention(*inp.args(), impl=impl,
                                             partition_size=2 * block_size)
    assert_close(out, expected, dtype)
    assert TOLERANCES[np.dtype(dtype)]


# ---- differentiation -------------------------------------------------------------

def test_grad_wrt_query_and_cache_values():
    from jax.test_util import check_grads
    rng = np.random.default_rng(7)
    inp = make_paged_inputs(rng, [3, 20, 0], 4, 2, 16, 8, np.float32)
    slopes = rng.random(4).astype(np.float32)
    # Unused slots are NaN: the gradient must stay finite anyway.
    q, kc, vc = (jnp.asarray(a) for a in inp.args()[:3])

    def loss(q, kc, vc):
        out = jax_paged.paged_attention(q, kc, vc, inp.block_tables, inp.seq_lens,
                                        alibi_slopes=slopes)
        return jnp.sum(out * jnp.cos(out))

    d_query, d_key_cache, d_value_cache = jax.grad(loss, argnums=(0, 1, 2))(q, kc, vc)
    for g in (d_query, d_key_cache, d_value_cache):
        assert np.all(np.isfinite(np.asarray(g)))
    # Slots outside every sequence (NaN here) get exactly zero gradient; used
    # slots get some.
    for g, cache in ((d_key_cache, inp.key_cache), (d_value_cache, inp.value_cache)):
        g = np.asarray(g)
        assert np.all(g[np.isnan(cache)] == 0)
        assert np.abs(g[~np.isnan(cache)]).sum() > 0
    assert np.all(np.asarray(d_query)[2] == 0)  # the empty sequence
    # Numerical check on clean (NaN-free) caches, at points away from the masks.
    kc0 = jnp.nan_to_num(kc)
    vc0 = jnp.nan_to_num(vc)
    check_grads(lambda q, kc, vc: jax_paged.paged_attention(
        q, kc, vc, inp.block_tables, inp.seq_lens, alibi_slopes=slopes),
        (q, kc0, vc0), order=1, modes=["fwd", "rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_jvp_matches_the_reference_and_the_value_is_the_kernels():
    rng = np.random.default_rng(8)
    inp = make_paged_inputs(rng, [3, 20, 0], 4, 2, 16, 8, np.float32, poison=False)
    q, kc, vc = (jnp.asarray(a) for a in inp.args()[:3])
    dq, dkc, dvc = (jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (q, kc, vc))

    def run(fn):
        return jax.jvp(lambda q, kc, vc: fn(q, kc, vc, inp.block_tables, inp.seq_lens,
                                            soft_cap=5.0, return_lse=True),
                       (q, kc, vc), (dq, dkc, dvc))
    (out, lse), (d_out, d_lse) = run(jax_paged.paged_attention)
    (ref_out, ref_lse), (ref_d_out, ref_d_lse) = run(reference.paged_attention)
    for got, want in ((out, ref_out), (d_out, ref_d_out), (d_lse, ref_d_lse)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax_paged.paged_attention(
        q, kc, vc, inp.block_tables, inp.seq_lens, soft_cap=5.0)))
    # A tangent on the query alone, under jit: only the query's derivative is built.
    f = jax.jit(lambda q, t: jax.jvp(lambda q: jax_paged.paged_attention(
        q, kc, vc, inp.block_tables, inp.seq_lens), (q,), (t,)))
    _, d_only_q = f(q, dq)
    _, want = jax.jvp(lambda q: reference.paged_attention(q, kc, vc, inp.block_tables,
                                                          inp.seq_lens), (q,), (dq,))
    np.testing.assert_allclose(np.asarray(d_only_q), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_cache_ops_are_differentiable():
    rng = np.random.default_rng(9)
    kc = jnp.asarray(rng.standard_normal((4, 2, 4, 8, 4)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((4, 2, 16, 8)), jnp.float32)
    key = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    slots = jnp.array([0, 9, 31], jnp.int32)
    mapping = jnp.array([[0, 3]], jnp.int32)

    def loss(fns, key, kc, vc):
        write, copy = fns
        kc, vc = write(key, 2 * key, kc, vc, slots)
        kc, vc = copy(kc, vc, mapping)
        return jnp.sum(kc ** 2) + jnp.sum(jnp.sin(vc))
    ops = (jax_paged.reshape_and_cache, jax_paged.copy_blocks)
    refs = (reference.reshape_and_cache, reference.copy_blocks)
    got = jax.grad(functools.partial(loss, ops), argnums=(0, 1, 2))(key, kc, vc)
    want = jax.grad(functools.partial(loss, refs), argnums=(0, 1, 2))(key, kc, vc)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_fp8_head_size_rule_is_named():
    kc = jax.ShapeDtypeStruct((4, 2, 5, 16, 16), jnp.float8_e4m3fn)   # head size 80
    vc = jax.ShapeDtypeStruct((4, 2, 80, 16), jnp.float8_e4m3fn)
    q = jax.ShapeDtypeStruct((1, 2, 72), jnp.float32)                 # 72 % 16 != 0
    tables = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"head_size 72: fp8 caches need head_size to be a multiple of 16"):
        jax.eval_shape(jax_paged.paged_attention, q, kc, vc, tables, lens)
    key = jax.ShapeDtypeStruct((1, 2, 72), jnp.float32)
    with pytest.raises(ValueError, match=r"head_size 72: fp8 caches need head_size to be a multiple of 16"):
        jax.eval_shape(jax_paged.reshape_and_cache, key, key, kc, vc,
                       jax.ShapeDtypeStruct((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"with fp8 caches \(head sizes that are multiples of "
                                         r"16\) support head_size in"):
        primitives.cuda_has_head_size("v1", 120, jnp.float8_e4m3fn)


def test_size_lists_come_from_the_native_module():
    from jax_paged import _native, _shapes
    assert primitives.CUDA_HEAD_SIZES == tuple(_native.cpu_module.head_sizes)
    assert _shapes.SUPPORTED_BLOCK_SIZES == tuple(_native.cpu_module.block_sizes)
    assert all(h % 16 == 0 for h in _shapes.CUDA_FP8_HEAD_SIZES)
    assert set(_shapes.CUDA_FP8_HEAD_SIZES) == {h for h in primitives.CUDA_HEAD_SIZES
                                               if h % 16 == 0}
    assert primitives._cpu_threads() == _native.cpu_module.cpu_threads() >= 1
