"""The MoE layer (model/moe.py) against a per-token loop over the chosen experts, every impl."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import moe


@pytest.mark.parametrize("impl", moe.MOE_IMPLS)
def test_moe_matches_per_token_reference(impl):
    rng = np.random.default_rng(0)
    T, D, E, F, k = 13, 32, 8, 16, 2
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    p = {"router": jnp.asarray(rng.normal(size=(D, E)), jnp.float32),
         "w_gate": jnp.asarray(rng.normal(size=(E, D, F)) / 6, jnp.float32),
         "w_up": jnp.asarray(rng.normal(size=(E, D, F)) / 6, jnp.float32),
         "w_down": jnp.asarray(rng.normal(size=(E, F, D)) / 4, jnp.float32)}
    with jax.default_matmul_precision("highest"):
        w, e = moe.route(x, p["router"], k)
        assert np.allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)
        assert len(set(np.asarray(e)[:, 0].tolist())) > 2  # routing actually spreads
        ref = np.zeros((T, D), np.float32)
        for t in range(T):
            for j in range(k):
                ee = int(e[t, j])
                h = jax.nn.silu(x[t] @ p["w_gate"][ee]) * (x[t] @ p["w_up"][ee])
                ref[t] += float(w[t, j]) * np.asarray(h @ p["w_down"][ee])
        out = np.asarray(moe.moe_ffn(x, p, k=k, dtype=jnp.float32, impl=impl))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="moe impl"):
        moe.grouped_ffn(jnp.zeros((2, 4)), jnp.zeros(2, jnp.int32), jnp.zeros((2, 4, 3)),
                        jnp.zeros((2, 4, 3)), jnp.zeros((2, 3, 4)), jnp.float32, impl="dense")
