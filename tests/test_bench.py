"""The benchmark's timing loop (benchmarks/bench_paged_attention.py), on CPU:
it makes the calls it claims to make, and the jnp reference repeats its page
gather at every call instead of sharing it between calls on the same inputs."""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_paged_attention as bench  # noqa: E402

import jax_paged as jp  # noqa: E402


def _inputs(num_seqs=4, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seq_len=256):
    rng = np.random.default_rng(0)
    x = 8  # 16 bytes of bf16
    blocks = num_seqs * seq_len // block_size
    tables = rng.permutation(blocks).reshape(num_seqs, -1).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((num_seqs, num_heads, head_size)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((blocks, num_kv_heads, head_size // x, block_size, x)),
                     jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((blocks, num_kv_heads, head_size, block_size)),
                     jnp.bfloat16)
    return q, kc, vc, jnp.asarray(tables), jnp.full((num_seqs,), seq_len, jnp.int32)


@pytest.mark.parametrize("n_sets,unroll", [(1, 8), (2, 4), (3, 1)])
def test_loop_makes_r_times_calls_per_iteration_calls(n_sets, unroll):
    R = 4
    sets = [(jnp.int32(s + 1),) for s in range(n_sets)]
    f = bench._loop_fn(lambda c, inc: c + inc, R, n_sets, unroll)
    got = int(f(jnp.int32(0), sets))
    assert got == R * unroll * sum(range(1, n_sets + 1))


def test_time_loop_reports_calls_per_iteration():
    args = argparse.Namespace(target_ms=0.5, max_loop=8, reps=3, min_calls_per_iter=8)
    t = bench.time_loop(lambda c, inc: c + inc, jnp.float32(0), [(jnp.float32(1),)] * 3, args)
    assert t["calls_per_iteration"] == 9  # 3 passes over 3 sets: the first count >= 8
    assert t["calls_per_sample"] == t["R"] * 9
    assert len(t["samples_s"]) == 3 and all(s > 0 for s in t["samples_s"])


def test_tie_to_query_keeps_the_tables_and_one_gather_pair_per_call():
    q, kc, vc, bt, sl = _inputs()
    np.testing.assert_array_equal(np.asarray(bench.tie_to_query(q, bt)), np.asarray(bt))
    via_api, via_module = bench.reference_step(jp, 0.125)
    np.testing.assert_array_equal(
        np.asarray(via_api(q, kc, vc, bt, sl), np.float32),
        np.asarray(jp.paged_attention(q, kc, vc, bt, sl, scale=0.125, impl="reference"),
                   np.float32))
    calls = 8

    def gathers(step):
        f = bench._loop_fn(step, 2, 1, calls)
        hlo = f.lower(q, [(kc, vc, bt, sl)]).compile().as_text()
        return len(re.findall(r"= \S+ gather\(", hlo))

    # K and V pages are gathered at every call, not once for the calls on the same set.
    assert gathers(via_api) == 2 * calls
    assert gathers(via_module) == 2 * calls
