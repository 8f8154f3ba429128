"""Quantized KV pages (int8, fp8): the quantizer, the KV write and every paged-attention path
(the XLA reference, the Pallas Triton-style and Mosaic kernels in interpret mode) against the
float64 reference of the unquantized K/V, within the format's tolerance, and against the
reference of the dequantized K/V to float32 precision (the kernels dequantize exactly).

Same poisoned caches and tiny shapes as tests/kernels/test_paged_attention_xla.py: NaN in the
null page, in unowned pages and past each length; the quantized pages carry the NaN into
their scale pages, which masking must keep out of the output.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kv_quant import QuantizedPages, dequantize, logical_kv_dtype, quantize
from kernels_pallas.paged_attention_tpu import paged_decode_attention_tpu, paged_prefill_attention_tpu
from kernels_pallas.paged_attention_xla import (
    paged_decode_attention_xla,
    paged_prefill_attention_xla,
    write_kv_pages,
)
from kernels_pallas.paged_decode_pallas import paged_decode_attention_pallas
from kernels_pallas.paged_prefill_pallas import paged_prefill_attention_pallas
from model.kv_cache import KVCache
from tests.support.paged_attention_harness import NUM_LAYERS, PS, SCALE, D, L, PagedCache, S, T, P, ref_attention

FORMATS = ["int8", "fp8"]
KERNELS = ["xla", "triton", "tpu"]
CASES = [(f, k) for f in FORMATS for k in KERNELS if not (f == "fp8" and k == "tpu")]  # (test time: fp8's
# dequantization is the same code in the Mosaic kernel as in the Triton one)
# Max abs error of an attention output against the unquantized reference, relative to
# max(1, |ref|): int8 keeps 1/254 of each vector's absmax, e4m3 3 mantissa bits (2^-4).
TOL = {"int8": 2e-2, "fp8": 1e-1}
LAYER = 1


def _quantized(pages: jax.Array, fmt: str, rng) -> QuantizedPages:
    """``pages`` (float32, [kv, N, PS, D]) as layer LAYER of a quantized stack whose other
    layers are noise or NaN, read in float32."""
    other = rng.standard_normal((NUM_LAYERS,) + pages.shape).astype(np.float32)
    other[::2] = np.nan
    data, scale = quantize(jnp.asarray(other).at[LAYER].set(pages), fmt)
    return QuantizedPages(data, scale, "float32")


def _dequantized_layer(pages: QuantizedPages) -> np.ndarray:
    return np.asarray(dequantize(pages.data[LAYER], pages.scale[LAYER]), np.float64)


def _bound(x: np.ndarray, fmt: str) -> np.ndarray:
    """The most a value of ``x`` [..., D] may move when quantized: half an int8 step of its
    vector's absmax; half an e4m3 ulp (2^-4 relative), or the subnormal step of its scale."""
    absmax = np.abs(x).max(-1, keepdims=True)
    if fmt == "int8":
        return absmax / 254 * (1 + 1e-5)
    return (np.abs(x) * 2.0**-4 + absmax / 448 * 2.0**-9) * (1 + 1e-5)


def _check(out, ref, tol, rows=None):
    out = np.asarray(out, np.float64)
    if rows is not None:
        out = out[rows]
    assert np.isfinite(out).all()
    err = float(np.abs(out - ref).max())
    assert err <= tol * max(1.0, float(np.abs(ref).max())), f"max abs error {err:.3g}"
    return err


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_roundtrip(fmt):
    """Per-vector absmax: int8 error <= absmax / 254, fp8 <= 2^-4 relative (plus the
    subnormal floor); a zero vector gets scale 0 and reads back as zeros."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 3, D)) * np.logspace(-3, 2, 64)[:, None, None],
                    jnp.float32).at[5, 1].set(0.0)
    data, scale = quantize(x, fmt)
    assert data.shape == x.shape and scale.shape == x.shape[:-1] and scale.dtype == jnp.float32
    assert data.dtype == (jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn)
    back = np.asarray(dequantize(data, scale), np.float64)
    x, absmax = np.asarray(x, np.float64), np.abs(np.asarray(x, np.float64)).max(-1, keepdims=True)
    assert (np.abs(back - x) <= _bound(x, fmt)).all()
    assert float(scale[5, 1]) == 0.0 and (back[5, 1] == 0).all()
    assert np.allclose(np.abs(back).max(-1), absmax[..., 0], rtol=1e-6)  # the absmax reads back exactly


@pytest.mark.parametrize("stacked", [False, True], ids=["layer", "stacked"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_pages(fmt, stacked):
    """Rows land quantized at their slots with their scales; other slots stay zero; the
    written values are those of bf16/f32 rows within the format's error."""
    rng = np.random.default_rng(1)
    kv, n_tok = 2, 7
    shape = ((NUM_LAYERS,) if stacked else ()) + (kv, 8, PS, D)
    kp, vp = QuantizedPages.zeros(shape, fmt, "float32"), QuantizedPages.zeros(shape, fmt, "float32")
    k = jnp.asarray(rng.standard_normal((n_tok, kv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n_tok, kv, D)), jnp.float32)
    slots = jnp.asarray([5, 6, 7, 8, 13, 30, 0], jnp.int32)  # the last: a padding token (null page)
    layer = jnp.int32(LAYER) if stacked else None
    kp, vp = jax.jit(write_kv_pages)(kp, vp, k, v, slots, layer)
    assert isinstance(kp, QuantizedPages) and kp.data.dtype == jnp.dtype(kp.format and kp.dtype)
    for pages, rows in ((kp, k), (vp, v)):
        data, scale = (pages.data[LAYER], pages.scale[LAYER]) if stacked else (pages.data, pages.scale)
        back = np.asarray(dequantize(data, scale), np.float64)
        want_d, want_s = quantize(rows, fmt)
        for t, slot in enumerate(np.asarray(slots)[:-1]):
            p, o = divmod(int(slot), PS)
            np.testing.assert_array_equal(np.asarray(scale[:, p, o]), np.asarray(want_s[t]))
            np.testing.assert_array_equal(np.asarray(data[:, p, o].astype(jnp.float32)),
                                          np.asarray(want_d[t].astype(jnp.float32)))
            want = np.asarray(rows[t], np.float64)
            assert (np.abs(back[:, p, o] - want) <= _bound(want, fmt)).all()
        written = np.zeros((8, PS), bool)
        for slot in np.asarray(slots):
            written[divmod(int(slot), PS)] = True
        assert (back[:, ~written] == 0).all()
        if stacked:
            assert (np.asarray(pages.scale)[[0, 2]] == 0).all()


def test_kv_cache_quantized():
    """KVCache.zeros of a format holds value and scale pages; copy_pages copies both."""
    cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=D)
    cache = KVCache.zeros(cfg, 4, PS, jnp.bfloat16, kv_format="int8")
    assert cache.quantized and cache.kv_format == "int8" and cache.num_pages == 4 and cache.page_size == PS
    assert cache.k.scale.shape == (2, 1, 4, PS) and logical_kv_dtype(cache.k) == jnp.bfloat16
    k = cache.k.map(lambda a: a.at[:, :, 1].set(3))
    cache = KVCache(k, cache.v).copy_pages(jnp.asarray([1]), jnp.asarray([2]))
    assert (np.asarray(cache.k.data[:, :, 2]) == 3).all() and (np.asarray(cache.k.scale[:, :, 2]) == 3).all()
    assert KVCache.zeros(cfg, 4, PS, jnp.float32).kv_format == "float32"


def _decode(kernel, q, kp, vp, lengths, table):
    opts = dict(scale=SCALE, sliding_window=jnp.int32(0), layer=jnp.int32(LAYER))
    if kernel == "xla":
        return paged_decode_attention_xla(q, kp, vp, lengths, table, **opts)
    if kernel == "tpu":
        return paged_decode_attention_tpu(q, kp, vp, lengths, table, interpret=True, **opts)
    return paged_decode_attention_pallas(q, kp, vp, lengths, table, pages_per_block=2, interpret=True, **opts)


@pytest.mark.parametrize("fmt,kernel", CASES)
def test_decode_attention(fmt, kernel):
    rng = np.random.default_rng(2)
    lengths = np.asarray([1, PS + 1, L, 0], np.int32)
    cache = PagedCache(rng, np.maximum(lengths, 1), 2, jnp.float32)
    table = cache.page_table.copy()
    table[lengths == 0] = 0
    q = 2.0 * rng.standard_normal((len(lengths), 8, D))
    kp, vp = _quantized(cache.k_pages, fmt, rng), _quantized(cache.v_pages, fmt, rng)
    out = jax.jit(_decode, static_argnums=0)(kernel, jnp.asarray(q, jnp.float32), kp, vp,
                                             jnp.asarray(lengths), jnp.asarray(table))
    assert out.dtype == jnp.float32
    kd, vd = _dequantized_layer(kp), _dequantized_layer(vp)
    real = np.flatnonzero(lengths > 0)
    exact, approx = [], []
    for s in real:
        pos = np.arange(lengths[s])
        keys_d = kd[:, table[s, pos // PS], pos % PS].transpose(1, 0, 2)
        vals_d = vd[:, table[s, pos // PS], pos % PS].transpose(1, 0, 2)
        exact.append(ref_attention(q[s:s + 1], keys_d, vals_d, [lengths[s] - 1], window=None, soft_cap=None)[0])
        approx.append(ref_attention(q[s:s + 1], cache.k[s], cache.v[s], [lengths[s] - 1], window=None,
                                    soft_cap=None)[0])
    _check(out, np.stack(exact), 1e-5, rows=real)
    _check(out, np.stack(approx), TOL[fmt], rows=real)
    assert np.all(np.asarray(out)[lengths == 0] == 0)


def _prefill(kernel, q, kp, vp, cu, kv_lens, table, num_seqs):
    opts = dict(scale=SCALE, sliding_window=jnp.int32(0), layer=jnp.int32(LAYER))
    if kernel == "xla":
        return paged_prefill_attention_xla(q, kp, vp, cu, kv_lens, table, num_seqs, **opts)
    if kernel == "tpu":
        return paged_prefill_attention_tpu(q, kp, vp, cu, kv_lens, table, num_seqs, interpret=True, **opts)
    return paged_prefill_attention_pallas(q, kp, vp, cu, kv_lens, table, num_seqs, block_q=4, pages_per_block=2,
                                          interpret=True, **opts)


@pytest.mark.parametrize("fmt,kernel", CASES)
def test_prefill_attention(fmt, kernel):
    """Two chunks (one from the start, one after a cached prefix) and a padding row."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens, num_seqs = [5, 9], [5, L], 2
    cache = PagedCache(rng, kv_lens, 2, jnp.float32)
    table = np.zeros((S, P), np.int32)
    table[:num_seqs] = cache.page_table
    kv = np.zeros(S, np.int32)
    kv[:num_seqs] = kv_lens
    cu = np.full(S + 1, sum(q_lens), np.int32)
    cu[:num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    q = 2.0 * rng.standard_normal((T, 8, D))
    kp, vp = _quantized(cache.k_pages, fmt, rng), _quantized(cache.v_pages, fmt, rng)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    out = jax.jit(_prefill, static_argnums=0)(kernel, jnp.asarray(q, jnp.float32), kp, vp, i32(cu), i32(kv),
                                              i32(table), i32(num_seqs))
    kd, vd = _dequantized_layer(kp), _dequantized_layer(vp)
    exact, approx = [], []
    for s in range(num_seqs):
        pos = np.arange(kv_lens[s])
        keys_d = kd[:, table[s, pos // PS], pos % PS].transpose(1, 0, 2)
        vals_d = vd[:, table[s, pos // PS], pos % PS].transpose(1, 0, 2)
        q_pos = np.arange(kv_lens[s] - q_lens[s], kv_lens[s])
        exact.append(ref_attention(q[cu[s]:cu[s + 1]], keys_d, vals_d, q_pos, window=None, soft_cap=None))
        approx.append(ref_attention(q[cu[s]:cu[s + 1]], cache.k[s], cache.v[s], q_pos, window=None,
                                    soft_cap=None))
    n_tok = cu[num_seqs]
    _check(out, np.concatenate(exact), 1e-5, rows=np.arange(n_tok))
    _check(out, np.concatenate(approx), TOL[fmt], rows=np.arange(n_tok))
    assert np.all(np.asarray(out)[n_tok:] == 0)


def test_quantized_kernels_lower_for_cuda_and_tpu():
    """jax.export of the Pallas kernels over int8 pages: Triton for platforms=["cuda"], Mosaic for
    ["tpu"] (a scale page is a block whose last two dimensions are the array's; no device needed)."""
    spec = jax.ShapeDtypeStruct
    i32 = lambda *shape: spec(shape, jnp.int32)  # noqa: E731
    cache = QuantizedPages(spec((2, 1, 64, 16, 256), jnp.int8), spec((2, 1, 64, 16), jnp.float32))
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    cases = [
        ("cuda", "xlaserve_paged_decode", lambda q, k, v, l, t, w, y: paged_decode_attention_pallas(
            q, k, v, l, t, scale=0.06, sliding_window=w, layer=y), (8,)),
        ("cuda", "xlaserve_paged_prefill", lambda q, k, v, cu, kv, t, n, w, y: paged_prefill_attention_pallas(
            q, k, v, cu, kv, t, n, scale=0.06, sliding_window=w, layer=y), (128,)),
        ("tpu", "xlaserve_paged_decode_tpu", lambda q, k, v, l, t, w, y: paged_decode_attention_tpu(
            q, k, v, l, t, scale=0.06, sliding_window=w, layer=y), (8,)),
        ("tpu", "xlaserve_paged_prefill_tpu", lambda q, k, v, cu, kv, t, n, w, y: paged_prefill_attention_tpu(
            q, k, v, cu, kv, t, n, scale=0.06, sliding_window=w, layer=y), (128,)),
    ]
    for platform, name, fn, (rows,) in cases:
        q = spec((rows, 4, 256), jnp.bfloat16)
        rest = ((i32(8), i32(8, 32), i32(), i32()) if rows == 8
                else (i32(5), i32(4), i32(4, 32), i32(), i32(), i32()))
        exported = jax.export.export(jax.jit(fn), platforms=[platform],
                                     disabled_checks=triton if platform == "cuda" else ())(q, cache, cache, *rest)
        assert name in exported.mlir_module(), (platform, name)
