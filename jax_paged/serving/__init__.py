"""A decode engine on top of the kernel library: Llama-family models, a checkpoint
loader, and continuous batching with pages allocated inside one jitted loop.

Nothing in :mod:`jax_paged`'s kernel API depends on this package."""
