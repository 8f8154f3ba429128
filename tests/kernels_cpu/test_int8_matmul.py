"""The int8 x int8 -> int32 kernel (``kernels_cpu``) against XLA's dot, bit for bit: every row
count 1..64, odd shapes, both weight layouts, every instruction-set path this CPU runs (the
AVX2 path forced on an AVX-512 CPU), threads, batch invariance, inside jitted code, and the
fallback when the library is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_cpu import Int8Matmul, int8_matmul, reference_int8_matmul

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
pytestmark = pytest.mark.skipif(not kernels_cpu.available() and not HAS_COMPILER,
                                reason="no C++ compiler: the kernels were not built")
PATHS = [isa for isa in ("avx512", "avx2", "scalar") if isa in kernels_cpu.isas() or not kernels_cpu.isas()]
LAYOUTS = {0: "[K, N]", 1: "[N, K]"}


def _ints(rng, shape, lo=-127, hi=127):
    return jnp.asarray(rng.integers(lo, hi + 1, shape), jnp.int8)


def _weight(rng, k, n, contract):
    return _ints(rng, (k, n) if contract == 0 else (n, k))


def test_the_library_is_built_where_a_compiler_exists():
    assert kernels_cpu.available(), kernels_cpu.load_error()
    assert "scalar" in kernels_cpu.isas()


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
@pytest.mark.parametrize("isa", PATHS)
def test_every_row_count_is_exact_and_batch_invariant(isa, contract):
    """Rows 1..64 of one x, each count in one call, and each row alone: all equal XLA's
    int32 dot bitwise, and row r of every call equals the 1-row call of row r."""
    rng = np.random.default_rng(1)
    k, n = 131, 77  # K not a multiple of any vector width, N odd
    x, w = _ints(rng, (64, k)), _weight(rng, k, n, contract)

    @jax.jit
    def run(x, w):
        by_rows = [int8_matmul(x[:m], w, contract, isa) for m in range(1, 65)]
        alone = [int8_matmul(x[r:r + 1], w, contract, isa) for r in range(64)]
        return by_rows, jnp.concatenate(alone)

    by_rows, alone = run(x, w)
    ref = np.asarray(reference_int8_matmul(x, w, contract))
    np.testing.assert_array_equal(np.asarray(alone), ref)
    for m, out in enumerate(by_rows, start=1):
        assert out.shape == (m, n) and out.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(out), ref[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
@pytest.mark.parametrize("isa", PATHS)
def test_odd_shapes_are_exact(isa, contract):
    rng = np.random.default_rng(2)
    # (2, 640, 2048): Gemma's MLP; (3, 70, 200): [K, N] swept in 3 blocks of rows, 4 column strips
    for m, k, n in [(1, 1, 1), (2, 3, 5), (3, 63, 65), (5, 64, 64), (7, 65, 63), (4, 127, 129),
                    (1, 640, 257), (9, 2048, 33), (2, 640, 2048), (3, 70, 200)]:
        x, w = _ints(rng, (m, k)), _weight(rng, k, n, contract)
        got = int8_matmul(x, w, contract, isa)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(reference_int8_matmul(x, w, contract)),
                                      err_msg=f"{(m, k, n)}")


@pytest.mark.parametrize("isa", PATHS)
def test_extreme_values_do_not_saturate(isa):
    """All +-127 over K = 4096: the AVX2 path's 16-bit pair sums (127 * 127 * 2) and the
    AVX-512 path's offset x + 128 stay exact."""
    k = 4096
    x = jnp.asarray([[127] * k, [-127] * k, [127, -127] * (k // 2)], jnp.int8)
    for contract in (0, 1):
        w = jnp.full((k, 70) if contract == 0 else (70, k), -127, jnp.int8)
        got = np.asarray(int8_matmul(x, w, contract, isa))
        np.testing.assert_array_equal(got, np.asarray(reference_int8_matmul(x, w, contract)))
        assert got[0, 0] == -127 * 127 * k


@pytest.mark.parametrize("threads, parallel_macs", [("1", "0"), ("2", "0"), ("8", "1")])
def test_thread_splits_give_the_same_bits(monkeypatch, threads, parallel_macs):
    """Columns split over the pool (forced even for small products) or on one thread."""
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_THREADS", threads)
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_PARALLEL_MACS", parallel_macs)
    rng = np.random.default_rng(3)
    for contract in (0, 1):
        x, w = _ints(rng, (6, 200)), _weight(rng, 200, 1031, contract)
        np.testing.assert_array_equal(np.asarray(int8_matmul(x, w, contract)),
                                      np.asarray(reference_int8_matmul(x, w, contract)))


def test_the_strip_walk_baseline_is_exact(monkeypatch):
    """$XLASERVE_CPU_KERNELS_KN=strips (the benchmarks' baseline of the [K, N] row sweep) gives
    the same bits."""
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_KN", "strips")
    rng = np.random.default_rng(5)
    for m, k, n in [(2, 640, 2048), (3, 70, 200)]:
        x, w = _ints(rng, (m, k)), _weight(rng, k, n, 0)
        np.testing.assert_array_equal(np.asarray(int8_matmul(x, w, 0)), np.asarray(reference_int8_matmul(x, w, 0)))


def test_inside_a_jitted_function_with_other_ops():
    """Quantize, multiply, scale, add: the kernel's function and the reference's agree bitwise."""
    rng = np.random.default_rng(4)
    xf = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    w = _ints(rng, (40, 96))

    def f(matmul):
        def g(xf, w):
            s = jnp.max(jnp.abs(xf), axis=1, keepdims=True) / 127
            q = jnp.round(xf / s).astype(jnp.int8)
            return jnp.tanh(matmul(q, w, 1).astype(jnp.float32) * s) + xf.sum()
        return jax.jit(g)

    np.testing.assert_array_equal(np.asarray(f(Int8Matmul())(xf, w)), np.asarray(f(reference_int8_matmul)(xf, w)))


def test_under_vmap():
    rng = np.random.default_rng(6)
    x, w = _ints(rng, (3, 5, 40)), _ints(rng, (40, 9))
    got = jax.vmap(lambda x: int8_matmul(x, w, 0))(x)
    np.testing.assert_array_equal(np.asarray(got), np.einsum("bmk,kn->bmn", np.asarray(x, np.int32), np.asarray(w, np.int32)))


def test_int8matmul_switches_to_xla_above_max_rows_and_is_a_value():
    rng = np.random.default_rng(5)
    x, w = _ints(rng, (9, 64)), _ints(rng, (64, 20))
    small = Int8Matmul(max_rows=8)
    assert small == Int8Matmul(max_rows=8) and hash(small) == hash(Int8Matmul(max_rows=8))
    assert "xlaserve_int8_matmul" in jax.jit(lambda x, w: small(x, w, 0)).lower(x[:8], w).as_text()
    assert "xlaserve_int8_matmul" not in jax.jit(lambda x, w: small(x, w, 0)).lower(x, w).as_text()
    np.testing.assert_array_equal(np.asarray(small(x, w, 0)), np.asarray(reference_int8_matmul(x, w, 0)))


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
@pytest.mark.parametrize("isa", PATHS)
def test_a_layer_of_a_stack_is_read_in_place_and_exact(isa, contract):
    """``layer=``: w is [L, ...] and the product is w[layer]'s, bitwise XLA's, for every row
    count 1..64 and each layer (traced under a scan, as the decoders call it; out-of-range
    indices clamped as dynamic-slice clamps them)."""
    rng = np.random.default_rng(7)
    L, k, n = 3, 67, 45
    x = _ints(rng, (64, k))
    w = jnp.stack([_weight(rng, k, n, contract) for _ in range(L)])

    @jax.jit
    def run(x, w):
        def body(_, layer):
            return None, [int8_matmul(x[:m], w, contract, isa, layer=layer) for m in (1, 3, 5, 64)]
        return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]

    outs = run(x, w)
    for i, m in enumerate((1, 3, 5, 64)):
        for layer in range(L):
            np.testing.assert_array_equal(np.asarray(outs[i][layer]),
                                          np.asarray(reference_int8_matmul(x[:m], w[layer], contract)),
                                          err_msg=f"{m} rows, layer {layer}")
    clamped = int8_matmul(x[:2], w, contract, isa, layer=jnp.int32(L + 5))
    np.testing.assert_array_equal(np.asarray(clamped), np.asarray(reference_int8_matmul(x[:2], w[L - 1], contract)))
    np.testing.assert_array_equal(np.asarray(Int8Matmul(isa, max_rows=1)(x[:3], w, contract, jnp.int32(1))),
                                  np.asarray(reference_int8_matmul(x[:3], w, contract, jnp.int32(1))))


def test_a_stacked_weight_is_not_copied_out_before_the_kernel():
    """In a layer scan over a stack closed over, the compiled program hands the custom call
    the whole stack: no dynamic-slice of the int8 weight feeds it (what scanning it as xs
    costs: a copy of every layer's matrix before the kernel reads it)."""
    rng = np.random.default_rng(8)
    x, w = _ints(rng, (2, 64)), jnp.stack([_ints(rng, (64, 96)) for _ in range(4)])

    def in_place(x, w):
        return jax.lax.scan(lambda c, l: (c + int8_matmul(x, w, 0, layer=l), None), jnp.zeros((2, 96), jnp.int32),
                            jnp.arange(4, dtype=jnp.int32))[0]

    def sliced(x, w):
        return jax.lax.scan(lambda c, wl: (c + int8_matmul(x, wl, 0), None), jnp.zeros((2, 96), jnp.int32), w)[0]

    hlo = {f.__name__: jax.jit(f).lower(x, w).compile().as_text() for f in (in_place, sliced)}
    weight_slice = "= s8[64,96]"  # an instruction making one layer's matrix out of s8[4,64,96]
    assert weight_slice in hlo["sliced"]  # (the check can see the copy: a dynamic-slice fusion)
    assert weight_slice not in hlo["in_place"]
    assert 'custom_call_target="xlaserve_int8_matmul_stacked"' in hlo["in_place"]
    np.testing.assert_array_equal(np.asarray(jax.jit(in_place)(x, w)), np.asarray(jax.jit(sliced)(x, w)))


def test_bad_inputs_raise():
    x, w = jnp.zeros((2, 8), jnp.int8), jnp.zeros((8, 4), jnp.int8)
    with pytest.raises(ValueError, match="2-D int8"):
        int8_matmul(x.astype(jnp.float32), w, 0)
    with pytest.raises(ValueError, match="do not agree"):
        int8_matmul(x, w, 1)
    with pytest.raises(ValueError, match="isa must be"):
        int8_matmul(x, w, 0, "neon")
    with pytest.raises(ValueError, match="3-D int8 w"):
        int8_matmul(x, w, 0, layer=jnp.int32(0))
    with pytest.raises(ValueError, match="layer must be a scalar"):
        int8_matmul(x, w[None], 0, layer=jnp.zeros(2, jnp.int32))


def test_a_missing_library_falls_back_to_xla_with_one_warning():
    """The loader pointed at a missing file (as where no compiler built it): the kernels are
    unavailable, the policy keeps XLA's dot for "auto" and "on", and says so once."""
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        import kernels_cpu
        from serving.engine.backend_policy import BackendPolicy
        from serving.engine.cpu_features import CpuFeatures
        spr = CpuFeatures.from_flags({"AVX512F": True, "AVX512_SPR": True, "AVX512VNNI": True})
        assert not kernels_cpu.available() and "cannot load" in kernels_cpu.load_error()
        for setting in ("auto", "on", "auto"):
            p = BackendPolicy.for_platform("cpu", cpu=spr, quantization="int8", cpu_kernels=setting)
            assert p.int8_matmul is None and p.compute().int8_matmul is None
            assert p.bf16_matmul is None  # the bf16 kernel too, in the same one warning
        print("ok")
    """)
    env = {**__import__("os").environ, "XLASERVE_CPU_KERNELS_LIB": "/nonexistent/_kernels.so"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok"
    warnings = [line for line in res.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2, warnings  # one per setting that wanted the kernels
    assert all("CPU kernels are unavailable" in w and "XLA's" in w for w in warnings)
