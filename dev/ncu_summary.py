#!/usr/bin/env python3
"""Sums an ncu source page (per SASS instruction) per opcode and per stall reason.

Reads what `ncu --import R.ncu-rep --page source --csv --print-source sass` printed
(dev/ncu_case.sh writes it as source_<name>.csv) and needs no ncu, so the
device machine's profiles can be read here:

    python3 dev/ncu_summary.py out/ncu/source_q16_512.csv [--top 20]

A file holds one table per profiled kernel launch (each starting with its own
header row). For each table it prints the stall samples (the column "Warp Stall
Sampling (All Samples)") and the instructions executed, per opcode (an
instruction's first word after its predicate, e.g. HMMA, LDS, F2FP), the totals
of every per-reason stall column (names with "stall" in them) that the table has,
and the instructions with the most samples.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    """A cell's value ("1,000" -> 1000.0); 0 for an empty or non-numeric cell."""
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """HMMA.16816.F32 -> HMMA; '@!P0 BRA ...' -> BRA; '' -> '?'."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def tables(rows: list[list[str]]) -> list[tuple[str, list[dict]]]:
    """(title, rows as dicts) per table: a table starts at a row naming the Source
    column; the last non-table line before it, if any, is its title."""
    out: list[tuple[str, list[dict]]] = []
    header: list[str] | None = None
    title = ""
    for row in rows:
        if "Source" in row and (SAMPLES in row or EXECUTED in row):
            header = row
            out.append((title, []))
            title = ""
        elif header is not None and len(row) == len(header):
            out[-1][1].append(dict(zip(header, row)))
        elif any(cell.strip() for cell in row):  # a line between tables: the next one's title
            header = None
            title = " ".join(cell.strip() for cell in row if cell.strip())
    return out


def summarise(title: str, rows: list[dict], top: int) -> str:
    if not rows:
        return f"== {title or 'table'}: no rows\n"
    columns = list(rows[0])
    # (Not the sample totals, "Warp Stall Sampling (...)".)
    stall_cols = [c for c in columns if re.search("stall", c, re.I)
                  and not c.startswith("Warp Stall Sampling")]
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    stall_totals: dict[str, float] = defaultdict(float)
    per_inst = []
    for r in rows:
        samples = _number(r.get(SAMPLES, ""))
        executed = _number(r.get(EXECUTED, ""))
        op = opcode(r.get("Source", ""))
        by_op[op][0] += samples
        by_op[op][1] += executed
        for c in stall_cols:
            stall_totals[c] += _number(r.get(c, ""))
        per_inst.append((samples, r.get("Address", r.get("# Address", "")), r.get("Source", "")))
    total_samples = sum(v[0] for v in by_op.values()) or 1.0
    total_exec = sum(v[1] for v in by_op.values()) or 1.0
    lines = [f"== {title or 'table'}: {len(rows)} instructions, {total_samples:.0f} stall samples, "
             f"{total_exec:.0f} instructions executed"]
    if stall_totals:
        lines.append("  stall samples by reason:")
        for c, v in sorted(stall_totals.items(), key=lambda kv: -kv[1])[:top]:
            if v:
                lines.append(f"    {c:<48} {v:>10.0f} {100 * v / total_samples:5.1f}%")
    lines.append("  by opcode: samples (share), executed (share)")
    for op, (s, e) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {op:<10} {s:>10.0f} {100 * s / total_samples:5.1f}%  "
                     f"{e:>14.0f} {100 * e / total_exec:5.1f}%")
    lines.append("  instructions with the most samples:")
    for s, addr, src in sorted(per_inst, key=lambda t: -t[0])[:top]:
        lines.append(f"    {s:>8.0f} {100 * s / total_samples:5.1f}%  {addr:>8} {src.strip()}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv_file")
    ap.add_argument("--top", type=int, default=15, help="rows per list")
    args = ap.parse_args(argv)
    with open(args.csv_file, newline="") as f:
        rows = list(csv.reader(f))
    found = tables(rows)
    if not found:
        print(f"{args.csv_file}: no table with a Source column and '{SAMPLES}' or "
              f"'{EXECUTED}'", file=sys.stderr)
        return 1
    for title, table_rows in found:
        sys.stdout.write(summarise(title, table_rows, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
