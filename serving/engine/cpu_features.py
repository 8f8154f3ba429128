"""What the host CPU computes natively: the facts the backend policy's CPU entries depend on.

XLA:CPU runs a bfloat16 matmul at full speed only where the CPU has bf16 dot
instructions (AVX512_BF16: AMD Zen 4 and later, Intel Cooper Lake; AMX on Intel
Sapphire Rapids and later); elsewhere (AVX2-only x86, e.g. AMD Zen 2/3) each bf16
operand is widened on the fly, and a bf16 decode step of Gemma 3 270M takes 2-3x
as long as on an AVX-512 machine while int8 weights (``--quantization int8``) keep
their speed (benchmarks/RESULTS.md, 2026-12-05, issue 34). Which kernel XLA picks
for a few-row bf16 matmul, and so how many rows the batch-invariant padding needs
(``kernels_pallas.dot_rows``), also differs by CPU.

The features come from NumPy's runtime dispatch table, the one ``numpy.show_runtime()``
prints (NumPy probes CPUID once at import): no new dependency, no /proc parsing.
NumPy does not list AMX; its "AVX512_SPR" group (the AVX-512 set of Sapphire Rapids,
FP16 included) stands for it, as every CPU with that set has AMX tiles.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class CpuFeatures:
    """The CPU capabilities the backend policy reads.

    Attributes:
      avx512: AVX512F.
      bf16_dot: native bfloat16 dot products (AVX512_BF16 or AMX).
      amx: Intel AMX tiles (inferred from NumPy's AVX512_SPR group).
      int8_dot: int8 dot-product instructions (AVX512_VNNI).
    """

    avx512: bool = False
    bf16_dot: bool = False
    amx: bool = False
    int8_dot: bool = False

    @classmethod
    def from_flags(cls, flags: dict[str, bool]) -> "CpuFeatures":
        """From NumPy-style feature names ({"AVX512F": True, "AVX512BF16": False, ...})."""
        amx = bool(flags.get("AVX512_SPR"))
        return cls(avx512=bool(flags.get("AVX512F")), bf16_dot=bool(flags.get("AVX512BF16")) or amx,
                   amx=amx, int8_dot=bool(flags.get("AVX512VNNI")))

    def describe(self) -> str:
        """The features for logs: e.g. "avx512 bf16-dot int8-dot", or "no avx512"."""
        names = [n for n, on in (("avx512", self.avx512), ("bf16-dot", self.bf16_dot), ("amx", self.amx),
                                 ("int8-dot", self.int8_dot)) if on]
        return " ".join(names) if names else "no avx512"


@functools.cache
def host_cpu() -> CpuFeatures:
    """The features of the CPU this process runs on (all False where NumPy does not say)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as flags
    except ImportError:  # NumPy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as flags
        except ImportError:
            flags = {}
    return CpuFeatures.from_flags(dict(flags))
