"""benchmarks/bench_decode.py on CPU with tiny shapes: it runs end to end, its JSON holds the
figures it claims, and its roofline bytes equal the ones computed here from the model shapes."""
from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_decode as bench  # noqa: E402

from jax_paged.serving.model import ModelConfig, init_params  # noqa: E402


def _expected_weight_bytes(c: ModelConfig, num_seqs: int, itemsize: int) -> int:
    """A Llama layer's matrices and norms, the final norm, the LM head, and the embedding rows
    gathered for ``num_seqs`` tokens (untied embeddings)."""
    d, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * i + 2 * d
    return (c.num_layers * per_layer + d + d * c.vocab_size + num_seqs * d) * itemsize


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "decode.json"
    argv = ["--model", "tiny", "--num-seqs", "3", "--context", "40", "--steps", "3",
            "--reps", "2", "--prefill-rows", "2", "--json", str(path)]
    assert bench.main(argv) == 0
    with open(path) as f:
        return json.load(f)


def test_json_fields(run):
    assert run["device_kind"] and run["platform"] == "cpu"
    assert run["num_seqs"] == 3 and run["context"] == 40 and run["steps"] == 3
    assert run["copy"]["bytes_per_iter"] == 2 * run["copy"]["array_bytes"]
    assert run["copy"]["bytes_per_s"] == pytest.approx(
        run["copy"]["bytes_per_iter"] / run["copy"]["per_iter_s"])
    pf = run["prefill"]
    # 3 prompts at 2 rows per call: 2 calls, the second padded.
    assert pf["tokens"] == 3 * 40 and pf["calls"] == 2 and pf["rows_per_call"] == 2
    assert pf["total_s"] > 0 and pf["per_token_us"] == pytest.approx(pf["total_s"] / 120 * 1e6)
    assert set(run["decode"]) == {"auto", "reference"}
    assert run["reference_over_auto"] == pytest.approx(
        run["decode"]["reference"]["step_us"] / run["decode"]["auto"]["step_us"])


def test_roofline_arithmetic(run):
    c = ModelConfig.preset("tiny")
    itemsize = 2  # bf16 weights and cache
    b, ctx, n = 3, 40, 3
    token_layer = 2 * c.num_kv_heads * c.head_dim * itemsize
    # The slope times steps n .. 2n - 1; step k attends ctx + k + 1 tokens.
    mean_ctx = sum(ctx + k + 1 for k in range(n, 2 * n)) / n
    kv_read = b * mean_ctx * c.num_layers * token_layer
    kv_written = b * c.num_layers * token_layer
    weights = _expected_weight_bytes(c, b, itemsize)
    assert run["timed_steps"]["mean_context"] == mean_ctx
    for impl, d in run["decode"].items():
        r = d["roofline"]
        assert r["weights"] == weights, impl
        assert r["kv_read"] == pytest.approx(kv_read, rel=1e-12), impl
        assert r["kv_written"] == kv_written, impl
        assert r["total"] == pytest.approx(weights + kv_read + kv_written, rel=1e-12)
        roof_s = (weights + kv_read + kv_written) / run["copy"]["bytes_per_s"]
        assert r["time_s"] == pytest.approx(roof_s, rel=1e-9)
        assert d["step_us"] > 0
        assert d["pct_of_roofline"] == pytest.approx(100 * roof_s / (d["step_us"] * 1e-6), rel=1e-9)
        assert d["tokens_per_s"] == pytest.approx(b / (d["step_us"] * 1e-6), rel=1e-9)


def test_breakdown_parts_add_up_to_the_step(run):
    c = ModelConfig.preset("tiny")
    bw = run["copy"]["bytes_per_s"]
    for impl, d in run["decode"].items():
        parts = d["breakdown"]
        assert len(parts) == 3
        assert sum(p["us"] for p in parts.values()) == pytest.approx(d["step_us"], rel=1e-9)
        assert sum(p["pct_of_step"] for p in parts.values()) == pytest.approx(100.0)
        att, dense, _ = parts.values()
        ctx = d["breakdown_timing"]["attention_ctx_len"]
        token_layer = 2 * c.num_kv_heads * c.head_dim * 2
        att_bytes = 3 * c.num_layers * token_layer * (ctx + 1)  # read ctx tokens, write one
        assert att["roofline_us"] == pytest.approx(att_bytes / bw * 1e6, rel=1e-9)
        assert dense["roofline_us"] == pytest.approx(d["roofline"]["weights"] / bw * 1e6, rel=1e-9)
        assert att["us"] > 0 and dense["us"] > 0


def test_weight_bytes_tied_embedding_counted_once():
    c = ModelConfig.preset("tiny", tie_word_embeddings=True)
    params = init_params(c, 0, jnp.bfloat16)
    untied = _expected_weight_bytes(c, 5, 2)
    # No separate LM head and no gathered rows: the table is read whole, once.
    expected = untied - 5 * c.hidden_size * 2
    assert bench.weight_bytes(params, c, 5) == expected


def test_kv_read_bytes_sliding_window():
    c = ModelConfig(family="mistral", sliding_window=8, window_layers=(0,), num_layers=2)
    per_token = 2 * c.num_kv_heads * c.head_dim * 1  # fp8 cache
    # Layer 0 reads min(len, 8) tokens, layer 1 the whole context.
    assert bench.kv_read_bytes(c, 1, [5, 20]) == ((5 + 8) + (5 + 20)) * per_token


def test_bad_attn_impl_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--attn-impl", "auto,v9"])
    assert "--attn-impl" in capsys.readouterr().err
