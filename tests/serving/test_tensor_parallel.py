"""Tensor-parallel decode (``Engine(..., mesh=...)``) on several CPU devices (conftest asks XLA
for 4 host devices): tokens equal the single-device run, the compiled decode loop and prefill
move no cache-sized buffer between devices, donation still updates the sharded caches in
place, and sizes that do not divide raise a clear error."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_paged.serving.engine import Engine, EngineConfig, init_decode_state, make_decode_loop, make_prefill
from jax_paged.serving.model import LlamaConfig, check_tensor_parallel, init_params
from test_engine import cache_copies

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices")

# The tiny model with 8 heads / 4 KV heads (GQA groups of 2), so it splits over 2 and 4 devices.
CFG = LlamaConfig.preset("tiny", num_heads=8, num_kv_heads=4)
# As in test_engine: 16 blocks for 4 slots of up to 64 tokens, so requests wait and get preempted.
EC = EngineConfig(max_batch=4, num_blocks=16, block_size=8, max_seq_len=64, max_steps_per_loop=16,
                  prefill_min_rows=4, prefill_min_len=32)

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+(?P<op>[\w\-]+)\(")
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter",
                "collective-broadcast", "ragged-all-to-all")


def collectives(hlo_text: str) -> list[tuple[str, set[tuple[int, ...]], str]]:
    """``(opcode without -start/-done, result shapes, line)`` of every collective in the HLO."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op = re.sub(r"-(start|done)$", "", m.group("op"))
        if op in _COLLECTIVES:
            shapes = {tuple(int(d) for d in dims.split(",") if d)
                      for dims in re.findall(r"\w+\[([\d,]*)\]", m.group("shape"))}
            found.append((op, shapes, line.strip()))
    return found


def cache_sized(hlo_text: str, shapes) -> list[str]:
    """Collectives whose result has one of ``shapes``."""
    return [line for _, got, line in collectives(hlo_text) if got & set(shapes)]


def tp_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:n]), ("tp",))


def replicated_state(mesh: Mesh):
    """Empty decode state on every device of ``mesh``, as the engine passes it to the loop."""
    return jax.device_put(init_decode_state(EC), NamedSharding(mesh, P()))


def cache_shapes(engine: Engine) -> set[tuple[int, ...]]:
    """Global and per-device shapes of the engine's caches (the partitioned HLO has the latter)."""
    return ({c.shape for kv in engine.kv_caches for c in kv} |
            {c.addressable_shards[0].data.shape for kv in engine.kv_caches for c in kv})


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def requests():
    """A mixed batch: prompt lengths 1-40, budgets 1-30, some with EOS; more requests than
    slots and more demand than blocks (refills, waits, preemptions)."""
    rng = np.random.default_rng(3)
    reqs = []
    for _ in range(10):
        prompt = [int(t) for t in rng.integers(0, CFG.vocab_size, int(rng.integers(1, 41)))]
        eos = int(rng.integers(0, CFG.vocab_size)) if rng.random() < 0.5 else None
        reqs.append((prompt, int(rng.integers(1, min(30, 64 - len(prompt)) + 1)), eos))
    return reqs


def _serve(params, reqs, mesh=None, **engine_kwargs):
    engine = Engine(CFG, params, EC, check_invariants=True, mesh=mesh, **engine_kwargs)
    ids = [engine.add_request(*r) for r in reqs]
    out = engine.run()
    return [out[i] for i in ids], engine


@pytest.fixture(scope="module")
def single_device(params, requests):
    return _serve(params, requests)


@pytest.mark.parametrize("tp", [2, 4])
def test_tokens_equal_single_device(params, requests, single_device, tp):
    want, base = single_device
    out, engine = _serve(params, requests, tp_mesh(tp))
    assert out == want
    assert engine.stats.preemptions == base.stats.preemptions > 0  # same schedule, preemptions hit
    # The engine really ran sharded: weights Megatron-style, caches on their KV-heads axis.
    layer = engine.params["layers"][0]
    assert layer["wq"].sharding.spec == P(None, "tp") and layer["wo"].sharding.spec == P("tp", None)
    assert layer["w_up"].sharding.spec == P(None, "tp") and layer["w_down"].sharding.spec == P("tp", None)
    assert engine.params["embed"].sharding.is_fully_replicated
    for k, v in engine.kv_caches:
        assert k.sharding.spec[1] == v.sharding.spec[1] == "tp"
        assert k.addressable_shards[0].data.shape[1] == CFG.num_kv_heads // tp


def test_fp8_cache_tokens_equal_single_device(params, requests):
    """fp8 caches with per-KV-head scales, split with the KV heads over 2 devices: the same
    tokens (and the same schedule, preemptions included) as on one device."""
    scales = [(np.linspace(0.5, 1.0, CFG.num_kv_heads, dtype=np.float32), np.float32(0.75))
              for _ in range(CFG.num_layers)]
    kwargs = dict(cache_dtype=jnp.float8_e4m3fn, kv_scales=scales)
    want, base = _serve(params, requests, **kwargs)
    out, engine = _serve(params, requests, tp_mesh(2), **kwargs)
    assert out == want and engine.stats.preemptions == base.stats.preemptions
    for k, v in engine.kv_caches:
        assert k.dtype == v.dtype == jnp.float8_e4m3fn and k.sharding.spec[1] == "tp"


def test_no_cache_collectives_and_donation_in_place(params):
    """The compiled decode loop (and prefill) on 4 devices: no collective of a cache-sized buffer
    (global or per-device shape), only the activation all-reduces after o_proj and down_proj;
    the caches are donated (no copy, input buffers consumed) and come back sharded as they went in."""
    mesh = tp_mesh(4)
    engine = Engine(CFG, params, EC, mesh=mesh)  # shards the weights, allocates sharded caches
    shapes = cache_shapes(engine)
    loop = make_decode_loop(CFG, EC, tensor_parallel=True)  # the engine's jitted loop
    args = (engine.params, engine.kv_caches, replicated_state(mesh), np.int32(4), np.int32(1))
    hlo = loop.lower(*args).compile().as_text()
    assert cache_sized(hlo, shapes) == []
    ops = [op for op, _, _ in collectives(hlo)]
    assert set(ops) == {"all-reduce"} and len(ops) == 2 * CFG.num_layers, ops
    assert cache_copies(hlo, shapes) == []

    old = engine.kv_caches
    caches, _, _ = loop(*args)
    assert all(c.is_deleted() for kv in old for c in kv)  # donated: updated in place
    assert all(c.sharding.spec == P(None, "tp") for kv in caches for c in kv)

    prefill_args = (engine.params, caches, np.zeros((4, 32), np.int32), np.zeros(4, np.int32),
                    np.full((4, 32), -1, np.int32))
    hlo = make_prefill(CFG, tensor_parallel=True).lower(*prefill_args).compile().as_text()
    assert cache_sized(hlo, shapes) == [] and cache_copies(hlo, shapes) == []
    assert {op for op, _, _ in collectives(hlo)} == {"all-reduce"}


def test_plain_ops_keep_caches_local_and_the_detector_sees_a_gather(params):
    """The top-level ops shard under plain jit: the decode loop built without the
    tensor-parallel switch keeps each device on its own KV heads too (no cache-sized
    collective). The check can fail: replicating one sharded cache is an all-gather it sees."""
    mesh = tp_mesh(4)
    engine = Engine(CFG, params, EC, mesh=mesh)
    loop = make_decode_loop(CFG, EC, tensor_parallel=False)
    hlo = loop.lower(engine.params, engine.kv_caches, replicated_state(mesh), np.int32(4),
                     np.int32(1)).compile().as_text()
    assert not cache_sized(hlo, cache_shapes(engine))
    gather = jax.jit(lambda c: c + 0, out_shardings=NamedSharding(mesh, P()))
    hlo = gather.lower(engine.kv_caches[0][0]).compile().as_text()
    assert cache_sized(hlo, cache_shapes(engine))


def test_uneven_sizes_raise(params):
    tiny = LlamaConfig.preset("tiny")  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match=r"multiple of 4; num_kv_heads \(2\) is not"):
        Engine(tiny, init_params(tiny, seed=0), EC, mesh=tp_mesh(4))
    with pytest.raises(ValueError, match=r"multiple of 3; num_heads \(4\), num_kv_heads \(2\), "
                                         r"intermediate_size \(128\) are not"):
        Engine(tiny, init_params(tiny, seed=0), EC, mesh=tp_mesh(3))
    with pytest.raises(ValueError, match=r"multiple of 4; intermediate_size \(130\) is not"):
        check_tensor_parallel(LlamaConfig.preset("tiny", num_heads=8, num_kv_heads=4,
                                                 intermediate_size=130), 4)
    check_tensor_parallel(CFG, 4)  # 8 heads, 4 KV heads, 128: fine
    with pytest.raises(ValueError, match="axis named 'tp'"):
        Engine(CFG, params, EC, mesh=Mesh(np.array(jax.devices("cpu")[:2]), ("model",)))
