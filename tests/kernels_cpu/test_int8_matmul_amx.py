"""The int8 kernel's AMX-INT8 path (isa "amx", ``csrc/int8_matmul_amx.cc``) against XLA's dot,
bit for bit: rows 5..64 and more, odd shapes (K not a multiple of 64, N not of 16), both weight
layouts, a layer of a stack read in place, threads, batch invariance (a row alone and among
others, and across the switch from the VNNI path at 4 rows), and ``Int8Matmul``'s routing
with the tiles on and off (the fallback: XLA's dot above 4 rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_cpu import Int8Matmul, int8_matmul, reference_int8_matmul

pytestmark = pytest.mark.skipif("amx_int8" not in kernels_cpu.isas(),
                                reason="this CPU has no AMX-INT8 tiles lent to this process")
LAYOUTS = {0: "[K, N]", 1: "[N, K]"}
ALONE = (0, 15, 16, 31, 47, 48, 63)


def _ints(rng, shape, lo=-128, hi=127):
    return jnp.asarray(rng.integers(lo, hi + 1, shape), jnp.int8)


def _weight(rng, k, n, contract):
    return _ints(rng, (k, n) if contract == 0 else (n, k))


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
def test_rows_5_to_64_are_exact_and_batch_invariant(contract):
    """Every row count 5..64 of one x in one call each, and rows alone on the tiles (the first
    and last of each 16-row tile and of the 64): all equal XLA's int32 dot bitwise (K = 131,
    N = 77: neither a whole tile)."""
    rng = np.random.default_rng(11)
    k, n = 131, 77
    x, w = _ints(rng, (64, k)), _weight(rng, k, n, contract)

    @jax.jit
    def run(x, w):
        by_rows = [int8_matmul(x[:m], w, contract, "amx") for m in range(5, 65)]
        alone = [int8_matmul(x[r:r + 1], w, contract, "amx") for r in ALONE]
        return by_rows, jnp.concatenate(alone)

    by_rows, alone = run(x, w)
    ref = np.asarray(reference_int8_matmul(x, w, contract))
    np.testing.assert_array_equal(np.asarray(alone), ref[list(ALONE)])
    for m, out in enumerate(by_rows, start=5):
        assert out.shape == (m, n) and out.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(out), ref[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
def test_odd_and_model_shapes_are_exact(contract):
    """Tails in every dimension (K < 64, K = 64 t + 1, N < 16, N = 64 t + 1), whole tiles,
    Gemma's layer shapes at decode and prefill rows, and an [N, K] weight read as stored over
    several 32-row blocks (K a multiple of 64)."""
    rng = np.random.default_rng(12)
    for m, k, n in [(5, 1, 1), (6, 63, 15), (16, 128, 64), (17, 129, 65), (31, 200, 130), (64, 640, 256),
                    (130, 640, 97)]:
        x, w = _ints(rng, (m, k)), _weight(rng, k, n, contract)
        np.testing.assert_array_equal(np.asarray(int8_matmul(x, w, contract, "amx")),
                                      np.asarray(reference_int8_matmul(x, w, contract)), err_msg=f"{(m, k, n)}")


def test_extreme_values_are_exact():
    """-128 by -128 over K = 4096 (the largest sums of a tile's int32 accumulators) and mixed
    signs: no saturation anywhere."""
    k = 4096
    x = jnp.asarray([[-128] * k, [127] * k, [127, -128] * (k // 2)] * 3, jnp.int8)
    for contract in (0, 1):
        w = jnp.full((k, 70) if contract == 0 else (70, k), -128, jnp.int8)
        got = np.asarray(int8_matmul(x, w, contract, "amx"))
        np.testing.assert_array_equal(got, np.asarray(reference_int8_matmul(x, w, contract)))
        assert got[0, 0] == 128 * 128 * k


@pytest.mark.parametrize("threads, parallel_macs", [("1", "0"), ("2", "1")])
def test_thread_splits_give_the_same_bits(monkeypatch, threads, parallel_macs):
    """Columns split over the pool in 64-column chunks (forced even for a small product) or
    on the calling thread alone."""
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_THREADS", threads)
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_PARALLEL_MACS", parallel_macs)
    rng = np.random.default_rng(13)
    for contract in (0, 1):
        x, w = _ints(rng, (20, 192)), _weight(rng, 192, 1031, contract)
        np.testing.assert_array_equal(np.asarray(int8_matmul(x, w, contract, "amx")),
                                      np.asarray(reference_int8_matmul(x, w, contract)))


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
def test_a_layer_of_a_stack_is_read_in_place_and_exact(contract):
    """``layer=`` under a layer scan, as the decoders call it: each layer's product at 5 and
    64 rows is XLA's dot of ``w[layer]``; an index past the stack is clamped."""
    rng = np.random.default_rng(14)
    L, k, n = 3, 67, 45
    x = _ints(rng, (64, k))
    w = jnp.stack([_weight(rng, k, n, contract) for _ in range(L)])
    rows = (5, 64)

    @jax.jit
    def run(x, w):
        def body(_, layer):
            return None, [int8_matmul(x[:m], w, contract, "amx", layer=layer) for m in rows]
        return jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32))[1]

    outs = run(x, w)
    for i, m in enumerate(rows):
        for layer in range(L):
            np.testing.assert_array_equal(np.asarray(outs[i][layer]),
                                          np.asarray(reference_int8_matmul(x[:m], w[layer], contract)),
                                          err_msg=f"{m} rows, layer {layer}")
    clamped = int8_matmul(x[:9], w, contract, "amx", layer=jnp.int32(L + 5))
    np.testing.assert_array_equal(np.asarray(clamped), np.asarray(reference_int8_matmul(x[:9], w[L - 1], contract)))


def test_int8matmul_routes_many_rows_to_the_tiles_or_to_xla():
    """``Int8Matmul(max_rows=4, amx=True)``: up to 4 rows the VNNI path, above it the tiles;
    ``amx=False`` (where the CPU or Linux lends no tiles): XLA's dot above 4 rows. Every route
    gives the same bits, so a row's result does not depend on how many rows share its call."""
    rng = np.random.default_rng(15)
    x, w = _ints(rng, (24, 96)), jnp.stack([_ints(rng, (96, 40)) for _ in range(2)])
    tiles, fallback = Int8Matmul(max_rows=4, amx=True), Int8Matmul(max_rows=4)
    assert tiles != fallback and fallback.amx is False

    def hlo(matmul, rows):
        return jax.jit(lambda x, w: matmul(x, w, 0, jnp.int32(1))).lower(x[:rows], w).as_text()

    isa = 'isa = 4 : i64'  # the custom call's attribute: ISA_CODES["amx"]
    assert "xlaserve_int8_matmul_stacked" in hlo(tiles, 24) and isa in hlo(tiles, 24)
    assert "xlaserve_int8_matmul_stacked" in hlo(tiles, 4) and isa not in hlo(tiles, 4)
    assert "xlaserve_int8_matmul" not in hlo(fallback, 24) and "xlaserve_int8_matmul" in hlo(fallback, 4)

    ref = np.asarray(reference_int8_matmul(x, w, 0, jnp.int32(1)))
    for matmul in (tiles, fallback):
        np.testing.assert_array_equal(np.asarray(matmul(x, w, 0, jnp.int32(1))), ref)
        for r in (0, 3, 23):  # a row alone (the VNNI path) equals its row among 24 (the tiles or XLA)
            np.testing.assert_array_equal(np.asarray(matmul(x[r:r + 1], w, 0, jnp.int32(1)))[0], ref[r])
