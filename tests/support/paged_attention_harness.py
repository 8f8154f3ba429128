"""The paged-attention test harness the XLA, Pallas and prefill-packing tests share: shapes, a
dense float64 reference, a poisoned paged cache built as the engine builds it, and the jitted
XLA entry points."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kernels_pallas.paged_attention_xla import (
    paged_decode_attention_xla,
    paged_prefill_attention_xla,
    write_kv_pages,
)

PS = 4  # page_size


D = 32  # head_dim


P = 6  # page-table width (pages per sequence)


L = P * PS  # longest sequence the table covers


NUM_PAGES = 32  # page 0 + 31 real pages: 4 sequences x 6 pages leave 7 unowned


SCALE = D**-0.5


SLOTS = 4  # decode rows


T = 16  # prefill token bucket


S = 4  # prefill max_seqs


NUM_LAYERS = 3


STATIC_LAYER = 1  # the layer used when it is passed as a python int


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Windows shorter and longer than the sequence, and the "unlimited" spellings.
WINDOWS = st.one_of(st.sampled_from([0, -1, 1, 2, PS, PS + 1, L, 100]), st.integers(1, L + 2))


LENGTHS = st.one_of(st.sampled_from([1, PS, PS + 1, L]), st.integers(1, L))


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded to dtype, returned as float64 (what the kernel actually sees)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def ref_attention(q, k, v, q_positions, *, window, soft_cap, scale=SCALE):
    """Dense attention of one sequence, float64.

    q: [n, H, D]; k, v: [kv_len, KV, D] (the sequence's keys in order); q_positions: [n].
    """
    n, num_heads, _ = q.shape
    kv_len, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    kh = np.arange(num_heads) // group
    out = np.zeros(q.shape, np.float64)
    j = np.arange(kv_len)
    for t in range(n):
        i = q_positions[t]
        mask = (j <= i) & (j < kv_len)
        if window is not None and window > 0:
            mask &= i - j < window
        assert mask.any()
        for h in range(num_heads):
            s = (k[mask, kh[h]] @ q[t, h]) * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ v[mask, kh[h]]
    return out


class PagedCache:
    """Dense per-sequence K/V scattered into NaN-poisoned pages with a shuffled page table."""

    def __init__(self, rng: np.random.Generator, kv_lens, kv_heads: int, dtype, *, fill_unused="mixed"):
        rows = len(kv_lens)
        assert rows * P <= NUM_PAGES - 1
        self.kv_lens = np.asarray(kv_lens, np.int32)
        perm = rng.permutation(np.arange(1, NUM_PAGES))  # page 0 never holds real data
        owned = perm[: rows * P].reshape(rows, P)
        unowned = perm[rows * P:]
        kp = np.full((kv_heads, NUM_PAGES, PS, D), np.nan, np.float32)
        vp = np.full((kv_heads, NUM_PAGES, PS, D), np.nan, np.float32)
        table = np.zeros((rows, P), np.int32)
        self.k, self.v = [], []
        for s, n in enumerate(self.kv_lens):
            k = _round(rng.standard_normal((n, kv_heads, D)), dtype)
            v = _round(rng.standard_normal((n, kv_heads, D)), dtype)
            self.k.append(k)
            self.v.append(v)
            used = -(-int(n) // PS)
            table[s, :used] = owned[s, :used]
            # Columns past the sequence: the null page or a page nobody owns (both NaN).
            for c in range(used, P):
                if fill_unused == "mixed" and rng.random() < 0.5 and len(unowned):
                    table[s, c] = rng.choice(unowned)
            for t in range(n):
                kp[:, table[s, t // PS], t % PS] = k[t].astype(np.float32)
                vp[:, table[s, t // PS], t % PS] = v[t].astype(np.float32)
        self.page_table = table
        self.k_pages = jnp.asarray(kp, dtype)
        self.v_pages = jnp.asarray(vp, dtype)

    def stacked(self, rng: np.random.Generator, layer: int):
        """This cache as layer `layer` of a [NUM_LAYERS, ...] stack whose other layers are NaN or noise."""
        def stack(pages):
            other = rng.standard_normal((NUM_LAYERS,) + pages.shape).astype(np.float32)
            other[::2] = np.nan
            return jnp.asarray(other, pages.dtype).at[layer].set(pages)
        return stack(self.k_pages), stack(self.v_pages)


def check_close(out, ref, dtype, rows=None):
    """float32: max abs err <= 1e-5 * max(1, scale); bfloat16: <= 2e-2 * max(1, scale)."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    if rows is not None:
        out = out[rows]
    assert np.isfinite(out).all()
    tol = (1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2) * max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(out - ref).max())
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


_TRACED = "traced"


@functools.lru_cache(maxsize=None)
def decode_fn(window=_TRACED, soft_cap=None, layer=None):
    """window/layer: a python value baked in statically, or _TRACED to take it as an argument."""
    def f(q, kp, vp, lengths, table, w, lay):
        return paged_decode_attention_xla(
            q, kp, vp, lengths, table, scale=SCALE, soft_cap=soft_cap,
            sliding_window=w if window == _TRACED else window,
            layer=lay if layer == _TRACED else layer)
    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def prefill_fn(window=_TRACED, soft_cap=None, layer=None):
    def f(q, kp, vp, cu, kv_lens, table, num_seqs, w, lay):
        return paged_prefill_attention_xla(
            q, kp, vp, cu, kv_lens, table, num_seqs, scale=SCALE, soft_cap=soft_cap,
            sliding_window=w if window == _TRACED else window,
            layer=lay if layer == _TRACED else layer)
    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def write_fn(layer=None):
    def f(kp, vp, k, v, slots, lay):
        return write_kv_pages(kp, vp, k, v, slots, layer=lay if layer == _TRACED else layer)
    return jax.jit(f)


def _i32(x):
    return jnp.asarray(x, jnp.int32)


@st.composite
def prefill_batches(draw):
    """(num_seqs, q_lens, kv_lens) for a ragged batch fitting T tokens and S rows, with padding."""
    num_seqs = draw(st.integers(1, S))
    q_lens, kv_lens = [], []
    budget = T
    for i in range(num_seqs):
        q_len = draw(st.integers(1, budget - (num_seqs - 1 - i)))
        q_len = min(q_len, L)
        budget -= q_len
        start = draw(st.one_of(st.just(0), st.integers(0, L - q_len)))  # 0: chunk starts the prompt
        q_lens.append(q_len)
        kv_lens.append(start + q_len)
    return num_seqs, q_lens, kv_lens


def run_prefill(rng, num_seqs, q_lens, kv_lens, num_heads, kv_heads, dtype, *, window, soft_cap,
                static_window=_TRACED, fn=None):
    """Runs prefill on a fresh poisoned cache and checks it; ``fn`` replaces the XLA entry point
    (same arguments as prefill_fn's), e.g. with the Pallas kernel."""
    cache = PagedCache(rng, kv_lens, kv_heads, dtype)
    table = np.zeros((S, P), np.int32)
    table[:num_seqs] = cache.page_table
    kv = np.zeros(S, np.int32)
    kv[:num_seqs] = kv_lens
    cu = np.full(S + 1, sum(q_lens), np.int32)  # padding rows: empty chunks at the end (as the engine)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    q = _round(2.0 * rng.standard_normal((T, num_heads, D)), dtype)  # padding tokens too: finite junk
    w = 0 if window is None else window
    fn = fn or prefill_fn(static_window, soft_cap)
    out = fn(jnp.asarray(q, dtype), cache.k_pages, cache.v_pages, _i32(cu), _i32(kv), _i32(table),
             _i32(num_seqs), _i32(w), None)
    assert out.shape == q.shape and out.dtype == dtype
    refs = []
    for s in range(num_seqs):
        pos = np.arange(kv_lens[s] - q_lens[s], kv_lens[s])
        refs.append(ref_attention(q[cu[s]:cu[s + 1]], cache.k[s], cache.v[s], pos, window=window,
                                  soft_cap=soft_cap))
    n_tok = cu[num_seqs]
    check_close(out, np.concatenate(refs), dtype, rows=np.arange(n_tok))
    assert np.all(np.asarray(out)[n_tok:] == 0)
    return out, cache, q, cu, kv, table
