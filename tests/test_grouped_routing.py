"""Which kernel a call lowers to: impl="grouped" and "auto" reach the grouped CUDA
kernel with every feature on a GPU (the V2 kernel on the CPU), except fp8 caches under
a float32 query; and every feature at once over long ragged contexts on the GPU."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from conftest import requires_gpu
from feature_helpers import compare, kv_scales, make_inputs
from paged_inputs import on


@pytest.mark.parametrize("feature", [
    dict(soft_cap=5.0), dict(sliding_window=64), dict(return_lse=True), dict(q_len=2),
    dict(fp8=True), dict(fp8=True, k_scale=0.5, v_scale=2.0)])
def test_features_lower_to_the_grouped_kernel(platform, feature):
    """impl="grouped" and "auto" run the grouped CUDA kernel with every
    feature on a GPU; on the CPU "grouped" is the V2 kernel."""
    feature = dict(feature)
    rng = np.random.default_rng(24)
    fp8 = feature.pop("fp8", False)
    q_len = feature.pop("q_len", None)
    feature = {k: (np.float32(v) if k.endswith("_scale") else v) for k, v in feature.items()}
    inp = make_inputs(rng, [5, 90], 8, 2, 64, 16, jnp.float8_e4m3fn if fp8 else jnp.bfloat16,
                      query_dtype=jnp.bfloat16, q_len=q_len)
    args = on(platform, *inp.args())
    for impl in ("grouped", "auto"):
        text = jax.jit(lambda *a: jax_paged.paged_attention(*a, impl=impl, **feature)
                       ).lower(*args).as_text()
        if platform == "gpu":
            assert "jax_paged_attention_grouped" in text, impl
        else:
            assert "jax_paged_attention_grouped" not in text
    compare(platform, inp, "grouped", **feature)


def test_fp8_under_a_float32_query_never_lowers_to_the_grouped_kernel(platform):
    """The grouped CUDA kernel widens fp8 to the query's 16-bit dtype; with a
    float32 query impl="grouped" runs classic V2 instead."""
    rng = np.random.default_rng(26)
    inp = make_inputs(rng, [5, 90], 8, 2, 64, 16, jnp.float8_e5m2, query_dtype=np.float32)
    args = on(platform, *inp.args())
    text = jax.jit(lambda *a: jax_paged.paged_attention(*a, impl="grouped")).lower(*args).as_text()
    assert "jax_paged_attention_grouped" not in text
    assert "jax_paged_attention_v2" in text
    compare(platform, inp, "grouped")


@requires_gpu
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (256, 32), (80, 8), (112, 16), (64, 8)])
def test_gpu_features_at_scale(head_size, block_size):
    """Every feature at once over long, ragged contexts on the GPU (grid sizes,
    many partitions, every fp8 instantiation family), against the reference."""
    rng = np.random.default_rng(head_size + block_size)
    lens = rng.integers(1, 3000, size=24)
    lens[:3] = [1, 16, 2999]
    slopes = (2.0 ** -rng.uniform(0, 8, size=32)).astype(np.float32)
    for cache_dtype in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2):
        inp = make_inputs(rng, lens, 32, 8, head_size, block_size, cache_dtype,
                          query_dtype=jnp.bfloat16, q_len=16)
        scales = {} if cache_dtype == jnp.bfloat16 else dict(
            k_scale=kv_scales("per_head", 8, rng), v_scale=np.float32(0.9))
        for impl in ("v1", "v2", "grouped"):
            compare("gpu", inp, impl, alibi_slopes=slopes, soft_cap=30.0, sliding_window=700,
                    return_lse=True, **scales)
