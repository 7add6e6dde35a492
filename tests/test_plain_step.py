"""The grouped CUDA kernel's plain decode step (one query token, 16-bit and fp8
caches): its half-rows and full-rows forms, and the fp8 step at every head and block
size (on the GPU; its checks also run on the CPU kernels)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from conftest import requires_gpu
from feature_helpers import compare, kv_scales, make_inputs


@requires_gpu
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (16, 2), (9, 1), (32, 2)])
def test_gpu_plain_step_half_and_full_rows(cache_dtype, num_heads, num_kv_heads):
    """The plain decode step's kernels (plain, soft cap; 16-bit and fp8 caches)
    come in a half-rows form for CTAs of at most 8 query rows (1 and 8 query
    heads per KV head here), whose loop skips the mma rows 8-15, and the
    full form (9 and 16 rows): both against the reference at edge lengths,
    split over partitions and not, NaN in every unused cache slot. A decode
    step's sliding window runs the same kernels (the window's first token in
    the tile mask), with and without the soft cap."""
    rng = np.random.default_rng(num_heads * 7 + num_kv_heads)
    lens = [0, 1, 16, 17, 511, 512, 513, 2049]
    inp = make_inputs(rng, lens, num_heads, num_kv_heads, 128, 16, cache_dtype,
                      query_dtype=jnp.bfloat16)
    scales = {} if cache_dtype == jnp.bfloat16 else dict(
        k_scale=kv_scales("per_head", num_kv_heads, rng), v_scale=np.float32(0.8))
    compare("gpu", inp, "grouped", return_lse=True, **scales)
    # Windows starting inside a page and on a page boundary, of one token, and
    # longer than some sequences.
    for window in (1, 17, 300):
        compare("gpu", inp, "grouped", sliding_window=window, return_lse=True, **scales)
    if cache_dtype == jnp.bfloat16:  # (fp8 caches' soft cap runs the general kernel)
        compare("gpu", inp, "grouped", scale=0.5, soft_cap=2.0, return_lse=True)
        compare("gpu", inp, "grouped", scale=0.5, soft_cap=2.0, sliding_window=17,
                return_lse=True)


def _check_fp8_plain_step(platform, head_size, block_size):
    """test_gpu_fp8_plain_step_every_head_and_block_size's checks on one platform."""
    rng = np.random.default_rng(head_size * 100 + block_size)
    lens = [0, 1, block_size, block_size + 1, 511, 512, 513, 2049]
    # (4 query heads per KV head: the half-rows form; 16: the full rows.)
    for cache_dtype, num_heads, query_dtype in ((jnp.float8_e4m3fn, 8, jnp.bfloat16),
                                                (jnp.float8_e5m2, 32, jnp.float16)):
        inp = make_inputs(rng, lens, num_heads, 2, head_size, block_size, cache_dtype,
                          query_dtype=query_dtype)
        scales = dict(k_scale=kv_scales("per_head", 2, rng), v_scale=np.float32(0.8))
        compare(platform, inp, "grouped", return_lse=True, **scales)
        compare(platform, inp, "grouped", sliding_window=17, return_lse=True, **scales)


@requires_gpu
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_fp8_plain_step_every_head_and_block_size(head_size, block_size):
    """The fp8 decode step's kernels are instantiated per head size and block size
    (constant shared-memory offsets; at head 64, 32-token warp slices): every pair,
    both fp8 formats and query dtypes, half and full rows, at edge lengths (0, 1, page
    and 512-token boundaries, one that splits over partitions) with NaN in every unused
    cache slot, per-head k scales, lse, and a 17-token window."""
    _check_fp8_plain_step("gpu", head_size, block_size)


def test_fp8_plain_step_checks_on_cpu():
    """The GPU test above, its checks run on the CPU kernels at one head and block size
    (so that the test itself runs in CI)."""
    _check_fp8_plain_step("cpu", 64, 8)
