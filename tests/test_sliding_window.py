"""Sliding windows against the reference: window sizes around blocks and partitions,
blocks before the window never read, impl="auto"'s choice for a short window, and the
grouped CUDA kernel's grid over a window's partitions."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import _shapes, primitives, reference
from conftest import requires_gpu
from feature_helpers import IMPLS, attend, compare, kv_scales, make_inputs
from paged_inputs import assert_close, on, reference_on_cpu


WINDOW_LENS = [0, 1, 16, 31, 64, 511, 512, 513, 700, 1100]


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
@pytest.mark.parametrize("window", [1, 16, 17, 100, 512, 513, 4096])
def test_sliding_window(platform, impl, window):
    """Windows of one token, one block, a block + 1, crossing 512-token
    partitions, and larger than every sequence (w >= L: plain attention)."""
    rng = np.random.default_rng(window)
    inp = make_inputs(rng, WINDOW_LENS, 8, 2, 64, 16, jnp.bfloat16)
    compare(platform, inp, impl, sliding_window=window)
    if impl == "v2":
        compare(platform, inp, impl, sliding_window=window, partition_size=64)


def test_window_at_least_length_is_plain_attention(platform):
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, [5, 100, 300], 4, 2, 64, 16, np.float32)
    plain = np.asarray(attend(platform, inp, "v1"))
    for impl in ("v1", "v2"):
        out = np.asarray(attend(platform, inp, impl, sliding_window=300))
        np.testing.assert_allclose(out, plain, atol=2e-5, rtol=2e-5)


def test_window_of_one_token_returns_last_value(platform):
    rng = np.random.default_rng(4)
    inp = make_inputs(rng, [1, 17, 600], 4, 4, 64, 16, np.float32)
    for impl in ("v1", "v2"):
        out = np.asarray(attend(platform, inp, impl, sliding_window=1))
        for s, L in enumerate(inp.seq_lens):
            np.testing.assert_allclose(out[s], inp.values[s][L - 1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
def test_blocks_outside_window_are_not_read(platform, impl):
    """Table entries of blocks wholly before the window point at a NaN block
    (or hold garbage): a kernel that reads them produces NaN."""
    rng = np.random.default_rng(5)
    block_size, window = 16, 40
    inp = make_inputs(rng, [100, 700, 1030, 33], 8, 2, 64, block_size, np.float32,
                      extra_blocks=2)
    used = set(inp.block_tables[inp.block_tables >= 0].tolist())
    nan_block = next(b for b in range(inp.key_cache.shape[0]) if b not in used)
    assert np.isnan(inp.key_cache[nan_block]).all()
    expected = reference_on_cpu(reference.paged_attention, *inp.args(), sliding_window=window)
    for s, L in enumerate(inp.seq_lens):
        first_needed = max(0, int(L) - window) // block_size
        inp.block_tables[s, :first_needed] = nan_block if s % 2 == 0 else -(10 ** 6)
    out = attend(platform, inp, impl, sliding_window=window, partition_size=64)
    assert_close(out, expected, np.float32, "window must skip blocks before it")


def test_auto_with_a_short_window(platform):
    """A short window over a long table: on the CPU V1 (the window fits one
    pass); on a GPU the grouped kernel, split over the window's blocks."""
    rng = np.random.default_rng(25)
    inp = make_inputs(rng, [5, 90], 8, 2, 64, 16, np.float32, max_blocks_per_seq=512)
    args = on(platform, *inp.args())
    text = jax.jit(lambda *a: jax_paged.paged_attention(*a, sliding_window=256)
                   ).lower(*args).as_text()
    want = "jax_paged_attention_grouped" if platform == "gpu" else "jax_paged_attention_v1"
    assert want in text
    compare(platform, inp, "auto", sliding_window=256)


@requires_gpu
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("q_len", [None, 4, 16])
def test_gpu_grouped_window_split_grid(cache_dtype, q_len):
    """Few sequences with a sliding window: the window's blocks are split, and
    the grouped kernel's grid holds only the partitions one CTA's rows can
    touch, counted from the partition of the rows' first token (the kernel's
    GroupedGridPartitions). Windows of one token, around the partition length,
    longer than the context; lengths 0, 1, block and partition multiples and
    past them; NaN in every unused cache slot, -1 past each table's end."""
    rng = np.random.default_rng(61 + (q_len or 1))
    lens = [0, 1, 16, 511, 512, 513, 1040, 3001, 4096]
    inp = make_inputs(rng, lens, 8, 2, 128, 16, cache_dtype, query_dtype=jnp.bfloat16,
                      q_len=q_len)
    dims = _shapes.check_paged_attention(*inp.args())
    scales = {} if cache_dtype == jnp.bfloat16 else dict(
        k_scale=kv_scales("per_head", 2, rng), v_scale=np.float32(1.1))
    for window in (1, 100, 300, 513, 1000, 5000):
        size = primitives.grouped_partition_size(
            "cuda", dims, window, primitives.grouped_ctas_per_sm(dims, inp.query.dtype),
            primitives.grouped_rows_per_cta(dims, inp.query.dtype))
        # A split (the reduce runs) once the window's blocks exceed 256 tokens;
        # windows of 1 and 100 tokens (2 and 8 blocks) run one partition, each
        # CTA from its window's first block.
        assert (size < dims.capacity) == (window >= 300), (window, size)
        compare("gpu", inp, "grouped", sliding_window=window, return_lse=True, **scales)
