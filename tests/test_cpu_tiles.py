"""The CPU kernel's tile products (csrc/cpu/cpu_tiles.h) for every instruction
set the library's function multi-versioning may pick on x86-64 (baseline,
x86-64-v3 = AVX2+FMA, x86-64-v4 = AVX-512): tests/cpu_tiles_check.cc compiled
once per set this CPU can run, against float64 loops. (The attention tests
exercise only the variant the loader picks on the test machine.)"""
from __future__ import annotations

import pathlib
import platform
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CXX = shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


_NEEDS = {"x86-64": set(), "x86-64-v3": {"avx2", "fma", "bmi2"},
          "x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


@pytest.mark.skipif(platform.machine() != "x86_64" or CXX is None,
                    reason="x86-64 with a C++ compiler only")
@pytest.mark.parametrize("arch", list(_NEEDS))
def test_cpu_tiles_match_float64(arch, tmp_path):
    if arch != "x86-64" and not _NEEDS[arch] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run {arch} code")
    exe = tmp_path / f"cpu_tiles_check_{arch}"
    subprocess.run([CXX, "-O3", "-std=c++17", f"-march={arch}", "-DJAX_PAGED_CPU_NO_CLONES",
                    f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / "cpu_tiles_check.cc"),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 27, run.stdout
