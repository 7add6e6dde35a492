"""The GPU machine's development scripts (dev/), checked where they run no build: the CMake
arguments they pass, so that a development option (a trace or a wrong-results timing probe)
can never stay on in a build meant as the default; and their stages, with stand-ins for the
GPU machine's tools."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = os.path.join(ROOT, "dev")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _script_env(**overrides: str) -> dict:
    """os.environ without the settings the scripts read (SKIP_*, CEILING, DECODE_*, ...),
    plus `overrides`. The GPU suite itself runs under gpu_check.sh, whose caller's settings
    (SKIP_SANITIZER=1, say) would otherwise reach the script a test starts and skip the
    very stage it checks."""
    knobs = set()
    for name in os.listdir(DEV):
        if name.endswith(".sh"):
            with open(os.path.join(DEV, name)) as f:
                knobs |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", f.read()))
    env = {k: v for k, v in os.environ.items() if k not in knobs - {"PATH", "HOME"}}
    env.update(overrides)
    return env


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def _cmake_options(*path: str) -> list:
    """The option() names of a CMakeLists.txt (relative to the repository root)."""
    return re.findall(r"^\s*option\((\w+)\s", _read(*path), re.M)


def _dev_options() -> list:
    """The development build's options, declared in dev/CMakeLists.txt."""
    return _cmake_options("dev", "CMakeLists.txt")


def _path_with_stand_in(tmp_path, name: str, script: str) -> str:
    """PATH with an executable bash `script` named `name` found first (a stand-in for a
    GPU machine's tool: compute-sanitizer, nvidia-smi)."""
    fake = tmp_path / "bin" / name
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/bash\n" + script)
    fake.chmod(0o755)
    return f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"


def _last_values(args: str) -> dict:
    """-DNAME=VALUE pairs as CMake reads them: the last of a name wins."""
    return dict(re.findall(r"-D(\w+)=(\S+)", args))


def test_development_options_are_unreachable_without_jax_paged_dev():
    """The top CMakeLists.txt declares JAX_PAGED_DEV (default OFF) and reads dev/ only under
    if(JAX_PAGED_DEV); the development options (a trace, wrong-results timing probes) and
    the research programs are declared only in dev/CMakeLists.txt, never named in the top
    file, with literal names (so that the scripts' sed expressions find every one)."""
    top = _read("CMakeLists.txt")
    assert re.search(r"^option\(JAX_PAGED_DEV\s+\"[^\"]*\"\s+OFF\)", top, re.M), (
        "CMakeLists.txt must declare option(JAX_PAGED_DEV ... OFF)")
    dev = _dev_options()
    assert {"JAX_PAGED_TRACE", "JAX_PAGED_PROBE_NO_COMPUTE", "JAX_PAGED_PROBE_NO_REDUCE",
            "JAX_PAGED_PROBE_NO_LOADS"} <= set(dev), dev
    dev_text = _read("dev", "CMakeLists.txt")
    assert not re.search(r"option\(\s*[^\sA-Za-z_]", dev_text), "option names must be literal"
    for name in dev:
        assert not re.search(rf"\b{name}\b", top), f"{name} is named outside dev/CMakeLists.txt"
    for program in ("read_floor.cu", "wgmma_ceiling.cu"):
        assert program in dev_text and program not in top, program
    # Every add_subdirectory(dev) sits inside if(JAX_PAGED_DEV) (a stack of the open ifs).
    open_ifs, seen = [], 0
    for line in top.splitlines():
        code = line.split("#", 1)[0].strip()
        if re.match(r"if\s*\(", code):
            open_ifs.append(code)
        elif re.match(r"endif\s*\(", code):
            open_ifs.pop()
        elif re.match(r"add_subdirectory\s*\(\s*dev\b", code):
            seen += 1
            assert any(re.match(r"if\s*\(\s*JAX_PAGED_DEV\s*\)", c) for c in open_ifs), (
                f"add_subdirectory(dev) outside if(JAX_PAGED_DEV): {open_ifs}")
    assert seen >= 1, "CMakeLists.txt never reads dev/"


def _gpu_check_install_args(tmp_path, **settings) -> dict:
    """The CMAKE_ARGS that dev/gpu_check.sh's install stage gives pip (a stand-in python
    that records them for `-m pip install` and runs the real interpreter otherwise),
    as CMake reads them: the last -DNAME=VALUE of a name."""
    record = tmp_path / "cmake_args.txt"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    'if [ "$1 $2 $3" = "-m pip install" ]; then\n'
                    f'  printf "%s" "$CMAKE_ARGS" > {record}; exit 0\n'
                    "fi\n"
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    stand_in = tmp_path / "program"
    stand_in.write_text("#!/bin/bash\necho ran\n")
    stand_in.chmod(0o755)
    env = _script_env(PYTHON=str(fake), OUT=str(tmp_path / "out"), SKIP_TESTS="1",
                      SKIP_SANITIZER="1", SKIP_BENCH="1", JAX_PLATFORMS="cpu",
                      CEILING_BIN=str(stand_in), FLOOR_BIN=str(stand_in), **settings)
    run = subprocess.run(["bash", os.path.join(DEV, "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert record.exists(), run.stdout[-3000:] + run.stderr[-2000:]
    args = record.read_text()
    assert f'CMAKE_ARGS="{args}"' in run.stdout, "the install stage prints its CMAKE_ARGS"
    return _last_values(args)


def test_gpu_check_default_install_compiles_no_development_code(tmp_path):
    """gpu_check.sh's install stage passes -DJAX_PAGED_DEV=OFF (a warm machine's build
    directory keeps a cached ON until it is set again) and nothing else by default; extra
    CMAKE_ARGS come after it."""
    assert _gpu_check_install_args(tmp_path) == {"JAX_PAGED_DEV": "OFF"}
    args = _gpu_check_install_args(tmp_path, CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a")
    assert args == {"JAX_PAGED_DEV": "OFF", "CMAKE_CUDA_ARCHITECTURES": "90a"}


@pytest.mark.parametrize("settings,on", [
    (dict(CMAKE_ARGS="-DJAX_PAGED_DEV=ON -DJAX_PAGED_PROBE_NO_LOADS=ON"),
     {"JAX_PAGED_PROBE_NO_LOADS"}),
    (dict(CMAKE_ARGS="-DJAX_PAGED_DEV=ON"), set()),
    (dict(CEILING="1"), set()),
    (dict(FLOOR="1 cluster"), set()),
], ids=["probe", "dev", "ceiling", "floor"])
def test_gpu_check_development_install_switches_off_every_other_option(tmp_path, settings, on):
    """A development build (CMAKE_ARGS with -DJAX_PAGED_DEV=ON, or CEILING / FLOOR, whose
    programs only that build compiles) passes -DJAX_PAGED_DEV=ON and every option of
    dev/CMakeLists.txt OFF except those CMAKE_ARGS switches on: a cached option of an
    earlier build (a trace, a wrong-results probe) never stays on."""
    args = _gpu_check_install_args(tmp_path, **settings)
    dev = _dev_options()
    assert args == {"JAX_PAGED_DEV": "ON", **{n: "ON" if n in on else "OFF" for n in dev}}


def test_ab_build_builds_the_default_against_a_development_build():
    """Build A is the default (-DJAX_PAGED_DEV=OFF); B and C are development builds with
    their own options ON and every other option of dev/CMakeLists.txt OFF: CMake keeps a
    cached option until it is set again, so no build inherits an option of another."""
    env = _script_env(AB_DRY_RUN="1", AB_CMAKE_ARGS="-DJAX_PAGED_PROBE_NO_COMPUTE=ON",
                      AB_CMAKE_ARGS_C="-DJAX_PAGED_PROBE_NO_REDUCE=ON")
    out = subprocess.run(["bash", os.path.join(DEV, "ab_build.sh")], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    builds = dict(line.split("=", 1) for line in out.strip().splitlines())
    assert set(builds) == {"A", "B", "C"}
    a, b, c = (_last_values(builds[k]) for k in "ABC")
    off = {name: "OFF" for name in _dev_options()}
    assert a == {**off, "JAX_PAGED_DEV": "OFF"}
    assert b == {**off, "JAX_PAGED_DEV": "ON", "JAX_PAGED_PROBE_NO_COMPUTE": "ON"}
    assert c == {**off, "JAX_PAGED_DEV": "ON", "JAX_PAGED_PROBE_NO_REDUCE": "ON"}
    # Without a C build there is none to print.
    env.pop("AB_CMAKE_ARGS_C")
    out = subprocess.run(["bash", os.path.join(DEV, "ab_build.sh")], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert "C=\n" in out


def test_development_options_reported_by_the_cuda_module_are_cmake_options():
    """jax_paged._native.cuda_development_options() (recorded in the benchmark's JSON) names
    only dev/CMakeLists.txt's options, without the JAX_PAGED_ prefix; () without the CUDA
    module or in a default build. The C++ function that lists them lists every one."""
    import jax_paged
    known = {name[len("JAX_PAGED_"):] for name in _dev_options()}
    opts = jax_paged._native.cuda_development_options()
    assert isinstance(opts, tuple) and set(opts) <= known
    if not jax_paged.has_cuda_kernels():
        assert opts == ()
    bodies = []
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            match = re.search(r"JaxPagedDevelopmentOptions\(\)\s*\{(.*?)\n\}", text, re.S)
            if match:
                bodies.append((name, match.group(1)))
    assert len(bodies) == 1, f"JaxPagedDevelopmentOptions defined in {len(bodies)} files"
    name, body = bodies[0]
    listed = set(re.findall(r'"([A-Z0-9_]+) "', body))
    assert listed == known, f"{name}'s JaxPagedDevelopmentOptions must list every option"


def test_sanitizer_case_narrowed_to_one_kernel_on_cpu():
    """dev/sanitizer_case.py --impls / --head-sizes / --no-cache-ops (for the slower
    compute-sanitizer tools) run only the named cases; here on the CPU kernels."""
    run = subprocess.run([sys.executable, os.path.join(DEV, "sanitizer_case.py"),
                          "--platform", "cpu", "--impls", "grouped", "--head-sizes", "256",
                          "--no-cache-ops"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = [line for line in run.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert checks and all(" grouped " in line and "head 256 " in line for line in checks), checks
    assert "sanitizer case: all ok" in run.stdout
    bad = subprocess.run([sys.executable, os.path.join(DEV, "sanitizer_case.py"),
                          "--platform", "cpu", "--impls", "v3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--impls: unknown implementation(s) ['v3']" in bad.stderr


def test_ncu_case_profiles_each_config_and_exports_its_pages(tmp_path):
    """dev/ncu_case.sh, with a stand-in `ncu` on PATH that logs its arguments: one
    profile per CONFIGS entry (its profile_case arguments split as words, the clocks left
    alone, the stall samples among the sections), then its details and source pages."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ncu_calls.txt"
    (bindir / "ncu").write_text(
        "#!/usr/bin/env bash\n"
        f"echo \"$XLA_PYTHON_CLIENT_PREALLOCATE $*\" >> {log}\n"
        "while [ $# -gt 0 ]; do\n"
        "  if [ \"$1\" = -o ]; then touch \"$2.ncu-rep\"; fi\n"
        "  if [ \"$1\" = --page ]; then echo \"page $2\"; fi\n"
        "  shift\n"
        "done\n")
    (bindir / "ncu").chmod(0o755)
    out = tmp_path / "out"
    env = _script_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", OUT=str(out),
               SKIP_INSTALL="1",
               CONFIGS="a=--config 1,32,8,1024 --q-len 16;b=--config 2,32,8,512 --kv bf16,fp8e4m3")
    subprocess.run(["bash", os.path.join(DEV, "ncu_case.sh")], env=env,
                   capture_output=True, text=True, check=True, timeout=60)
    calls = log.read_text().splitlines()
    assert len(calls) == 6, calls
    # JAX must not preallocate: ncu saves what a kernel can reach around each replay.
    assert all(c.startswith("false ") for c in calls), calls
    calls = [c[len("false "):] for c in calls]
    profile_a, details_a, source_a = calls[:3]
    assert "--clock-control none" in profile_a and "--section SourceCounters" in profile_a
    assert profile_a.endswith("dev/profile_case.py --config 1,32,8,1024 --q-len 16")
    rep = re.search(r"-o (\S+)/a ", profile_a).group(1)
    assert rep != str(out), "the reports stay out of OUT unless KEEP_REP=1"
    assert details_a == f"--import {rep}/a.ncu-rep --page details"
    assert source_a.startswith(f"--import {rep}/a.ncu-rep --page source --csv")
    assert calls[3].endswith("--config 2,32,8,512 --kv bf16,fp8e4m3")
    assert sorted(p.name for p in out.iterdir()) == [
        "details_a.txt", "details_b.txt", "source_a.csv", "source_b.csv"]
    assert (out / "source_b.csv").read_text() == "page source\n"
    # KEEP_REP=1: the reports in OUT too.
    subprocess.run(["bash", os.path.join(DEV, "ncu_case.sh")],
                   env=dict(env, KEEP_REP="1", CONFIGS="c=--config 1,32,8,1024"),
                   capture_output=True, text=True, check=True, timeout=60)
    assert (out / "c.ncu-rep").exists()


def test_ncu_summary_sums_samples_per_opcode_and_reason(tmp_path):
    """dev/ncu_summary.py over a two-kernel source page: samples and executed
    instructions per opcode (predicates and modifiers stripped), the per-reason stall
    columns' totals, one summary per table with the line before it as its title."""
    head = ('"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Instructions Executed","stall_long_sb","stall_barrier"\n')
    page = ('"Kernel A"\n' + head +
            '"0x10","HMMA.16816.F32 R0, R4, R8, R0","30","1,000","0","0"\n'
            '"0x20","@!P0 BAR.SYNC 0x0","50","100","0","45"\n'
            '"0x30","HMMA.16816.F32 R2, R4, R8, R2","20","1,000","5","0"\n'
            '"Kernel B"\n' + head +
            '"0x10","LDS.128 R0, [R1]","7","10","7","0"\n')
    path = tmp_path / "source.csv"
    path.write_text(page)
    out = subprocess.run([sys.executable, os.path.join(DEV, "ncu_summary.py"),
                          str(path)], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    a, b = out.split("== ")[1:]
    assert a.startswith("Kernel A: 3 instructions, 100 stall samples, 2100 instructions executed")
    assert re.search(r"HMMA +50 +50\.0% +2000 +95\.2%", a)
    assert re.search(r"BAR +50 +50\.0% +100 +4\.8%", a)
    assert re.search(r"stall_barrier +45 +45\.0%", a) and re.search(r"stall_long_sb +5 +5\.0%", a)
    assert b.startswith("Kernel B: 1 instructions, 7 stall samples")
    assert re.search(r"LDS +7 +100\.0%", b)
    # No such table: a clear failure.
    (tmp_path / "empty.csv").write_text("==PROF== nothing\n")
    bad = subprocess.run([sys.executable, os.path.join(DEV, "ncu_summary.py"),
                          str(tmp_path / "empty.csv")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no table" in bad.stderr


@pytest.mark.parametrize("crashes,runs,ok", [(2, "3", True), (3, "3", False), (4, None, True)])
def test_gpu_check_runs_a_crashing_sanitizer_again(tmp_path, crashes, runs, ok):
    """compute-sanitizer itself sometimes segfaults (exit 139, no summary line, up to
    several times in a row): gpu_check.sh
    runs it again, up to SANITIZER_RUNS runs (default 5), and says so. Here a stand-in
    tool crashes the first `crashes` times and then reports a clean run."""
    count = tmp_path / "count"
    path = _path_with_stand_in(
        tmp_path, "compute-sanitizer",
        f"n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}\n"
        f"if [ $n -le {crashes} ]; then kill -SEGV $$; fi\n"
        "echo 'sanitizer case: all ok'; echo '========= ERROR SUMMARY: 0 errors'\n")
    env = _script_env(PATH=path,
                      PYTHON=sys.executable, OUT=str(tmp_path / "out"), SKIP_INSTALL="1",
                      SKIP_TESTS="1", SKIP_BENCH="1")
    if runs is not None:
        env["SANITIZER_RUNS"] = runs
    run = subprocess.run(["bash", os.path.join(DEV, "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    (line,) = [x for x in summary.splitlines() if x.startswith("sanitizer ")]
    assert count.read_text().strip() == str(min(crashes + 1, int(runs or 5)))
    assert "run 2: compute-sanitizer crashed (exit 139" in line
    if ok:
        assert run.returncode == 0 and " ok " in line and "memcheck errors: 0" in line
        assert "sanitizer case: all ok" in line
    else:
        assert run.returncode != 0 and "FAILED (exit 139)" in line


def test_gpu_check_decode_stage_runs_each_variant(tmp_path):
    """DECODE_VARIANTS: examples/generate.py once per ';'-separated argument set, each
    after DECODE_ARGS, with its JSON and its throughput line in the summary (here the tiny
    model on the CPU, a float32 cache against an fp8 one; JAX_PLATFORMS=cpu, since its head
    size is not one the CUDA kernels are built for)."""
    out = tmp_path / "out"
    env = _script_env(PYTHON=sys.executable, OUT=str(out), SKIP_INSTALL="1", SKIP_TESTS="1",
                      JAX_PLATFORMS="cpu",
                      SKIP_SANITIZER="1", SKIP_BENCH="1",
                      DECODE_ARGS="--model tiny --num-requests 2 --prompt-len 4 8 "
                                  "--max-new-tokens 3 3 --skip-dense-check --no-warmup",
                      DECODE_VARIANTS="--kv-cache-dtype model;--kv-cache-dtype float8_e4m3fn")
    run = subprocess.run(["bash", os.path.join(DEV, "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    lines = {x.split()[0]: x for x in summary.splitlines() if x.startswith("decode_")}
    assert set(lines) == {"decode_1", "decode_2"}, summary
    for i, (dtype, variant) in enumerate([("float32", "model"), ("float8_e4m3fn", "float8_e4m3fn")], 1):
        line = lines[f"decode_{i}"]
        assert " ok " in line and f"--kv-cache-dtype {variant}: throughput:" in line, line
        with open(out / f"decode_{i}.json") as f:
            result = json.load(f)
        assert result["kv_cache_dtype"] == dtype and result["tokens_generated"] == 6, result


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_gpu_check_kills_what_a_stage_left_and_nothing_else(tmp_path):
    """After a stage, gpu_check.sh kills the processes that stage left running (the
    sanitizer's target can outlive the timeout), and only those: a process elsewhere whose
    command line names the same script lives on (killing by command line would also kill a
    concurrent GPU test's run of the same example)."""
    leftover_pid = tmp_path / "leftover.pid"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    'case "$*" in *examples/generate.py*)\n'
                    f"  sleep 300 & echo $! > {leftover_pid}\n"
                    "  echo 'throughput:        1.0 tokens/s'; exit 0 ;;\n"
                    "esac\n"
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    bystander = subprocess.Popen(
        ["bash", "-c", "exec -a 'python examples/generate.py --bystander' sleep 300"])
    try:
        env = _script_env(PYTHON=str(fake), OUT=str(tmp_path / "out"), SKIP_INSTALL="1",
                          SKIP_TESTS="1", SKIP_SANITIZER="1", SKIP_BENCH="1",
                          DECODE_VARIANTS="--kv-cache-dtype model")
        run = subprocess.run(["bash", os.path.join(DEV, "gpu_check.sh")], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        leftover = int(leftover_pid.read_text())
        for _ in range(50):
            if not _alive(leftover):
                break
            time.sleep(0.1)
        assert not _alive(leftover), "the stage's leftover process still runs"
        assert bystander.poll() is None, "gpu_check.sh killed a process that was not its own"
    finally:
        bystander.kill()
        bystander.wait()


def test_gpu_check_floor_stage_runs_read_floor_with_its_arguments(tmp_path):
    """FLOOR="REPS MODE": the read_floor program the install built, run after the env
    stage with FLOOR's words as its arguments, its output in floor.log and the stage in
    the summary (here a stand-in binary named by FLOOR_BIN); a stage that fails says so."""
    fake = tmp_path / "read_floor"
    fake.write_text('#!/bin/bash\necho "read_floor args: $*"\n[ "$2" != fail ]\n')
    fake.chmod(0o755)
    for mode, ok in (("cluster", True), ("fail", False)):
        out = tmp_path / f"out_{mode}"
        env = _script_env(PYTHON=sys.executable, OUT=str(out), SKIP_INSTALL="1", SKIP_TESTS="1",
                          SKIP_SANITIZER="1", SKIP_BENCH="1", FLOOR=f"15 {mode}",
                          FLOOR_BIN=str(fake))
        run = subprocess.run(["bash", os.path.join(DEV, "gpu_check.sh")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert (out / "floor.log").read_text() == f"read_floor args: 15 {mode}\n"
        (line,) = [x for x in (out / "summary.txt").read_text().splitlines()
                   if x.startswith("floor ")]
        if ok:
            assert run.returncode == 0 and " ok " in line and f"15 {mode}" in line, line
        else:
            assert run.returncode != 0 and "FAILED (exit 1)" in line, line


def test_gpu_check_only_on_runs_nothing_on_another_card(tmp_path):
    """ONLY_ON=H200: on a machine whose GPU is an H100 (a stand-in nvidia-smi) gpu_check.sh
    runs no stage, says which card it found in summary.txt and exits 3; on a matching card
    it goes on to its stages (all skipped here) and exits 0."""
    path = _path_with_stand_in(tmp_path, "nvidia-smi", "echo 'NVIDIA H100 80GB HBM3'\n")
    for only_on, rc in (("H200", 3), ("H100", 0)):
        out = tmp_path / f"out_{only_on}"
        env = _script_env(PATH=path, PYTHON=sys.executable, OUT=str(out), ONLY_ON=only_on,
                          SKIP_INSTALL="1", SKIP_TESTS="1", SKIP_SANITIZER="1",
                          SKIP_BENCH="1", JAX_PLATFORMS="cpu")
        run = subprocess.run(["bash", os.path.join(DEV, "gpu_check.sh")], env=env,
                             capture_output=True, text=True, timeout=300)
        summary = (out / "summary.txt").read_text()
        assert run.returncode == rc, run.stdout[-3000:] + run.stderr[-2000:]
        refused = "the GPU is 'NVIDIA H100 80GB HBM3', not ONLY_ON=H200: no stage run"
        if rc == 3:
            assert refused in summary and "=== [" not in run.stdout, run.stdout
        else:
            assert refused not in summary and "ALL STAGES OK" in summary, summary
