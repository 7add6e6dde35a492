"""Loads the native modules and registers their FFI targets with JAX.

``_cpu`` is always built; ``_cuda`` only where a CUDA compiler was found at
build time. Handlers built against newer XLA FFI headers than the running
jaxlib break it at backend start-up, so that case is refused here with a
clear ImportError instead.
"""
from __future__ import annotations

import importlib
import types

import jax
import jaxlib

# The FFI targets (custom-call names) the ops lower to; "grouped" exists on CUDA only.
TARGETS = ("jax_paged_attention_v1", "jax_paged_attention_v2", "jax_paged_attention_grouped",
           "jax_paged_reshape_and_cache", "jax_paged_copy_blocks")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _load(name: str, platform: str, required: bool) -> types.ModuleType | None:
    try:
        module = importlib.import_module(f"jax_paged.{name}")
    except ImportError:
        if required:
            raise ImportError(
                "jax_paged's native CPU module is missing: install the package with "
                "`pip install -e .` (it compiles cuda/ with CMake)") from None
        return None
    built, running = module.jaxlib_build_version, jaxlib.__version__
    if _version_tuple(built) > _version_tuple(running):
        raise ImportError(
            f"jax_paged.{name} was built against jaxlib {built} but jaxlib {running} is "
            f"running; handlers built with newer XLA FFI headers fail on older jaxlib. "
            f"Rebuild jax_paged (pip install -e . --no-build-isolation) with this jaxlib.")
    for target, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(target, capsule, platform=platform)
    return module


cpu_module = _load("_cpu", "cpu", required=True)
cuda_module = _load("_cuda", "CUDA", required=False)


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels were built (whether or not a GPU is present)."""
    return cuda_module is not None


def cuda_development_options() -> tuple[str, ...]:
    """The development build options (CMakeLists.txt, "(development)": timing
    probes with wrong results, candidate kernels under measurement) the CUDA
    kernels were built with, e.g. ("TRACE",); () for a default build or
    without the CUDA module."""
    return tuple(getattr(cuda_module, "development_options", "").split())


def export_safety_checks() -> list:
    """The ``jax.export.DisabledSafetyCheck`` list that lets ``jax.export`` serialise a
    function using this library's ops: one ``custom_call`` check per FFI target (JAX
    guarantees no compatibility for custom calls it does not own; this library's
    contract for its targets is in docs/jax_integration.md). The process that
    deserialises and calls the export must ``import jax_paged`` first, which registers
    the targets.

        exported = jax.export.export(jax.jit(step),
                                     disabled_checks=jax_paged.export_safety_checks())(*args)
    """
    from jax import export
    return [export.DisabledSafetyCheck.custom_call(target) for target in TARGETS]
