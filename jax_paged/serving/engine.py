"""Continuous-batching greedy generation on the paged KV cache.

Design
------
The host runs an outer loop; each iteration

1. **preempts** if the next decode step cannot get the blocks it needs (the loop below stopped
   for that reason): the most recently admitted live sequence is evicted, its blocks go back to
   the free list and its request returns to the *front* of the waiting queue with the tokens
   generated so far. It is later recomputed: its prefill prompt is ``prompt + generated``, so no
   generated token is lost or changed (greedy) and no other sequence's pages are touched;
2. **admits** waiting requests (first come, first served) into free batch slots while the free
   list can hold their prompt *and* still give every live sequence its next block, allocating
   the prompt blocks with the host mirror of the free list (:class:`~jax_paged.cache.HostBlockAllocator`)
   and running one batched, jitted prefill (dense causal attention; one ``reshape_and_cache`` per
   layer for all prompt tokens) that also yields each request's first token;
3. runs **one jitted** ``lax.while_loop`` over many decode steps (:func:`decode_loop`) with the
   KV caches and the decode state (tokens, seq_lens, block_tables, free list, ...) donated.
   Each step, a sequence whose new token starts a block pops one block from the device-side free
   list; a sequence that emits its EOS or reaches ``max_new_tokens`` pushes all its blocks back
   at once. The loop exits when ``max_steps`` are done, when no sequence is live, when
   ``exit_after`` sequences have finished (the host passes 1 while requests are waiting, so a
   freed slot is refilled promptly; otherwise it never exits for that), or *before* a step whose
   block allocation would fail (so the host can preempt). There is no host round-trip per step.

Memory therefore follows the actual lengths: a sequence holds ``ceil(seq_len / block_size)``
blocks, never its maximum. ``check_invariants=True`` verifies after every admission and every
loop that live block tables and the free list partition the blocks (``check_page_accounting``).

Tensor parallelism: ``Engine(..., mesh=mesh)`` with a mesh axis ``"tp"`` of N devices shards the
weights Megatron-style (:func:`jax_paged.serving.model.shard_params`) and every layer's caches on their
KV-heads axis (dim 1); the decode state (tokens, block tables, lengths, free list) is replicated,
so scheduling and paging are the same on every device. Prefill and decode loop are the same
jitted functions with ``tensor_parallel=True``; XLA partitions them from the input shardings.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_paged.cache import (
    BlockPool, HostBlockAllocator, KVCaches, allocate_blocks, allocate_kv_cache,
    check_page_accounting, free_blocks,
)
from jax_paged.serving.model import (
    TP_AXIS, EosIds, KVScales, ModelConfig, Params, check_kv_scales, decode_step_paged,
    eos_id_array, prefill_paged, shard_params,
)


def _cdiv(a, b):
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Batching and cache sizes.

    Attributes:
      max_batch: decode slots (sequences decoded together each step).
      num_blocks: physical cache blocks shared by all sequences.
      block_size: tokens per block.
      max_seq_len: per-sequence capacity (prompt + new tokens); block table width is
        ``ceil(max_seq_len / block_size)``.
      max_steps_per_loop: decode steps per jitted loop at most (bounds the time between progress
        reports; the loop usually exits earlier for a finished sequence or a full free list).
      attn_impl: ``impl`` passed to ``jax_paged.paged_attention`` ("auto" or "reference").
      partition_size: passed to ``jax_paged.paged_attention``.
      prefill_min_rows, prefill_min_len: a prefill batch is padded to a power of two of rows
        (at least ``prefill_min_rows``, at most ``max_batch``) and of tokens (at least
        ``prefill_min_len``), so only a few prefill shapes are ever compiled.
      max_eos_ids: stop ids a request may have at most (a checkpoint may name several).
    """

    max_batch: int = 8
    num_blocks: int = 128
    block_size: int = 16
    max_seq_len: int = 256
    max_steps_per_loop: int = 64
    attn_impl: str = "auto"
    partition_size: int = 512
    prefill_min_rows: int = 1
    prefill_min_len: int = 16
    max_eos_ids: int = 4

    @property
    def max_blocks_per_seq(self) -> int:
        return _cdiv(self.max_seq_len, self.block_size)


class DecodeState(NamedTuple):
    """Device-side state of the decode slots (a pytree; ``B = max_batch``).

    tokens          int32 [B]      newest token of each slot, not yet in the cache
    seq_lens        int32 [B]      tokens in the cache (= position of ``tokens``)
    block_tables    int32 [B, max_blocks_per_seq]  -1 past a sequence's last block
    active          bool  [B]      slot holds a live sequence
    num_generated   int32 [B]      tokens generated by the current occupant (incl. prefill's)
    max_new_tokens  int32 [B]      its budget
    eos_ids         int32 [B, E]   stop ids, -1 for none (E = max_eos_ids)
    generated       int32 [B, max_seq_len]  its generated tokens
    pool            BlockPool      the free list
    """

    tokens: Any
    seq_lens: Any
    block_tables: Any
    active: Any
    num_generated: Any
    max_new_tokens: Any
    eos_ids: Any
    generated: Any
    pool: Any


def init_decode_state(engine_config: EngineConfig) -> DecodeState:
    """Empty slots and a full free list (numpy arrays; ``jax.device_put`` them)."""
    b, m = engine_config.max_batch, engine_config.max_blocks_per_seq
    pool = HostBlockAllocator(engine_config.num_blocks).to_pool()
    return DecodeState(
        tokens=np.zeros(b, np.int32), seq_lens=np.zeros(b, np.int32),
        block_tables=np.full((b, m), -1, np.int32), active=np.zeros(b, bool),
        num_generated=np.zeros(b, np.int32), max_new_tokens=np.zeros(b, np.int32),
        eos_ids=np.full((b, engine_config.max_eos_ids), -1, np.int32),
        generated=np.full((b, engine_config.max_seq_len), -1, np.int32),
        pool=pool)


def _step_needs(state: DecodeState, block_size: int) -> jax.Array:
    """bool [B]: live slots whose next token starts a new block (and so needs one)."""
    return state.active & (state.seq_lens % block_size == 0)


def decode_loop(
    params: Params,
    kv_caches: KVCaches,
    state: DecodeState,
    max_steps: jax.Array,
    exit_after: jax.Array,
    kv_scales: KVScales = None,
    *,
    config: ModelConfig,
    block_size: int,
    attn_impl: str = "auto",
    partition_size: int = 512,
    tensor_parallel: bool = False,
) -> tuple[KVCaches, DecodeState, jax.Array]:
    """Greedy decode steps in one ``lax.while_loop``; jit it with ``kv_caches``/``state`` donated.

    Args:
      params: model parameters.
      kv_caches: per-layer ``(key_cache, value_cache)`` (see ``jax_paged.cache``).
      state: :class:`DecodeState`.
      max_steps: int32 scalar, most steps to run.
      exit_after: int32 scalar, stop after the step in which this many sequences finished.
      kv_scales: fp8 caches: one ``(k_scale, v_scale)`` per layer (traced); None means 1.
      tensor_parallel: caches sharded on KV heads (see :func:`jax_paged.serving.model.paged_ops`).

    Returns:
      ``(kv_caches, state, steps int32 [])``. Stops early when no slot is live, after
      ``exit_after`` finishes, or before a step whose block allocation would fail; the host
      tells the last case by ``sum(active & seq_lens % block_size == 0) > pool.num_free``.
    """
    batch, max_blocks = state.block_tables.shape
    rows = jnp.arange(batch)
    gen_len = state.generated.shape[1]

    def cond(carry):
        _, st, steps, n_finished = carry
        can_alloc = jnp.sum(_step_needs(st, block_size), dtype=jnp.int32) <= st.pool.num_free
        return (steps < max_steps) & jnp.any(st.active) & (n_finished < exit_after) & can_alloc

    def body(carry):
        caches, st, steps, n_finished = carry
        # 1. New block for sequences crossing a block boundary (cond guaranteed enough are free).
        need = _step_needs(st, block_size)
        pool, new_ids, _ = allocate_blocks(st.pool, need)
        blk = jnp.clip(st.seq_lens // block_size, 0, max_blocks - 1)
        entry = jnp.where(need, new_ids, st.block_tables[rows, blk])
        block_tables = st.block_tables.at[rows, blk].set(entry)
        # 2. Model step: write the token's K/V at its slot, attend over seq_len + 1 tokens.
        slot_mapping = jnp.where(st.active, entry * block_size + st.seq_lens % block_size, -1)
        ctx_lens = jnp.where(st.active, st.seq_lens + 1, 0)
        logits, caches = decode_step_paged(
            params, caches, st.tokens, st.seq_lens, block_tables, slot_mapping, ctx_lens,
            config=config, attn_impl=attn_impl, partition_size=partition_size,
            tensor_parallel=tensor_parallel, kv_scales=kv_scales)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        # 3. Record the token; live slots advance.
        act = st.active
        generated = st.generated.at[rows, jnp.where(act, st.num_generated, gen_len)].set(nxt, mode="drop")
        num_generated = st.num_generated + act
        seq_lens = st.seq_lens + act
        tokens = jnp.where(act, nxt, st.tokens)
        # 4. Finished sequences return all their blocks at once.
        stop = jnp.any(nxt[:, None] == st.eos_ids, axis=-1)
        finished = act & (stop | (num_generated >= st.max_new_tokens))
        owned = jnp.arange(max_blocks)[None, :] < _cdiv(seq_lens, block_size)[:, None]
        pool = free_blocks(pool, block_tables, finished[:, None] & owned)
        block_tables = jnp.where(finished[:, None], -1, block_tables)
        st = DecodeState(tokens, seq_lens, block_tables, act & ~finished, num_generated,
                         st.max_new_tokens, st.eos_ids, generated, pool)
        return caches, st, steps + 1, n_finished + jnp.sum(finished, dtype=jnp.int32)

    caches, state, steps, _ = jax.lax.while_loop(
        cond, body, (kv_caches, state, jnp.int32(0), jnp.int32(0)))
    return caches, state, steps


def make_decode_loop(config: ModelConfig, engine_config: EngineConfig, *, donate: bool = True,
                     tensor_parallel: bool = False) -> Callable:
    """:func:`decode_loop` jitted, with ``kv_caches`` and ``state`` donated unless ``donate=False``.

    Engines with the same model config, block size and attention settings share one jitted
    function (and so its compilation cache). With ``tensor_parallel=True`` the same function runs
    on the shardings of its inputs (weights and caches placed by :class:`Engine` on its mesh).
    """
    ec = engine_config
    return _jitted_decode_loop(config, ec.block_size, ec.attn_impl, ec.partition_size, donate,
                               tensor_parallel)


@functools.lru_cache(maxsize=None)
def _jitted_decode_loop(config, block_size, attn_impl, partition_size, donate, tensor_parallel):
    fn = functools.partial(decode_loop, config=config, block_size=block_size,
                           attn_impl=attn_impl, partition_size=partition_size,
                           tensor_parallel=tensor_parallel)
    return jax.jit(fn, donate_argnums=(1, 2) if donate else ())


def _prefill_and_sample(params, kv_caches, tokens, prompt_lens, slot_mapping, kv_scales=None, *,
                        config, tensor_parallel):
    logits, kv_caches = prefill_paged(params, kv_caches, tokens, prompt_lens, slot_mapping,
                                      config=config, tensor_parallel=tensor_parallel,
                                      kv_scales=kv_scales)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_caches


@functools.lru_cache(maxsize=None)
def make_prefill(config: ModelConfig, *, donate: bool = True, tensor_parallel: bool = False) -> Callable:
    """Jitted prefill + greedy first token: ``(params, kv_caches, tokens [R,T], prompt_lens [R],
    slot_mapping [R,T][, kv_scales]) -> (first_tokens int32 [R], kv_caches)``, caches donated."""
    return jax.jit(functools.partial(_prefill_and_sample, config=config,
                                     tensor_parallel=tensor_parallel),
                   donate_argnums=(1,) if donate else ())


@dataclasses.dataclass
class Request:
    """A generation request. ``output`` fills with generated token ids (the EOS id included if
    one is hit)."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    output: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0


@dataclasses.dataclass
class EngineStats:
    """Counters of an :class:`Engine` run."""

    requests_served: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    prefill_calls: int = 0
    decode_loops: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # prompt + generated tokens prefilled again after preemption
    peak_blocks_used: int = 0


class Engine:
    """Continuous-batching greedy generation (see the module docstring for the design).

    Example::

        engine = Engine(config, params, EngineConfig(max_batch=8, num_blocks=64))
        ids = [engine.add_request(prompt, max_new_tokens=32, eos_id=[2, 7]) for prompt in prompts]
        outputs = engine.run()          # {request_id: [token ids]}

    ``cache_dtype`` (default: the weights' dtype) may be ``float8_e4m3fn`` or ``float8_e5m2``:
    an fp8 cache, half the bytes of a 16-bit one per token. Each layer's K and V are then
    written as ``value / scale`` (saturated) and read as ``value * scale``, with ``kv_scales``,
    one ``(k_scale, v_scale)`` per layer (float32 scalars or ``[num_kv_heads]``, traced: new
    scales do not recompile), or 1 for every layer (the default). The prompt attends its own
    K/V unquantised (dense prefill); decode steps attend the fp8 cache. The query stays in the
    weights' dtype.

    Tensor parallel over N devices: pass ``mesh=Mesh(np.array(jax.devices()[:N]), ("tp",))``.
    ``params`` are then copied onto the mesh (sharded) and the caches are allocated sharded;
    raises ``ValueError`` if heads, KV heads or the intermediate size do not divide by N.
    """

    def __init__(self, config: ModelConfig, params: Params, engine_config: EngineConfig = EngineConfig(),
                 *, cache_dtype: Any = None, kv_scales: KVScales = None,
                 check_invariants: bool = False, mesh: Optional[Mesh] = None):
        ec = engine_config
        if ec.num_blocks < ec.max_blocks_per_seq:
            raise ValueError(f"num_blocks must hold at least one max_seq_len sequence: got "
                             f"{ec.num_blocks}, expected >= {ec.max_blocks_per_seq} blocks of "
                             f"{ec.block_size} tokens (max_seq_len {ec.max_seq_len})")
        self.config = config
        self.engine_config = ec
        self.check_invariants = check_invariants
        self.mesh = mesh
        dtype = cache_dtype if cache_dtype is not None else params["embed"].dtype
        self.kv_scales = check_kv_scales(kv_scales, dtype, config.num_layers)
        cache_sharding = None
        # Where the decode state goes each loop: the default device, or every device of the mesh.
        self._state_sharding: Optional[NamedSharding] = None
        if mesh is not None:
            if TP_AXIS not in mesh.axis_names:
                raise ValueError(f"tensor parallelism needs a mesh axis named {TP_AXIS!r}, "
                                 f"got {mesh.axis_names}")
            params = shard_params(params, config, mesh)  # checks the sizes divide
            cache_sharding = NamedSharding(mesh, P(None, TP_AXIS))  # KV heads split
            self._state_sharding = NamedSharding(mesh, P())  # replicated
        self.params = params
        self.kv_caches = allocate_kv_cache(config.num_layers, ec.num_blocks, config.num_kv_heads,
                                           config.head_dim, ec.block_size, dtype,
                                           sharding=cache_sharding)
        tp = mesh is not None
        self._decode_loop = make_decode_loop(config, ec, tensor_parallel=tp)
        self._prefill = make_prefill(config, tensor_parallel=tp)
        self._state = init_decode_state(ec)  # host copy, authoritative between loops
        self._slot_req: list[Optional[Request]] = [None] * ec.max_batch
        self._slot_order = np.zeros(ec.max_batch, np.int64)  # admission order, for preemption
        self._admissions = 0
        self._waiting: collections.deque[Request] = collections.deque()
        self._next_id = 0
        self.finished: dict[int, Request] = {}
        self.stats = EngineStats()

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, eos_id: EosIds = None) -> int:
        """Queue a request; returns its id. ``len(prompt) + max_new_tokens <= max_seq_len``;
        ``eos_id``: one stop id, several (at most ``max_eos_ids``), or None."""
        ec = self.engine_config
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must hold at least one token id, got an empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > ec.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) > max_seq_len ({ec.max_seq_len})")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.config.vocab_size}), "
                             f"got {bad[:8]}")
        eos = eos_id_array(eos_id, ec.max_eos_ids)
        req = Request(self._next_id, prompt, int(max_new_tokens), tuple(int(e) for e in eos if e >= 0))
        self._next_id += 1
        self._waiting.append(req)
        return req.request_id

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slot_req)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.num_running > 0

    def host_state(self) -> DecodeState:
        """The host copy of the decode state (numpy; valid between :meth:`step` calls)."""
        return self._state

    def blocks_in_use(self) -> int:
        return self.engine_config.num_blocks - int(self._state.pool.num_free)

    # ---------------------------------------------------------------- scheduling
    def _check(self) -> None:
        if self.check_invariants:
            s = self._state
            check_page_accounting(s.pool.free_ids, int(s.pool.num_free), s.block_tables, s.seq_lens,
                                  s.active, self.engine_config.block_size)
            occupied = np.array([r is not None for r in self._slot_req])
            assert np.array_equal(occupied, s.active), "host slot table and device state disagree"

    def _finish(self, req: Request) -> None:
        self.finished[req.request_id] = req
        self.stats.requests_served += 1

    def _release_slot(self, b: int, alloc: HostBlockAllocator) -> None:
        s, bs = self._state, self.engine_config.block_size
        alloc.free(s.block_tables[b, : _cdiv(int(s.seq_lens[b]), bs)])
        s.block_tables[b] = -1
        s.active[b] = False
        s.seq_lens[b] = 0
        self._slot_req[b] = None

    def _preempt(self, alloc: HostBlockAllocator) -> None:
        """Evict the newest sequences until the next decode step's blocks fit."""
        s, bs = self._state, self.engine_config.block_size
        while int(np.sum(s.active & (s.seq_lens % bs == 0))) > alloc.num_free:
            live = np.flatnonzero(s.active)
            b = int(live[np.argmax(self._slot_order[live])])
            req = self._slot_req[b]
            req.output.extend(int(t) for t in s.generated[b, : s.num_generated[b]])
            req.num_preemptions += 1
            self.stats.preemptions += 1
            self._release_slot(b, alloc)
            self._waiting.appendleft(req)  # recomputed first: its prompt becomes prompt + output

    def _admit(self, alloc: HostBlockAllocator, on_tokens: Optional[Callable[[int], None]]) -> None:
        """Admit waiting requests into free slots and prefill them (one batched call)."""
        s, ec = self._state, self.engine_config
        bs = ec.block_size
        free_slots = [b for b in range(ec.max_batch) if self._slot_req[b] is None]
        # Blocks the live sequences need for their next step must stay free (else the admitted
        # request would be preempted straight away, or cause a livelock of admit/preempt).
        reserve = int(np.sum(s.active & (s.seq_lens % bs == 0)))
        batch = []
        while self._waiting and free_slots:
            req = self._waiting[0]
            prompt = req.prompt + req.output
            n_blocks = _cdiv(len(prompt), bs)
            first_step_block = int(len(prompt) % bs == 0)
            if alloc.num_free - n_blocks < reserve + first_step_block:
                break  # first come, first served: later requests wait too
            reserve += first_step_block
            ids = alloc.allocate(n_blocks)
            self._waiting.popleft()
            batch.append((free_slots.pop(0), req, prompt, ids))
        if not batch:
            return
        # One prefill for the batch; rows and length padded to powers of two to limit recompiles.
        r = min(max(ec.prefill_min_rows, 1 << (len(batch) - 1).bit_length()), ec.max_batch)
        t = max(ec.prefill_min_len, 1 << (max(len(p) for _, _, p, _ in batch) - 1).bit_length())
        tokens = np.zeros((r, t), np.int32)
        lens = np.zeros(r, np.int32)
        slots = np.full((r, t), -1, np.int32)
        for i, (_, req, prompt, ids) in enumerate(batch):
            n = len(prompt)
            tokens[i, :n] = prompt
            lens[i] = n
            pos = np.arange(n)
            slots[i, :n] = ids[pos // bs] * bs + pos % bs
            self.stats.prompt_tokens += n
            if req.output:
                self.stats.recomputed_tokens += n
        first, self.kv_caches = self._prefill(self.params, self.kv_caches, tokens, lens, slots,
                                              self.kv_scales)
        first = np.asarray(first)
        self.stats.prefill_calls += 1
        for i, (b, req, prompt, ids) in enumerate(batch):
            tok = int(first[i])
            remaining = req.max_new_tokens - len(req.output)
            if tok in req.eos_ids or remaining == 1:
                req.output.append(tok)
                alloc.free(ids)
                self._finish(req)
                continue
            self._slot_req[b] = req
            self._slot_order[b] = self._admissions
            self._admissions += 1
            s.tokens[b] = tok
            s.seq_lens[b] = len(prompt)
            s.block_tables[b] = -1
            s.block_tables[b, : len(ids)] = ids
            s.active[b] = True
            s.num_generated[b] = 1
            s.max_new_tokens[b] = remaining
            s.eos_ids[b] = eos_id_array(req.eos_ids, ec.max_eos_ids)
            s.generated[b] = -1
            s.generated[b, 0] = tok
        self.stats.tokens_generated += len(batch)
        if on_tokens is not None:
            on_tokens(len(batch))

    def step(self, on_tokens: Optional[Callable[[int], None]] = None) -> None:
        """One host iteration: preempt if needed, admit + prefill, then one jitted decode loop."""
        ec = self.engine_config
        alloc = HostBlockAllocator.from_pool(self._state.pool)
        self._preempt(alloc)
        self._admit(alloc, on_tokens)
        self._state = self._state._replace(pool=alloc.to_pool())
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, alloc.peak_used)
        self._check()
        if not self._state.active.any():
            return
        before = self._state.num_generated.copy()
        exit_after = 1 if self._waiting else ec.max_batch + 1
        self.kv_caches, dev_state, steps = self._decode_loop(
            self.params, self.kv_caches, jax.device_put(self._state, self._state_sharding),
            np.int32(ec.max_steps_per_loop), np.int32(exit_after), self.kv_scales)
        # The one host sync per loop: the (small) decode state, never the caches.
        host = jax.device_get(dev_state)
        self._state = DecodeState(*(np.array(a) for a in host[:-1]),
                                  pool=BlockPool(*(np.array(a) for a in host.pool)))
        self.stats.decode_loops += 1
        self.stats.decode_steps += int(steps)
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, int(self._state.pool.peak_used))
        new_tokens = int(np.sum(self._state.num_generated - before))
        self.stats.tokens_generated += new_tokens
        if on_tokens is not None and new_tokens:
            on_tokens(new_tokens)
        s = self._state
        for b, req in enumerate(self._slot_req):
            if req is not None and not s.active[b]:  # finished inside the loop
                req.output.extend(int(t) for t in s.generated[b, : s.num_generated[b]])
                self._slot_req[b] = None
                s.seq_lens[b] = 0
                self._finish(req)
        self._check()

    def run(self, on_tokens: Optional[Callable[[int], None]] = None) -> dict[int, list[int]]:
        """Serve every queued request; returns ``{request_id: generated token ids}``.

        ``on_tokens(n)`` is called as tokens are produced (once per prefill and per decode loop).
        """
        while self.has_work():
            self.step(on_tokens)
        return {rid: list(req.output) for rid, req in sorted(self.finished.items())}


def generate(
    config: ModelConfig,
    params: Params,
    requests: Sequence[tuple[Sequence[int], int, EosIds]],
    engine_config: EngineConfig = EngineConfig(),
    **engine_kwargs: Any,
) -> tuple[list[list[int]], EngineStats]:
    """Serve ``requests`` (``(prompt, max_new_tokens, eos_id)`` tuples; ``eos_id`` one id,
    several or None) with a fresh
    :class:`Engine`; returns ``(outputs in request order, stats)``."""
    engine = Engine(config, params, engine_config, **engine_kwargs)
    ids = [engine.add_request(p, n, e) for p, n, e in requests]
    out = engine.run()
    return [out[i] for i in ids], engine.stats
