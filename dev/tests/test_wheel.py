"""`pip wheel .` builds an installable wheel: a CPU-only one (JAX_PAGED_CUDA=OFF) holds the
package, the serving code and the CPU module and nothing of tests/ or dev/, and, installed
into a fresh environment, imports from there (not from this source tree) and computes what
the reference computes. (The GPU machine's check of a CUDA wheel is the WHEEL=1 stage of
dev/gpu_check.sh.)"""
from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The wheel is built without build isolation (no network), from the running environment's
# build backend.
_MISSING = [m for m in ("scikit_build_core", "nanobind") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"building a wheel without isolation needs {', '.join(_MISSING)} "
    "installed in this environment (pip install scikit-build-core nanobind)")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # A build directory of its own: the default (build/<wheel tag>/) is the editable
    # install's, which a CPU-only configure would change.
    env = dict(os.environ, JAX_PAGED_CUDA="OFF")
    env.pop("CMAKE_ARGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "-C", f"build-dir={tmp / 'build'}", "-w", str(dist), ROOT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip wheel exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    wheels = sorted(p for p in os.listdir(dist) if p.endswith(".whl"))
    assert len(wheels) == 1, f"expected one wheel in {dist}, got {wheels}"
    assert wheels[0].startswith("jax_paged-"), f"wheel name: got {wheels[0]}, expected jax_paged-*"
    return str(dist / wheels[0])


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    package = {n for n in names if not n.startswith("jax_paged-")}
    want = {"jax_paged/__init__.py", "jax_paged/api.py", "jax_paged/reference.py",
            "jax_paged/_native.py", "jax_paged/serving/__init__.py",
            "jax_paged/serving/engine.py", "jax_paged/serving/model.py"}
    assert want <= package, f"wheel lacks {sorted(want - package)}; it holds {sorted(package)}"
    serving = {f"jax_paged/serving/{f}" for f in os.listdir(os.path.join(ROOT, "jax_paged", "serving"))
               if f.endswith(".py")}
    assert serving <= package, f"wheel lacks {sorted(serving - package)}"
    cpu = [n for n in package if n.startswith("jax_paged/_cpu") and n.endswith(".so")]
    assert len(cpu) == 1, f"expected one jax_paged/_cpu*.so in the wheel, got {cpu}"
    cuda = [n for n in package if n.startswith("jax_paged/_cuda")]
    assert not cuda, f"a JAX_PAGED_CUDA=OFF wheel holds {cuda}"
    stray = sorted(n for n in package if not n.startswith("jax_paged/")
                   or "/tests/" in n or n.startswith(("tests/", "dev/")))
    assert not stray, f"files outside the package in the wheel: {stray}"


def _venv(path: str) -> str:
    """A fresh environment at `path` that sees this one's packages (jax, numpy) after its
    own, returning its python. Not `--system-site-packages`: that shares the base
    interpreter's site directories, not this environment's, and would run their .pth files,
    among them an editable install's import hook, which takes `jax_paged` back to the
    source tree whatever the environment holds. A .pth of plain directories adds them to
    the path without running the .pth files inside them."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True,
                   capture_output=True, timeout=120)
    python = os.path.join(path, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    outer = [p for p in site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_path("purelib")]
             if os.path.isdir(p)]
    with open(os.path.join(purelib, "outer_site.pth"), "w") as f:
        f.write("".join(f"{p}\n" for p in dict.fromkeys(outer)))
    return python


def test_wheel_installs_and_runs(wheel, tmp_path):
    venv = str(tmp_path / "venv")
    python = _venv(venv)
    # This environment's pip, run by the new interpreter, installs into the new one;
    # --ignore-installed: the editable install it also sees is not to be touched.
    proc = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--ignore-installed", "--no-warn-script-location", wheel],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip install of {wheel} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"

    script = textwrap.dedent(f"""
        import os, sys
        import numpy as np
        import jax, jax.numpy as jnp
        import jax_paged
        from jax_paged import reference
        venv, root = {os.path.realpath(venv)!r}, {os.path.realpath(ROOT)!r}
        for name in ("jax_paged", "jax_paged._cpu", "jax_paged.serving"):
            __import__(name)
            where = os.path.realpath(sys.modules[name].__file__)
            assert where.startswith(venv + os.sep), f"{{name}} imported from {{where}}, expected under {{venv}}"
            assert not where.startswith(root + os.sep), f"{{name}} imported from the source tree: {{where}}"
        rng = np.random.default_rng(0)
        seqs, heads, kv_heads, head_size, block, blocks = 3, 4, 2, 64, 16, 8
        x = jax_paged.x_for_dtype(jnp.float32)
        q = jnp.asarray(rng.standard_normal((seqs, heads, head_size)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((blocks, kv_heads, head_size // x, block, x)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((blocks, kv_heads, head_size, block)), jnp.float32)
        tables = jnp.asarray(rng.permutation(blocks)[:seqs * 2].reshape(seqs, 2), jnp.int32)
        lens = jnp.asarray([5, 32, 17], jnp.int32)
        got = jax.jit(lambda *a: jax_paged.paged_attention(*a, impl="v1"))(q, k, v, tables, lens)
        want = reference.paged_attention(q, k, v, tables, lens)
        err = float(jnp.max(jnp.abs(got - want)))
        assert err < 2e-5, f"wheel's CPU kernel against the reference: max abs error {{err}}"
        print("ok", jax.devices()[0].platform, err)
        """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([python, "-c", script], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"the installed wheel's check exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split()[:2] == ["ok", "cpu"], f"unexpected output: {proc.stdout!r}"
