"""Decode attention's sliding-window gather: the same numbers as reading the whole page table.

``paged_decode_attention_xla`` reads only two aligned blocks of pages around a
sliding layer's window when that is narrower than the page table (a python-int
window, or a traced one with ``window_bound``). Checked here on tiny shapes:
against the float64 reference of tests/kernels/test_paged_attention_xla.py (soft cap,
padding slots, NaN in every page and position a slot does not own), and in
bfloat16 with the fixed-order softmax (the batch-invariant mode): bitwise equal
to the whole-table read, to a wider page-table bucket, to the same slot among
other neighbours, and to the prefill output of the same token. One case uses
Gemma 3 270M's attention shapes (window 512, page 16, head_dim 256, MQA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention_xla import (
    _window_span_tokens,
    paged_decode_attention_xla,
    paged_prefill_attention_xla,
)
from tests.support.paged_attention_harness import PS, SCALE, PagedCache, check_close, ref_attention

P = 6  # pages in the test cache's table (tests.kernels.test_paged_attention_xla)
WINDOW_BOUND = 5  # block 8 tokens (2 pages), span 16 tokens: narrower than the 24-token table


@functools.lru_cache(maxsize=None)
def decode_fn(*, bound=WINDOW_BOUND, soft_cap=None, ordered=False, static_window=None):
    """The decode attention jitted once per static config; the window is traced unless static."""
    def f(q, kp, vp, lengths, table, w):
        return paged_decode_attention_xla(
            q, kp, vp, lengths, table, scale=SCALE, soft_cap=soft_cap, ordered_sums=ordered,
            sliding_window=w if static_window is None else static_window, window_bound=bound)
    return jax.jit(f)


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def test_window_span_is_two_aligned_blocks_or_none():
    assert _window_span_tokens(512, 16, 2048) == 1024
    assert _window_span_tokens(500, 16, 4096) == 1024  # block: the next power of two
    assert _window_span_tokens(512, 16, 1024) is None  # no narrower than the table: whole table
    assert _window_span_tokens(5, 4, 24) == 16 and _window_span_tokens(2, 4, 24) == 8  # block >= a page
    assert _window_span_tokens(None, 16, 2048) is None and _window_span_tokens(0, 16, 2048) is None
    assert _window_span_tokens(4, 12, 480) is None  # block 16 is not a whole number of 12-token pages


@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 3, 5])
def test_window_gather_matches_reference_with_padding_and_nan_garbage(window, soft_cap):
    """4 slots (one a padding slot of length 0) in a NaN-poisoned cache: the traced window
    with its bound and the same window as a python int both match float64 attention; the
    padding slot outputs exactly 0."""
    rng = np.random.default_rng(window)
    lengths = np.asarray([0, 3, 13, P * PS], np.int32)
    cache = PagedCache(rng, np.maximum(lengths, 1), 2, jnp.float32)
    table = cache.page_table.copy()
    table[lengths == 0] = 0
    q = 2.0 * rng.standard_normal((4, 8, 32)).astype(np.float32)
    args = (jnp.asarray(q), cache.k_pages, cache.v_pages, _i32(lengths), _i32(table), _i32(window))
    traced = decode_fn(soft_cap=soft_cap)(*args)
    static = decode_fn(soft_cap=soft_cap, static_window=window)(*args)
    ref = np.stack([ref_attention(q[s:s + 1], cache.k[s][:n], cache.v[s][:n], [n - 1], window=window,
                                  soft_cap=soft_cap)[0] for s, n in enumerate(lengths) if n])
    for out in (traced, static):
        check_close(out, ref, jnp.float32, rows=np.flatnonzero(lengths))
        assert np.all(np.asarray(out)[0] == 0)
    # A global layer (window 0) under the same bound reads the whole table.
    out = decode_fn(soft_cap=soft_cap)(*args[:-1], _i32(0))
    ref = np.stack([ref_attention(q[s:s + 1], cache.k[s][:n], cache.v[s][:n], [n - 1], window=None,
                                  soft_cap=soft_cap)[0] for s, n in enumerate(lengths) if n])
    check_close(out, ref, jnp.float32, rows=np.flatnonzero(lengths))


def _bf16_case(rng, lengths, kv_heads=2, heads=8, d=32):
    cache = PagedCache(rng, lengths, kv_heads, jnp.bfloat16)
    q = jnp.asarray(2.0 * rng.standard_normal((len(lengths), heads, d)), jnp.bfloat16)
    return cache, q


def test_bf16_ordered_window_gather_is_bitwise_the_whole_table_any_bucket_any_neighbours():
    rng = np.random.default_rng(7)
    lengths = np.asarray([9, 17, 22, P * PS], np.int32)
    cache, q = _bf16_case(rng, lengths)
    args = (q, cache.k_pages, cache.v_pages, _i32(lengths))
    window = _i32(WINDOW_BOUND)
    windowed = np.asarray(decode_fn(ordered=True)(*args, _i32(cache.page_table), window))
    whole = np.asarray(decode_fn(bound=None, ordered=True)(*args, _i32(cache.page_table), window))
    assert np.array_equal(windowed, whole)
    # A bucket twice as wide (null-page columns on the right): the same bits.
    wide = np.pad(cache.page_table, ((0, 0), (0, P)))
    assert np.array_equal(np.asarray(decode_fn(ordered=True)(*args, _i32(wide), window)), windowed)
    # Slot 2 alone, its neighbours replaced by padding slots: the same bits.
    alone = lengths * (np.arange(4) == 2)
    table = cache.page_table * (np.arange(4) == 2)[:, None]
    out = decode_fn(ordered=True)(q, cache.k_pages, cache.v_pages, _i32(alone), _i32(table), window)
    assert np.array_equal(np.asarray(out)[2], windowed[2]) and np.all(np.asarray(out)[[0, 1, 3]] == 0)


def test_bf16_ordered_decode_equals_prefill_of_the_same_token():
    """The last token of each sequence: decode (window gather) and prefill of the whole
    sequence give bitwise the same attention output."""
    rng = np.random.default_rng(11)
    lengths = np.asarray([7, 21, P * PS], np.int32)
    cache, q_last = _bf16_case(rng, lengths)
    window = _i32(WINDOW_BOUND)
    decoded = np.asarray(decode_fn(ordered=True)(q_last, cache.k_pages, cache.v_pages, _i32(lengths),
                                                 _i32(cache.page_table), window))
    prefill = jax.jit(lambda q, kp, vp, cu, kv, t, w: paged_prefill_attention_xla(
        q, kp, vp, cu, kv, t, _i32(1), scale=SCALE, sliding_window=w, ordered_sums=True))
    for s, n in enumerate(lengths):
        q = jnp.asarray(2.0 * rng.standard_normal((32, 8, 32)), jnp.bfloat16).at[n - 1].set(q_last[s])
        out = prefill(q, cache.k_pages, cache.v_pages, _i32([0, n]), _i32([n]),
                      _i32(cache.page_table[s:s + 1]), window)
        assert np.array_equal(np.asarray(out)[n - 1], decoded[s]), f"sequence {s} (length {n})"


def test_bf16_ordered_window_gather_bitwise_at_gemma_shapes():
    """Window 512, 16-token pages, head_dim 256, 4 query heads on 1 KV head, a 2048-token table
    (the window path reads 1024 tokens): bitwise the whole-table read at lengths that put the
    window at every offset within its blocks, and close to the float32 computation."""
    rng = np.random.default_rng(3)
    ps, cols, d, slots = 16, 128, 256, 4
    lengths = np.asarray([1, 700, 1537, cols * ps], np.int32)
    num_pages = slots * cols + 1
    kp = jnp.asarray(rng.standard_normal((1, num_pages, ps, d)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((1, num_pages, ps, d)), jnp.bfloat16)
    table = _i32(1 + rng.permutation(slots * cols).reshape(slots, cols))
    q = jnp.asarray(rng.standard_normal((slots, 4, d)), jnp.bfloat16)

    def run(bound, dtype=jnp.bfloat16, ordered=True):
        return np.asarray(jax.jit(lambda *a: paged_decode_attention_xla(
            *a, scale=d**-0.5, sliding_window=_i32(512), ordered_sums=ordered, window_bound=bound))(
            q.astype(dtype), kp.astype(dtype), vp.astype(dtype), _i32(lengths), table).astype(jnp.float32))

    windowed = run(512)
    assert np.array_equal(windowed, run(None))
    # float32 keeps the probabilities unrounded, so a softmax sum in another order would show.
    assert np.array_equal(run(512, jnp.float32), run(None, jnp.float32))
    np.testing.assert_allclose(windowed, run(None, jnp.float32, ordered=False), atol=2e-2)
