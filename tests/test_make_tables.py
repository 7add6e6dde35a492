"""benchmarks/make_tables.py: the committed performance tables match the benchmark JSON
they come from, and the generator turns a small synthetic run into the expected rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "make_tables.py"
sys.path.insert(0, str(SCRIPT.parent))
import make_tables  # noqa: E402

COPY_TBPS = 2.5


def _config(batch, heads, kv_heads, seq_len, head=128, block=16, ragged=False):
    return dict(batch=batch, num_heads=heads, num_kv_heads=kv_heads, seq_len=seq_len,
                head_size=head, block_size=block, ragged=ragged, dtype="bfloat16")


def _kv_bytes(cfg, itemsize=2):
    return cfg["batch"] * cfg["seq_len"] * cfg["num_kv_heads"] * cfg["head_size"] * 2 * itemsize


def _synthetic_run(device="Test GPU X", copy_tbps=COPY_TBPS):
    """Two configurations as bench_paged_attention.py writes them: a long single sequence
    (auto, v2, reference, fp8, q_len 4, soft cap) and a large batch (auto, reference, Pallas,
    a window, and a v2 row that failed its check)."""
    long_ = _config(1, 32, 8, 32768)
    batch = _config(64, 32, 8, 4096)
    kv_long, kv_batch = _kv_bytes(long_), _kv_bytes(batch)
    results = [
        dict(config=long_, label="1,32,8,32768", kv_bytes=kv_long, impls={
            "auto": dict(us=50.0, kv_bytes=kv_long, ok=True),
            "v2": dict(us=80.0, kv_bytes=kv_long, ok=True),
            "reference": dict(us=400.0, kv_bytes=kv_long, ok=True),
            "auto+fp8e4m3": dict(us=32.0, kv_bytes=kv_long // 2, ok=True, variant="fp8e4m3"),
            "auto+q4": dict(us=60.0, kv_bytes=kv_long, ok=True, variant="q4", q_len=4),
            "auto+cap": dict(us=51.0, kv_bytes=kv_long, ok=True, variant="cap", soft_cap=30.0),
        }),
        dict(config=batch, label="64,32,8,4096", kv_bytes=kv_batch, impls={
            "auto": dict(us=400.0, kv_bytes=kv_batch, ok=True),
            "v2": dict(us=900.0, kv_bytes=kv_batch, ok=False),
            "reference": dict(us=2000.0, kv_bytes=kv_batch, ok=True),
            "auto+win1024": dict(us=120.0, kv_bytes=64 * 1024 * 8 * 128 * 2 * 2, ok=True,
                                 variant="win1024", sliding_window=1024),
            "pallas": dict(error="import failed: no Triton"),
        }),
    ]
    meta = dict(device=device, copy_bandwidth=dict(tbps=copy_tbps, reps=9, target_ms=40.0),
                args=dict(reps=7, target_ms=20.0), jax_version="0.0.test",
                jax_paged_development_options=[], jax_paged_environment={}, failures=[],
                argv=["--fp8", "e4m3", "--soft-cap", "30", "--json", "/tmp/x.json", "--no-progress"])
    return dict(meta=meta, results=results)


def _table_rows(markdown: str) -> list[list[str]]:
    """The cells of every body row of the pipe tables in `markdown`."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return [r for r in rows if r[0] not in ("seqs", "call (bf16 query)")]


def _pct(kv_bytes, us, copy_tbps=COPY_TBPS):
    """Read bandwidth as a percentage of the copy bandwidth, computed here independently."""
    return f"{kv_bytes / (us / 1e6) / (copy_tbps * 1e12) * 100:.1f}"


def _write_run(folder: Path, name: str, run: dict) -> Path:
    path = folder / name
    path.write_text(json.dumps(run), encoding="utf-8")
    return path


def test_committed_tables_are_in_sync():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_results_are_only_the_table_sources():
    """benchmarks/results holds the JSON files the tables read, nothing else."""
    files = sorted(p.name for p in (REPO / "benchmarks" / "results").iterdir())
    assert files and all(f.endswith(".json") for f in files), files
    shown = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    for f in files:
        assert f"benchmarks/results/{f}" in shown, f


def test_rows_and_percentages_of_a_synthetic_run(tmp_path):
    _write_run(tmp_path, "testgpu.json", _synthetic_run())
    text = make_tables.render_performance(make_tables.load_runs(tmp_path))
    assert "### Test GPU X" in text
    assert "2.50 TB/s" in text
    rows = _table_rows(text)
    # Columns: seqs, heads, context, head, block, cache, q_len, option, jax_paged µs,
    # % of copy, v2 µs, jnp reference µs, Pallas µs, x jnp reference.
    long_kv, batch_kv = _kv_bytes(_config(1, 32, 8, 32768)), _kv_bytes(_config(64, 32, 8, 4096))
    assert rows == [
        ["1", "32/8", "32768", "128", "16", "bf16", "1", "–", "50.0", _pct(long_kv, 50.0),
         "80.0", "400.0", "–", f"{400 / 50:.1f}×"],
        ["1", "32/8", "32768", "128", "16", "fp8 e4m3", "1", "–", "32.0",
         _pct(long_kv // 2, 32.0), "–", "–", "–", "–"],
        ["1", "32/8", "32768", "128", "16", "bf16", "4", "–", "60.0", _pct(long_kv, 60.0),
         "–", "–", "–", "–"],
        ["1", "32/8", "32768", "128", "16", "bf16", "1", "soft cap 30", "51.0",
         _pct(long_kv, 51.0), "–", "–", "–", "–"],
        ["64", "32/8", "4096", "128", "16", "bf16", "1", "–", "400.0", _pct(batch_kv, 400.0),
         "mismatch", "2000.0", "error", f"{2000 / 400:.1f}×"],
        ["64", "32/8", "4096", "128", "16", "bf16", "1", "window 1024", "120.0",
         _pct(64 * 1024 * 8 * 128 * 4, 120.0), "–", "–", "–", "–"],
    ]
    # The command that wrote the run, without its output options.
    assert "`python benchmarks/bench_paged_attention.py --fp8 e4m3 --soft-cap 30 --json " in text
    assert "/tmp/x.json" not in text and "--no-progress" not in text


def test_a_second_file_adds_only_missing_configurations(tmp_path):
    main = _synthetic_run()
    extra = _synthetic_run(copy_tbps=3.0)
    extra["results"].append(dict(config=_config(8, 32, 8, 8192, head=64), kv_bytes=2 ** 26, impls={
        "auto": dict(us=40.0, kv_bytes=2 ** 26, ok=True)}))
    _write_run(tmp_path, "testgpu.json", main)
    _write_run(tmp_path, "testgpu-extra.json", extra)
    _write_run(tmp_path, "othergpu.json", _synthetic_run(device="Other GPU"))
    text = make_tables.render_performance(make_tables.load_runs(tmp_path))
    assert text.index("### Other GPU") < text.index("### Test GPU X")
    test_part = text[text.index("### Test GPU X"):]
    extra_part = test_part[test_part.index("testgpu-extra.json"):]
    assert test_part.index("testgpu.json") < test_part.index("testgpu-extra.json")
    assert "3.00 TB/s" in extra_part
    assert _table_rows(extra_part) == [
        ["8", "32/8", "8192", "64", "16", "bf16", "1", "–", "40.0", _pct(2 ** 26, 40.0, 3.0), "–"]]


def test_readme_table_picks_the_representative_rows(tmp_path):
    _write_run(tmp_path, "testgpu.json", _synthetic_run())
    text = make_tables.render_readme(make_tables.load_runs(tmp_path))
    long_kv, batch_kv = _kv_bytes(_config(1, 32, 8, 32768)), _kv_bytes(_config(64, 32, 8, 4096))
    assert _table_rows(text) == [
        ["1 sequence × 32768 tokens, 32/8 heads, head 128, bf16", "50.0", _pct(long_kv, 50.0), "8.0×"],
        ["64 sequences × 4096 tokens, 32/8 heads, head 128, bf16", "400.0", _pct(batch_kv, 400.0),
         "5.0×"],
        ["1 sequence × 32768 tokens, 32/8 heads, head 128, fp8 e4m3", "32.0",
         _pct(long_kv // 2, 32.0), "–"],
    ]


def _docs(tmp_path: Path) -> tuple[Path, Path]:
    doc, readme = tmp_path / "performance.md", tmp_path / "README.md"
    doc.write_text("# Perf\n\ntext\n\n<!-- generated:begin -->\nold\n<!-- generated:end -->\ntail\n",
                   encoding="utf-8")
    readme.write_text("# R\n<!-- perf-table:begin -->\n<!-- perf-table:end -->\nafter\n",
                      encoding="utf-8")
    return doc, readme


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ))


def test_write_then_check(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _write_run(results, "testgpu.json", _synthetic_run())
    doc, readme = _docs(tmp_path)
    paths = ["--results", str(results), "--doc", str(doc), "--readme", str(readme)]

    stale = _cli("--check", *paths)
    assert stale.returncode == 1
    assert "+| seqs" in stale.stderr and "-old" in stale.stderr
    assert doc.read_text(encoding="utf-8").count("old") == 1       # --check writes nothing

    assert _cli(*paths).returncode == 0
    written = doc.read_text(encoding="utf-8")
    assert written.startswith("# Perf\n\ntext\n\n<!-- generated:begin -->\n")
    assert written.endswith("<!-- generated:end -->\ntail\n") and "\nold\n" not in written
    assert readme.read_text(encoding="utf-8").endswith("<!-- perf-table:end -->\nafter\n")
    assert _cli("--check", *paths).returncode == 0

    doc.write_text(written.replace("50.0", "49.0"), encoding="utf-8")
    again = _cli("--check", *paths)
    assert again.returncode == 1 and "49.0" in again.stderr


@pytest.mark.parametrize("text", [
    "no markers\n",
    "<!-- generated:end -->\n<!-- generated:begin -->\n",
    "<!-- generated:begin -->\n<!-- generated:begin -->\n<!-- generated:end -->\n",
])
def test_missing_or_misplaced_markers_are_an_error(tmp_path, text):
    with pytest.raises(ValueError, match="generated:begin"):
        make_tables.replace_between(text, make_tables.DOC_MARKERS, "x", "performance.md")


def test_a_file_without_copy_bandwidth_is_refused(tmp_path):
    run = _synthetic_run()
    del run["meta"]["copy_bandwidth"]
    _write_run(tmp_path, "bad.json", run)
    with pytest.raises(ValueError, match=r"bad\.json: meta\.copy_bandwidth\.tbps"):
        make_tables.load_runs(tmp_path)
