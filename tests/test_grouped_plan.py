"""The grouped call's plan: partition size (the split over SMs, a window's blocks),
rows per CTA (the row split) and CTAs per SM, as the native module works them out;
and a GPU call that runs one partition with every feature."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import _shapes, primitives
from conftest import requires_gpu
from feature_helpers import (compare, dev_options, fp8_rows_per_cta_17_to_32, kv_scales,
                             make_inputs)


def test_grouped_partition_size_follows_window_and_query_rows(monkeypatch):
    """The grouped split counts CTAs per partition (16 query rows each) and,
    with a sliding window, splits the window's blocks, not the whole table."""
    monkeypatch.setattr(primitives, "_num_sms", lambda: 132)
    dims = _shapes.AttentionDims(num_seqs=1, num_heads=32, head_size=128, num_blocks=4096,
                                 num_kv_heads=8, block_size=16, max_blocks_per_seq=2048)
    # 264 workers over 8 CTAs: 33 splits of 32768 tokens -> 993, rounded up to 16.
    assert primitives.grouped_partition_size("cuda", dims) == 1008
    # Window 1024: at most 65 blocks (1040 tokens) are read, in >= 256-token pieces.
    assert primitives.grouped_partition_size("cuda", dims, 1024) == 208
    # q_len 16 with 4 heads per KV head: 64 rows = 4 CTAs per KV head, 8 splits.
    dims16 = dataclasses.replace(dims, q_len=16)
    assert primitives.grouped_partition_size("cuda", dims16) == 4096
    # The same 64 rows in one CTA (the row split): 8 CTAs per partition, 33 splits.
    assert primitives.grouped_partition_size("cuda", dims16, rows_per_cta=64) == 1008
    if not jax_paged.has_cuda_kernels():
        pytest.skip("the CUDA module is not built")
    # The row split (multi-token queries, 16-bit caches and queries): at head sizes
    # <= 128 as few 16-row blocks as hold the KV head's rows, up to 4; off with the
    # development option row_split=0.
    row_split = dev_options().get("row_split") != "0"
    dims8 = dataclasses.replace(dims, q_len=8)
    assert primitives.grouped_rows_per_cta(dims16, jnp.bfloat16) == (64 if row_split else 16)
    assert primitives.grouped_rows_per_cta(dims8, jnp.bfloat16) == (32 if row_split else 16)
    assert primitives.grouped_rows_per_cta(dims, jnp.bfloat16) == 16   # 4 rows per KV head
    # A decode step keeps 16-row CTAs, even with 32 query heads per KV head.
    mqa = dataclasses.replace(dims, num_kv_heads=1)
    assert primitives.grouped_rows_per_cta(mqa, jnp.bfloat16) == 16
    # Not for f32 queries. Head sizes above 128: 64-row CTAs only (no 32-row form),
    # fp8 caches there only above 32 rows per KV head; fp8 caches at head sizes up to
    # 128 as 16-bit ones (32 or 64 rows).
    fp8 = np.dtype(jnp.float8_e4m3fn)
    split64 = 64 if row_split else 16
    rows_per_cta = primitives.grouped_rows_per_cta
    replace = dataclasses.replace
    for head_size in (64, 128, 192, 256):
        assert rows_per_cta(replace(dims16, cache_dtype=fp8, head_size=head_size),
                            jnp.bfloat16) == split64
        assert rows_per_cta(replace(dims8, cache_dtype=fp8, head_size=head_size),
                            jnp.bfloat16) == fp8_rows_per_cta_17_to_32(head_size)
    assert primitives.grouped_rows_per_cta(dims16, jnp.float32) == 16
    for head_size in (192, 256):
        for d in (dims16, dims8):
            assert rows_per_cta(replace(d, head_size=head_size), jnp.bfloat16) == split64


def test_development_options_are_read_by_the_layout():
    """JAX_PAGED_DEV_OPTIONS (read once per process, so in processes of their own):
    row_split=0 gives 16-row CTAs to multi-token calls, and fp8_ctas=2 or =4 forces the
    fp8 decode step's CTAs per SM, in the layout the partition rule reads as in the
    kernel choice (both use RowBlocks and the CTA rule in grouped_launch.h). Several
    options in one list, in either order, each take effect."""
    if not jax_paged.has_cuda_kernels():
        pytest.skip("the CUDA module is not built")
    code = ("import jax.numpy as jnp, numpy as np; from jax_paged import _shapes, primitives; "
            "d = _shapes.AttentionDims(num_seqs=1, num_heads=32, head_size=128, num_blocks=64, "
            "num_kv_heads=8, block_size=16, max_blocks_per_seq=64, q_len=16); "
            "f = _shapes.AttentionDims(**{**d.__dict__, 'q_len': 1, "
            "'cache_dtype': np.dtype(jnp.float8_e4m3fn)}); "
            "big = _shapes.AttentionDims(**{**f.__dict__, 'num_seqs': 64}); "
            "print(primitives.grouped_rows_per_cta(d, jnp.bfloat16), "
            "*(primitives.grouped_ctas_per_sm(x, jnp.bfloat16) for x in (f, big)))")
    # (rows per CTA at q_len 16; fp8 CTAs per SM at 8 and at 512 work items.)
    for options, want in (("", ["64", "2", "4"]), ("row_split=0", ["16", "2", "4"]),
                          ("fp8_ctas=4,row_split=1", ["64", "4", "4"]),
                          ("row_split=0,fp8_ctas=2", ["16", "2", "2"])):
        env = dict(os.environ, JAX_PAGED_DEV_OPTIONS=options, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split()[-3:] == want, (options, proc.stdout, proc.stderr[-2000:])


def test_grouped_split_counts_resident_ctas_per_sm(monkeypatch):
    """Kernels with small pipeline stages run four CTAs per SM: the split
    then fills twice as many slots."""
    monkeypatch.setattr(primitives, "_num_sms", lambda: 132)
    dims = _shapes.AttentionDims(num_seqs=1, num_heads=32, head_size=64, num_blocks=4096,
                                 num_kv_heads=8, block_size=16, max_blocks_per_seq=2048)
    # 528 workers over 8 CTAs: 66 splits of 32768 tokens -> 497, rounded up to 16.
    assert primitives.grouped_partition_size("cuda", dims, ctas_per_sm=4) == 512
    if not jax_paged.has_cuda_kernels():
        pytest.skip("the CUDA module is not built")
    per_sm = primitives.grouped_ctas_per_sm
    fp8 = dict(dims.__dict__, cache_dtype=np.dtype(jnp.float8_e4m3fn))
    assert per_sm(dims, jnp.bfloat16) == 4          # 16 KiB stages
    assert per_sm(_shapes.AttentionDims(**{**dims.__dict__, "head_size": 128}), jnp.bfloat16) == 2
    # fp8 decode (16 KiB stages): two per SM for calls of at most 32 work items
    # (sequence, KV head, 16 query rows), else four; the development option fp8_ctas=2
    # or =4 forces one (the module reads it once, as here).
    forced = dev_options().get("fp8_ctas")

    def fp8_ctas(work_items):
        return {"2": 2, "4": 4}.get(forced, 2 if work_items <= 32 else 4)

    for head_size in (64, 128):
        fp8_dims = _shapes.AttentionDims(**{**fp8, "head_size": head_size})
        assert per_sm(fp8_dims, jnp.bfloat16) == fp8_ctas(8)        # 1 x 8 KV heads
        for num_seqs in (2, 4, 5, 64):
            batch = _shapes.AttentionDims(**{**fp8_dims.__dict__, "num_seqs": num_seqs})
            assert per_sm(batch, jnp.bfloat16) == fp8_ctas(8 * num_seqs), num_seqs
        # q_len 4 at group 4: 16 rows, one 16-row CTA per (sequence, KV head).
        for num_seqs in (4, 5):
            four = _shapes.AttentionDims(**{**fp8_dims.__dict__, "num_seqs": num_seqs, "q_len": 4})
            assert per_sm(four, jnp.bfloat16) == fp8_ctas(8 * num_seqs), num_seqs
        # Multi-token calls with more than 16 rows per KV head run the row split: not varied.
        if dev_options().get("row_split") != "0":
            multi = _shapes.AttentionDims(**{**fp8_dims.__dict__, "q_len": 8})
            assert per_sm(multi, jnp.bfloat16) == (4 if head_size == 64 else 2)
    # fp8, head 256: one warp per 16-token slice, so 64-token stages of 32 KiB: two.
    assert per_sm(_shapes.AttentionDims(**{**fp8, "head_size": 256}), jnp.bfloat16) == 2
    assert per_sm(dims, jnp.float32) == 2           # f32 stages are twice as large


def test_grouped_window_partition_rule(monkeypatch):
    """A windowed CUDA call whose CTAs fill the SMs without a split gets one
    partition of the table's capacity (each CTA reads its window, no reduce);
    one that splits splits the window's blocks; CPU calls split the window."""
    monkeypatch.setattr(primitives, "_num_sms", lambda: 132)
    monkeypatch.setattr(primitives, "_cpu_threads", lambda: 2)
    many = _shapes.AttentionDims(num_seqs=64, num_heads=32, head_size=128, num_blocks=16384,
                                 num_kv_heads=8, block_size=16, max_blocks_per_seq=256)
    one = _shapes.AttentionDims(**{**many.__dict__, "num_seqs": 1, "max_blocks_per_seq": 2048})
    size = primitives.grouped_partition_size
    assert size("cuda", many, 1024) == many.capacity  # 512 CTAs fill 264 slots
    assert size("cuda", one, 1024) == 208    # 8 CTAs: 5 splits of the window's 65 blocks
    assert size("cuda", many) == many.capacity  # no window: one partition too
    assert size("cuda", one) == 1008         # no window: 264 // 8 = 33 splits of 32768
    assert size("cpu", many, 1024) == 1040      # CPU: the window's 65 blocks


@requires_gpu
@pytest.mark.parametrize("q_len,cache_dtype", [(None, jnp.bfloat16), (2, jnp.float8_e4m3fn),
                                               (None, jnp.float8_e5m2)])
def test_gpu_grouped_single_partition_with_features(q_len, cache_dtype):
    """Enough (sequence, KV head) pairs that the grouped kernel runs one
    partition and writes out and lse itself (no reduce kernel)."""
    rng = np.random.default_rng(27)
    lens = rng.integers(0, 400, size=40)
    lens[:3] = [0, 1, 384]
    inp = make_inputs(rng, lens, 32, 8, 128, 16, cache_dtype, query_dtype=jnp.bfloat16,
                      q_len=q_len)
    dims = _shapes.check_paged_attention(*inp.args())
    assert primitives.grouped_partition_size("cuda", dims) >= dims.capacity
    scales = {} if cache_dtype == jnp.bfloat16 else dict(
        k_scale=kv_scales("per_head", 8, rng), v_scale=np.float32(1.3))
    slopes = (2.0 ** -rng.uniform(0, 8, size=32)).astype(np.float32)
    compare("gpu", inp, "grouped", alibi_slopes=slopes, soft_cap=20.0, return_lse=True, **scales)
    # A window: one partition too, each CTA starting at its window's first block.
    assert primitives.grouped_partition_size("cuda", dims, 200) >= dims.capacity
    compare("gpu", inp, "grouped", sliding_window=200, return_lse=True, **scales)
