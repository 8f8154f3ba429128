"""The int8 x int8 -> int32 matmul kernel as a JAX function (``csrc/int8_matmul.cc``).

    out[m, n] = sum_k x[m, k] * w[n, k]     (contract=1: w is [N, K], e.g. the tied output head)
    out[m, n] = sum_k x[m, k] * w[k, n]     (contract=0: w is [K, N], e.g. a layer matrix)

With ``layer`` given, ``w`` is a stack ``[L, ...]`` of such matrices and the product is with
``w[layer]``, read where it lies: inside a ``lax.scan`` over layers, a weight scanned as ``xs``
is first copied out of its stack by XLA (a dynamic-slice fusion) before a custom call reads it,
two more passes over the weight's bytes than the product itself (benchmarks/RESULTS.md,
2026-12-06 and 2026-12-07); the stack and the index as operands leave one.

The sums are int32 and exact, so the result equals ``jnp.einsum(..., preferred_element_type=
jnp.int32)`` bit for bit, whatever the row count, instruction set or thread split: a row's
result never depends on its batch. With per-row quantized activations and per-channel weight
scales around it, it is the int32 core of ``model.quantization``'s "int8" and "int8x2" dots.

Instruction sets (``isa``): "auto" (the best vector path this CPU runs: avx512 with AVX512_VNNI,
else avx2, else scalar), "avx2", "avx512", "scalar" or "amx" (AMX-INT8 tiles, TDPBSSD, for
products of many rows: ``csrc/int8_matmul_amx.cc``; only on request, where ``kernels_cpu.isas()``
lists "amx_int8": the CPU has AMX-INT8 and Linux lent this process the tiles; x is packed per
call, a [K, N] weight per call into the tiles' layout in a per-thread buffer, an [N, K] weight
read as stored); ``$XLASERVE_CPU_KERNELS_ISA`` sets what "auto" means in this process (tests
force the AVX2 path on an AVX-512 CPU with it or with
the argument). Threads: the output columns are split over XLA's intra-op pool (at most the
cores this process may use; ``$XLASERVE_CPU_KERNELS_THREADS`` caps them, 1: the calling
thread only); products under ``$XLASERVE_CPU_KERNELS_PARALLEL_MACS`` multiply-adds (default
2**25: a layer matrix of a few rows; the output head is split) run on the calling thread.
A [K, N] weight (contract=0) on the avx512 path is read 32 rows at a time across all its
columns; ``$XLASERVE_CPU_KERNELS_KN=strips`` restores the former walk of one 64-column strip
down all of K (a benchmarks' baseline: 2-3x slower on Gemma's [640, 2048]; the same bits).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.library import INT8_MATMUL_STACKED_TARGET, INT8_MATMUL_TARGET, available, load_error

ISAS = ("auto", "avx2", "avx512", "scalar", "amx")
ISA_ENV = "XLASERVE_CPU_KERNELS_ISA"
ISA_CODES = {"auto": 0, "avx2": 1, "avx512": 2, "scalar": 3, "amx": 4}
"""The kernels' ``isa`` attribute values (shared by every kernel of ``csrc/``)."""


def resolve_isa(isa: str) -> str:
    """``isa`` with "auto" replaced by ``$XLASERVE_CPU_KERNELS_ISA`` when that is set.

    Raises:
      ValueError: not one of ``ISAS``.
    """
    if isa == "auto":
        isa = os.environ.get(ISA_ENV) or "auto"
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    return isa


def int8_matmul(x: jax.Array, w: jax.Array, contract: int, isa: str = "auto",
                layer: jax.Array | None = None) -> jax.Array:
    """``x: [M, K] int8`` times ``w`` (int8, [N, K] with contract=1 or [K, N] with contract=0)
    -> ``[M, N] int32``, through the compiled kernel (XLA:CPU only; works under jit).

    With ``layer`` (an int32 scalar, traced or not), ``w`` is ``[L, N, K]`` / ``[L, K, N]`` and
    the product is with ``w[layer]`` (clamped to [0, L - 1], as ``lax.dynamic_index_in_dim``),
    read in place in the stack.

    Raises:
      ValueError: wrong dtypes, ranks or shapes; an unknown isa; K over 65536 (the int32
        sums could overflow).
      RuntimeError: the library is unavailable (``library.load_error`` says why).
      jax.errors.JaxRuntimeError (at run time): this CPU lacks the requested isa.
    """
    stacked = layer is not None
    if x.dtype != jnp.int8 or w.dtype != jnp.int8 or x.ndim != 2 or w.ndim != 2 + stacked:
        raise ValueError(f"int8_matmul takes 2-D int8 x and {3 if stacked else 2}-D int8 w, got "
                         f"{x.dtype}{x.shape}, {w.dtype}{w.shape}")
    if contract not in (0, 1):
        raise ValueError(f"contract must be 0 (w: [K, N]) or 1 (w: [N, K]), got {contract}")
    matrix = w.shape[1:] if stacked else w.shape
    m, k = x.shape
    if matrix[contract] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} (contract axis {contract}) do not agree")
    if k > 65536:
        raise ValueError(f"K = {k} over 65536 could overflow the int32 sums")
    code = ISA_CODES[resolve_isa(isa)]
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {load_error()}")
    n = matrix[1 - contract]
    out = jax.ShapeDtypeStruct((m, n), jnp.int32)
    attrs = dict(w_kn=np.int64(1 - contract), isa=np.int64(code))
    if stacked:
        layer = jnp.asarray(layer, jnp.int32)
        if layer.ndim != 0:
            raise ValueError(f"layer must be a scalar, got shape {layer.shape}")
        return jax.ffi.ffi_call(INT8_MATMUL_STACKED_TARGET, out, vmap_method="sequential")(x, w, layer, **attrs)
    return jax.ffi.ffi_call(INT8_MATMUL_TARGET, out, vmap_method="sequential")(x, w, **attrs)


def reference_int8_matmul(x: jax.Array, w: jax.Array, contract: int, layer: jax.Array | None = None) -> jax.Array:
    """XLA's dot of the same product (the reference and the fallback): ``x: [M, K] int8``,
    ``w`` int8 ([N, K] with contract=1, [K, N] with contract=0; with ``layer``, a stack
    ``[L, ...]`` of them, ``w[layer]`` taken) -> ``[M, N] int32``."""
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    dims = (((1,), (contract,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.int32)


@dataclasses.dataclass(frozen=True)
class Int8Matmul:
    """``int8_matmul`` with fixed settings, as a value (hashable and comparable, so it can be
    a field of a static jit argument such as ``model.compute.Compute``).

    Call: ``(x: [M, K] int8, w: int8 2-D, contract: int, layer=None) -> [M, N] int32``; with
    ``layer`` (int32 scalar) ``w`` is a 3-D stack and ``w[layer]`` is read in place.

    Attributes:
      isa: as ``int8_matmul``'s.
      max_rows: products of more rows run the kernel's "amx" path when ``amx`` is set, else
        XLA's dot (``reference_int8_matmul``), where either is faster (None: the kernel's
        ``isa`` always). All three sums are exact, so a row's result is the same bits on every
        path: the switch keeps batch invariance.
      amx: products over ``max_rows`` rows run the AMX-INT8 tiles (isa "amx"); False: XLA's dot.
      reads_stacked: callers (``model.compute.Compute.layer_weights``) may hand it a layer's
        stack and index; False: they slice the layer out first (the baseline of
        ``benchmarks.engine --cpu-kernels auto-sliced``). The call takes ``layer=`` either way.
    """

    isa: str = "auto"
    max_rows: int | None = None
    reads_stacked: bool = True
    amx: bool = False

    def __call__(self, x: jax.Array, w: jax.Array, contract: int, layer: jax.Array | None = None) -> jax.Array:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            if self.amx:
                return int8_matmul(x, w, contract, "amx", layer)
            return reference_int8_matmul(x, w, contract, layer)
        return int8_matmul(x, w, contract, self.isa, layer)
