"""Which grouped kernel each GPU generation gets (jax_paged.primitives.grouped_form, the
Python side of the CUDA handler's rule): the Hopper form on compute capability 9.x, the
portable kernel on 8.x and newer GPUs, none below 8.0 (impl="auto" then picks V1/V2 and a
named impl="grouped" is a ValueError); and the portable kernel on the GPU suite's card
under the development option ``portable`` against the reference."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import _native, _shapes, primitives
from conftest import requires_gpu
from feature_helpers import dev_options_env, make_inputs


class _Module:
    """A stand-in CUDA module whose kernel_options() says whether `portable` is set."""

    def __init__(self, portable: bool):
        self.portable = portable

    def kernel_options(self):
        return {"portable": self.portable}


@pytest.mark.parametrize("cc,portable_option,expected", [
    ((9, 0), False, "hopper"), ((9, 0), True, "portable"),
    ((8, 0), False, "portable"), ((8, 6), False, "portable"), ((8, 9), False, "portable"),
    ((10, 0), False, "portable"), ((12, 0), False, "portable"),
    ((7, 5), False, None), ((7, 0), True, None),
])
def test_grouped_form_by_compute_capability(monkeypatch, cc, portable_option, expected):
    monkeypatch.setattr(primitives, "gpu_compute_capability", lambda: cc)
    monkeypatch.setattr(_native, "cuda_module", _Module(portable_option))
    assert primitives.grouped_form() == expected


@pytest.mark.parametrize("form,query_dtype,cache_dtype,expected", [
    ("hopper", jnp.float32, None, True),
    ("hopper", jnp.float32, jnp.float8_e4m3fn, False),
    ("hopper", jnp.bfloat16, jnp.float8_e4m3fn, True),
    ("portable", jnp.float32, None, False),
    ("portable", jnp.float16, None, True),
    ("portable", jnp.bfloat16, jnp.float8_e5m2, True),
    (None, jnp.bfloat16, None, False),
])
def test_grouped_supports_by_form(monkeypatch, form, query_dtype, cache_dtype, expected):
    monkeypatch.setattr(primitives, "grouped_form", lambda: form)
    dims = _shapes.AttentionDims(num_seqs=2, num_heads=8, head_size=128, num_blocks=4,
                                 num_kv_heads=2, block_size=16, max_blocks_per_seq=2,
                                 cache_dtype=cache_dtype)
    assert primitives.grouped_supports(dims, query_dtype) is expected
    # impl="auto" never picks a kernel the GPU cannot run.
    impl = primitives.resolve_impl("auto", "cuda", dims, 512, 0, expected)
    assert (impl == "grouped") is expected


def _lower_for_cuda(impl: str):
    rng = np.random.default_rng(3)
    inp = make_inputs(rng, [5, 20], 8, 2, 64, 16, jnp.bfloat16)
    args = inp.args()
    fn = jax.jit(lambda *a: jax_paged.paged_attention(*a, impl=impl))
    return jax.export.export(fn, platforms=["cuda"],
                             disabled_checks=jax_paged.export_safety_checks())(*args)


@pytest.mark.skipif(not _native.has_cuda_kernels(), reason="needs the CUDA module's lowering")
def test_named_grouped_below_compute_capability_8_is_refused(monkeypatch):
    monkeypatch.setattr(primitives, "gpu_compute_capability", lambda: (7, 5))
    with pytest.raises(ValueError, match=r"impl='grouped' needs a GPU of compute capability "
                                         r"8\.0 or newer, this one has 7\.5"):
        _lower_for_cuda("grouped")
    # impl="auto" lowers to a classic kernel there.
    text = _lower_for_cuda("auto").mlir_module()
    assert "jax_paged_attention_grouped" not in text
    assert "jax_paged_attention_v1" in text or "jax_paged_attention_v2" in text


# Feature tests whose GPU cases cover every feature of impl="grouped" against the
# reference: run again with the portable kernel forced on this card.
_PORTABLE_FILES = ["test_grouped_routing.py", "test_plain_step.py", "test_soft_cap.py",
                   "test_sliding_window.py", "test_lse.py", "test_multi_token.py", "test_fp8.py"]


@requires_gpu
def test_gpu_portable_kernel_features():
    """The GPU cases of the feature tests (every feature, fp8 caches, block and head
    sizes, edge lengths, NaN-poisoned unused slots) pass with impl="grouped" on the
    portable kernel: a pytest process of its own under the option portable=1."""
    env = dict(dev_options_env(portable=1), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    probe = subprocess.run(
        [sys.executable, "-c", "import jax_paged._native as n; "
         "print(n.cuda_module.kernel_options()['portable'])"],
        env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "True", probe.stdout + probe.stderr[-2000:]
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gpu",
         *(os.path.join(here, f) for f in _PORTABLE_FILES)],
        env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0 and " passed" in proc.stdout, (
        proc.stdout[-4000:] + proc.stderr[-2000:])
