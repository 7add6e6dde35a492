"""jax.export of a jitted decode step using the ops: export with
jax_paged.export_safety_checks(), serialise, then deserialise and call in a fresh
process that imports jax_paged (which registers the FFI targets); the result equals
the direct call."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import jax
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_paged
from paged_inputs import make_paged_inputs

try:
    import flatbuffers  # noqa: F401  (jax.export's serialisation needs it)
    HAS_FLATBUFFERS = True
except ImportError:
    HAS_FLATBUFFERS = False
needs_flatbuffers = pytest.mark.skipif(
    not HAS_FLATBUFFERS, reason="jax.export serialisation needs the 'flatbuffers' package")

LOADER = textwrap.dedent("""
    import sys
    import numpy as np
    import jax
    import jax_paged  # registers the FFI targets the export calls
    data = np.load(sys.argv[1])
    with open(sys.argv[2], "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    args = [data[f"arg{i}"] for i in range(len(data.files))]
    call = exported.call
    if exported.nr_devices > 1:  # a sharded export runs on a mesh with its axis names
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:exported.nr_devices]), (sys.argv[4],))
        call = jax.jit(call, in_shardings=exported.in_shardings_jax(mesh))
    outs = call(*args)
    np.savez(sys.argv[3], *[np.asarray(o) for o in jax.tree_util.tree_leaves(outs)])
""")


def decode_step(query, key, value, key_cache, value_cache, block_tables, seq_lens, slots):
    key_cache, value_cache = jax_paged.reshape_and_cache(key, value, key_cache, value_cache,
                                                         slots)
    out, lse = jax_paged.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         soft_cap=20.0, return_lse=True)
    return out, lse, key_cache, value_cache


def step_inputs(seed=0):
    rng = np.random.default_rng(seed)
    inp = make_paged_inputs(rng, [6, 40, 17], 8, 4, 64, 16, np.float32, poison=False)
    slots = np.array([5, 16 * int(inp.block_tables[1, 2]) + 7, 16 * int(inp.block_tables[2, 1])],
                     np.int32)
    key = rng.standard_normal((3, 4, 64)).astype(np.float32)
    value = rng.standard_normal((3, 4, 64)).astype(np.float32)
    return (inp.query, key, value, inp.key_cache, inp.value_cache, inp.block_tables,
            inp.seq_lens, slots)


def load_and_call(tmp_path, blob, args, extra_env=None, axis="tp"):
    """Deserialises and calls ``blob`` in a fresh Python process; returns its outputs."""
    data, blob_file, out_file = (tmp_path / n for n in ("args.npz", "step.bin", "out.npz"))
    np.savez(data, **{f"arg{i}": np.asarray(a) for i, a in enumerate(args)})
    blob_file.write_bytes(blob)
    env = dict(os.environ, **(extra_env or {}))
    subprocess.run([sys.executable, "-c", LOADER, str(data), str(blob_file), str(out_file), axis],
                   check=True, env=env, timeout=300)
    with np.load(out_file) as result:
        return [result[f"arr_{i}"] for i in range(len(result.files))]


def test_export_refuses_without_the_safety_checks():
    with pytest.raises(ValueError, match="jax_paged_"):
        export.export(jax.jit(decode_step))(*step_inputs())


def test_safety_checks_name_every_target():
    names = {str(check) for check in jax_paged.export_safety_checks()}
    for target in ("jax_paged_attention_v1", "jax_paged_attention_v2",
                   "jax_paged_attention_grouped", "jax_paged_reshape_and_cache",
                   "jax_paged_copy_blocks"):
        assert any(target in name for name in names), target


@needs_flatbuffers
def test_exported_step_round_trips_in_a_fresh_process(tmp_path):
    args = step_inputs()
    exported = export.export(jax.jit(decode_step),
                             disabled_checks=jax_paged.export_safety_checks())(*args)
    text = exported.mlir_module()
    assert "jax_paged_attention" in text and "jax_paged_reshape_and_cache" in text
    outs = load_and_call(tmp_path, exported.serialize(), args)
    direct = jax.tree_util.tree_leaves(jax.jit(decode_step)(*args))
    assert len(outs) == len(direct) == 4
    for got, want in zip(outs, direct):
        np.testing.assert_array_equal(got, np.asarray(want))


@needs_flatbuffers
@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_exported_sharded_step_with_shard_map(tmp_path):
    """A step sharded over heads exports through shard_map (inside it the ops are the
    plain kernels); the loader runs it on 4 devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    heads = P(None, "tp")
    specs = (heads, heads, heads, heads, heads, P(), P(), P())
    step = jax.jit(jax.shard_map(decode_step, mesh=mesh, in_specs=specs,
                                 out_specs=(heads, heads, heads, heads)))
    args = step_inputs(1)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    exported = export.export(step, disabled_checks=jax_paged.export_safety_checks())(*placed)
    assert exported.nr_devices == 4
    flags = os.environ.get("XLA_FLAGS", "")
    outs = load_and_call(tmp_path, exported.serialize(), args,
                         {"XLA_FLAGS": flags} if "device_count" in flags else None)
    for got, want in zip(outs, jax.tree_util.tree_leaves(step(*placed))):
        np.testing.assert_array_equal(got, np.asarray(want))
