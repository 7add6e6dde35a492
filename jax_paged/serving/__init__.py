"""A decode engine on top of the kernel library: one decoder module for Llama 2/3.x,
Mistral, Qwen2/2.5, Qwen3 and Gemma 2, a checkpoint loader that reads them or refuses, and
continuous batching with pages allocated inside one jitted loop.

Nothing in :mod:`jax_paged`'s kernel API depends on this package."""
