#!/usr/bin/env python3
"""Runs one pytest selection as N concurrent pytest processes (shards).

The GPU suite is compile-bound (each parametrisation builds its own XLA
programs on the host), so on the GPU machine's 16 cores several processes
sharing the one GPU finish it in a fraction of the serial time; device time
is the scarce resource there. No plugin needed (pytest-xdist is not
installed on that machine).

    python3 dev/sharded_pytest.py --jobs 4 --log-dir out -- -q -k gpu tests

Collects the node ids once (`pytest --collect-only -q ARGS`), deals them out
round-robin, runs `pytest -q -p no:cacheprovider IDS` per shard with XLA's
GPU memory preallocation off (so the processes share the GPU's memory), each
shard's output in LOG_DIR/tests-shard<i>.log. Prints every shard's summary
line, the end of each failed shard's log, then one combined pytest-style
summary line (what dev/gpu_check.sh reports). Exit status: 0 when every shard passed, else
the largest shard status (5 if nothing was collected).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

# Node ids are relative to pytest's rootdir: the same one (the working
# directory) for the collection and every shard.
ROOT = ["-p", "no:cacheprovider", "--rootdir", os.getcwd()]
TAIL_LINES = 80  # of a failed shard's log, printed
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def collect(pytest_args: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          *ROOT, *pytest_args],
                         capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if any(i.startswith("::") for i in ids):
        raise SystemExit("sharded_pytest: test paths must lie under the working directory")
    if not ids and out.returncode not in (0, 5):
        sys.stdout.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(out.returncode)
    return ids


def summary_counts(text: str) -> dict[str, int]:
    """Counts from the last pytest summary line of a log ("3 passed, 1 failed in 2.0s")."""
    lines = [ln for ln in text.splitlines() if COUNT.search(ln) and " in " in ln]
    counts: dict[str, int] = {}
    if lines:
        for n, what in COUNT.findall(lines[-1]):
            key = "errors" if what.startswith("error") else what
            counts[key] = counts.get(key, 0) + int(n)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4, help="concurrent pytest processes")
    ap.add_argument("--log-dir", default=".", help="where tests-shard<i>.log go")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER,
                    help="after --: the pytest selection (options and paths)")
    args = ap.parse_args()
    pytest_args = [a for a in args.pytest_args if a != "--"] or ["-q", "tests"]
    # Selection options only: -q / -x and the like are for the shard runs.
    select = [a for a in pytest_args if a not in ("-q", "-x", "-v")]
    ids = collect(select)
    if not ids:
        print("no tests ran (nothing collected)")
        return 5
    jobs = max(1, min(args.jobs, len(ids)))
    shards = [ids[i::jobs] for i in range(jobs)]
    os.makedirs(args.log_dir, exist_ok=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    extra = [a for a in pytest_args if a in ("-x",)]
    t0 = time.time()
    procs = []
    for i, shard in enumerate(shards):
        log = open(os.path.join(args.log_dir, f"tests-shard{i}.log"), "w")
        cmd = [sys.executable, "-m", "pytest", "-q", *ROOT, *extra, *shard]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    print(f"{len(ids)} tests in {jobs} shards", flush=True)
    total: dict[str, int] = {}
    worst = 0
    for i, (proc, log) in enumerate(procs):
        rc = proc.wait()
        log.close()
        with open(log.name) as f:
            text = f.read()
        counts = summary_counts(text)
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(no output)"]
        print(f"shard {i}: {len(shards[i])} tests, exit {rc}: {last[0]}")
        if rc != 0:  # the shard's own report, so that one log says what went wrong
            tail = text.splitlines()[-TAIL_LINES:]
            print("\n".join(f"  | {ln}" for ln in tail))
        worst = max(worst, rc)
    parts = [f"{total[k]} {k}" for k in ("failed", "passed", "skipped", "errors", "xfailed",
                                        "xpassed") if total.get(k)]
    print(f"{', '.join(parts) or 'no result'} in {time.time() - t0:.2f}s ({jobs} shards)")
    return worst


if __name__ == "__main__":
    sys.exit(main())
