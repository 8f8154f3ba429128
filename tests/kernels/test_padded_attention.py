"""The padded (encoder) attention against a numpy reference: causal and bidirectional masks,
sliding windows (EmbeddingGemma's symmetric one), grouped-query heads, padding that never leaks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.padded_attention_xla import padded_attention_xla


def reference(q, k, v, lengths, scale, causal, window):
    """Per row, per head, a dense softmax over the keys the rule lets each query see."""
    B, S, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        L = lengths[b]
        for n in range(N):
            for i in range(L):
                if causal:
                    seen = [j for j in range(i + 1) if window <= 0 or i - j < window]
                else:
                    seen = [j for j in range(L) if window <= 0 or abs(i - j) <= window // 2]
                s = np.array([q[b, i, n] @ k[b, j, n // G] for j in seen]) * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, n] = p @ v[b, seen, n // G]
    return out


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 3), (False, 0), (False, 4), (False, 5)])
def test_matches_reference_and_ignores_padding(causal, window):
    rng = np.random.default_rng(0)
    B, S, N, K, H = 3, 9, 4, 2, 8
    q = rng.standard_normal((B, S, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    lengths = np.array([9, 5, 1], np.int32)
    # Garbage (NaN) in the padding must not reach a real query.
    for b, L in enumerate(lengths):
        k[b, L:] = np.nan
        v[b, L:] = np.nan
    got = np.asarray(padded_attention_xla(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                          scale=0.3, causal=causal,
                                          sliding_window=jnp.int32(window) if window else None))
    want = reference(q, k, v, lengths, 0.3, causal, window)
    for b, L in enumerate(lengths):
        np.testing.assert_allclose(got[b, :L], want[b, :L], rtol=1e-5, atol=1e-5)


def test_bidirectional_differs_from_causal_and_window_sees_both_sides():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 4)), jnp.float32) for _ in range(3))
    lengths = jnp.asarray([6], jnp.int32)
    causal = padded_attention_xla(q, k, v, lengths, scale=1.0, causal=True)
    bidir = padded_attention_xla(q, k, v, lengths, scale=1.0, causal=False)
    # The last query sees every key either way; the first sees only itself when causal.
    np.testing.assert_allclose(causal[0, -1], bidir[0, -1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(causal[0, 0], bidir[0, 0])
    np.testing.assert_allclose(causal[0, 0], v[0, 0], rtol=1e-6)
    # Window 2 bidirectional: query 0 sees keys 0 and 1 (|i - j| <= 1), not 2.
    w2 = padded_attention_xla(q, k, v, lengths, scale=1.0, causal=False, sliding_window=2)
    k2 = k.at[0, 2:].set(100.0)
    np.testing.assert_allclose(w2[0, 0], padded_attention_xla(q, k2, v, lengths, scale=1.0, causal=False,
                                                              sliding_window=2)[0, 0], rtol=1e-6)


def test_rejects_mismatched_heads():
    q = jnp.zeros((1, 2, 3, 4))
    kv = jnp.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="multiple"):
        padded_attention_xla(q, kv, kv, jnp.asarray([2]), scale=1.0)
