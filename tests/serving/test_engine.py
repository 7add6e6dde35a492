"""The continuous-batching engine: greedy equality with the dense-cache reference, page
accounting, block exhaustion/preemption, EOS, and no cache copies in the compiled loop."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged.cache import allocate_kv_cache, check_page_accounting
from jax_paged.serving.engine import (
    Engine, EngineConfig, decode_loop, init_decode_state, make_decode_loop, make_prefill,
)
from jax_paged.serving.model import LlamaConfig, generate_dense, init_params

CFG = LlamaConfig.preset("tiny")
# One engine shape for every test here, so the decode loop and the prefill compile once
# (prefill rows fixed at max_batch; prompt buckets of 32 and 64 tokens).
EC = EngineConfig(max_batch=4, num_blocks=16, block_size=8, max_seq_len=64, max_steps_per_loop=16,
                  prefill_min_rows=4, prefill_min_len=32)
DENSE_LEN = 64  # the dense reference's cache length (one compilation too)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


def _random_requests(rng, n, max_prompt=30, max_new=30, eos_rate=0.0):
    reqs = []
    for _ in range(n):
        prompt = [int(t) for t in rng.integers(0, CFG.vocab_size, int(rng.integers(1, max_prompt + 1)))]
        eos = int(rng.integers(0, CFG.vocab_size)) if rng.random() < eos_rate else None
        reqs.append((prompt, int(rng.integers(1, max_new + 1)), eos))
    return reqs


def _serve(params, reqs, ec=EC, **kw):
    engine = Engine(CFG, params, ec, check_invariants=True, **kw)
    ids = [engine.add_request(*r) for r in reqs]
    out = engine.run()
    return [out[i] for i in ids], engine


def _dense(params, reqs):
    return [generate_dense(params, CFG, p, n, e, max_len=DENSE_LEN) for p, n, e in reqs]


def _assert_all_blocks_free(engine):
    s, n = engine.host_state(), engine.engine_config.num_blocks
    assert int(s.pool.num_free) == n
    assert sorted(s.pool.free_ids.tolist()) == list(range(n))
    assert not s.active.any() and engine.num_running == 0 and engine.num_waiting == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_dense_cache_reference(params, seed):
    """Mixed prompt lengths and budgets, some with EOS, more requests than slots (refills) and
    more demand than blocks (waits/preemptions): tokens equal the dense-cache reference."""
    rng = np.random.default_rng(seed)
    reqs = _random_requests(rng, 10, eos_rate=0.5)
    out, engine = _serve(params, reqs)
    assert out == _dense(params, reqs)
    for o, (_, n, eos) in zip(out, reqs):
        assert 1 <= len(o) <= n and (len(o) == n or o[-1] == eos) and eos not in o[:-1]
    st = engine.stats
    assert st.requests_served == 10 and st.tokens_generated == sum(map(len, out))
    assert st.decode_loops < st.decode_steps  # many steps per host round-trip
    _assert_all_blocks_free(engine)


def test_page_accounting_every_step_and_peak(params):
    """One decode step per loop so the host sees every step: blocks in use always equal
    sum(ceil(seq_len / block_size)) over live sequences, block tables and the free list always
    partition the pool, and the peak equals the one computed from the sequence lengths."""
    rng = np.random.default_rng(5)
    lens = [(3, 20), (17, 9), (8, 1), (25, 14)]  # (prompt, max_new); max_new=1 finishes at prefill
    reqs = [([int(t) for t in rng.integers(0, CFG.vocab_size, p)], n, None) for p, n in lens]
    ec = EngineConfig(**{**EC.__dict__, "max_steps_per_loop": 1})
    engine = Engine(CFG, params, ec, check_invariants=True)
    ids = [engine.add_request(*r) for r in reqs]
    bs = ec.block_size
    while engine.has_work():
        engine.step()
        s = engine.host_state()
        live = np.flatnonzero(s.active)
        assert engine.blocks_in_use() == sum(-(-int(s.seq_lens[b]) // bs) for b in live)
        check_page_accounting(s.pool.free_ids, int(s.pool.num_free), s.block_tables, s.seq_lens, s.active, bs)
    out = [engine.finished[i].output for i in ids]
    assert out == _dense(params, reqs)
    _assert_all_blocks_free(engine)
    # All four were admitted together (enough blocks) and none was preempted, so:
    # at admission every prompt holds ceil(p / bs) blocks; during decode step k (k = 1, 2, ...)
    # sequence i, if still decoding (k <= len(out_i) - 1), holds ceil((p_i + k) / bs).
    assert engine.stats.preemptions == 0 and engine.stats.prefill_calls == 1
    peak = sum(-(-p // bs) for p, _ in lens)
    for k in range(1, 64):
        peak = max(peak, sum(-(-(p + k) // bs) for (p, _), o in zip(lens, out) if k <= len(o) - 1))
    assert engine.stats.peak_blocks_used == peak
    assert peak < ec.max_batch * ec.max_blocks_per_seq  # less than a max-length reservation


def test_block_exhaustion_waits_and_preempts(params):
    rng = np.random.default_rng(9)
    # Four long requests need 4 * 8 = 32 blocks at the end; the pool has 16.
    reqs = [([int(t) for t in rng.integers(0, CFG.vocab_size, p)], 64 - p, None) for p in (20, 30, 12, 25)]
    engine = Engine(CFG, params, EC, check_invariants=True)
    ids = [engine.add_request(*r) for r in reqs]
    engine.step()  # admission: the prompts' 3 + 4 + 2 + 4 blocks fit; growth does not
    assert engine.num_running + len(engine.finished) == 4
    out = engine.run()
    assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
    assert any(engine.finished[i].num_preemptions for i in ids)
    assert [out[i] for i in ids] == _dense(params, reqs)  # nobody's pages were corrupted
    _assert_all_blocks_free(engine)
    assert engine.stats.peak_blocks_used == EC.num_blocks

    # Prompts too large to admit together: the later ones wait (free slots, but no blocks).
    reqs = [([int(t) for t in rng.integers(0, CFG.vocab_size, 50)], 3, None) for _ in range(3)]
    engine = Engine(CFG, params, EC, check_invariants=True)
    ids = [engine.add_request(*r) for r in reqs]
    engine.step()
    assert engine.num_running + len(engine.finished) == 2 and engine.num_waiting == 1
    out = engine.run()
    assert [out[i] for i in ids] == _dense(params, reqs)
    _assert_all_blocks_free(engine)


def test_eos(params):
    rng = np.random.default_rng(21)
    reqs = _random_requests(rng, 5, max_new=25)
    reqs = [(p, 25, None) for p, _, _ in reqs]
    base, _ = _serve(params, reqs)
    # EOS = a token first produced mid-way through request 0's output; EOS = request 1's very
    # first token (from the prefill); request 2 without EOS.
    k = next(i for i in range(3, 25) if base[0][i] not in base[0][:i])
    eos0, eos1 = base[0][k], base[1][0]
    with_eos = [(reqs[0][0], 25, eos0), (reqs[1][0], 25, eos1), reqs[2]]
    out, engine = _serve(params, with_eos)
    assert out[0] == base[0][: k + 1]
    assert out[1] == [eos1]
    assert out[2] == base[2]
    assert out == _dense(params, with_eos)
    _assert_all_blocks_free(engine)


def test_decode_loop_exit_conditions(params):
    """The jitted loop stops after `exit_after` finishes and before a step that cannot get a block."""
    loop = make_decode_loop(CFG, EC)
    prefill = make_prefill(CFG)
    caches = allocate_kv_cache(CFG.num_layers, EC.num_blocks, CFG.num_kv_heads, CFG.head_dim, EC.block_size)
    state = init_decode_state(EC)
    # Slot 0: an 8-token prompt in block 5, budget 4 (3 decode steps); slot 2: 7 tokens in
    # block 9, budget 30; the other 14 blocks are free. Prefilled as rows 0 and 1.
    tokens = np.zeros((4, 32), np.int32)
    tokens[0, :8], tokens[1, :7] = np.arange(1, 9), np.arange(20, 27)
    slots = np.full((4, 32), -1, np.int32)
    slots[0, :8] = 5 * 8 + np.arange(8)
    slots[1, :7] = 9 * 8 + np.arange(7)
    first, caches = prefill(params, caches, tokens, np.array([8, 7, 0, 0], np.int32), slots)
    s = state._replace(
        tokens=np.array([first[0], 0, first[1], 0], np.int32), seq_lens=np.array([8, 0, 7, 0], np.int32),
        active=np.array([True, False, True, False]), num_generated=np.array([1, 0, 1, 0], np.int32),
        max_new_tokens=np.array([4, 0, 30, 0], np.int32))
    s.block_tables[0, 0], s.block_tables[2, 0] = 5, 9
    free = [b for b in range(16) if b not in (5, 9)]
    s.pool.free_ids[:] = free + [-1, -1]
    s = s._replace(pool=s.pool._replace(num_free=np.int32(14), peak_used=np.int32(2)))
    # Slot 0 finishes after 3 steps; with exit_after=1 the loop stops right there.
    caches, s1, steps = loop(params, caches, jax.device_put(s), np.int32(50), np.int32(1))
    s1 = jax.device_get(s1)
    assert int(steps) == 3 and not s1.active[0] and s1.active[2] and s1.num_generated[0] == 4
    # Both slots took their 2nd block at position 8; slot 0 then returned its two.
    assert int(s1.pool.num_free) == 14 - 2 + 2 and int(s1.seq_lens[2]) == 10
    # Now leave no free block: slot 2 is at position 10, it needs its 2nd block at position 16
    # (after 6 more steps) and the loop must stop before that step.
    s2 = jax.device_get(s1)
    s2 = s2._replace(pool=s2.pool._replace(num_free=np.int32(0)))
    caches, s3, steps = loop(params, caches, jax.device_put(s2), np.int32(50), np.int32(5))
    s3 = jax.device_get(s3)
    assert int(steps) == 16 - 10 and s3.active[2] and int(s3.seq_lens[2]) == 16
    assert int(s3.seq_lens[2]) % EC.block_size == 0 and int(s3.pool.num_free) == 0


# ------------------------------------------------------------------ no cache copy in the HLO

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+(?P<op>[\w\-]+)\(")


def cache_copies(hlo_text: str, shapes) -> list[str]:
    """HLO instructions whose opcode is copy/copy-start and whose (or one of whose tuple)
    result shapes equals one of ``shapes`` (fused computations are scanned too)."""
    shapes = {tuple(s) for s in shapes}
    hits = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group("op") not in ("copy", "copy-start"):
            continue
        for dims in re.findall(r"\w+\[([\d,]*)\]", m.group("shape")):
            if tuple(int(d) for d in dims.split(",") if d) in shapes:
                hits.append(line.strip())
                break
    return hits


def _loop_args(params):
    caches = allocate_kv_cache(CFG.num_layers, EC.num_blocks, CFG.num_kv_heads, CFG.head_dim, EC.block_size)
    shapes = {c.shape for kv in caches for c in kv}
    return caches, jax.device_put(init_decode_state(EC)), shapes


@pytest.mark.parametrize("attn_impl", ["auto", "reference"])
def test_no_cache_copy_in_compiled_decode_loop(params, attn_impl):
    """The whole decode loop (many steps), as the engine compiles it, copies no cache buffer."""
    caches, state, shapes = _loop_args(params)
    ec = EngineConfig(**{**EC.__dict__, "attn_impl": attn_impl})
    hlo = make_decode_loop(CFG, ec).lower(params, caches, state, np.int32(4), np.int32(1)).compile().as_text()
    assert "while" in hlo
    assert cache_copies(hlo, shapes) == []


def test_cache_copy_detector_finds_real_copies(params):
    """The detector is not vacuous: without donation XLA must copy every cache into the loop
    (the caller keeps its buffers); with donation but the old cache kept alive (also returned),
    it must copy that one."""
    caches, state, shapes = _loop_args(params)
    hlo = make_decode_loop(CFG, EC, donate=False).lower(
        params, caches, state, np.int32(4), np.int32(1)).compile().as_text()
    assert len(cache_copies(hlo, shapes)) == 2 * CFG.num_layers

    def keeps_old(params, caches, state):
        new, st, _ = decode_loop(params, caches, state, 4, 1, config=CFG, block_size=EC.block_size)
        return new, st, caches[0][0]
    hlo = jax.jit(keeps_old, donate_argnums=(1, 2)).lower(params, caches, state).compile().as_text()
    assert len(cache_copies(hlo, shapes)) >= 1


def test_no_cache_copy_in_compiled_prefill(params):
    caches, _, shapes = _loop_args(params)
    args = (params, caches, np.zeros((4, 32), np.int32), np.zeros(4, np.int32), np.zeros((4, 32), np.int32))
    assert cache_copies(make_prefill(CFG).lower(*args).compile().as_text(), shapes) == []
    assert len(cache_copies(make_prefill(CFG, donate=False).lower(*args).compile().as_text(), shapes)) > 0


def test_cache_copies_parser():
    text = """
  %copy.3 = f32[16,2,4,8,4]{4,3,2,1,0} copy(f32[16,2,4,8,4]{4,3,2,1,0} %p0)
  ROOT copy.9 = f32[16,2,16,8]{3,2,1,0} copy(%x), metadata={op_name="x"}
  %cs = (f32[16,2,16,8]{3,2,1,0}, f32[16,2,16,8]{3,2,1,0}, u32[]) copy-start(%y)
  %copy.4 = f32[2,4]{1,0} copy(%z)
  %add.1 = f32[16,2,16,8]{3,2,1,0} add(%a, %b)
"""
    hits = cache_copies(text, [(16, 2, 4, 8, 4), (16, 2, 16, 8)])
    assert len(hits) == 3 and "copy.4" not in " ".join(hits)


def test_add_request_validation(params):
    """Each refusal names the argument, what it got and what was expected."""
    engine = Engine(CFG, params, EC)
    with pytest.raises(ValueError, match=r"prompt \(40\) \+ max_new_tokens \(25\) > max_seq_len"):
        engine.add_request([1] * 40, 25)  # 65 > max_seq_len
    with pytest.raises(ValueError, match=r"prompt must hold at least one token id"):
        engine.add_request([], 5)
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1, got 0"):
        engine.add_request([1, 2], 0)
    with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, vocab_size="
                                         rf"{CFG.vocab_size}\), got \[{CFG.vocab_size}, -1\]"):
        engine.add_request([3, CFG.vocab_size, 4, -1], 5)
    assert engine.num_waiting == 0  # nothing refused was queued


def test_engine_refuses_a_pool_smaller_than_one_sequence(params):
    small = dataclasses.replace(EC, num_blocks=EC.max_blocks_per_seq - 1)
    with pytest.raises(ValueError, match=rf"num_blocks must hold at least one max_seq_len sequence: "
                                         rf"got {small.num_blocks}, expected >= "
                                         rf"{EC.max_blocks_per_seq} blocks"):
        Engine(CFG, params, small)


# ------------------------------------------------------------------ fp8 KV cache

# Room for every slot's longest sequence: no preemption (a preempted request is recomputed by
# the dense prefill from unquantised K/V, which an fp8 cache does not reproduce).
EC_FP8 = dataclasses.replace(EC, num_blocks=EC.max_batch * EC.max_blocks_per_seq)


@pytest.mark.parametrize("cache_dtype,per_head", [(jnp.float8_e4m3fn, False),
                                                  (jnp.float8_e5m2, True)])
def test_fp8_cache_matches_the_fp8_dense_reference(params, cache_dtype, per_head):
    """An fp8 cache: the engine's tokens equal the dense reference's with the same cache
    semantics (the prompt attends its K/V as computed, every later token the cache's
    quantised values), with per-layer scales (per KV head for e5m2); the unquantised
    reference differs, so the comparison sees the quantisation."""
    rng = np.random.default_rng(7)
    reqs = _random_requests(rng, 8, max_new=24)
    shape = (CFG.num_kv_heads,) if per_head else ()
    kv_scales = [(np.full(shape, 0.5 + 0.25 * i, np.float32), np.full(shape, 0.75, np.float32))
                 for i in range(CFG.num_layers)]
    out, engine = _serve(params, reqs, EC_FP8, cache_dtype=cache_dtype, kv_scales=kv_scales)
    assert engine.stats.preemptions == 0
    assert all(k.dtype == cache_dtype and v.dtype == cache_dtype for k, v in engine.kv_caches)
    ref = [generate_dense(params, CFG, p, n, e, max_len=DENSE_LEN, cache_dtype=cache_dtype,
                          kv_scales=kv_scales) for p, n, e in reqs]
    assert out == ref
    assert ref != _dense(params, reqs)
    _assert_all_blocks_free(engine)


def test_no_cache_copy_in_compiled_decode_loop_fp8(params):
    """fp8 caches with traced per-layer scales stay donated in place through the loop."""
    caches = allocate_kv_cache(CFG.num_layers, EC.num_blocks, CFG.num_kv_heads, CFG.head_dim,
                               EC.block_size, jnp.float8_e4m3fn)
    shapes = {c.shape for kv in caches for c in kv}
    scales = [(np.float32(1.0), np.float32(0.5))] * CFG.num_layers
    hlo = make_decode_loop(CFG, EC).lower(params, caches, jax.device_put(init_decode_state(EC)),
                                          np.int32(4), np.int32(1), scales).compile().as_text()
    assert "while" in hlo
    assert cache_copies(hlo, shapes) == []


def test_kv_scales_validation(params):
    with pytest.raises(ValueError, match=r"kv_scales: only for fp8 caches \(cache_dtype "
                                         r"float8_e4m3fn or float8_e5m2\), got cache_dtype float32"):
        Engine(CFG, params, EC, kv_scales=[(1.0, 1.0)] * CFG.num_layers)
    with pytest.raises(ValueError, match=rf"kv_scales: expected {CFG.num_layers} \(k_scale, "
                                         rf"v_scale\) pairs, one per layer, got 1 entries"):
        Engine(CFG, params, EC, cache_dtype=jnp.float8_e4m3fn, kv_scales=[(1.0, 1.0)])
    with pytest.raises(ValueError, match=r"kv_scales: only for fp8 caches \(cache_dtype "
                                         r"float8_e4m3fn or float8_e5m2\), got cache_dtype float32"):
        generate_dense(params, CFG, [1, 2], 3, kv_scales=[(1.0, 1.0)] * CFG.num_layers)
