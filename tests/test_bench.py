"""The benchmark's timing loop (benchmarks/bench_paged_attention.py), on CPU:
it makes the calls it claims to make, and the jnp reference repeats its page
gather at every call instead of sharing it between calls on the same inputs."""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_paged_attention as bench  # noqa: E402

import jax_paged as jp  # noqa: E402
from paged_inputs import make_paged_inputs  # noqa: E402


@pytest.mark.parametrize("n_sets,unroll", [(1, 8), (2, 4), (3, 1)])
def test_loop_makes_r_times_calls_per_iteration_calls(n_sets, unroll):
    R = 4
    sets = [(jnp.int32(s + 1),) for s in range(n_sets)]
    f = bench._loop_fn(lambda c, inc: c + inc, R, n_sets, unroll)
    got = int(f(jnp.int32(0), sets))
    assert got == R * unroll * sum(range(1, n_sets + 1))


@pytest.mark.parametrize("n_sets,unroll", [(1, 8), (2, 4), (3, 1)])
def test_dependent_loop_chains_its_calls_in_order(n_sets, unroll):
    """Each call of the dependent loop takes the previous call's output as its query: a step
    that counts its calls in slot 0 and writes its set's id into the slot of that count
    leaves the R * unroll * n_sets calls, in order. It returns float32 where the query is
    int32: the loop casts each output back to the query's dtype."""
    R = 4
    calls = R * unroll * n_sets

    def step(c, set_id):
        n = c[0]
        return c.at[0].add(1).at[n + 1].set(set_id).astype(jnp.float32)

    sets = [(jnp.int32(10 + s),) for s in range(n_sets)]
    f = bench._dependent_fn(step, R, n_sets, unroll)
    got = np.asarray(f(jnp.zeros(calls + 1, jnp.int32), sets))
    assert got.dtype == np.int32
    assert got[0] == calls
    assert got[1:].tolist() == [10 + s for _ in range(R * unroll) for s in range(n_sets)]


def test_dependent_is_the_default_method_and_gives_the_figure():
    _, args = bench.parse_args([])
    assert args.method == "dependent"
    assert bench.METHOD_CHOICES[args.method] == ("dependent",)
    args = argparse.Namespace(target_ms=0.5, max_loop=4, reps=2, min_calls_per_iter=2,
                              method="all")
    t = bench.run_timing(lambda c, inc: c + inc, jnp.float32(0), [(jnp.float32(1),)], args)
    assert list(t) == ["dependent", "loop", "dispatch"]
    assert [x["method"] for x in t.values()] == ["dependent", "loop", "dispatch"]
    with pytest.raises(ValueError, match="time_loop method: got 'graph'"):
        bench.time_loop(lambda c: c, jnp.float32(0), [()], args, method="graph")


def test_peers_suite_expands_to_its_rows_with_fp8_and_fits_an_80gb_card():
    _, args = bench.parse_args(["--suite", "peers", "--no-pallas"])
    peers = ["64,32,8,4096", "256,32,8,1024", "1,32,8,32768", "8,32,8,8192",
             "32,32,32,2048", "128,64,8,2048"]
    small_batch = ["1,32,8,8192", "1,32,8,32768", "1,32,8,131072",
                   "2,32,8,8192", "2,32,8,32768", "2,32,8,131072",
                   "4,32,8,8192", "4,32,8,32768", "4,32,8,131072",
                   "8,32,8,4096", "8,32,8,16384", "16,32,8,4096", "16,32,8,16384"]
    specs = bench.config_specs(args)
    assert specs[:6] == peers and sorted(specs[6:]) == sorted(small_batch)
    configs = {bench.parse_config(s, args.dtype) for s in specs}
    assert len(configs) == len(peers) + len(small_batch) - 1  # 1 x 32768 is in both lists
    # Every row also runs on an fp8 e4m3 cache (the peers' two fp8 rows among them).
    assert args.fp8 == ["e4m3"] and ("auto+fp8e4m3", "auto", "fp8e4m3") in bench.variant_list(args)
    # The longest rows fit the suite's cache cap, which is far inside an 80 GB card.
    assert args.max_cache_gb <= 24
    for cfg in configs:
        plan = bench.plan_config(cfg, args)
        assert not plan["too_big"], cfg.label
        assert plan["alloc_bytes"] <= args.max_cache_gb * 2 ** 30
    # With the Pallas copy too, 4 x 128k tokens still fit.
    _, args = bench.parse_args(["--suite", "peers"])
    assert not bench.plan_config(bench.parse_config("4,32,8,131072", args.dtype), args)["too_big"]
    # An explicit cap wins, and --config adds to the preset.
    _, args = bench.parse_args(["--suite", "peers", "--max-cache-gb", "1", "--config", "3,8,8,64"])
    assert args.max_cache_gb == 1 and bench.config_specs(args)[-1] == "3,8,8,64"
    _, args = bench.parse_args([])
    assert args.max_cache_gb == 4.0 and args.fp8 == [] and "1,32,8,131072" not in bench.config_specs(args)
    with pytest.raises(SystemExit):
        bench.parse_args(["--suite", "peers", "--quick"])


def test_quick_run_records_the_dependent_method_outside_the_results_folder(tmp_path, monkeypatch):
    """A --quick run with the default method: every timed row's figure comes from the
    dependent loop and says so, the meta describes the method, and the JSON goes to
    out/bench/, not benchmarks/results/ (which benchmarks/make_tables.py reads whole)."""
    import json
    monkeypatch.setattr(bench, "REPO_ROOT", str(tmp_path))
    rc = bench.main(["--quick", "--no-classic", "--no-pallas", "--no-reference", "--reps", "2",
                     "--target-ms", "1", "--max-loop", "2", "--no-progress"])
    assert rc == 0
    (path,) = (tmp_path / "out" / "bench").glob("*-quick.json")
    assert not (tmp_path / "benchmarks").exists()
    with open(path) as f:
        result = json.load(f)
    assert result["meta"]["args"]["method"] == "dependent"
    assert list(result["meta"]["method"]) == ["dependent"]
    assert result["meta"]["method"]["dependent"].startswith("dependent: ")
    assert len(result["results"]) == len(bench.QUICK_CONFIGS)
    for row in result["results"]:
        auto = row["impls"]["auto"]
        assert auto["ok"] and auto["method"] == "dependent" and "loop" not in auto
        assert auto["us"] == pytest.approx(auto["dependent"]["us"])
        assert auto["dependent"]["calls_per_sample"] == auto["dependent"]["R"] * auto[
            "dependent"]["calls_per_iteration"]


def test_time_loop_reports_calls_per_iteration():
    args = argparse.Namespace(target_ms=0.5, max_loop=8, reps=3, min_calls_per_iter=8)
    t = bench.time_loop(lambda c, inc: c + inc, jnp.float32(0), [(jnp.float32(1),)] * 3, args)
    assert t["calls_per_iteration"] == 9  # 3 passes over 3 sets: the first count >= 8
    assert t["calls_per_sample"] == t["R"] * 9
    # One slope per pair of samples (each may be noise-negative for this trivial step);
    # the reported figure is positive either way.
    assert len(t["samples_s"]) == 3 and t["median_s"] > 0 and t["average_per_call_s"] > 0
    assert "fixed_per_sample_s" in t


def test_slope_per_call_cancels_a_fixed_cost_per_sample():
    """The loop method's per-call figure is the slope between a loop of R and one of 2R
    iterations: a cost paid once per sample (~0.6-1.0 ms on the H200) drops out, where the
    average over one loop's calls carries it."""
    per_call, fixed = 300e-6, 700e-6
    short = [fixed + 64 * per_call + e for e in (0.0, 2e-6, -1e-6)]
    long_ = [fixed + 128 * per_call + e for e in (1e-6, 0.0, 3e-6)]
    got = bench.slope_per_call(short, long_, 64, 128)
    assert got == pytest.approx([per_call + d / 64 for d in (1e-6, -2e-6, 4e-6)], rel=1e-9)
    # The average figure (long loop / its calls) reads 1.8% high here: 700 us over 128 calls.
    assert long_[0] / 128 == pytest.approx(per_call + fixed / 128 + 1e-6 / 128)


def test_tie_to_query_keeps_the_tables_and_one_gather_pair_per_call():
    inp = make_paged_inputs(np.random.default_rng(0), [256, 100, 17, 256], 4, 2, 64, 16,
                            dtype=jnp.bfloat16)
    q, kc, vc, bt, sl = (jnp.asarray(a) for a in inp.args())
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


def test_cache_variant_names():
    """bench.cache_variant (used by size_series.py and partition_sweep.py): the
    kwargs and bytes of each variant, and a clear error for an unknown name."""
    sets = [(jnp.ones((2, 1, 8, 16, 8), jnp.bfloat16), jnp.ones((2, 1, 64, 16), jnp.bfloat16),
             jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 32, jnp.int32))]
    assert bench.cache_variant(sets, "bf16", 1000)[1:] == ({}, 1000)
    assert bench.cache_variant(sets, "cap30", 1000)[1:] == (dict(soft_cap=30.0), 1000)
    fp8_sets, kwargs, nbytes = bench.cache_variant(sets, "fp8e4m3", 1000)
    assert nbytes == 500 and set(kwargs) == {"k_scale", "v_scale"}
    assert fp8_sets[0][0].dtype == jnp.float8_e4m3fn and fp8_sets[0][0].shape == (2, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="cache variant 'int8'"):
        bench.cache_variant(sets, "int8", 1000)


def test_goal_check_counts_only_correct_rows():
    """Issue 4's goal line credits a fast row only when it passed the float32 check
    (a wrong result, e.g. a timing-probe build's, meets no goal)."""
    cfg = bench.Config(1, 32, 8, 32768)
    fast = dict(us=30.0, frac_copy=0.9)
    met = bench.goal_check(cfg, dict(impls=dict(auto=dict(fast, ok=True)),
                                     quoted=dict(flashinfer=(57, 2.37))), 4.2)
    assert met.startswith("MET") and "beats FI*: yes" in met and ">=75% copy: yes" in met
    wrong = bench.goal_check(cfg, dict(impls=dict(auto=dict(fast, ok=False)),
                                       quoted=dict(flashinfer=(57, 2.37))), 4.2)
    assert wrong.startswith("not counted") and "MET" not in wrong
    slow = bench.goal_check(cfg, dict(impls=dict(auto=dict(us=60.0, frac_copy=0.5, ok=True)),
                                      quoted=dict(flashinfer=(57, 2.37))), 4.2)
    assert slow.startswith("not met") and "beats FI*: NO" in slow


def test_feature_goal_check_reports_issue_6_bars():
    """Issue 6's line: an fp8 decode row against issue 4's bandwidth bar for its
    configuration, each multi-token row as a multiple of its own decode step (bf16 rows
    of auto, fp8 rows of auto+fp8<fmt>); other feature rows are not judged, and a row that
    failed the float32 check counts for nothing."""
    impls = {"auto": dict(us=40.0, frac_copy=0.8, ok=True),
             "auto+fp8e4m3": dict(us=27.0, frac_copy=0.589, ok=True),
             "auto+fp8e5m2": dict(us=20.0, frac_copy=0.8, ok=True),
             "auto+cap": dict(us=41.0, frac_copy=0.78, ok=True),
             "auto+q16": dict(us=50.0, ok=True),
             "auto+fp8e4m3q16": dict(us=54.0, ok=True),
             "auto+fp8e5m2q16": dict(us=30.0, ok=False)}
    got = bench.feature_goal_check(bench.Config(1, 32, 8, 32768), dict(impls=impls))
    assert got.split(", ") == [
        "fp8e4m3 >=75% copy: NO (58.9%)", "fp8e5m2 >=75% copy: yes (80.0%)",
        "q16 1.25x step", "fp8e4m3q16 2.00x step", "fp8e5m2q16: not counted (failed the check)"]
    # Issue 4's 90% bar where B * Hkv >= 256; no bar (only the multiples) elsewhere.
    big = bench.feature_goal_check(bench.Config(64, 32, 8, 4096), dict(impls=impls))
    assert "fp8e4m3 >=90% copy: NO (58.9%)" in big
    small = bench.feature_goal_check(bench.Config(8, 32, 8, 8192), dict(impls=impls))
    assert "copy" not in small and "q16 1.25x step" in small
    assert bench.feature_goal_check(bench.Config(8, 32, 8, 8192),
                                    dict(impls={"auto": impls["auto"]})) is None


def test_ground_truth_with_multi_token_queries():
    """The benchmark's independent ground truth for --q-len rows agrees with the jnp
    reference on ragged lengths, including sequences shorter than the query (their first
    rows attend nothing: zeros), and its decode case is the q_len = 1 slice."""
    q_len = 5
    rng = np.random.default_rng(3)
    # (No NaN poison: the ground truth is a plain masked softmax, 0 * NaN would be NaN.)
    inp = make_paged_inputs(rng, [3, 8, 17, 40], num_heads=4, num_kv_heads=2, head_size=32,
                            block_size=8, poison=False)
    _, kc, vc, bt, sl = inp.args()
    q = rng.standard_normal((4, q_len, 4, 32)).astype(np.float32)
    scale = 32 ** -0.5
    truth = np.asarray(bench.ground_truth(q, kc, vc, bt, sl, scale))
    ref = np.asarray(jp.reference.paged_attention(q, kc, vc, bt, sl, scale=scale))
    assert truth.shape == (4, q_len, 4, 32)
    np.testing.assert_allclose(truth, ref, atol=2e-5, rtol=2e-5)
    assert np.all(truth[0, :2] == 0) and np.all(np.abs(truth[0, 2:]).sum(-1) > 0)  # L=3 < q_len
    last = np.asarray(bench.ground_truth(q[:, -1], kc, vc, bt, sl, scale))
    np.testing.assert_allclose(last, truth[:, -1], atol=1e-6, rtol=1e-6)
    _, args = bench.parse_args(["--q-len", "4", "--q-len", "16", "--no-pallas"])
    assert [v for v in bench.variant_list(args)] == [("auto+q4", "auto", "q4"),
                                                    ("auto+q16", "auto", "q16")]
    with pytest.raises(SystemExit):
        bench.parse_args(["--q-len", "1"])
    # fp8 caches with multi-token queries: one row per format and length, after the others.
    _, args = bench.parse_args(["--fp8", "e4m3", "--fp8", "e5m2", "--fp8-q-len", "16", "--no-pallas"])
    assert [v[2] for v in bench.variant_list(args)] == ["fp8e4m3", "fp8e5m2", "fp8e4m3q16",
                                                        "fp8e5m2q16"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--fp8-q-len", "16"])  # (no --fp8)


def test_no_classic_rows_and_run_time_switches_in_the_json(tmp_path, monkeypatch, capsys):
    """--no-classic leaves out the v1 / v2 rows; the JAX_PAGED_* environment (whose
    development options change the kernels a GPU run takes) is recorded and printed; each
    row's sample spread is in the JSON and the table."""
    import json
    monkeypatch.setenv("JAX_PAGED_DEV_OPTIONS", "row_split=0")
    out = tmp_path / "b.json"
    rc = bench.main(["--no-defaults", "--config", "2,4,2,64,64,16", "--no-classic", "--no-pallas",
                     "--no-reference", "--reps", "2", "--target-ms", "1", "--max-loop", "2",
                     "--no-progress", "--json", str(out), "--png", str(tmp_path / "b.png")])
    assert rc == 0
    with open(out) as f:
        result = json.load(f)
    assert result["meta"]["jax_paged_environment"].get("JAX_PAGED_DEV_OPTIONS") == "row_split=0"
    (row,) = result["results"]
    assert set(row["impls"]) == {"auto"}
    # The same-run matrix-product rate and each row's roofline bound.
    assert result["meta"]["matmul_rate"]["tflops"] > 0
    auto = row["impls"]["auto"]
    assert auto["flops"] == 4 * 64 * 4 * 2 * 64        # 2 sequences of 64 tokens, 4 heads
    assert 0 < auto["frac_roofline"] == pytest.approx(auto["roofline_us"] / auto["us"])
    # Each row's sample spread, from the samples of its figure, printed beside its time.
    samples = auto[auto["method"]]["samples_us"]
    assert len(samples) == 2
    assert auto["spread"] == pytest.approx(bench.sample_spread(samples))
    lines = capsys.readouterr().out.splitlines()
    assert "jax_paged environment: JAX_PAGED_DEV_OPTIONS=row_split=0" in lines
    header = next(line for line in lines if line.startswith("config") and " impl " in line)
    assert header.split()[2:4] == ["us", "spread"]
    (auto_line,) = [line for line in lines if line.split()[1:2] == ["auto"]]
    assert auto_line.split()[3] == f"{100 * auto['spread']:.1f}%"


def test_sample_spread_is_the_range_over_the_median():
    """The table's spread column: (slowest - fastest) / median of a row's samples, so
    a row of samples 112.4-156.8 µs, median 147.0, shows 30%."""
    got = bench.sample_spread([156.8e-6, 148.1e-6, 112.4e-6, 121.4e-6, 147.0e-6])
    assert got == pytest.approx((156.8 - 112.4) / 147.0)
    assert bench.sample_spread([1.0, 1.0, 1.0]) == 0.0
    assert bench.sample_spread([2.0]) is None      # one sample: nothing to compare
    assert bench.sample_spread([]) is None


class _FakeLoop:
    """A stand-in for a compiled loop of R iterations (for a fake clock)."""

    def __init__(self, R, n_calls):
        self.R, self.n_calls = R, n_calls

    def __call__(self, *_):
        return self


def _fake_clock(monkeypatch, per_call_s, fixed_s, slow_first=0, slow_s=0.0):
    """Fake bench._loop_fn / bench._wall: a sample of R iterations lasts fixed + R *
    calls * per_call, except the first `slow_first` samples after the compile-and-warm-up
    pair, which last slow_s (a GPU still raising its clocks). Returns the list of sampled
    R values."""
    seen = []

    def loop_fn(step, R, n, unroll):
        return _FakeLoop(R, n * unroll)

    def wall(fn):
        loop = fn()
        seen.append(loop.R)
        if 2 < len(seen) <= 2 + slow_first:
            return slow_s
        return fixed_s + loop.R * loop.n_calls * per_call_s

    monkeypatch.setattr(bench, "_loop_fn", loop_fn)
    monkeypatch.setattr(bench, "_wall", wall)
    return seen


def test_time_loop_sizes_r_again_when_the_probes_ran_slow(monkeypatch):
    """Probes that ran slow (a GPU still raising its clocks) would leave R at 2, and slope
    pairs of 2 against 4 iterations of ~1 ms beside a ~0.6 ms fixed cost read the bandwidth
    high. With the probes' samples slow, R is sized again from the measured R
    samples; with them on time, R is what the probes chose and nothing is measured twice."""
    args = argparse.Namespace(target_ms=15.0, max_loop=4096, reps=3, min_calls_per_iter=1)
    per_call, fixed = 1.0e-3, 0.6e-3
    _fake_clock(monkeypatch, per_call, fixed, slow_first=2, slow_s=4.0e-3)
    t = bench.time_loop(None, None, [()], args)
    assert t["probe_R"] == 2 and t["R"] == 8  # 2.6 ms measured at R = 2: 7.5 ms needs R = 8
    assert t["median_s"] == pytest.approx(per_call)
    seen = _fake_clock(monkeypatch, per_call, fixed)
    t = bench.time_loop(None, None, [()], args)
    assert t["probe_R"] == t["R"] == 8 and t["median_s"] == pytest.approx(per_call)
    assert max(seen) == 16  # the long loop of the pairs; no second sizing


def test_attention_work_counts_each_attended_pair_once():
    """attention_work's flops against a count over every (sequence, new token, token) of
    the ground truth's mask: causal among the new tokens, the window, a sequence shorter
    than the query (its first rows attend nothing)."""
    lens, q_len, heads, d = [7, 1, 40, 3], 4, 3, 16
    for window in (None, 5):
        pairs = 0
        for L in lens:
            for i in range(q_len):
                pos = L - q_len + i
                pairs += sum(1 for t in range(L) if t <= pos and (not window or t > pos - window))
        flops, io_bytes = bench.attention_work(lens, q_len, heads, d, window, 2, 1000)
        assert flops == 4 * d * heads * pairs
        assert io_bytes == 1000 + 2 * len(lens) * q_len * heads * d * 2


def test_roofline_is_the_longer_of_the_two_bounds():
    # 1 GB at 4 TB/s = 250 us; 100 GFLOP at 500 TFLOP/s = 200 us.
    assert bench.roofline_s(100e9, 1e9, 4.0, 500.0) == pytest.approx(250e-6)
    assert bench.roofline_s(200e9, 1e9, 4.0, 500.0) == pytest.approx(400e-6)
    assert bench.roofline_s(1, 1, None, 500.0) is None and bench.roofline_s(1, 1, 4.0, None) is None


def test_references_take_their_own_least_sample_length_and_count(monkeypatch):
    """The copy bandwidth and the matrix-product rate divide every row's %copy and %roof,
    so they are timed with at least --ref-target-ms per long sample and --ref-reps pairs
    even when the rows are timed shorter (at --target-ms 10 the copy loop would stay at
    R = 2, whose pairs spread widely); a longer --target-ms or more --reps still apply to
    them."""
    _, args = bench.parse_args(["--target-ms", "10", "--reps", "5"])
    ref = bench._reference_args(args)
    assert (ref.target_ms, ref.reps, ref.min_calls_per_iter) == (40.0, 9, 1)
    assert (args.target_ms, args.reps) == (10.0, 5)  # the rows' own settings are untouched
    _, args = bench.parse_args(["--target-ms", "60", "--reps", "15", "--ref-reps", "3"])
    ref = bench._reference_args(args)
    assert (ref.target_ms, ref.reps) == (60.0, 15)
    # The copy measurement passes them to both of its timings and records them.
    _, args = bench.parse_args(["--target-ms", "10", "--reps", "5", "--copy-gb", "0.0001"])
    seen = []

    def fake_loop(step, carry0, sets, a):
        seen.append(("loop", a.target_ms, a.reps))
        return dict(median_s=1e-3, samples_s=[1e-3], R=2)

    def fake_dispatch(step_jit, carry0, sets, a):
        seen.append(("dispatch", a.target_ms, a.reps))
        return dict(median_s=1e-3, samples_s=[1e-3], calls_per_sample=1)

    monkeypatch.setattr(bench, "time_loop", fake_loop)
    monkeypatch.setattr(bench, "time_dispatch", fake_dispatch)
    res = bench.measure_copy_bandwidth(args)
    assert seen == [("loop", 40.0, 9), ("dispatch", 40.0, 9)]
    assert (res["target_ms"], res["reps"]) == (40.0, 9) and res["tbps"] > 0
    # So does the matrix-product rate.
    _, args = bench.parse_args(["--target-ms", "10", "--reps", "5", "--matmul-n", "8"])
    seen.clear()
    res = bench.measure_matmul_rate(args)
    assert seen == [("loop", 40.0, 9)]
    assert (res["target_ms"], res["reps"]) == (40.0, 9) and res["tflops"] > 0
