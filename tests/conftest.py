"""Shared fixtures: the platforms to run kernels on (CPU always, GPU when one
is present) and random paged inputs with poisoned unused slots."""
from __future__ import annotations

import os
import sys

# Several host devices for the sharding tests; set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

jax.config.update("jax_enable_x64", False)


def gpu_available() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


HAS_GPU = gpu_available()
PLATFORMS = ["cpu"] + (["gpu"] if HAS_GPU else [])

requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


@pytest.fixture(params=PLATFORMS)
def platform(request) -> str:
    """Platform the kernels under test run on."""
    if request.param == "gpu":
        import jax_paged
        if not jax_paged.has_cuda_kernels():
            pytest.fail("a GPU is present but jax_paged was built without CUDA kernels")
    return request.param
