"""The weight-only bf16 kernel (``kernels_cpu.bf16_matmul``) against XLA: every row count
1..64, odd shapes, both weight layouts, every instruction-set path this CPU runs (AVX2 forced
on an AVX-512 CPU; AMX tiles where Linux lends them), threads, batch invariance bit for bit,
inside jitted code, ``Compute.dot`` and the products it gives the kernel (``Bf16Matmul.serves``).

The reference is the same math in float32 (bf16 inputs widened exactly, XLA's float32 dot at
HIGHEST precision), so the only difference is the order of the float32 additions: both are
held to the recursive-summation bound ``K * 2**-24 * sum_k |x_k w_k|`` each (twice that)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_cpu import Bf16Matmul, bf16_matmul, reference_bf16_matmul
from model.compute import Compute

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
pytestmark = pytest.mark.skipif(not kernels_cpu.available() and not HAS_COMPILER,
                                reason="no C++ compiler: the kernels were not built")
PATHS = [isa for isa in ("avx512", "avx2", "scalar", "amx") if isa in kernels_cpu.isas() or not kernels_cpu.isas()]
LAYOUTS = {0: "[K, N]", 1: "[N, K]"}


def _weight(rng, k, n, contract):
    return jnp.asarray(rng.standard_normal((k, n) if contract == 0 else (n, k)), jnp.bfloat16)


def assert_close(out, x, w, contract):
    """``out`` within twice float32's recursive-summation bound of the exact product."""
    xf, wf = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    wf = wf if contract == 0 else wf.T
    exact, mags = xf @ wf, np.abs(xf) @ np.abs(wf)
    bound = 2 * xf.shape[1] * 2.0**-24 * mags + 1e-30
    ref = np.asarray(jax.lax.dot_general(jnp.asarray(x, jnp.float32), w.astype(jnp.float32),
                                         (((1,), (contract,)), ((), ())), precision="highest"))
    out = np.asarray(out, np.float64)
    assert out.shape == exact.shape
    assert np.all(np.abs(ref - exact) <= bound), "the reference itself is off"
    bad = np.abs(out - exact) > bound
    assert not bad.any(), f"{bad.sum()} elements off; worst {np.max(np.abs(out - exact) - bound)}"


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
@pytest.mark.parametrize("isa", PATHS)
def test_every_row_count_is_close_and_batch_invariant(isa, contract):
    """Rows 1..64 of one x, each count in one call, and each row alone: all within the bound
    of the exact product, and row r of every call equals the 1-row call of row r bitwise."""
    rng = np.random.default_rng(1)
    k, n = 131, 77  # K not a multiple of any vector width, N odd
    x, w = jnp.asarray(rng.standard_normal((64, k)), jnp.bfloat16), _weight(rng, k, n, contract)

    @jax.jit
    def run(x, w):
        by_rows = [bf16_matmul(x[:m], w, contract, isa) for m in range(1, 65)]
        alone = [bf16_matmul(x[r:r + 1], w, contract, isa) for r in range(64)]
        return by_rows, jnp.concatenate(alone)

    by_rows, alone = run(x, w)
    assert_close(alone, x, w, contract)
    alone = np.asarray(alone)
    for m, out in enumerate(by_rows, start=1):
        assert out.shape == (m, n) and out.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out), alone[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("k,n", [(1, 1), (15, 17), (16, 16), (17, 65), (33, 129), (640, 3)])
def test_odd_shapes_and_float32_x(isa, contract, k, n):
    rng = np.random.default_rng(k * 1000 + n)
    w = _weight(rng, k, n, contract)
    for m in (1, 5):
        x32 = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        assert_close(bf16_matmul(x32, w, contract, isa), x32, w, contract)  # f32 x: not rounded
        xb = x32.astype(jnp.bfloat16)
        assert_close(bf16_matmul(xb, w, contract, isa), xb, w, contract)


@pytest.mark.parametrize("contract", [0, 1], ids=LAYOUTS.get)
def test_threads_split_columns_without_changing_a_bit(contract, monkeypatch):
    rng = np.random.default_rng(3)
    k, n = 200, 1000
    x, w = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16), _weight(rng, k, n, contract)
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_THREADS", "1")
    one = np.asarray(bf16_matmul(x, w, contract))
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_THREADS", "8")
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_PARALLEL_MACS", "1")
    np.testing.assert_array_equal(np.asarray(bf16_matmul(x, w, contract)), one)
    assert_close(one, x, w, contract)


def test_isa_env_forces_a_path(monkeypatch):
    if "avx2" not in kernels_cpu.isas():
        pytest.skip("no AVX2 here")
    rng = np.random.default_rng(4)
    x, w = jnp.asarray(rng.standard_normal((2, 300)), jnp.bfloat16), _weight(rng, 300, 40, 1)
    forced = np.asarray(bf16_matmul(x, w, 1, "avx2"))
    monkeypatch.setenv("XLASERVE_CPU_KERNELS_ISA", "avx2")
    np.testing.assert_array_equal(np.asarray(bf16_matmul(x, w, 1)), forced)


def test_inside_jit_with_other_ops_and_through_compute_dot():
    """The head's and a layer's equations through ``Compute.dot`` with the kernel: close to
    XLA's bf16 dot (``preferred_element_type=float32``), among other jitted ops."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    head, layer = _weight(rng, 64, 300, 1), _weight(rng, 64, 96, 0)
    kernel, plain = Compute(bf16_matmul=Bf16Matmul()), Compute(pad_single_row=True)

    def step(compute, x, head, layer):
        h = jnp.tanh(compute.dot("td,df->tf", x * 0.5, layer, jnp.bfloat16)) + 1.0
        return compute.dot("sd,vd->sv", h[:, :64], head, jnp.bfloat16).sum(-1), h

    got = jax.jit(lambda *a: step(kernel, *a))(x, head, layer)
    want = jax.jit(lambda *a: step(plain, *a))(x, head, layer)
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-4, atol=1e-4)
    text = jax.jit(lambda *a: step(kernel, *a)).lower(x, head, layer).as_text()
    assert text.count("xlaserve_bf16_matmul") == 2
    xb = x.astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(bf16_matmul(xb, layer, 0)),
                               np.asarray(reference_bf16_matmul(xb, layer, 0)), rtol=1e-5, atol=1e-5)


def test_max_rows_and_errors():
    rng = np.random.default_rng(6)
    x, w = jnp.asarray(rng.standard_normal((5, 32)), jnp.bfloat16), _weight(rng, 32, 8, 1)
    text = jax.jit(lambda x, w: Bf16Matmul(max_rows=4)(x, w, 1)).lower(x, w).as_text()
    assert "xlaserve_bf16_matmul" not in text  # 5 rows > 4: XLA's dot
    with pytest.raises(ValueError, match="bfloat16"):
        bf16_matmul(x, w.astype(jnp.float32), 1)
    with pytest.raises(ValueError, match="do not agree"):
        bf16_matmul(x, w, 0)
    with pytest.raises(ValueError, match="isa must be"):
        bf16_matmul(x, w, 1, "sse")


def test_compute_dot_gives_the_kernel_only_the_products_it_serves():
    """A kernel that serves [N, K] weights of at least 300 columns (the backend policy's head-only
    kernel): ``Compute.dot`` sends it the head's product at every row count, unpadded, and
    computes the layer's and a narrower head's with XLA's dot and the ``dot_rows`` padding."""
    from kernels_pallas.dot_rows import DotRows

    head_only = Bf16Matmul(contracts=(1,), min_columns=300)
    assert head_only.serves(1, 300) and not head_only.serves(1, 299) and not head_only.serves(0, 5000)
    compute = Compute(pad_single_row=True, dot_rows=DotRows(min_rows=4, tile=16), bf16_matmul=head_only)
    rng = np.random.default_rng(7)
    head, narrow, layer = _weight(rng, 64, 300, 1), _weight(rng, 64, 299, 1), _weight(rng, 64, 64, 0)

    def step(x, head, narrow, layer):
        h = compute.dot("td,df->tf", x, layer, jnp.bfloat16)
        return compute.dot("sd,vd->sv", h, head, jnp.bfloat16), compute.dot("sd,vd->sv", h, narrow, jnp.bfloat16), h

    for rows in (1, 3):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        text = jax.jit(step).lower(x, head, narrow, layer).as_text()
        assert text.count("xlaserve_bf16_matmul") == 1, rows
        assert "4x64xbf16" in text  # the layer's XLA dot padded to 4 rows
        got, _, h = jax.jit(step)(x, head, narrow, layer)
        assert_close(got, h.astype(jnp.bfloat16), head, 1)
