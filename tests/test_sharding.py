"""Sharding of the top-level ops under plain jax.jit, on 4 CPU devices (conftest
asks XLA for 4 host devices): no collective in the compiled program, the output
keeps the head sharding, results equal the unsharded call; vmap, grad and
donation still work; uneven head splits are refused by name."""
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_paged
from jax_paged import primitives, sharding
from paged_inputs import dense_attention, make_paged_inputs

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices")

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(-start)?\(")


def cpu_mesh(shape, names):
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]).reshape(shape), names)


def placer(mesh):
    return lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))


def assert_local(f, *args):
    hlo = f.lower(*args).compile().as_text()
    match = COLLECTIVES.search(hlo)
    assert match is None, match.group(0)
    return hlo


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 4), (8, 8), (8, 1)])
def test_head_sharded_attention_is_local(num_heads, num_kv_heads):
    rng = np.random.default_rng(0)
    inp = make_paged_inputs(rng, [5, 40, 77, 0], num_heads, num_kv_heads, 64, 16, np.float32,
                            poison=False)
    put = placer(cpu_mesh((4,), ("tp",)))
    cache_axis = "tp" if num_kv_heads % 4 == 0 else None  # MQA: the one KV head stays whole
    args = (put(inp.query, None, "tp", None), put(inp.key_cache, None, cache_axis),
            put(inp.value_cache, None, cache_axis), put(inp.block_tables), put(inp.seq_lens))
    f = jax.jit(jax_paged.paged_attention)
    hlo = assert_local(f, *args)
    assert "jax_paged_attention" in hlo
    out = f(*args)
    assert out.sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax_paged.paged_attention(
        *inp.args())))


def test_every_feature_sharded_over_sequences_and_heads():
    """A 2 x 2 mesh: sequences over "dp", heads over "tp"; 4-D queries, lse, ALiBi,
    soft cap, window and fp8 caches with per-KV-head scales."""
    rng = np.random.default_rng(1)
    inp = make_paged_inputs(rng, [5, 40, 77, 3], 8, 4, 64, 16, np.float32, poison=False)
    query = rng.standard_normal((4, 3, 8, 64)).astype(np.float32)
    num_blocks = inp.key_cache.shape[0]
    kc = jnp.asarray(rng.standard_normal((num_blocks, 4, 4, 16, 16)), jnp.float8_e4m3fn)
    vc = jnp.asarray(rng.standard_normal((num_blocks, 4, 64, 16)), jnp.float8_e4m3fn)
    slopes = np.linspace(0.05, 0.5, 8).astype(np.float32)
    scales = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    kw = dict(alibi_slopes=slopes, soft_cap=30.0, sliding_window=24, return_lse=True)
    put = placer(cpu_mesh((2, 2), ("dp", "tp")))
    args = (put(query, "dp", None, "tp", None), put(kc, None, "tp"), put(vc, None, "tp"),
            put(inp.block_tables, "dp"), put(inp.seq_lens, "dp"), put(scales, "tp"),
            put(scales[::-1].copy(), "tp"))

    def attend(q, kc, vc, bt, sl, ks, vs):
        return jax_paged.paged_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=vs, **kw)
    f = jax.jit(attend)
    assert_local(f, *args)
    out, lse = f(*args)
    assert out.sharding.spec == P("dp", None, "tp") and lse.sharding.spec == P("dp", None, "tp")
    want_out, want_lse = attend(query, kc, vc, inp.block_tables, inp.seq_lens, scales,
                                scales[::-1].copy())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-6)


def test_write_attend_and_copy_in_place_per_device():
    """A decode step under jit with the caches donated: the write and the block copy run
    on each device's KV heads, in place (the donated buffers are reused)."""
    rng = np.random.default_rng(2)
    inp = make_paged_inputs(rng, [5, 40, 77], 8, 4, 64, 16, np.float32, poison=False,
                            extra_blocks=4)
    put = placer(cpu_mesh((4,), ("tp",)))
    new_k = rng.standard_normal((3, 4, 64)).astype(np.float32)
    new_v = rng.standard_normal((3, 4, 64)).astype(np.float32)
    free = sorted(set(range(inp.key_cache.shape[0])) - set(inp.block_tables.ravel().tolist()))
    slots = np.array([free[0] * 16 + 1, free[1] * 16, -1], np.int32)
    mapping = np.array([[inp.block_tables[0, 0], free[2]]], np.int32)

    def step(q, kc, vc, bt, sl, k, v, slots, mapping):
        kc, vc = jax_paged.reshape_and_cache(k, v, kc, vc, slots)
        kc, vc = jax_paged.copy_blocks(kc, vc, mapping)
        return jax_paged.paged_attention(q, kc, vc, bt, sl), kc, vc

    f = jax.jit(step, donate_argnums=(1, 2))
    make_args = lambda: (put(inp.query, None, "tp"), put(inp.key_cache, None, "tp"),  # noqa: E731
                         put(inp.value_cache, None, "tp"), put(inp.block_tables),
                         put(inp.seq_lens), put(new_k, None, "tp"), put(new_v, None, "tp"),
                         put(slots), put(mapping))
    args = make_args()
    hlo = assert_local(f, *args)
    assert "jax_paged_reshape_and_cache" in hlo and "jax_paged_copy_blocks" in hlo
    pointers = [s.data.unsafe_buffer_pointer() for s in args[1].addressable_shards]
    out, kc, vc = f(*args)
    assert args[1].is_deleted()
    assert [s.data.unsafe_buffer_pointer() for s in kc.addressable_shards] == pointers
    assert out.sharding.spec[1] == "tp" and kc.sharding.spec[1] == "tp"
    want = step(*make_args())
    for got, expected in zip((out, kc, vc), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_vmap_and_grad_under_sharding():
    rng = np.random.default_rng(3)
    inp = make_paged_inputs(rng, [5, 40], 8, 4, 64, 16, np.float32, poison=False)
    put = placer(cpu_mesh((4,), ("tp",)))
    queries = rng.standard_normal((3,) + inp.query.shape).astype(np.float32)
    kc, vc = put(inp.key_cache, None, "tp"), put(inp.value_cache, None, "tp")

    batched = jax.jit(jax.vmap(jax_paged.paged_attention, in_axes=(0, None, None, None, None)))
    out = batched(put(queries, None, None, "tp"), kc, vc, inp.block_tables, inp.seq_lens)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(
            jax_paged.paged_attention(queries[i], *inp.args()[1:])))

    loss = lambda q, kc, vc: jnp.sum(jax_paged.paged_attention(  # noqa: E731
        q, kc, vc, inp.block_tables, inp.seq_lens) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(put(inp.query, None, "tp"), kc, vc)
    want = jax.grad(loss, argnums=(0, 1))(*inp.args()[:3])
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def test_detector_sees_a_gather_without_the_rule():
    """The collective check can fail: the bare primitive (no partitioning rule) with a
    cache sharded on heads makes XLA gather it."""
    rng = np.random.default_rng(4)
    inp = make_paged_inputs(rng, [5, 40], 8, 4, 64, 16, np.float32, poison=False)
    put = placer(cpu_mesh((4,), ("tp",)))
    args = (put(inp.query, None, "tp", None), put(inp.key_cache, None, "tp"),
            put(inp.value_cache, None, "tp"), put(inp.block_tables), put(inp.seq_lens))
    none = jnp.zeros((0,), jnp.float32)

    def bare(q, kc, vc, bt, sl):
        return primitives.paged_attention_p.bind(
            q, kc, vc, bt, sl, none, none, none, scale=0.125, impl="auto", partition_size=512,
            soft_cap=0.0, sliding_window=0, return_lse=False)[0]
    assert COLLECTIVES.search(jax.jit(bare).lower(*args).compile().as_text())


def test_uneven_kv_heads_are_refused_by_name():
    rng = np.random.default_rng(5)
    inp = make_paged_inputs(rng, [5, 40], 8, 2, 64, 16, np.float32, poison=False)
    put = placer(cpu_mesh((4,), ("tp",)))
    args = (put(inp.query, None, "tp"),) + tuple(inp.args()[1:])
    with pytest.raises(Exception, match=r"num_kv_heads \(2\) does not divide evenly over mesh "
                                        r"axis 'tp' of size 4"):
        jax.jit(jax_paged.paged_attention)(*args)
    mesh = cpu_mesh((2,), ("tp",))
    with pytest.raises(ValueError, match=r"num_heads \(3\) does not divide evenly"):
        primitives.head_split("paged_attention", mesh, "tp", 1, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) does not divide evenly"):
        primitives.head_split("reshape_and_cache", mesh, "tp", 3)
    assert primitives.head_split("paged_attention", mesh, "tp", 4, 8) == "tp"
    assert primitives.head_split("paged_attention", mesh, "tp", 1, 8) is None  # MQA


def test_sharding_module_names_the_top_level_ops():
    assert sharding.paged_attention is jax_paged.paged_attention
    assert sharding.reshape_and_cache is jax_paged.reshape_and_cache
    assert sharding.copy_blocks is jax_paged.copy_blocks


def test_data_parallel_own_pools():
    rng = np.random.default_rng(6)
    n = 4
    per_device = [make_paged_inputs(rng, [9, 33], 4, 2, 64, 16, np.float32, extra_blocks=2,
                                    poison=False) for _ in range(n)]
    stacked = [np.concatenate(a) for a in zip(*(i.args() for i in per_device))]
    mesh = cpu_mesh((n,), ("dp",))
    args = [jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in stacked]
    out = np.asarray(jax.jit(sharding.data_parallel(mesh, "dp"))(*args))
    for d, inp in enumerate(per_device):
        expected = dense_attention(inp.query, inp.keys, inp.values, 64 ** -0.5)
        np.testing.assert_allclose(out[2 * d:2 * d + 2], expected, atol=2e-5, rtol=2e-5)
