"""Sharding rules on several CPU devices (conftest asks XLA for 4 host devices)."""
import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_paged
from jax_paged import sharding
from paged_inputs import dense_attention, make_paged_inputs

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices")

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(-start)?\(")


def cpu_mesh(n, name):
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]), (name,))


def test_tensor_parallel_attention_and_write_have_no_collectives():
    rng = np.random.default_rng(0)
    inp = make_paged_inputs(rng, [5, 40, 77], 16, 4, 64, 16, np.float32, poison=False)
    mesh = cpu_mesh(4, "tp")
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    q = put(inp.query, None, "tp", None)
    kc, vc = put(inp.key_cache, None, "tp"), put(inp.value_cache, None, "tp")
    bt, sl = put(inp.block_tables), put(inp.seq_lens)
    new_k = rng.standard_normal((3, 4, 64)).astype(np.float32)
    new_v = rng.standard_normal((3, 4, 64)).astype(np.float32)
    slots = np.array([5, 40 + 16 * 3 + 1, -1], np.int32)  # distinct free slots and a skip

    def step(q, kc, vc, bt, sl, k, v, slots):
        kc, vc = sharding.reshape_and_cache(k, v, kc, vc, slots)
        return sharding.paged_attention(q, kc, vc, bt, sl), kc, vc

    f = jax.jit(step)
    args = (q, kc, vc, bt, sl, put(new_k, None, "tp"), put(new_v, None, "tp"), put(slots))
    out, kc2, vc2 = f(*args)
    assert out.sharding.spec[1] == "tp"
    assert kc2.sharding.spec[1] == "tp"
    hlo = f.lower(*args).compile().as_text()
    assert not COLLECTIVES.search(hlo), COLLECTIVES.search(hlo).group(0)
    assert hlo.count("jax_paged_attention") >= 1
    # Sharded equals unsharded.
    kc_ref, vc_ref = jax_paged.reshape_and_cache(new_k, new_v, inp.key_cache, inp.value_cache,
                                                 slots)
    expected = jax_paged.paged_attention(inp.query, kc_ref, vc_ref, inp.block_tables,
                                         inp.seq_lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kc2), np.asarray(kc_ref))


def test_detector_sees_a_gather_when_sharding_is_ignored():
    """The collective check above can fail: the plain primitive (no rule) with a
    cache sharded on heads makes XLA gather it."""
    rng = np.random.default_rng(1)
    inp = make_paged_inputs(rng, [5, 40], 8, 4, 64, 16, np.float32, poison=False)
    mesh = cpu_mesh(4, "tp")
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    args = (put(inp.query, None, "tp", None), put(inp.key_cache, None, "tp"),
            put(inp.value_cache, None, "tp"), put(inp.block_tables), put(inp.seq_lens))
    hlo = jax.jit(jax_paged.paged_attention).lower(*args).compile().as_text()
    assert COLLECTIVES.search(hlo)


def test_copy_blocks_tensor_parallel():
    rng = np.random.default_rng(2)
    inp = make_paged_inputs(rng, [20], 8, 4, 64, 16, np.float32, poison=False, extra_blocks=4)
    mesh = cpu_mesh(2, "tp")
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    mapping = np.array([[0, 3], [1, 4]], np.int32)
    f = jax.jit(sharding.copy_blocks)
    args = (put(inp.key_cache, None, "tp"), put(inp.value_cache, None, "tp"), put(mapping))
    kc, vc = f(*args)
    assert not COLLECTIVES.search(f.lower(*args).compile().as_text())
    want = jax_paged.copy_blocks(inp.key_cache, inp.value_cache, mapping)
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(vc), np.asarray(want[1]))


def test_uneven_heads_raise():
    """jax refuses uneven shardings at device_put, so the rule's own check is
    exercised directly, with the shardings the partitioner would pass it."""
    mesh = cpu_mesh(2, "tp")
    cache_sharding = NamedSharding(mesh, P(None, "tp"))
    assert sharding._heads_axis(mesh, cache_sharding, ("num_kv_heads", 4)) == "tp"
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) does not divide evenly over mesh "
                                         r"axis 'tp' of size 2"):
        sharding._heads_axis(mesh, cache_sharding, ("num_heads", 6), ("num_kv_heads", 3))


def test_data_parallel_own_pools():
    rng = np.random.default_rng(4)
    n = 4
    per_device = [make_paged_inputs(rng, [9, 33], 4, 2, 64, 16, np.float32, extra_blocks=2,
                                    poison=False) for _ in range(n)]
    stacked = [np.concatenate(a) for a in zip(*(i.args() for i in per_device))]
    mesh = cpu_mesh(n, "dp")
    args = [jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in stacked]
    out = np.asarray(jax.jit(sharding.data_parallel(mesh, "dp"))(*args))
    for d, inp in enumerate(per_device):
        expected = dense_attention(inp.query, inp.keys, inp.values, 64 ** -0.5)
        np.testing.assert_allclose(out[2 * d:2 * d + 2], expected, atol=2e-5, rtol=2e-5)
