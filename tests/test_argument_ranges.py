"""Extreme values of every numeric argument: each call either raises a ValueError /
TypeError naming the argument or agrees with the reference; none crashes the process
(the fuzz loop runs in a subprocess, so a crash fails the test instead of the run).
The FFI handlers refuse values that would not fit their int32 fields."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_paged
from jax_paged import primitives

EXTREMES = [2 ** 31, 2 ** 31 - 16, 2 ** 32, 1e300, 1e-46, float("inf"), float("-inf"),
            float("nan"), -1, 0, 1e-30, 3.0]

FUZZ = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax, jax.numpy as jnp
    sys.path.insert(0, sys.argv[1])
    import jax_paged
    from jax_paged import reference
    from paged_inputs import make_paged_inputs

    extremes = json.loads(sys.argv[2])
    rng = np.random.default_rng(0)
    inp = make_paged_inputs(rng, [5, 40, 0], 4, 2, 64, 16, np.float32)
    fp8_k = jnp.asarray(np.nan_to_num(inp.key_cache).reshape(
        inp.key_cache.shape[0], 2, 4, 16, 16), jnp.float8_e4m3fn)
    fp8_v = jnp.asarray(np.nan_to_num(inp.value_cache), jnp.float8_e4m3fn)
    args = inp.args()
    fp8_args = (args[0], fp8_k, fp8_v) + args[3:]
    cases = []
    for value in extremes:
        for name in ("partition_size", "scale", "soft_cap", "sliding_window"):
            cases.append((name, value, args))
        for name in ("k_scale", "v_scale"):
            cases.append((name, value, fp8_args))
    for name, value, call_args in cases:
        for impl in ("v1", "v2", "grouped"):
            kw = {name: value}
            outcome = {"arg": name, "value": repr(value), "impl": impl}
            try:
                got = jax_paged.paged_attention(*call_args, impl=impl, return_lse=True, **kw)
                got = [np.asarray(g, np.float64) for g in got]
            except (ValueError, TypeError) as e:
                outcome["error"] = type(e).__name__ + ": " + str(e).split("\\n")[0]
                print(json.dumps(outcome), flush=True)
                continue
            want = reference.paged_attention(*call_args, impl=impl if impl == "v2" else "v1",
                                             return_lse=True, **kw)
            want = [np.asarray(w, np.float64) for w in want]
            worst = 0.0
            for g, w in zip(got, want):
                same_nan = np.isnan(g) == np.isnan(w)
                same_inf = np.where(np.isinf(w), g == w, True)
                finite = np.isfinite(w) & np.isfinite(g)
                scale = max(1.0, float(np.max(np.abs(w[finite]), initial=0.0)))
                diff = np.where(finite, np.abs(g - w), 0.0) / scale
                worst = max(worst, float(np.max(diff, initial=0.0)))
                if not (same_nan.all() and same_inf.all()):
                    worst = float("inf")
            outcome["worst"] = worst
            print(json.dumps(outcome), flush=True)
""")


def test_extreme_arguments_are_refused_by_name_or_agree_with_the_reference():
    tests_dir = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", FUZZ, tests_dir, json.dumps(EXTREMES)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (f"the fuzz process died ({proc.returncode}):\n"
                                  f"{proc.stderr[-3000:]}")
    outcomes = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(outcomes) == len(EXTREMES) * 6 * 3
    agreed = refused = 0
    for o in outcomes:
        where = f"{o['arg']}={o['value']} impl={o['impl']}"
        if "error" in o:
            assert o["arg"] in o["error"], f"{where}: the error does not name it: {o['error']}"
            refused += 1
        else:
            assert o["worst"] <= 1e-4, f"{where}: differs from the reference by {o['worst']}"
            agreed += 1
    assert agreed and refused  # both branches are exercised


@pytest.mark.parametrize("name,value,match", [
    ("partition_size", 2 ** 31, r"partition_size must be a positive multiple of block_size "
                                r"\(16\) below 2\^31"),
    ("partition_size", 16.0, r"partition_size must be a static Python int"),
    ("scale", 1e300, r"scale must be 0 or finite with magnitude in"),
    ("scale", 1e-46, r"scale must be 0 or finite with magnitude in"),
    ("soft_cap", 1e300, r"soft_cap must be positive and finite, in \[2\^-126, 2\^126\]"),
    ("soft_cap", 1e-46, r"soft_cap must be positive and finite, in \[2\^-126, 2\^126\]"),
    ("soft_cap", -1.0, r"soft_cap must be positive and finite"),
    ("sliding_window", 2 ** 31, r"sliding_window must be in \[1, 2\^31\)"),
])
def test_messages(name, value, match):
    q = jnp.zeros((1, 2, 64), jnp.float32)
    kc = jnp.zeros((2, 2, 16, 16, 4), jnp.float32)
    vc = jnp.zeros((2, 2, 64, 16), jnp.float32)
    args = (q, kc, vc, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises((ValueError, TypeError), match=match):
        jax_paged.paged_attention(*args, **{name: value})


def test_soft_cap_zero_is_off():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    kc = rng.standard_normal((2, 2, 16, 16, 4)).astype(np.float32)
    vc = rng.standard_normal((2, 2, 64, 16)).astype(np.float32)
    args = (q, kc, vc, np.array([[0, 1]], np.int32), np.array([20], np.int32))
    np.testing.assert_array_equal(np.asarray(jax_paged.paged_attention(*args, soft_cap=0)),
                                  np.asarray(jax_paged.paged_attention(*args)))


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), 1e300, 1e-46])
def test_host_fp8_scales_are_checked(value):
    """Host fp8 scales: a write divides by them (0 refused; a negative one round-trips
    with the same scale on read); a read multiplies (0 and negative allowed). NaN, inf,
    beyond float32 and denormal are refused on both sides, naming the argument."""
    k = jnp.zeros((1, 2, 64), jnp.float32)
    kc = jnp.zeros((2, 2, 4, 16, 16), jnp.float8_e4m3fn)
    vc = jnp.zeros((2, 2, 64, 16), jnp.float8_e4m3fn)
    write_ok = value == -1.0
    read_ok = value in (0.0, -1.0)
    write = lambda: jax_paged.reshape_and_cache(k, k, kc, vc, np.zeros(1, np.int32),  # noqa: E731
                                                k_scale=value)
    read = lambda: jax_paged.paged_attention(  # noqa: E731
        jnp.zeros((1, 2, 64), jnp.float32), kc, vc, np.zeros((1, 2), np.int32),
        np.ones(1, np.int32), v_scale=value)
    if write_ok:
        write()
    else:
        with pytest.raises(ValueError, match="k_scale must be nonzero and finite"):
            write()
    if read_ok:
        assert np.all(np.isfinite(np.asarray(read())))
    else:
        with pytest.raises(ValueError, match="v_scale must be finite"):
            read()


@pytest.mark.parametrize("attrs,match", [
    (dict(partition_size=2 ** 32), "partition_size must be a positive multiple"),
    (dict(partition_size=2 ** 31), "partition_size must be a positive multiple"),
    (dict(sliding_window=2 ** 40), "sliding_window must be in"),
    (dict(soft_cap=np.float32(1e38)), "soft_cap must be 0"),
    (dict(soft_cap=np.float32(-1.0)), "soft_cap must be 0"),
])
def test_ffi_handler_refuses_values_that_do_not_fit(attrs, match):
    """The handlers' own checks, for callers of the FFI targets that skip the Python
    layer: an error naming the attribute, not a narrowed value (2^32 would be 0)."""
    q = jnp.ones((1, 2, 64), jnp.float32)
    kc = jnp.ones((2, 2, 16, 16, 4), jnp.float32)
    vc = jnp.ones((2, 2, 64, 16), jnp.float32)
    none = jnp.zeros((0,), jnp.float32)
    full = dict(scale=0.125, soft_cap=0.0, sliding_window=0, partition_size=16)
    full.update(attrs)
    rows = (1, 1, 2, 2)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((0,), jnp.float32),
               jax.ShapeDtypeStruct(rows, jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
               jax.ShapeDtypeStruct(rows + (64,), jnp.float32))
    call = jax.ffi.ffi_call("jax_paged_attention_v2", results)
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(call(q, kc, vc, jnp.zeros((1, 2), jnp.int32),
                                   jnp.ones((1,), jnp.int32), none, none, none,
                                   **primitives.ffi_attrs(**full)))
