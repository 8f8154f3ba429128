"""The Pallas paged-attention kernels (decode, chunked prefill), in interpret mode, against the
float64 reference and the XLA path.

Same poisoned caches as tests/kernels/test_paged_attention_xla.py (NaN in page 0, in
unowned pages and past each length; shuffled, non-contiguous page tables),
plus a poisoned output buffer is not possible for pallas_call, so padding
slots are checked to be exactly 0 instead. Also: the kernel lowers for CUDA
(Triton) through ``jax.export``, so a GPU lowering that breaks fails CI.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas.paged_attention_tpu import paged_decode_attention_tpu, paged_prefill_attention_tpu
from kernels_pallas.paged_attention_xla import paged_decode_attention_xla
from kernels_pallas.paged_decode_pallas import paged_decode_attention_pallas
from kernels_pallas.paged_prefill_pallas import paged_prefill_attention_pallas
from tests.support.paged_attention_harness import (
    LENGTHS,
    NUM_LAYERS,
    PS,
    SCALE,
    SETTINGS,
    SLOTS,
    WINDOWS,
    L,
    PagedCache,
    _round,
    check_close,
    prefill_batches,
    ref_attention,
    run_prefill,
)

PAGES_PER_BLOCK = 2  # 2 pages of 4 tokens per inner iteration: blocks straddle lengths and windows


KERNELS = ["triton", "tpu"]  # the GPU-style kernel and the Mosaic (TPU) one, both interpreted here


@functools.lru_cache(maxsize=None)
def pallas_fn(soft_cap=None, kernel="triton"):
    def f(q, kp, vp, lengths, table, w, layer):
        if kernel == "tpu":
            return paged_decode_attention_tpu(q, kp, vp, lengths, table, scale=SCALE, sliding_window=w,
                                              soft_cap=soft_cap, layer=layer, interpret=True)
        return paged_decode_attention_pallas(
            q, kp, vp, lengths, table, scale=SCALE, sliding_window=w, soft_cap=soft_cap, layer=layer,
            pages_per_block=PAGES_PER_BLOCK, interpret=True)
    return jax.jit(f)


def run(rng, lengths, num_heads, kv_heads, dtype, *, window, soft_cap=None, layer=None, kernel="triton"):
    lengths = np.asarray(lengths, np.int32)
    cache = PagedCache(rng, np.maximum(lengths, 1), kv_heads, dtype)
    table = cache.page_table.copy()
    table[lengths == 0] = 0
    q = _round(2.0 * rng.standard_normal((len(lengths), num_heads, jnp.shape(cache.k_pages)[-1])), dtype)
    kp, vp = cache.k_pages, cache.v_pages
    lay = 0
    if layer is not None:
        kp, vp = cache.stacked(rng, layer)
        lay = layer
    else:
        kp, vp = kp[None], vp[None]
    w = jnp.int32(0 if window is None else window)
    out = pallas_fn(soft_cap, kernel)(jnp.asarray(q, dtype), kp, vp, jnp.asarray(lengths), jnp.asarray(table), w,
                              jnp.int32(lay))
    assert out.shape == q.shape and out.dtype == dtype
    real = np.flatnonzero(lengths > 0)
    if len(real):
        ref = np.stack([
            ref_attention(q[s:s + 1], cache.k[s][: lengths[s]], cache.v[s][: lengths[s]], [lengths[s] - 1],
                          window=window, soft_cap=soft_cap)[0]
            for s in real])
        check_close(out, ref, dtype, rows=real)
        xla = paged_decode_attention_xla(jnp.asarray(q, dtype), kp, vp, jnp.asarray(lengths),
                                         jnp.asarray(table), scale=SCALE, sliding_window=w,
                                         soft_cap=soft_cap, layer=jnp.int32(lay))
        check_close(out, np.asarray(jnp.asarray(xla, jnp.float32), np.float64)[real], dtype, rows=real)
    assert np.all(np.asarray(out)[lengths == 0] == 0)


CONFIGS = [pytest.param(4, 1, None, id="mqa"), pytest.param(8, 2, None, id="gqa"),
           pytest.param(8, 2, 5.0, id="gqa-softcap")]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", CONFIGS)
def test_edge_lengths(num_heads, kv_heads, soft_cap, kernel):
    """Length 1, exactly one page, a page plus one, and the full page table, in one batch."""
    run(np.random.default_rng(0), [1, PS, PS + 1, L], num_heads, kv_heads, jnp.float32,
        window=None, soft_cap=soft_cap, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 1), (8, 2)])
@settings(SETTINGS, max_examples=12)
@given(seed=st.integers(0, 2**32 - 1),
       lengths=st.lists(st.one_of(st.just(0), LENGTHS), min_size=SLOTS, max_size=SLOTS),
       window=st.one_of(st.none(), WINDOWS))
def test_matches_reference(num_heads, kv_heads, kernel, seed, lengths, window):
    run(np.random.default_rng(seed), lengths, num_heads, kv_heads, jnp.float32, window=window, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@settings(SETTINGS, max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(LENGTHS, min_size=SLOTS, max_size=SLOTS),
       window=st.one_of(st.none(), WINDOWS), layer=st.integers(0, NUM_LAYERS - 1))
def test_stacked_cache_layer(kernel, seed, lengths, window, layer):
    """layer= selects one layer of the stacked cache; the others are NaN or noise."""
    run(np.random.default_rng(seed), lengths, 8, 2, jnp.float32, window=window, layer=layer, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@settings(SETTINGS, max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(LENGTHS, min_size=SLOTS, max_size=SLOTS),
       window=st.one_of(st.none(), WINDOWS))
def test_bfloat16(kernel, seed, lengths, window):
    run(np.random.default_rng(seed), lengths, 8, 2, jnp.bfloat16, window=window, kernel=kernel)


@pytest.mark.parametrize("head_dim,num_heads,kv_heads,page_size", [
    pytest.param(256, 4, 1, 16, id="gemma3-270m"), pytest.param(128, 32, 8, 16, id="llama3-8b")])
def test_lowers_for_cuda(head_dim, num_heads, kv_heads, page_size):
    """jax.export for platforms=["cuda"] lowers the kernel to Triton (no GPU needed)."""
    layers, pages, slots, cols = 2, 64, 8, 32

    def f(q, kp, vp, lengths, table, w, layer):
        return paged_decode_attention_pallas(q, kp, vp, lengths, table, scale=head_dim**-0.5,
                                             sliding_window=w, layer=layer)

    spec = jax.ShapeDtypeStruct
    args = (spec((slots, num_heads, head_dim), jnp.bfloat16),
            spec((layers, kv_heads, pages, page_size, head_dim), jnp.bfloat16),
            spec((layers, kv_heads, pages, page_size, head_dim), jnp.bfloat16),
            spec((slots,), jnp.int32), spec((slots, cols), jnp.int32), spec((), jnp.int32),
            spec((), jnp.int32))
    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "xlaserve_paged_decode" in text


def test_kernel_benchmark_runs_and_checks_the_kernel(capsys):
    """benchmarks/kernels.py runs end to end (interpret mode here) and reports no failure."""
    from benchmarks.kernels import main

    main(["--batch", "2", "--context", "64", "--page-size", "16", "--heads", "gemma3-270m",
          "--iters", "1", "--dtype", "float32", "--no-kv-write"])
    out = capsys.readouterr().out
    assert "FAILED" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("decode", "prefill"))]
    assert [(r[0], r[5]) for r in rows] == [("decode", "pallas"), ("decode", "xla"),
                                            ("prefill", "pallas"), ("prefill", "xla")]
    assert all(float(r[-1]) < 1e-5 for r in rows)  # each kernel's max error against the reference


def test_interpret_mode_poisons_unwritten_outputs():
    """The premise of the 'every output element written' checks: in interpret mode an output
    element no program writes reads back as NaN (so a finite output was written)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((16, 128), jnp.float32)
    out = pl.pallas_call(kernel, grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                         out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                         out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
    assert np.all(np.asarray(out[:8]) == 1) and np.all(np.isnan(np.asarray(out[8:])))


# --------------------------------------------------------------------------
# chunked prefill


@functools.lru_cache(maxsize=None)
def pallas_prefill_fn(soft_cap=None, block_q=4, kernel="triton"):
    def f(q, kp, vp, cu, kv_lens, table, num_seqs, w, layer):
        if kernel == "tpu":
            return paged_prefill_attention_tpu(
                q, kp, vp, cu, kv_lens, table, num_seqs, scale=SCALE, sliding_window=w, soft_cap=soft_cap,
                layer=layer, block_q=max(8, block_q), interpret=True)
        return paged_prefill_attention_pallas(
            q, kp, vp, cu, kv_lens, table, num_seqs, scale=SCALE, sliding_window=w, soft_cap=soft_cap,
            layer=layer, block_q=block_q, pages_per_block=PAGES_PER_BLOCK, interpret=True)
    return jax.jit(f)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", [
    pytest.param(4, 1, None, id="mqa"), pytest.param(8, 2, 5.0, id="gqa-softcap")])
def test_prefill_fixed_cases(num_heads, kv_heads, soft_cap, kernel):
    """A chunk at position 0, one mid-sequence, a single token ending a page, then padding;
    with and without a window; and one chunk covering the second half of a full table."""
    rng = np.random.default_rng(1)
    fn = pallas_prefill_fn(soft_cap, kernel=kernel)
    for window in (None, 3):
        run_prefill(rng, 3, [5, 6, 1], [5, 14, 4], num_heads, kv_heads, jnp.float32, window=window,
                    soft_cap=soft_cap, fn=fn)
    run_prefill(rng, 1, [L // 2], [L], num_heads, kv_heads, jnp.float32, window=None, soft_cap=soft_cap,
                fn=fn)


@pytest.mark.parametrize("kernel", KERNELS)
@settings(SETTINGS, max_examples=12)
@given(seed=st.integers(0, 2**32 - 1), batch=prefill_batches(), window=st.one_of(st.none(), WINDOWS),
       block_q=st.sampled_from([4, 16]))
def test_prefill_matches_reference(kernel, seed, batch, window, block_q):
    num_seqs, q_lens, kv_lens = batch
    run_prefill(np.random.default_rng(seed), num_seqs, q_lens, kv_lens, 8, 2, jnp.float32, window=window,
                soft_cap=None, fn=pallas_prefill_fn(None, block_q, kernel))


@pytest.mark.parametrize("kernel", KERNELS)
@settings(SETTINGS, max_examples=6)
@given(seed=st.integers(0, 2**32 - 1), batch=prefill_batches(), window=st.one_of(st.none(), WINDOWS))
def test_prefill_bfloat16(kernel, seed, batch, window):
    num_seqs, q_lens, kv_lens = batch
    run_prefill(np.random.default_rng(seed), num_seqs, q_lens, kv_lens, 8, 2, jnp.bfloat16, window=window,
                soft_cap=None, fn=pallas_prefill_fn(kernel=kernel))


def test_prefill_stacked_cache_layer():
    """layer= reads one layer of a stacked cache whose other layers are NaN or noise."""
    rng = np.random.default_rng(3)
    layer = 2
    out, cache, q, cu, kv, table = run_prefill(rng, 3, [5, 6, 1], [5, 14, 4], 8, 2, jnp.float32,
                                               window=4, soft_cap=None, fn=pallas_prefill_fn())
    kst, vst = cache.stacked(rng, layer)
    stacked = paged_prefill_attention_pallas(
        jnp.asarray(q), kst, vst, jnp.asarray(cu), jnp.asarray(kv), jnp.asarray(table), jnp.int32(3),
        scale=SCALE, sliding_window=4, layer=jnp.int32(layer), block_q=4, pages_per_block=PAGES_PER_BLOCK,
        interpret=True)
    np.testing.assert_allclose(np.asarray(stacked), np.asarray(out), rtol=0, atol=1e-6)


def test_prefill_lowers_for_cuda():
    """jax.export for platforms=["cuda"] lowers the prefill kernel to Triton (Llama-3-8B heads)."""
    tokens, seqs, layers, pages, page_size, cols = 256, 4, 2, 128, 16, 32

    def f(q, kp, vp, cu, kv, table, num_seqs, w, layer):
        return paged_prefill_attention_pallas(q, kp, vp, cu, kv, table, num_seqs, scale=128**-0.5,
                                              sliding_window=w, layer=layer)

    spec = jax.ShapeDtypeStruct
    cache = spec((layers, 8, pages, page_size, 128), jnp.bfloat16)
    args = (spec((tokens, 32, 128), jnp.bfloat16), cache, cache, spec((seqs + 1,), jnp.int32),
            spec((seqs,), jnp.int32), spec((seqs, cols), jnp.int32), spec((), jnp.int32),
            spec((), jnp.int32), spec((), jnp.int32))
    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xlaserve_paged_prefill" in exported.mlir_module()


@pytest.mark.parametrize("head_dim,num_heads,kv_heads", [
    pytest.param(256, 4, 1, id="gemma3-270m"), pytest.param(128, 32, 8, id="llama3-8b")])
def test_tpu_kernels_lower_for_tpu(head_dim, num_heads, kv_heads):
    """jax.export for platforms=["tpu"] runs the Mosaic lowering of both TPU kernels (no TPU needed)."""
    spec = jax.ShapeDtypeStruct
    cache = spec((2, kv_heads, 64, 16, head_dim), jnp.bfloat16)
    i32 = lambda *shape: spec(shape, jnp.int32)

    def decode(q, kp, vp, lengths, table, w, layer):
        return paged_decode_attention_tpu(q, kp, vp, lengths, table, scale=head_dim**-0.5,
                                          sliding_window=w, layer=layer)

    def prefill(q, kp, vp, cu, kv, table, num_seqs, w, layer):
        return paged_prefill_attention_tpu(q, kp, vp, cu, kv, table, num_seqs, scale=head_dim**-0.5,
                                           sliding_window=w, layer=layer)

    for name, fn, args in [
        ("xlaserve_paged_decode_tpu", decode,
         (spec((8, num_heads, head_dim), jnp.bfloat16), cache, cache, i32(8), i32(8, 32), i32(), i32())),
        ("xlaserve_paged_prefill_tpu", prefill,
         (spec((128, num_heads, head_dim), jnp.bfloat16), cache, cache, i32(5), i32(4), i32(4, 32), i32(),
          i32(), i32())),
    ]:
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
        text = exported.mlir_module()
        assert "tpu_custom_call" in text and name in text
