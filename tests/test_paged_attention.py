"""Native paged-attention kernels (CPU always, CUDA when a GPU is present)
against the jnp reference, on random data with NaN-poisoned unused slots."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import reference
from conftest import requires_gpu
from paged_inputs import (DTYPES, assert_close, dense_attention, make_paged_inputs, on,
                          reference_on_cpu)

# Lengths covering 0, 1, exact block multiples, ragged, and 512-token
# partition boundaries (511 / 512 / 513).
LENGTHS = [0, 1, 16, 31, 64, 511, 512, 513, 700]
# Native paths: the classic V1/V2 and the split-KV grouped kernel.
IMPLS = ["v1", "v2", "grouped"]


def run_and_compare(platform, inp, dtype, impl, **kwargs):
    out = jax_paged.paged_attention(*on(platform, *inp.args()), impl=impl, **kwargs)
    assert out.shape == inp.query.shape and out.dtype == inp.query.dtype
    ref_impl = "v2" if impl == "v2" else "v1"
    expected = reference_on_cpu(reference.paged_attention, *inp.args(), impl=ref_impl, **kwargs)
    assert_close(out, expected, dtype, f"{impl} vs reference")
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_dtypes_and_block_sizes(platform, impl, dtype, block_size):
    rng = np.random.default_rng(block_size)
    inp = make_paged_inputs(rng, LENGTHS, 8, 2, 64, block_size, dtype)
    out = run_and_compare(platform, inp, dtype, impl)
    assert np.all(out[0] == 0), "seq_len 0 must give zeros"


@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_sizes(platform, head_size, dtype):
    rng = np.random.default_rng(head_size)
    inp = make_paged_inputs(rng, [1, 17, 300, 600], 4, 2, head_size, 16, dtype)
    for impl in IMPLS:
        run_and_compare(platform, inp, dtype, impl)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (16, 2), (8, 1),
                                                    (40, 8), (24, 1), (34, 2)])
def test_gqa_mqa(platform, num_heads, num_kv_heads):
    """Groups of 1 to 24 query heads per KV head; groups larger than 16 are
    split over several CTAs by the grouped CUDA kernel (24 = 2 x 12, 17 = 2 x 9)."""
    rng = np.random.default_rng(num_heads * 10 + num_kv_heads)
    inp = make_paged_inputs(rng, [3, 129, 520], num_heads, num_kv_heads, 64, 16, jnp.bfloat16)
    run_and_compare(platform, inp, jnp.bfloat16, "grouped")
    out = run_and_compare(platform, inp, jnp.bfloat16, "auto")
    # And against plain attention over the logical sequence (independent of paging).
    expected = dense_attention(inp.query.astype(np.float32), inp.keys, inp.values, 64 ** -0.5)
    np.testing.assert_allclose(out, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_alibi_and_scale(platform, impl):
    rng = np.random.default_rng(3)
    inp = make_paged_inputs(rng, [1, 40, 513], 8, 4, 64, 16, np.float32)
    slopes = (2.0 ** -rng.uniform(0, 8, size=8)).astype(np.float32)
    run_and_compare(platform, inp, np.float32, impl, scale=0.07, alibi_slopes=slopes)
    expected = dense_attention(inp.query, inp.keys, inp.values, 0.07, slopes)
    out = jax_paged.paged_attention(*on(platform, *inp.args()), impl=impl, scale=0.07,
                                    alibi_slopes=slopes)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v1_equals_v2(platform, dtype):
    rng = np.random.default_rng(4)
    inp = make_paged_inputs(rng, [1, 255, 256, 257, 1024, 1500], 8, 2, 128, 16, dtype)
    args = on(platform, *inp.args())
    v1 = np.asarray(jax_paged.paged_attention(*args, impl="v1"), np.float32)
    for partition_size in (256, 512):
        v2 = np.asarray(jax_paged.paged_attention(*args, impl="v2",
                                                  partition_size=partition_size), np.float32)
        atol, rtol = {np.dtype(np.float32): (2e-5, 2e-5)}.get(np.dtype(dtype), (2e-2, 2e-2))
        np.testing.assert_allclose(v2, v1, atol=atol, rtol=rtol)
    grouped = np.asarray(jax_paged.paged_attention(*args, impl="grouped"), np.float32)
    np.testing.assert_allclose(grouped, v1, atol=atol, rtol=rtol)


@pytest.mark.parametrize("head_size", [128, 256])
@pytest.mark.parametrize("lens", [[0, 1, 17, 128], [0, 1, 128, 144, 257, 640, 656, 1293]],
                         ids=["few_partitions", "many_partitions"])
def test_v2_reduce_partition_counts(platform, head_size, lens):
    """V2 with 16-token partitions, so the reduce merges 0 to 81 partitions per
    row: at most 8 (its small-chunk kernels) and across its rounds of 16 (two
    output elements per thread) and 40 partitions (one), output and LSE."""
    rng = np.random.default_rng(11)
    inp = make_paged_inputs(rng, lens, 4, 2, head_size, 16, np.float32)
    out, lse = jax_paged.paged_attention(*on(platform, *inp.args()), impl="v2",
                                         partition_size=16, return_lse=True)
    expected, expected_lse = reference_on_cpu(reference.paged_attention, *inp.args(),
                                              impl="v2", partition_size=16, return_lse=True)
    assert_close(out, expected, np.float32, "v2 vs reference")
    lse, expected_lse = np.asarray(lse), np.asarray(expected_lse)
    assert np.all(lse[0] == -np.inf), "seq_len 0 must give lse = -inf"
    np.testing.assert_allclose(lse[1:], expected_lse[1:], atol=2e-5, rtol=2e-5)


def test_padding_never_read(platform):
    """Table entries past a sequence's last block hold garbage ids (huge and
    negative); the unused tail of each last block and all unused blocks are NaN."""
    rng = np.random.default_rng(5)
    inp = make_paged_inputs(rng, [7, 16, 100, 0, 33], 4, 2, 64, 16, np.float32,
                            max_blocks_per_seq=12, padding="garbage")
    for impl in IMPLS:
        run_and_compare(platform, inp, np.float32, impl, partition_size=64)


def test_invalid_ids_in_used_range_are_masked(platform):
    """Out-of-range ids among the used blocks are masked, never read."""
    rng = np.random.default_rng(6)
    inp = make_paged_inputs(rng, [40, 40, 40], 4, 4, 64, 16, np.float32)
    inp.block_tables[0, 1] = -7
    inp.block_tables[1, 0] = 2 ** 31 - 1
    inp.block_tables[2, 2] = inp.key_cache.shape[0]
    for impl in IMPLS:
        out = run_and_compare(platform, inp, np.float32, impl, partition_size=32)
        assert np.all(np.isfinite(out))
    with pytest.raises(ValueError, match=r"sequences \[0, 1, 2\]"):
        jax_paged.check_inputs(inp.block_tables, inp.seq_lens, inp.key_cache.shape[0], 16)


def test_lengths_beyond_capacity_are_clamped(platform):
    rng = np.random.default_rng(7)
    inp = make_paged_inputs(rng, [32, 20], 4, 2, 64, 16, np.float32)
    lens = np.array([10 ** 6, -5], np.int32)
    out = jax_paged.paged_attention(*on(platform, inp.query, inp.key_cache, inp.value_cache,
                                        inp.block_tables, lens))
    expected = dense_attention(inp.query, [inp.keys[0], inp.keys[1][:0]],
                               [inp.values[0], inp.values[1][:0]], 64 ** -0.5)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


def test_lowered_program_contains_custom_call(platform):
    rng = np.random.default_rng(8)
    inp = make_paged_inputs(rng, [5, 9], 4, 2, 64, 16, np.float32)
    args = on(platform, *inp.args())
    for impl, target in (("v1", "jax_paged_attention_v1"), ("v2", "jax_paged_attention_v2")):
        text = jax.jit(lambda *a: jax_paged.paged_attention(*a, impl=impl)).lower(*args).as_text()
        assert f"@{target}" in text or f'"{target}"' in text, text[:2000]


# ---- GPU-only scale tests -------------------------------------------------

@requires_gpu
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 120, 128, 192, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_every_head_and_block_size(head_size, block_size):
    rng = np.random.default_rng(head_size + block_size)
    for dtype in DTYPES:
        inp = make_paged_inputs(rng, [1, block_size, 77, 513], 8, 2, head_size, block_size,
                                dtype)
        for impl in IMPLS:
            run_and_compare("gpu", inp, dtype, impl)


@requires_gpu
def test_gpu_head_size_without_a_kernel():
    """Head size 16 (the decode example's tiny model) has no CUDA kernel: "auto" runs the
    reference on the GPU with a warning and is right; a named kernel is a clear error."""
    rng = np.random.default_rng(16)
    inp = make_paged_inputs(rng, [1, 16, 77], 4, 2, 16, 16, jnp.float32)
    with pytest.warns(UserWarning, match="no CUDA kernel for head_size 16"):
        run_and_compare("gpu", inp, jnp.float32, "auto")
    with pytest.raises(ValueError, match="got 16 with impl='grouped'"):
        jax_paged.paged_attention(*on("gpu", *inp.args()), impl="grouped")


@requires_gpu
def test_gpu_long_context():
    rng = np.random.default_rng(9)
    inp = make_paged_inputs(rng, [32768, 20000], 8, 2, 128, 16, jnp.bfloat16, poison=False)
    for impl in ("v2", "grouped", "auto"):
        run_and_compare("gpu", inp, jnp.bfloat16, impl)


@requires_gpu
def test_gpu_large_batch():
    rng = np.random.default_rng(10)
    lens = rng.integers(1, 600, size=256)
    inp = make_paged_inputs(rng, lens, 32, 8, 128, 16, jnp.bfloat16)
    for impl in IMPLS + ["auto"]:
        run_and_compare("gpu", inp, jnp.bfloat16, impl)


@requires_gpu
def test_gpu_cache_beyond_int32_elements():
    """A cache of more than 2^31 elements with the used blocks at its very end:
    offsets must be computed in int64."""
    num_kv_heads, head_size, block_size = 8, 128, 16
    block_elems = num_kv_heads * head_size * block_size
    num_blocks = 2 ** 31 // block_elems + 64           # > 2^31 elements per cache
    x = 8
    rng = np.random.default_rng(11)
    dev = jax.devices("gpu")[0]
    with jax.default_device(dev):
        key_cache = jnp.full((num_blocks, num_kv_heads, head_size // x, block_size, x), jnp.nan,
                             jnp.bfloat16)
        value_cache = jnp.full((num_blocks, num_kv_heads, head_size, block_size), jnp.nan,
                               jnp.bfloat16)
    lens = np.array([100, 37], np.int32)
    # Seq 0 uses 7 blocks, seq 1 three, all among the last 13 of the cache.
    blocks = np.full((2, 7), -1, np.int64)
    blocks[0, :] = num_blocks - 1 - 2 * np.arange(7)
    blocks[1, :3] = num_blocks - 2 - 2 * np.arange(3)
    blocks = blocks.astype(np.int32)
    keys = [rng.standard_normal((L, num_kv_heads, head_size)).astype(jnp.bfloat16) for L in lens]
    values = [rng.standard_normal((L, num_kv_heads, head_size)).astype(jnp.bfloat16)
              for L in lens]
    slots = np.concatenate([blocks[s, np.arange(L) // block_size] * block_size
                            + np.arange(L) % block_size for s, L in enumerate(lens)])
    write = jax.jit(jax_paged.reshape_and_cache, donate_argnums=(2, 3))
    key_cache, value_cache = write(jnp.asarray(np.concatenate(keys)),
                                   jnp.asarray(np.concatenate(values)), key_cache, value_cache,
                                   jnp.asarray(slots.astype(np.int32)))
    query = rng.standard_normal((2, 32, head_size)).astype(jnp.bfloat16)
    expected = dense_attention(query.astype(np.float32), [k.astype(np.float32) for k in keys],
                               [v.astype(np.float32) for v in values], head_size ** -0.5)
    for impl in IMPLS:
        out = jax_paged.paged_attention(jnp.asarray(query), key_cache, value_cache,
                                        jnp.asarray(blocks), jnp.asarray(lens), impl=impl,
                                        partition_size=32)
        np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=3e-2, rtol=3e-2)
