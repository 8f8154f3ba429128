"""The weight-only bfloat16 matmul kernel as a JAX function (``csrc/bf16_matmul.cc``).

    out[m, n] = sum_k x[m, k] * w[n, k]     (contract=1: w is [N, K], e.g. the tied output head)
    out[m, n] = sum_k x[m, k] * w[k, n]     (contract=0: w is [K, N], e.g. a layer matrix)

x is [M, K] bfloat16 or float32, w bfloat16, the result [M, N] float32. Each weight is widened
to float32 exactly and each product is a float32 fused multiply-add into a float32 sum, so
with bfloat16 x every product is exact and the result differs from XLA's dot with
``preferred_element_type=float32`` (:func:`reference_bf16_matmul`) only by the order of the
float32 additions: within float32 summation error, not bit for bit.

Batch invariance: each output element is summed in one fixed order whatever M (and whatever
the thread split), so row r of an M-row call equals a 1-row call bit for bit. The order
depends on the instruction set and the layout (see the C++ file's header), so a row computed
by the kernel and by XLA's dot may differ in the last bits: a caller that wants invariance
must not switch between them by row count (:class:`Bf16Matmul`'s ``max_rows``).

Instruction sets and threads: as ``kernels_cpu.int8_matmul`` (``isa`` "auto", "avx2",
"avx512" (AVX512F/BW; no AVX512_BF16 needed), "scalar" or "amx"; ``$XLASERVE_CPU_KERNELS_ISA``;
``$XLASERVE_CPU_KERNELS_THREADS``; ``$XLASERVE_CPU_KERNELS_PARALLEL_MACS``). "amx"
(``csrc/bf16_matmul_amx.cc``) runs a bfloat16 x on Intel AMX tiles (TDPBF16PS: pairs of exact
products added in the hardware's fixed order, tiles of 32 k ascending; a float32 x takes the
avx512 path); "auto" takes it for a [N, K] weight where the CPU has AMX-BF16 and Linux lends the
tiles (``kernels_cpu.isas()`` lists "amx"); a [K, N] weight is repacked into tile pairs on every
call, so "amx" is there only on request. On the 2-core Sapphire Rapids VM it measured bitwise
equal to XLA's bf16 dot on the shapes of the tests (XLA's dot runs on AMX there too) and faster
than it on the Gemma head at 4-64 rows (benchmarks/RESULTS.md, 2026-12-07).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.int8_matmul import ISA_CODES, resolve_isa
from kernels_cpu.library import BF16_MATMUL_TARGET, available, load_error


def bf16_matmul(x: jax.Array, w: jax.Array, contract: int, isa: str = "auto") -> jax.Array:
    """``x: [M, K]`` (bfloat16 or float32) times ``w`` (bfloat16, [N, K] with contract=1 or
    [K, N] with contract=0) -> ``[M, N] float32``, through the compiled kernel (XLA:CPU only;
    works under jit).

    Raises:
      ValueError: wrong dtypes, ranks or shapes; an unknown isa.
      RuntimeError: the library is unavailable (``library.load_error`` says why).
      jax.errors.JaxRuntimeError (at run time): this CPU lacks the requested isa.
    """
    if (x.dtype not in (jnp.bfloat16, jnp.float32) or w.dtype != jnp.bfloat16
            or x.ndim != 2 or w.ndim != 2):
        raise ValueError(f"bf16_matmul takes 2-D bfloat16/float32 x and 2-D bfloat16 w, "
                         f"got {x.dtype}{x.shape}, {w.dtype}{w.shape}")
    if contract not in (0, 1):
        raise ValueError(f"contract must be 0 (w: [K, N]) or 1 (w: [N, K]), got {contract}")
    m, k = x.shape
    if w.shape[contract] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} (contract axis {contract}) do not agree")
    code = ISA_CODES[resolve_isa(isa)]
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {load_error()}")
    n = w.shape[1 - contract]
    call = jax.ffi.ffi_call(BF16_MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, w_kn=np.int64(1 - contract), isa=np.int64(code))


def reference_bf16_matmul(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """XLA's dot of the same product (the reference and the fallback): ``x: [M, K]``,
    ``w`` bfloat16 ([N, K] with contract=1, [K, N] with contract=0) -> ``[M, N] float32``,
    as ``model.compute.Compute.dot`` computes it (``preferred_element_type=float32``)."""
    dims = (((1,), (contract,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Bf16Matmul:
    """``bf16_matmul`` with fixed settings, as a value (hashable, a field of the static
    ``model.compute.Compute``).

    Call: ``(x: [M, K] bfloat16, w: bfloat16 2-D, contract: int) -> [M, N] float32``.

    Attributes:
      isa: as ``bf16_matmul``'s.
      max_rows: products of more rows run XLA's dot (``reference_bf16_matmul``; None: the
        kernel always). The two differ in rounding, so a row's bits then depend on its
        batch's size: leave it None where batch invariance is wanted.
      contracts: the weight layouts the kernel serves (0: [K, N], 1: [N, K]); and
      min_columns: the fewest output columns N it serves. :meth:`serves` says which products
        are the kernel's: a choice by the weight's shape alone, so each matmul of a model is
        always computed one way whatever the row count (the backend policy serves only the
        output head this way: ``(1,)`` and a vocabulary's columns).
    """

    isa: str = "auto"
    max_rows: int | None = None
    contracts: tuple[int, ...] = (0, 1)
    min_columns: int = 0

    def serves(self, contract: int, columns: int) -> bool:
        """Whether a product with a weight of layout ``contract`` and ``columns`` output
        columns is the kernel's (else the caller computes it as it would without the kernel)."""
        return contract in self.contracts and columns >= self.min_columns

    def __call__(self, x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return reference_bf16_matmul(x, w, contract)
        return bf16_matmul(x, w, contract, self.isa)
