"""The logit soft cap (soft_cap * tanh(logit / soft_cap)) against the reference, alone
and with ALiBi, in every kernel; the grouped CUDA kernel's plain soft-capped step."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from jax_paged import _shapes, primitives
from conftest import requires_gpu
from feature_helpers import IMPLS, attend, compare, make_inputs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_soft_cap_with_alibi(platform, impl, dtype):
    rng = np.random.default_rng(1)
    inp = make_inputs(rng, [0, 1, 31, 513, 700], 8, 2, 64, 16, dtype)
    slopes = (2.0 ** -rng.uniform(0, 8, size=8)).astype(np.float32)
    for soft_cap in (1.5, 30.0):
        # A large scale makes the cap bite (|logit| >> soft_cap before capping).
        compare(platform, inp, impl, scale=0.5, alibi_slopes=slopes, soft_cap=soft_cap)


def test_soft_cap_changes_result(platform):
    rng = np.random.default_rng(2)
    inp = make_inputs(rng, [40, 90], 4, 2, 64, 16, np.float32)
    plain = np.asarray(attend(platform, inp, "v1", scale=1.0))
    capped = np.asarray(attend(platform, inp, "v1", scale=1.0, soft_cap=1.0))
    assert np.abs(plain - capped).max() > 1e-2
    # A huge cap is the identity (tanh(x) ~ x).
    loose = np.asarray(attend(platform, inp, "v1", scale=1.0, soft_cap=1e6))
    np.testing.assert_allclose(loose, plain, atol=1e-4, rtol=1e-4)


@requires_gpu
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (64, 8), (256, 32), (80, 16)])
def test_gpu_grouped_plain_soft_cap(cache_dtype, head_size, block_size):
    """A decode step whose only feature is the soft cap runs a grouped kernel
    of its own with 16-bit caches (plain, plus the cap): against the reference
    at edge lengths (0, 1, a block, around the 512-token partition size), split
    over partitions (the reduce runs) and in one partition (direct out)."""
    rng = np.random.default_rng(head_size + block_size)
    split = make_inputs(rng, [0, 1, block_size, 511, 512, 513, 1024, 3000], 32, 8, head_size,
                        block_size, cache_dtype)
    lens = rng.integers(0, 300, size=48)
    lens[:4] = [0, 1, block_size, 2 * block_size]
    direct = make_inputs(rng, lens, 32, 8, head_size, block_size, cache_dtype)
    for inp, one_partition in ((split, False), (direct, True)):
        dims = _shapes.check_paged_attention(*inp.args())
        assert (primitives.grouped_partition_size("cuda", dims) >= dims.capacity) == one_partition
        for soft_cap in (2.0, 30.0):  # 2.0 bites (logits of a few units at scale 0.5)
            compare("gpu", inp, "grouped", scale=0.5, soft_cap=soft_cap, return_lse=True)
            compare("gpu", inp, "auto", scale=0.5, soft_cap=soft_cap)
