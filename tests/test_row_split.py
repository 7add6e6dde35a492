"""The grouped CUDA kernel's row split (multi-token queries: CTAs of 32, 64 or 128 query
rows per KV head) against the reference on the GPU: every page layout, 16-bit and fp8
caches, uneven row counts, many work items, lazy rescales, and the forms the
development options select (JAX_PAGED_DEV_OPTIONS: wgmma=0, wgmma_128=0/1)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import jax.numpy as jnp
import pytest

from jax_paged import _shapes, primitives, reference
from conftest import requires_gpu
from feature_helpers import (LSE_TOL, attend_on_poisoned_memory, compare, dev_options_env,
                             fp8_rows_per_cta_17_to_32, kv_scales, make_inputs,
                             run_in_own_process)
from paged_inputs import assert_close, reference_on_cpu


@requires_gpu
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_size,block_size", [(96, 32), (128, 32), (128, 16), (128, 8),
                                                  (80, 16), (64, 16),
                                                  (112, 8), (192, 32), (192, 16), (192, 8),
                                                  (256, 32), (256, 16), (256, 8)])
def test_gpu_row_split_64_rows_every_page_layout(cache_dtype, head_size, block_size):
    """The row split's 64-row CTAs at every block size and head sizes 64-256 (192
    and 256: the wide row split), at edge lengths (block and 64-token tile boundaries,
    512-token partitions), with NaN in every unused cache slot; plain (the wholly valid
    passes), with LSE and a soft cap, with a window, and with 48 rows (three row blocks,
    the fourth warp's rows empty: q_len 12). On an H100 / H200 (head sizes 80-128, 16-bit
    caches) this checks the wgmma kernel (under the development option wgmma=0, the
    mma.sync one): V's layouts as its tensor copies write them (8-token pages as stored,
    16 and 32 swizzled), V zeroed where a tile has no data, P.V in products of 64 + 32 +
    16 columns."""
    rng = np.random.default_rng(head_size * block_size)
    lens = [0, 1, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1100]
    for q_len in (16, 12):
        inp = make_inputs(rng, lens, 32, 8, head_size, block_size, cache_dtype, q_len=q_len)
        compare("gpu", inp, "grouped")
        compare("gpu", inp, "grouped", return_lse=True, soft_cap=10.0)
        compare("gpu", inp, "grouped", sliding_window=100)


@requires_gpu
def test_gpu_row_split_mma_sync_form():
    """The mma.sync form of the 16-bit 64-row CTAs at head sizes 80-128, which an H100 /
    H200 runs only under the development option wgmma=0 (read once per process, so in a
    pytest run of its own): the other tests check the wgmma form there, and this form is
    what other GPUs and builds without sm_90a run. Its cases: the page-layout test at those head
    sizes (every block size, both 16-bit dtypes) and two many-items cases."""
    cases = [f"test_gpu_row_split_64_rows_every_page_layout[{c}]" for c in (
        "96-32-bfloat16", "128-32-float16", "128-16-bfloat16", "128-8-float16",
        "80-16-bfloat16", "112-8-float16")]
    cases += [f"test_gpu_row_split_many_items[{c}]" for c in ("128-16-bfloat16", "96-16-float16")]
    run_in_own_process(__file__, cases, wgmma=0)


@requires_gpu
@pytest.mark.parametrize("head_size,block_size,cache_dtype", [
    (128, 16, jnp.bfloat16), (128, 8, jnp.bfloat16), (128, 32, jnp.float16),
    (96, 16, jnp.float16), (128, 16, jnp.float8_e4m3fn)])
def test_gpu_row_split_many_items(head_size, block_size, cache_dtype, monkeypatch):
    """The 64-row CTAs over ~2900 work items (120 sequences x 8 KV heads x up to 3
    partitions at q_len 16; on an H100 / H200 the wgmma form, whose query rows go from
    global memory straight into registers and whose output is written from registers).
    Lengths include 0 (items with nothing to read, among items that read), 1, page,
    tile and partition edges, shuffled; NaN in every unused cache slot and (best
    effort) in the output's memory; plain, LSE with a soft cap, a window (fewer
    partitions in the grid), 48 rows (q_len 12, the fourth warp's rows empty), and
    256-token partitions (the partition rule patched: the workspace and V2's reduce,
    ~5 partitions per sequence, where the rule itself splits only grids of fewer items
    than CTA slots). An e4m3 cache takes a bf16 query (the fp8 row split)."""
    rng = np.random.default_rng(head_size * block_size + 7)
    edges = [0, 0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 511, 512, 513, 1024, 1100]
    lens = np.concatenate([edges, rng.integers(0, 1100, size=120 - len(edges))])
    rng.shuffle(lens)
    query_dtype = jnp.bfloat16 if cache_dtype == jnp.float8_e4m3fn else None
    inputs = {q_len: make_inputs(rng, [int(n) for n in lens], 32, 8, head_size, block_size,
                                 cache_dtype, query_dtype=query_dtype, q_len=q_len)
              for q_len in (16, 12)}
    # (compare's assert_close also fails on NaN: an output the kernel did not write.)
    for q_len, kwargs in ((16, {}), (16, dict(return_lse=True, soft_cap=10.0)),
                          (16, dict(sliding_window=100)), (12, {})):
        compare("gpu", inputs[q_len], "grouped", poisoned=True, **kwargs)
    # (partition_size=1024 only keys this call apart from the ones above: the grouped
    # kernel takes the rule's size.)
    inp = inputs[12]
    monkeypatch.setattr(primitives, "grouped_partition_size", lambda *args, **kw: 256)
    got, lse = attend_on_poisoned_memory("gpu", inp, "grouped", return_lse=True,
                                         partition_size=1024)
    want, want_lse = reference_on_cpu(reference.paged_attention, *inp.args(), impl="v2",
                                      partition_size=256, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=LSE_TOL, rtol=LSE_TOL)
    assert_close(got, want, inp.query.dtype, "row split, 256-token partitions")


@requires_gpu
@pytest.mark.parametrize("head_size,block_size,dtype", [
    (128, 16, jnp.bfloat16), (128, 8, jnp.float16), (128, 32, jnp.bfloat16),
    (96, 16, jnp.float16), (80, 32, jnp.bfloat16), (112, 8, jnp.bfloat16)])
def test_gpu_row_split_128_rows(head_size, block_size, dtype, monkeypatch):
    """KV heads of more than 64 query rows with 16-bit caches: on compute capability 9.0
    the wgmma form's 128-row CTAs, two warpgroups over shared stages, each tile's P.V
    issued at the next tile (test_gpu_wgmma_128_rows runs this test under the development
    option wgmma_128=0: two or more 64-row CTAs, which other GPUs run). Rows per KV head:
    128 (group 8 at q_len 16: one full CTA), 72 (the second warpgroup's first warp half
    full, its other three empty), 132 and 208 (groups of 12 and 16 at q_len 11
    and 13, one KV head: two 128-row CTAs of 66 and 104 rows, whose few work items the
    partition rule splits over partitions: the workspace and V2's reduce). Edge lengths
    (page, 64-token tile and 512-token partition edges), NaN in every unused cache slot
    and (best effort) in the output's memory; plain, a window, ALiBi with a window, a
    soft cap and LSE; and 256-token partitions (the rule patched)."""
    _check_rows_above_64(np.random.default_rng(head_size * block_size + 128), head_size,
                         block_size, dtype, monkeypatch)


def _check_rows_above_64(rng, head_size, block_size, cache_dtype, monkeypatch,
                         query_dtype=None, fp8_scales=False):
    """KV heads of 128, 72, 132 and 208 query rows at edge lengths: plain on poisoned
    memory, a window, ALiBi with a window, a soft cap and LSE; then 256-token partitions
    (the rule patched). fp8_scales: per-KV-head K scales and a V scale."""
    lens = [0, 1, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1100]
    for num_heads, num_kv_heads, q_len in ((64, 8, 16), (72, 8, 8), (12, 1, 11), (16, 1, 13)):
        inp = make_inputs(rng, lens, num_heads, num_kv_heads, head_size, block_size,
                          cache_dtype, query_dtype=query_dtype, q_len=q_len)
        scales = (dict(k_scale=kv_scales("per_head", num_kv_heads, rng), v_scale=np.float32(0.8))
                  if fp8_scales else {})
        compare("gpu", inp, "grouped", poisoned=True, **scales)
        compare("gpu", inp, "grouped", sliding_window=100, **scales)
        slopes = (0.03 * rng.uniform(0.5, 1.0, size=num_heads)).astype(np.float32)
        compare("gpu", inp, "grouped", alibi_slopes=slopes, sliding_window=300, soft_cap=10.0,
                return_lse=True, **scales)
    # (partition_size=1024 only keys this call apart from the ones above: the grouped
    # kernel takes the rule's size.)
    monkeypatch.setattr(primitives, "grouped_partition_size", lambda *args, **kw: 256)
    compare("gpu", inp, "grouped", poisoned=True, return_lse=True, partition_size=1024, **scales)


@requires_gpu
@pytest.mark.parametrize("wgmma_128", [0, 1])
def test_gpu_wgmma_128_rows(wgmma_128):
    """KV heads of more than 64 rows under the development option wgmma_128 (read once
    per process, so in a pytest run of its own): 0, two or more 64-row CTAs; 1, the
    128-row CTAs that issue each tile's P.V at the next tile: the 128-rows test at every
    head size and block size it has, and the uneven-rows test's 16-bit wgmma case (80 and
    128 rows with ALiBi that makes the running maxima grow, so that the deferred O
    rescales run). The CUDA module reports the options its process parsed, so the
    test knows which of the two forms the calls took."""
    cases = [f"test_gpu_row_split_128_rows[{c}]" for c in (
        "128-16-bfloat16", "128-8-float16", "128-32-bfloat16", "96-16-float16",
        "80-32-bfloat16", "112-8-bfloat16")]
    cases += ["test_gpu_row_split_uneven_rows_with_alibi[128-16-float16-float16]"]
    run_in_own_process(__file__, cases, wgmma_128=wgmma_128)
    probe = subprocess.run(
        [sys.executable, "-c", "import jax_paged._native as n; "
         "print(n.cuda_module.kernel_options()['wgmma_128'])"],
        env=dev_options_env(wgmma_128=wgmma_128), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == str(bool(wgmma_128)), probe.stdout + probe.stderr[-2000:]


@requires_gpu
@pytest.mark.parametrize("cache_dtype,query_dtype", [
    (jnp.float8_e4m3fn, jnp.bfloat16), (jnp.float8_e5m2, jnp.float16),
    (jnp.float8_e4m3fn, jnp.float16), (jnp.float8_e5m2, jnp.bfloat16)])
def test_gpu_fp8_row_split_128_rows(cache_dtype, query_dtype, monkeypatch):
    """KV heads of more than 64 query rows with fp8 caches, head 128, 16-token pages, per
    KV head K scales and a V scale: two or more of the fp8 row split's 64-row CTAs per KV
    head (rows per KV head as in test_gpu_row_split_128_rows: 128, 72, 132 and 208, the
    last two one KV head whose few work items the partition rule splits: the workspace
    and V2's reduce). Edge lengths, NaN in every unused cache slot and (best effort) in
    the output's memory; plain, a window, ALiBi with a window, a soft cap and LSE; and
    256-token partitions (the rule patched)."""
    rng = np.random.default_rng(1280 + 2 * (cache_dtype == jnp.float8_e5m2)
                                + (query_dtype == jnp.bfloat16))
    _check_rows_above_64(rng, 128, 16, cache_dtype, monkeypatch, query_dtype=query_dtype,
                         fp8_scales=True)


@requires_gpu
@pytest.mark.parametrize("head_size,block_size,cache_dtype,query_dtype", [
    (128, 16, jnp.float16, jnp.float16), (256, 32, jnp.bfloat16, jnp.bfloat16),
    (192, 8, jnp.float16, jnp.float16), (128, 32, jnp.float8_e4m3fn, jnp.bfloat16)])
def test_gpu_row_split_uneven_rows_with_alibi(head_size, block_size, cache_dtype, query_dtype):
    """Row counts per KV head that are not whole 64-row CTAs: 20 (q_len 5 x group 4:
    one CTA, its second row block a quarter full, two warps idle), 80 (40 query
    heads over 8 KV heads at q_len 16: two CTAs of 40 rows) and 128 (group 8: two
    full CTAs, the second starting at row 64), with ALiBi slopes that make the
    running maxima grow (lazy rescales, f16 probabilities up to 2^8) and with a soft
    cap and LSE; head 256 at 32-token pages (one page per wide tile) and 192 at 8
    in the wide row split, and fp8 (20 rows: one 32-row CTA; 80 and 128: the fp8 row
    split's 64-row CTAs)."""
    rng = np.random.default_rng(head_size + block_size)
    lens = [0, 1, 4, 5, 31, 32, 33, 500, 1100]
    for num_heads, q_len in ((32, 5), (40, 16), (64, 16)):
        inp = make_inputs(rng, lens, num_heads, 8, head_size, block_size, cache_dtype,
                          query_dtype=query_dtype, q_len=q_len)
        slopes = (0.03 * rng.uniform(0.5, 1.0, size=num_heads)).astype(np.float32)
        compare("gpu", inp, "grouped", alibi_slopes=slopes)
        compare("gpu", inp, "grouped", alibi_slopes=slopes, soft_cap=10.0, return_lse=True)


@requires_gpu
@pytest.mark.parametrize("cache_dtype,query_dtype", [(jnp.float8_e4m3fn, jnp.bfloat16),
                                                     (jnp.float8_e5m2, jnp.float16)])
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (64, 8), (96, 32), (112, 16),
                                                  (256, 32), (192, 8), (96, 16)])
def test_gpu_fp8_row_split_64_rows(cache_dtype, query_dtype, head_size, block_size):
    """fp8 caches with 64 (q_len 16) and 48 (q_len 12) query rows per KV head, at edge
    lengths, NaN in every unused slot, per-KV-head scales: one 64-row CTA (the fp8
    loads and widening in the row split's four-slice passes; at head sizes 192 and 256
    the wide row split's two-slice passes). Plain, with LSE and a soft
    cap, with a window. Then 40 query heads over 8 KV heads at q_len 16: 80 rows
    per KV head, two CTAs of 40 rows each (a row block half full, one empty)."""
    rng = np.random.default_rng(head_size * block_size + 7)
    scales = _check_fp8_row_split(rng, 32, (16, 12), head_size, block_size, cache_dtype,
                                  query_dtype)
    inp = make_inputs(rng, _FP8_ROW_SPLIT_LENS, 40, 8, head_size, block_size, cache_dtype,
                      query_dtype=query_dtype, q_len=16)
    compare("gpu", inp, "grouped", return_lse=True, **scales)


_FP8_ROW_SPLIT_LENS = [0, 1, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1100]


def _check_fp8_row_split(rng, num_heads, q_lens, head_size, block_size, cache_dtype,
                         query_dtype):
    """fp8 caches over 8 KV heads at edge lengths (NaN in unused slots), per-KV-head K
    scales: plain, with LSE and a soft cap, with a window, for each q_len. Returns the
    scales."""
    scales = dict(k_scale=kv_scales("per_head", 8, rng), v_scale=np.float32(0.8))
    for q_len in q_lens:
        inp = make_inputs(rng, _FP8_ROW_SPLIT_LENS, num_heads, 8, head_size, block_size,
                          cache_dtype, query_dtype=query_dtype, q_len=q_len)
        compare("gpu", inp, "grouped", **scales)
        compare("gpu", inp, "grouped", return_lse=True, soft_cap=10.0, **scales)
        compare("gpu", inp, "grouped", sliding_window=100, **scales)
    return scales


@requires_gpu
@pytest.mark.parametrize("cache_dtype,query_dtype", [(jnp.float8_e4m3fn, jnp.bfloat16),
                                                     (jnp.float8_e5m2, jnp.float16)])
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (64, 8), (96, 32), (80, 16),
                                                  (112, 8)])
def test_gpu_fp8_row_split_32_rows(cache_dtype, query_dtype, head_size, block_size):
    """fp8 caches with 17-32 query rows per KV head at head sizes up to 128: 32 rows
    (q_len 8, group 4), 20 (q_len 5) and 24 (q_len 3, group 8), at edge lengths with
    NaN in every unused slot, per-KV-head scales; plain, with LSE and a soft cap, with
    a window. One 32-row CTA (two row blocks, each warp two slices of a 64-token tile,
    32 tokens apart; the second row block a quarter full at 20 rows)."""
    dims = _shapes.AttentionDims(num_seqs=1, num_heads=32, head_size=head_size, num_blocks=64,
                                 num_kv_heads=8, block_size=block_size, max_blocks_per_seq=64,
                                 q_len=8, cache_dtype=np.dtype(cache_dtype))
    assert primitives.grouped_rows_per_cta(dims, query_dtype) == fp8_rows_per_cta_17_to_32(
        head_size)
    rng = np.random.default_rng(head_size * block_size + 11)
    _check_fp8_row_split(rng, 32, (8, 5), head_size, block_size, cache_dtype, query_dtype)
    _check_fp8_row_split(rng, 64, (3,), head_size, block_size, cache_dtype, query_dtype)


@requires_gpu
@pytest.mark.parametrize("block_size,head_size", [(8, 128), (16, 128), (32, 128), (16, 256)])
@pytest.mark.parametrize("slope_scale", [0.004, 0.03, 0.3])
def test_gpu_row_split_lazy_rescale_growing_maxima(block_size, head_size, slope_scale):
    """The row split keeps a row's running maximum until a 64-token pass exceeds
    it by more than 2^8 (kLazyRescale), then rescales. ALiBi slopes make every
    row's logits grow along the sequence: by a fraction of that threshold per
    pass (the maximum stays stale for many passes, probabilities up to 2^8),
    about half of it, and several times it (a rescale in every pass); plus
    keys scaled up along the sequence without ALiBi (the wholly valid passes).
    Against the reference, with LSE (which must use the same maximum as O).
    (Head size 256: the wide row split's 32-token passes, where it is built.)"""
    rng = np.random.default_rng(block_size + int(1000 * slope_scale))
    lens = [1, 64, 65, 700, 1100, 2100]
    inp = make_inputs(rng, lens, 32, 8, head_size, block_size, jnp.bfloat16, q_len=16)
    slopes = (slope_scale * rng.uniform(0.5, 1.0, size=32)).astype(np.float32)
    compare("gpu", inp, "grouped", alibi_slopes=slopes, return_lse=True)
    # Positive queries and keys growing with the token's position (no ALiBi: the
    # all-valid passes); NaN slots stay NaN.
    key = np.abs(np.asarray(inp.key_cache, np.float32))  # [num_blocks, Hkv, D/x, bs, x]
    pos = np.zeros(key.shape[0], np.float32)
    for s, n in enumerate(lens):
        for j, b in enumerate(np.asarray(inp.block_tables[s][: -(-n // block_size)])):
            pos[b] = j * block_size
    ramp = 1.0 + 40.0 * slope_scale * (pos[:, None, None, None, None] +
                                       np.arange(block_size)[None, None, None, :, None]) / 1024
    inp.key_cache = (key * ramp).astype(inp.key_cache.dtype)
    inp.query = np.abs(np.asarray(inp.query, np.float32)).astype(inp.query.dtype)
    compare("gpu", inp, "grouped", return_lse=True)
