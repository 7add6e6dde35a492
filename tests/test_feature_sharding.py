"""The sharded wrappers pass every feature argument through (4 CPU devices from
conftest): tensor parallel over KV heads, data parallel over sequences."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jax_paged import reference
from feature_helpers import make_inputs
from paged_inputs import assert_close


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices")
def test_sharding_passes_the_new_arguments_through():
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_paged import sharding
    rng = np.random.default_rng(26)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    inp = make_inputs(rng, [5, 40, 77, 130], 16, 4, 64, 16, jnp.float8_e5m2)
    ks = rng.uniform(0.5, 2, size=4).astype(np.float32)
    kw = dict(soft_cap=3.0, sliding_window=50)
    new_k = rng.standard_normal((2, 4, 64)).astype(np.float32)
    slots = np.array([7, -1], np.int32)

    def step(q, kc, vc, bt, sl, k):
        kc, vc = sharding.reshape_and_cache(k, k, kc, vc, slots, k_scale=ks, v_scale=ks)
        return sharding.paged_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=ks, **kw)

    out = jax.jit(step)(put(inp.query, None, "tp", None), put(inp.key_cache, None, "tp"),
                        put(inp.value_cache, None, "tp"), put(inp.block_tables),
                        put(inp.seq_lens), put(new_k, None, "tp"))
    assert out.sharding.spec[1] == "tp"
    kc, vc = reference.reshape_and_cache(new_k, new_k, inp.key_cache, inp.value_cache, slots,
                                         k_scale=ks, v_scale=ks)
    want = reference.paged_attention(inp.query, kc, vc, inp.block_tables, inp.seq_lens,
                                     k_scale=ks, v_scale=ks, **kw)
    assert_close(out, want, np.float32, "tensor parallel")

    # Data parallel: every keyword passes through, multi-token queries and LSE included.
    dp = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("dp",))
    inps = [make_inputs(rng, [9, 33], 8, 2, 64, 16, jnp.float8_e4m3fn, q_len=3,
                        extra_blocks=2) for _ in range(2)]
    q = np.concatenate([i.query for i in inps])
    kc = np.concatenate([i.key_cache for i in inps])
    vc = np.concatenate([i.value_cache for i in inps])
    bt = np.concatenate([i.block_tables for i in inps])
    sl = np.concatenate([i.seq_lens for i in inps])
    attend = sharding.data_parallel(dp, "dp")
    out, lse = jax.jit(lambda *a: attend(*a, k_scale=ks[:2], return_lse=True, **kw))(
        q, kc, vc, bt, sl)
    for d, i in enumerate(inps):
        want, want_lse = reference.paged_attention(*i.args(), k_scale=ks[:2], return_lse=True,
                                                   **kw)
        assert_close(np.asarray(out)[2 * d:2 * d + 2], want, np.float32, f"shard {d}")
        np.testing.assert_allclose(np.asarray(lse)[2 * d:2 * d + 2], want_lse, atol=2e-5,
                                   rtol=2e-5)
