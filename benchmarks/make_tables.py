#!/usr/bin/env python3
"""Write the performance tables of docs/performance.md and README.md from benchmark JSON.

Every ``*.json`` under ``benchmarks/results/`` is a file written by
``benchmarks/bench_paged_attention.py --json``. The files are grouped by card
(``meta.device``); per card the main file comes first (``h200.json`` before
``h200-head64.json``), and a later file adds only the configurations the earlier ones
lack. Each file gives one table, headed by the card, the copy bandwidth measured in the
same run and the file's path.

    python benchmarks/make_tables.py            # rewrite both files in place
    python benchmarks/make_tables.py --check    # exit 1, with a diff on stderr, when either
                                                # file differs from what would be written

Only the text between the marker lines is written: ``<!-- generated:begin -->`` /
``<!-- generated:end -->`` in docs/performance.md, ``<!-- perf-table:begin -->`` /
``<!-- perf-table:end -->`` in README.md. Standard library only, so that CI runs it
without JAX.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DOC_PATH = REPO_ROOT / "docs" / "performance.md"
README_PATH = REPO_ROOT / "README.md"

DOC_MARKERS = ("<!-- generated:begin -->", "<!-- generated:end -->")
README_MARKERS = ("<!-- perf-table:begin -->", "<!-- perf-table:end -->")
GENERATED_NOTE = ("<!-- Written by benchmarks/make_tables.py from benchmarks/results/*.json; "
                  "edit those, not this section. -->")

DEFAULT_IMPL = "auto"
IMPL_TITLES = {"auto": "jax_paged µs", "reference": "jnp reference µs", "pallas": "Pallas µs"}

# The README's rows: (num_seqs, num_heads, num_kv_heads, context, head_size, block_size,
# ragged, feature). A long single sequence, a large bf16 batch, and both with fp8 caches.
README_ROWS = [
    (1, 32, 8, 32768, 128, 16, False, ""),
    (64, 32, 8, 4096, 128, 16, False, ""),
    (64, 32, 8, 4096, 128, 16, False, "fp8e4m3"),
    (1, 32, 8, 32768, 128, 16, False, "fp8e4m3"),
]

DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmark JSON file: its card, same-run copy bandwidth and results."""

    path: Path
    device: str
    copy_tbps: float
    meta: dict[str, Any]
    results: list[dict[str, Any]]


@dataclasses.dataclass
class Row:
    """One configuration and feature (plain decode, fp8 cache, q_len, ...) of one run:
    the measured entry of each implementation that ran it."""

    config: dict[str, Any]
    feature: str
    entries: dict[str, dict[str, Any]]


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------
def _sort_key(path: Path) -> tuple[str, bool, str]:
    stem = path.stem
    return (stem.split("-", 1)[0], "-" in stem, stem)


def load_run(path: Path) -> Run:
    """Read one benchmark JSON; a missing card name or copy bandwidth is an error."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    meta = data.get("meta") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected an object with a 'meta' object (bench_paged_attention.py "
                         f"--json output), got {type(data).__name__}")
    device = meta.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(f"{path}: meta.device must be the card's name, got {device!r}")
    copy = (meta.get("copy_bandwidth") or {}).get("tbps")
    if not isinstance(copy, (int, float)) or not copy > 0:
        raise ValueError(f"{path}: meta.copy_bandwidth.tbps must be a positive number, got {copy!r}")
    results = data.get("results")
    if not isinstance(results, list):
        raise ValueError(f"{path}: 'results' must be a list, got {type(results).__name__}")
    return Run(path=path, device=device, copy_tbps=float(copy), meta=meta, results=results)


def load_runs(results_dir: Path) -> list[Run]:
    """Every *.json under results_dir, main file of each card first."""
    paths = sorted(results_dir.glob("*.json"), key=_sort_key)
    if not paths:
        raise ValueError(f"{results_dir}: no *.json benchmark results found")
    return [load_run(p) for p in paths]


def by_device(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs grouped by card, cards and runs in the order of `runs`."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.device, []).append(run)
    return out


# ---------------------------------------------------------------------------
# Rows and figures
# ---------------------------------------------------------------------------
def split_impl_name(name: str) -> tuple[str, str]:
    """'auto+fp8e4m3q16' -> ('auto', 'fp8e4m3q16'); 'pallas' -> ('pallas', '')."""
    impl, _, feature = name.partition("+")
    return impl, feature


def config_key(config: dict[str, Any]) -> tuple:
    return (config["batch"], config["num_heads"], config["num_kv_heads"], config["seq_len"],
            config.get("head_size", 128), config.get("block_size", 16),
            bool(config.get("ragged", False)), config.get("dtype", "bfloat16"))


def run_rows(run: Run) -> list[Row]:
    """The rows of one run: per configuration the plain decode row first, then each
    feature row in the order the benchmark ran them."""
    rows = []
    for result in run.results:
        by_feature: dict[str, dict[str, dict[str, Any]]] = {"": {}}
        for name, entry in result.get("impls", {}).items():
            impl, feature = split_impl_name(name)
            by_feature.setdefault(feature, {})[impl] = entry
        for feature, entries in by_feature.items():
            if entries:
                rows.append(Row(config=result["config"], feature=feature, entries=entries))
    return rows


def impl_columns(rows: Sequence[Row]) -> list[str]:
    """Implementations measured in any row: the default first, then in the order they ran."""
    names: list[str] = []
    for row in rows:
        for impl in row.entries:
            if impl not in names:
                names.append(impl)
    return sorted(names, key=lambda n: n != DEFAULT_IMPL)


def timed_us(entry: dict[str, Any] | None) -> float | None:
    """The entry's µs per call when it ran and matched the ground truth, else None."""
    if not entry or entry.get("ok") is False:
        return None
    us = entry.get("us")
    return float(us) if isinstance(us, (int, float)) and us > 0 else None


def percent_of_copy(entry: dict[str, Any], result_kv_bytes: int, copy_tbps: float) -> float | None:
    """Bytes of K and V the call reads per second, as a percentage of the copy bandwidth
    (bytes read + written per second by y = x + 1) measured in the same run."""
    us = timed_us(entry)
    if us is None:
        return None
    kv_bytes = entry.get("kv_bytes", result_kv_bytes)
    return 100.0 * kv_bytes / (us * 1e-6) / (copy_tbps * 1e12)


def reference_speedup(row: Row) -> float | None:
    """Time of the jnp reference / time of the default impl, both in this row."""
    ref, main = timed_us(row.entries.get("reference")), timed_us(row.entries.get(DEFAULT_IMPL))
    return ref / main if ref is not None and main is not None else None


def describe_feature(feature: str, entries: dict[str, dict[str, Any]]) -> tuple[str, int, str]:
    """(fp8 format or '', q_len, option) of a feature name of the benchmark."""
    m = re.fullmatch(r"(?:fp8(e4m3|e5m2))?(?:q(\d+))?", feature)
    if m:
        return m.group(1) or "", int(m.group(2) or 1), ""
    if feature == "cap":
        cap = next((e["soft_cap"] for e in entries.values() if "soft_cap" in e), None)
        return "", 1, "soft cap" + (f" {cap:g}" if isinstance(cap, (int, float)) else "")
    m = re.fullmatch(r"win(\d+)", feature)
    if m:
        return "", 1, f"window {m.group(1)}"
    return "", 1, feature


def cache_name(config: dict[str, Any], fp8: str) -> str:
    dtype = config.get("dtype", "bfloat16")
    return f"fp8 {fp8}" if fp8 else DTYPE_NAMES.get(dtype, dtype)


def context_text(config: dict[str, Any]) -> str:
    return f"ragged, ≤ {config['seq_len']}" if config.get("ragged") else str(config["seq_len"])


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return format(value, spec) + suffix


def time_cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "–"
    if "us" not in entry:
        return "error"
    if entry.get("ok") is False:
        return "mismatch"
    return fmt(timed_us(entry), ".1f")


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   right: Sequence[bool]) -> list[str]:
    """A pipe table with padded columns; `right` aligns a column to the right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(cells, widths, right)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2))
                          for w, r in zip(widths, right)) + "|"
    return [line(header), rule] + [line(r) for r in rows]


def display_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def run_note(run: Run) -> str:
    """What the table's heading says about its run beyond the card and the baseline."""
    args = run.meta.get("args") or {}
    copy = run.meta.get("copy_bandwidth") or {}
    parts = []
    # The copy's own settings where the run recorded them, else it ran with the rows'.
    copy_reps, copy_ms = copy.get("reps", args.get("reps")), copy.get("target_ms", args.get("target_ms"))
    if copy_reps and copy_ms:
        parts.append(f"copy timed as the median of {copy_reps} sample pairs of about {copy_ms:g} ms")
    if args.get("reps") and args.get("target_ms"):
        parts.append(f"each row as the median of {args['reps']} pairs of about {args['target_ms']:g} ms")
    if run.meta.get("jax_version"):
        parts.append(f"jax {run.meta['jax_version']}")
    dev_opts = run.meta.get("jax_paged_development_options") or []
    if dev_opts:
        parts.append("built with development options " + ", ".join(dev_opts) + " (not the default build)")
    env = run.meta.get("jax_paged_environment") or {}
    if env:
        parts.append("run with " + " ".join(f"{k}={v}" for k, v in env.items()))
    if run.meta.get("failures"):
        parts.append(f"{len(run.meta['failures'])} implementation(s) failed their check")
    return "; ".join(parts)


def bench_command(run: Run) -> str | None:
    """The benchmark command line that wrote the run, writing its JSON to the same path."""
    argv = run.meta.get("argv")
    if not isinstance(argv, list):
        return None
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--png"):
            skip = True
        elif a != "--no-progress" and not a.startswith(("--json=", "--png=")):
            kept.append(str(a))
    return shlex.join(["python", "benchmarks/bench_paged_attention.py", *kept,
                       "--json", display_path(run.path)])


def run_table(run: Run, rows: Sequence[Row]) -> list[str]:
    """The full table of one run's rows."""
    impls = impl_columns(rows)
    header = ["seqs", "heads q/kv", "context", "head", "block", "KV cache", "q_len", "option",
              IMPL_TITLES[DEFAULT_IMPL], "% of copy"]
    header += [IMPL_TITLES.get(i, f"{i} µs") for i in impls if i != DEFAULT_IMPL]
    header.append("× jnp reference")
    kv_by_config = {config_key(r["config"]): r.get("kv_bytes", 0) for r in run.results}
    body = []
    for row in rows:
        c = row.config
        fp8, q_len, option = describe_feature(row.feature, row.entries)
        main = row.entries.get(DEFAULT_IMPL)
        pct = percent_of_copy(main, kv_by_config[config_key(c)], run.copy_tbps) if main else None
        cells = [str(c["batch"]), f"{c['num_heads']}/{c['num_kv_heads']}", context_text(c),
                 str(c.get("head_size", 128)), str(c.get("block_size", 16)), cache_name(c, fp8),
                 str(q_len), option or "–", time_cell(main), fmt(pct, ".1f")]
        cells += [time_cell(row.entries.get(i)) for i in impls if i != DEFAULT_IMPL]
        cells.append(fmt(reference_speedup(row), ".1f", "×"))
        body.append(cells)
    right = [True, True, True, True, True, False, True, False] + [True] * (len(header) - 8)
    return markdown_table(header, body, right)


def render_performance(runs: Sequence[Run]) -> str:
    """The generated section of docs/performance.md: one table per card and file."""
    out = [GENERATED_NOTE, ""]
    for device, device_runs in by_device(runs).items():
        out += [f"### {device}", ""]
        shown: set[tuple] = set()
        for i, run in enumerate(device_runs):
            rows = [r for r in run_rows(run) if config_key(r.config) not in shown]
            if not rows:
                continue
            shown.update(config_key(r.config) for r in rows)
            lead = "From" if i == 0 else "Configurations the files above lack, from"
            note = run_note(run)
            out.append(f"{lead} `{display_path(run.path)}`: copy bandwidth measured in the same run "
                       f"{run.copy_tbps:.2f} TB/s" + (f"; {note}" if note else "") + ".")
            command = bench_command(run)
            if command:
                out += ["", f"`{command}`"]
            out.append("")
            out += run_table(run, rows)
            out.append("")
    return "\n".join(out).rstrip("\n")


def readme_call(spec: tuple) -> str:
    batch, heads, kv_heads, context, head, block, ragged, feature = spec
    fp8, q_len, option = describe_feature(feature, {})
    seqs = f"{batch} sequence" + ("s" if batch != 1 else "")
    text = (f"{seqs} × {'up to ' if ragged else ''}{context} tokens, {heads}/{kv_heads} heads, "
            f"head {head}, {cache_name({}, fp8)}")
    if q_len != 1:
        text += f", q_len {q_len}"
    return text + (f", {option}" if option else "")


def render_readme(runs: Sequence[Run]) -> str:
    """The README's small table per card: the README_ROWS its files have."""
    out = [GENERATED_NOTE]
    for device, device_runs in by_device(runs).items():
        found: dict[tuple, tuple[Run, Row]] = {}
        for run in device_runs:
            for row in run_rows(run):
                key = config_key(row.config)[:7] + (row.feature,)
                found.setdefault(key, (run, row))
        body = []
        for spec in README_ROWS:
            if spec not in found:
                continue
            run, row = found[spec]
            kv = next(r.get("kv_bytes", 0) for r in run.results
                      if config_key(r["config"]) == config_key(row.config))
            main = row.entries.get(DEFAULT_IMPL)
            body.append([readme_call(spec), time_cell(main),
                         fmt(percent_of_copy(main, kv, run.copy_tbps) if main else None, ".1f"),
                         fmt(reference_speedup(row), ".1f", "×")])
        if not body:
            continue
        main_run = device_runs[0]
        out += ["", f"**{device}**, copy bandwidth {main_run.copy_tbps:.2f} TB/s measured in the same "
                    f"run (`{display_path(main_run.path)}`):", ""]
        out += markdown_table(["call (bf16 query)", "µs per call", "% of copy", "× jnp reference"],
                              body, [False, True, True, True])
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------
def replace_between(text: str, markers: tuple[str, str], body: str, name: str) -> str:
    """`text` with the lines between the two marker lines replaced by `body`."""
    begin, end = markers
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == begin]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or starts[0] > ends[0]:
        raise ValueError(f"{name}: expected one line {begin!r} followed by one line {end!r}, "
                         f"found {len(starts)} and {len(ends)}"
                         + (" in the wrong order" if len(starts) == len(ends) == 1 else ""))
    return "\n".join(lines[:starts[0] + 1] + body.split("\n") + lines[ends[0]:])


def expected_files(runs: Sequence[Run], doc: Path, readme: Path) -> dict[Path, tuple[str, str]]:
    """{path: (current text, text to write)} for both files."""
    out = {}
    for path, markers, body in ((doc, DOC_MARKERS, render_performance(runs)),
                                (readme, README_MARKERS, render_readme(runs))):
        current = path.read_text(encoding="utf-8")
        out[path] = (current, replace_between(current, markers, body, display_path(path)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 with a diff on stderr when a file is out of date")
    p.add_argument("--results", type=Path, default=RESULTS_DIR,
                   help="folder of benchmark JSON files (default benchmarks/results)")
    p.add_argument("--doc", type=Path, default=DOC_PATH, help="default docs/performance.md")
    p.add_argument("--readme", type=Path, default=README_PATH, help="default README.md")
    args = p.parse_args(argv)
    try:
        files = expected_files(load_runs(args.results), args.doc, args.readme)
    except (OSError, ValueError, KeyError) as e:
        print(f"make_tables: {e}", file=sys.stderr)
        return 2
    stale = [path for path, (current, new) in files.items() if current != new]
    if args.check:
        for path in stale:
            current, new = files[path]
            name = display_path(path)
            sys.stderr.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), new.splitlines(keepends=True),
                fromfile=f"{name} (committed)", tofile=f"{name} (generated)"))
        if stale:
            print("make_tables: out of date: " + ", ".join(display_path(p) for p in stale)
                  + "; run python benchmarks/make_tables.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path][1], encoding="utf-8")
        print(f"wrote {display_path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
