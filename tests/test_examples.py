"""The examples run and pass their own checks (each exits non-zero when its
output disagrees with an independent computation): what the README tells a
user to run works."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import requires_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script,args,expect", [
    ("decode_loop.py", ["--steps", "4"], "max |paged - dense|"),
    ("features.py", [], "all checks passed"),
    ("generate.py", ["--num-requests", "6", "--max-new-tokens", "4", "12"],
     "greedy tokens equal the dense-cache implementation: yes"),
    # An fp8 cache, checked against a dense cache with the same semantics.
    ("generate.py", ["--num-requests", "6", "--max-new-tokens", "4", "12", "--no-warmup",
                     "--kv-cache-dtype", "float8_e4m3fn", "--kv-scale", "0.5"],
     "greedy tokens equal the dense-cache implementation: yes (6/6 requests)"),
])
def test_example_runs_and_checks_itself(script, args, expect):
    run_example(script, args, expect)


def run_example(script: str, args: list, expect: str) -> str:
    """Runs examples/<script> with args; asserts it exits 0 and prints `expect`; its stdout."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert expect in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


@requires_gpu
@pytest.mark.parametrize("script,expect", [
    ("decode_loop.py", "max |paged - dense|"),
    ("features.py", "all checks passed"),
    ("generate.py", "greedy tokens equal the dense-cache implementation: yes"),
])
def test_gpu_examples_run_as_the_readme_says(script, expect):
    """The README's commands as written (no arguments) on the GPU: the GPU suite selects
    tests by "gpu" in their names, so the CPU test above never ran there. (The decode
    example's default tiny model has head_dim 16, which no CUDA kernel is built for: it
    runs on the reference and says so.)"""
    stdout = run_example(script, [], expect)
    if script == "generate.py":
        assert "paged attention: jnp reference (no CUDA kernel for head_dim 16)" in stdout
