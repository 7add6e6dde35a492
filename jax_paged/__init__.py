"""jax_paged: paged KV-cache attention (vLLM-style PagedAttention) for jitted
JAX decode loops, with CUDA and CPU kernels registered as XLA FFI custom calls.

Public API::

    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *,
                    scale=None, alibi_slopes=None, impl="auto", partition_size=512,
                    k_scale=None, v_scale=None, soft_cap=None, sliding_window=None,
                    return_lse=False)
    merge_attention_states(o1, lse1, o2, lse2) -> (o, lse)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *,
                      k_scale=None, v_scale=None)
    copy_blocks(key_cache, value_cache, block_mapping)
    check_inputs(block_tables, seq_lens, num_blocks, block_size)
    export_safety_checks()  # the disabled_checks jax.export needs for these ops
    reference.*     # pure jax.numpy versions with identical semantics

The ops shard under plain ``jax.jit`` (heads and sequences local, no collective), and
support ``vmap``, ``grad``, ``jvp`` and donation (docs/jax_integration.md).
"""
from . import _native  # registers the FFI targets before any lowering
from . import reference
from ._native import export_safety_checks, has_cuda_kernels
from ._shapes import x_for_dtype
from .api import (check_inputs, copy_blocks, merge_attention_states, paged_attention,
                  reshape_and_cache)

__version__ = "0.1.0"

__all__ = ["paged_attention", "merge_attention_states", "reshape_and_cache", "copy_blocks",
           "check_inputs", "export_safety_checks", "has_cuda_kernels", "x_for_dtype", "reference"]
