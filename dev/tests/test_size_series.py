"""dev/size_series.py (per-call time against bytes read), on the CPU: its fit and its
rows."""
from __future__ import annotations

import os
import sys

import pytest

DEV = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, DEV)
import size_series  # noqa: E402  (it puts benchmarks/ on the path for the benchmark)
import bench_paged_attention as bench  # noqa: E402


def test_size_series_fit_and_rows():
    """dev/size_series.py: the fit recovers a known fixed cost and rate,
    and both series produce rows with the bytes they claim (tiny sizes, CPU)."""
    a_us, r_tbps = size_series.fit([(b, 5e-6 + b / 3e12) for b in (1e6, 4e6, 9e6)])
    assert a_us == pytest.approx(5.0, rel=1e-6) and r_tbps == pytest.approx(3.0, rel=1e-6)
    _, args = bench.parse_args(["--no-pallas", "--no-reference", "--reps", "1", "--target-ms",
                                "0.5", "--max-loop", "2", "--rotate-mb", "0.1", "--max-sets", "2"])
    rows = size_series.attention_series([32], "fp8e4m3", args)
    # One sequence of 32 tokens, 8 KV heads, head 128, K and V, one byte per element.
    assert rows[0]["bytes"] == 32 * 8 * 128 * 2 and rows[0]["rel_err"] < 1e-2
    rows = size_series.read_series([0.01], args)
    assert rows[0]["bytes"] == 10_000 and rows[0]["us"] > 0
