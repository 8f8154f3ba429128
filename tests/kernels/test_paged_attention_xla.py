"""Pure-XLA paged attention against a dense float64 numpy reference.

Every case builds the paged cache the way the engine does (page 0 is the null
page, a sequence's pages are a shuffled, non-contiguous set of ids, unused
page-table columns point at page 0 or at a page nobody owns) and poisons it:
page 0, every unowned page and every slot past a sequence's length hold NaN.
Real rows must then match the reference and be finite; padding rows and
padding tokens must be exactly 0.

Shapes are fixed per test (hypothesis varies values, lengths, permutations
and windows only), and each jitted function is built once per static config,
so the file compiles a bounded number of programs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas.paged_attention_xla import (
    paged_decode_attention_xla,
    write_kv_pages,
)
from tests.support.paged_attention_harness import (
    _TRACED,
    LENGTHS,
    NUM_LAYERS,
    NUM_PAGES,
    PS,
    SCALE,
    SETTINGS,
    SLOTS,
    STATIC_LAYER,
    WINDOWS,
    D,
    L,
    P,
    PagedCache,
    S,
    T,
    _i32,
    _round,
    check_close,
    decode_fn,
    prefill_batches,
    prefill_fn,
    ref_attention,
    run_prefill,
    write_fn,
)

# --------------------------------------------------------------------------
# reference and cache construction


# --------------------------------------------------------------------------
# jitted entry points, one per static config


# --------------------------------------------------------------------------
# decode


def run_decode(rng, lengths, num_heads, kv_heads, dtype, *, window, soft_cap, static_window=_TRACED,
               q_std=2.0):
    """Runs decode on a fresh poisoned cache and checks it against the reference."""
    lengths = np.asarray(lengths, np.int32)
    cache = PagedCache(rng, np.maximum(lengths, 1), kv_heads, dtype)
    table = cache.page_table.copy()
    table[lengths == 0] = 0  # padding slots point at the null page
    q = _round(q_std * rng.standard_normal((len(lengths), num_heads, D)), dtype)
    fn = decode_fn(static_window, soft_cap)
    w = 0 if window is None else window
    out = fn(jnp.asarray(q, dtype), cache.k_pages, cache.v_pages, _i32(lengths), _i32(table), _i32(w), None)
    assert out.shape == q.shape and out.dtype == dtype
    real = np.flatnonzero(lengths > 0)
    if len(real):
        ref = np.stack([
            ref_attention(q[s:s + 1], cache.k[s][: lengths[s]], cache.v[s][: lengths[s]], [lengths[s] - 1],
                          window=window, soft_cap=soft_cap)[0]
            for s in real])
        check_close(out, ref, dtype, rows=real)
    pad = np.asarray(out)[lengths == 0]
    assert np.all(pad == 0)
    return out, cache, q, table


DECODE_CONFIGS = [
    pytest.param(4, 1, None, id="mqa"),
    pytest.param(8, 2, None, id="gqa"),
    pytest.param(8, 2, 5.0, id="gqa-softcap"),
]


@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", DECODE_CONFIGS)
def test_decode_edge_lengths(num_heads, kv_heads, soft_cap):
    """Length 1, exactly one page, a page plus one, and the full page table, in one batch."""
    run_decode(np.random.default_rng(0), [1, PS, PS + 1, L], num_heads, kv_heads, jnp.float32,
               window=None, soft_cap=soft_cap)


@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", DECODE_CONFIGS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.one_of(st.just(0), LENGTHS), min_size=SLOTS,
                                                          max_size=SLOTS),
       window=st.one_of(st.none(), WINDOWS))
def test_decode_matches_reference(num_heads, kv_heads, soft_cap, seed, lengths, window):
    run_decode(np.random.default_rng(seed), lengths, num_heads, kv_heads, jnp.float32,
               window=window, soft_cap=soft_cap)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(LENGTHS, min_size=SLOTS, max_size=SLOTS),
       window=st.one_of(st.none(), WINDOWS))
def test_decode_bfloat16(seed, lengths, window):
    run_decode(np.random.default_rng(seed), lengths, 8, 2, jnp.bfloat16, window=window, soft_cap=None)


@pytest.mark.parametrize("window", [3, PS + 1, 100])
def test_decode_static_int_window_matches_traced(window):
    """A python-int window (shorter and longer than the sequences) equals the traced int32 scalar,
    to float32 rounding: the static window lets XLA skip pages and order the sums otherwise
    (CI's CPU differed by 4e-7 from the traced form where this VM's matched to the bit)."""
    lengths = [1, PS + 1, 2 * PS + 3, L]
    out, cache, q, table = run_decode(np.random.default_rng(window), lengths, 8, 2, jnp.float32,
                                      window=window, soft_cap=None, static_window=window)
    traced = decode_fn()(jnp.asarray(q, jnp.float32), cache.k_pages, cache.v_pages, _i32(lengths),
                         _i32(table), _i32(window), None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(traced), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("layer_kind", ["int", _TRACED])
@settings(SETTINGS, max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.one_of(st.just(0), LENGTHS), min_size=SLOTS,
                                                          max_size=SLOTS),
       window=WINDOWS, layer=st.integers(0, NUM_LAYERS - 1))
def test_decode_stacked_layer(layer_kind, seed, lengths, window, layer):
    """layer= over the stacked cache equals passing that layer's pages (other layers NaN/noise)."""
    rng = np.random.default_rng(seed)
    out, cache, q, table = run_decode(rng, lengths, 8, 2, jnp.float32, window=window, soft_cap=None)
    if layer_kind == "int":
        layer = STATIC_LAYER  # a python int is baked into the program: one value, one compile
    kst, vst = cache.stacked(rng, layer)
    fn = decode_fn(_TRACED, None, _TRACED if layer_kind == _TRACED else layer)
    got = fn(jnp.asarray(q, jnp.float32), kst, vst, _i32(lengths), _i32(table), _i32(window), _i32(layer))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(out))


# --------------------------------------------------------------------------
# prefill


PREFILL_CONFIGS = [
    pytest.param(4, 1, None, id="mqa"),
    pytest.param(8, 2, 5.0, id="gqa-softcap"),
]


@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", PREFILL_CONFIGS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), batch=prefill_batches(), window=st.one_of(st.none(), WINDOWS))
def test_prefill_matches_reference(num_heads, kv_heads, soft_cap, seed, batch, window):
    num_seqs, q_lens, kv_lens = batch
    run_prefill(np.random.default_rng(seed), num_seqs, q_lens, kv_lens, num_heads, kv_heads, jnp.float32,
                window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", PREFILL_CONFIGS)
def test_prefill_fixed_cases(num_heads, kv_heads, soft_cap):
    """A chunk at position 0, one mid-sequence, one ending exactly on a page, then padding."""
    rng = np.random.default_rng(1)
    # seq0: positions 0..4 (one page + 1); seq1: 8..13 of 14; seq2: 3..3 (single token, end of page 0)
    run_prefill(rng, 3, [5, 6, 1], [5, 14, 4], num_heads, kv_heads, jnp.float32, window=None,
                soft_cap=soft_cap)
    run_prefill(rng, 3, [5, 6, 1], [5, 14, 4], num_heads, kv_heads, jnp.float32, window=3,
                soft_cap=soft_cap)
    # A single sequence filling the whole table, the chunk covering its second half.
    run_prefill(rng, 1, [L // 2], [L], num_heads, kv_heads, jnp.float32, window=None, soft_cap=soft_cap)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), batch=prefill_batches(), window=st.one_of(st.none(), WINDOWS))
def test_prefill_bfloat16(seed, batch, window):
    num_seqs, q_lens, kv_lens = batch
    run_prefill(np.random.default_rng(seed), num_seqs, q_lens, kv_lens, 8, 2, jnp.bfloat16,
                window=window, soft_cap=None)


@pytest.mark.parametrize("window", [2, 100])
def test_prefill_static_int_window_matches_traced(window):
    rng = np.random.default_rng(window)
    out, cache, q, cu, kv, table = run_prefill(rng, 3, [5, 6, 1], [5, 14, 4], 8, 2, jnp.float32,
                                               window=window, soft_cap=None, static_window=window)
    traced = prefill_fn()(jnp.asarray(q), cache.k_pages, cache.v_pages, _i32(cu), _i32(kv), _i32(table),
                          _i32(3), _i32(window), None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(traced), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("layer_kind", ["int", _TRACED])
@settings(SETTINGS, max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), batch=prefill_batches(), window=WINDOWS,
       layer=st.integers(0, NUM_LAYERS - 1))
def test_prefill_stacked_layer(layer_kind, seed, batch, window, layer):
    num_seqs, q_lens, kv_lens = batch
    rng = np.random.default_rng(seed)
    out, cache, q, cu, kv, table = run_prefill(rng, num_seqs, q_lens, kv_lens, 8, 2, jnp.float32,
                                               window=window, soft_cap=None)
    if layer_kind == "int":
        layer = STATIC_LAYER
    kst, vst = cache.stacked(rng, layer)
    fn = prefill_fn(_TRACED, None, _TRACED if layer_kind == _TRACED else layer)
    got = fn(jnp.asarray(q), kst, vst, _i32(cu), _i32(kv), _i32(table), _i32(num_seqs), _i32(window),
             _i32(layer))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(out))


def test_chunked_prefill_through_write_kv_pages():
    """Chunks written with write_kv_pages then attended equal full-sequence attention.

    Two sequences are prefilled in two steps; the second step's chunks start
    mid-sequence and read the first step's K/V from the pages.
    """
    rng = np.random.default_rng(7)
    num_heads, kv_heads = 8, 2
    total = [13, 9]
    splits = [6, 4]  # first chunk lengths
    pages = rng.permutation(np.arange(1, NUM_PAGES))[: 2 * P].reshape(2, P)
    table = np.zeros((S, P), np.int32)
    for s in range(2):
        table[s, : -(-total[s] // PS)] = pages[s, : -(-total[s] // PS)]
    q_full = [rng.standard_normal((n, num_heads, D)) for n in total]
    k_full = [rng.standard_normal((n, kv_heads, D)) for n in total]
    v_full = [rng.standard_normal((n, kv_heads, D)) for n in total]
    kp = jnp.full((kv_heads, NUM_PAGES, PS, D), jnp.nan, jnp.float32)
    vp = jnp.full((kv_heads, NUM_PAGES, PS, D), jnp.nan, jnp.float32)
    got = [[], []]
    for step in range(2):
        lo = [0 if step == 0 else splits[s] for s in range(2)]
        hi = [splits[s] if step == 0 else total[s] for s in range(2)]
        q = np.zeros((T, num_heads, D))
        k = np.zeros((T, kv_heads, D))
        v = np.zeros((T, kv_heads, D))
        slots = np.zeros(T, np.int32)  # padding tokens write into the null page
        cu = [0]
        for s in range(2):
            o, n = cu[-1], hi[s] - lo[s]
            pos = np.arange(lo[s], hi[s])
            q[o:o + n], k[o:o + n], v[o:o + n] = q_full[s][pos], k_full[s][pos], v_full[s][pos]
            slots[o:o + n] = table[s, pos // PS] * PS + pos % PS
            cu.append(o + n)
        cu = np.array(cu + [cu[-1]] * (S - 2), np.int32)
        kv = np.array(hi + [0] * (S - 2), np.int32)
        kp, vp = write_fn()(kp, vp, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), _i32(slots), None)
        out = np.asarray(prefill_fn()(jnp.asarray(q, jnp.float32), kp, vp, _i32(cu), _i32(kv), _i32(table),
                                      _i32(2), _i32(0), None))
        for s in range(2):
            got[s].append(out[cu[s]:cu[s + 1]])
        assert np.all(out[cu[2]:] == 0)
    for s in range(2):
        q64 = _round(q_full[s], jnp.float32)
        ref = ref_attention(q64, _round(k_full[s], jnp.float32), _round(v_full[s], jnp.float32),
                            np.arange(total[s]), window=None, soft_cap=None)
        check_close(np.concatenate(got[s]), ref, jnp.float32)


# --------------------------------------------------------------------------
# write_kv_pages

W_TOKENS = 12


def _bits(x):
    """Bit pattern of a float array (so NaN == NaN and -0.0 != 0.0)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("layer_kind", [None, "int", _TRACED])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@settings(SETTINGS, max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), n_real=st.integers(0, W_TOKENS), layer=st.integers(0, NUM_LAYERS - 1))
def test_write_kv_pages(layer_kind, dtype, seed, n_real, layer):
    """Rows land exactly at slot_mapping; every other slot (all pages but the null page) is untouched."""
    rng = np.random.default_rng(seed)
    if layer_kind == "int":
        layer = STATIC_LAYER
    kv_heads = 2
    shape = (kv_heads, NUM_PAGES, PS, D)
    if layer_kind is not None:
        shape = (NUM_LAYERS,) + shape
    base_k = rng.standard_normal(shape).astype(np.float32)
    base_k[..., ::5, :, :] = np.nan  # some pages hold garbage: they must stay bit-identical
    base_v = rng.standard_normal(shape).astype(np.float32)
    kp0 = np.asarray(jnp.asarray(base_k, dtype))
    vp0 = np.asarray(jnp.asarray(base_v, dtype))
    # Distinct real slots outside the null page, in random order; padding tokens -> slot 0.
    real_slots = rng.choice(np.arange(PS, NUM_PAGES * PS), size=n_real, replace=False)
    slots = np.zeros(W_TOKENS, np.int32)
    idx = rng.permutation(W_TOKENS)[:n_real]  # real tokens need not be contiguous for the writer
    slots[idx] = real_slots
    k = np.asarray(jnp.asarray(rng.standard_normal((W_TOKENS, kv_heads, D)), dtype))
    v = np.asarray(jnp.asarray(rng.standard_normal((W_TOKENS, kv_heads, D)), dtype))

    fn = write_fn(_TRACED if layer_kind == _TRACED else (layer if layer_kind == "int" else None))
    kp, vp = fn(jnp.asarray(kp0), jnp.asarray(vp0), jnp.asarray(k), jnp.asarray(v), _i32(slots), _i32(layer))
    kp, vp = np.asarray(kp), np.asarray(vp)
    assert kp.dtype == kp0.dtype and kp.shape == kp0.shape

    exp_k, exp_v = kp0.copy(), vp0.copy()
    sel_k = exp_k[layer] if layer_kind is not None else exp_k
    sel_v = exp_v[layer] if layer_kind is not None else exp_v
    for t in idx:
        sel_k[:, slots[t] // PS, slots[t] % PS] = k[t]
        sel_v[:, slots[t] // PS, slots[t] % PS] = v[t]
    # Page 0 (the null page) takes the padding writes in unspecified order: exclude it.
    np.testing.assert_array_equal(_bits(kp[..., 1:, :, :]), _bits(exp_k[..., 1:, :, :]))
    np.testing.assert_array_equal(_bits(vp[..., 1:, :, :]), _bits(exp_v[..., 1:, :, :]))
    if layer_kind is not None:  # other layers' null pages are untouched too
        others = [i for i in range(NUM_LAYERS) if i != layer]
        np.testing.assert_array_equal(_bits(kp[others]), _bits(exp_k[others]))
        np.testing.assert_array_equal(_bits(vp[others]), _bits(exp_v[others]))


def test_bf16_stored_as_uint16_bits_behaves_like_bf16():
    """kernels_pallas.kv_storage: a uint16 cache (bf16 bits, the XLA:CPU layout) writes and reads
    exactly like a bfloat16 one."""
    from kernels_pallas.kv_storage import from_storage, logical_dtype, storage_dtype

    assert storage_dtype(jnp.bfloat16, "cpu") == jnp.uint16
    assert storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert storage_dtype(jnp.float32, "cpu") == jnp.float32
    assert logical_dtype(jnp.uint16) == jnp.bfloat16
    rng = np.random.default_rng(7)
    k = jnp.asarray(rng.standard_normal((5, 2, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((5, 2, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, D)), jnp.bfloat16)
    table = jnp.asarray([[1, 2, 3, 0, 0, 0], [2, 3, 0, 0, 0, 0]], jnp.int32)
    slots = jnp.asarray([PS + 1, 2 * PS, 2 * PS + 1, 3 * PS + 2, 0], jnp.int32)
    results = []
    for stored in (jnp.bfloat16, jnp.uint16):
        kp = jnp.zeros((NUM_LAYERS, 2, NUM_PAGES, PS, D), stored)
        vp = jnp.zeros((NUM_LAYERS, 2, NUM_PAGES, PS, D), stored)
        kp, vp = write_kv_pages(kp, vp, k, v, slots, layer=1)
        assert kp.dtype == stored
        out = paged_decode_attention_xla(q, kp, vp, jnp.asarray([3, 7], jnp.int32), table, scale=SCALE,
                                         layer=1)
        results.append((np.asarray(from_storage(kp).astype(jnp.float32)), np.asarray(out.astype(jnp.float32))))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
