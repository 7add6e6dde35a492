"""The jnp reference's features (ALiBi, soft cap, sliding window, LSE, multi-token
queries) against an independent float64 oracle."""
from __future__ import annotations

import numpy as np
import pytest

from jax_paged import reference
from feature_helpers import make_inputs, oracle


@pytest.mark.parametrize("impl", ["v1", "v2"])
@pytest.mark.parametrize("q_len", [None, 3])
def test_reference_features_match_oracle(impl, q_len):
    rng = np.random.default_rng(0)
    lens = [0, 1, 2, 16, 45, 70, 130]
    inp = make_inputs(rng, lens, 6, 2, 32, 16, np.float32, q_len=q_len, poison=True)
    slopes = rng.random(6).astype(np.float32)
    for window in (None, 1, 20, 64):
        for soft_cap in (None, 2.0):
            out, lse = reference.paged_attention(
                *inp.args(), scale=0.3, alibi_slopes=slopes, impl=impl, partition_size=32,
                soft_cap=soft_cap, sliding_window=window, return_lse=True)
            want, want_lse = oracle(inp.query, inp.keys, inp.values, 0.3, slopes=slopes,
                                    soft_cap=soft_cap, window=window)
            np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)
            # lse = max + log(sum + 1e-6): within 1e-6 relative of the true value.
            np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=1e-5)
