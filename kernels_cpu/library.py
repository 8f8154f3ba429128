"""Finding, loading and registering the compiled kernels (``_kernels.so``).

The library is looked for, in order, at ``$XLASERVE_CPU_KERNELS_LIB`` (a path; tests point
it at a missing file to see the fallback), where Python's import system finds the module
``kernels_cpu._kernels`` (an editable install keeps its build there, outside the source
tree), and beside this file. It is loaded with ctypes once per process and its handlers are
registered as XLA:CPU custom-call targets (``jax.ffi.register_ffi_target``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

import jax

LIBRARY_ENV = "XLASERVE_CPU_KERNELS_LIB"
INT8_MATMUL_TARGET = "xlaserve_int8_matmul"
"""The custom-call target of ``int8_matmul`` (handler ``XlaserveInt8Matmul``)."""
INT8_MATMUL_STACKED_TARGET = "xlaserve_int8_matmul_stacked"
"""The custom-call target of ``int8_matmul`` with a stacked weight and a layer index
(handler ``XlaserveInt8MatmulStacked``)."""
BF16_MATMUL_TARGET = "xlaserve_bf16_matmul"
"""The custom-call target of ``bf16_matmul`` (handler ``XlaserveBf16Matmul``)."""


def library_path() -> Path | None:
    """Where the library is expected (it may not exist): $XLASERVE_CPU_KERNELS_LIB, else the
    installed ``kernels_cpu._kernels`` module's file, else None."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return Path(env)
    try:
        spec = importlib.util.find_spec("kernels_cpu._kernels")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        return Path(spec.origin)
    beside = Path(__file__).with_name("_kernels.so")
    return beside if beside.exists() else None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    path = library_path()
    if path is None:
        return None, "the kernels were not built at install time (no C++ compiler or CMake?)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    try:
        handlers = {INT8_MATMUL_TARGET: lib.XlaserveInt8Matmul,
                    INT8_MATMUL_STACKED_TARGET: lib.XlaserveInt8MatmulStacked,
                    BF16_MATMUL_TARGET: lib.XlaserveBf16Matmul}
    except AttributeError as e:  # an editable install's build from older sources
        return None, f"{path} is older than kernels_cpu/csrc ({e}): run `pip install -e .` again"
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return lib, None


def available() -> bool:
    """True when the library loaded and its targets are registered (loads it on first call)."""
    return _load()[0] is not None


def load_error() -> str | None:
    """Why the library is unavailable (None when it loaded)."""
    return _load()[1]


def isas() -> tuple[str, ...]:
    """The kernels' instruction-set paths this CPU runs: a subset of ("avx2", "avx512", "amx",
    "amx_int8"), plus "scalar" (any CPU); () when the library is unavailable. "avx512" is the
    int8 kernel's (it needs AVX512_VNNI); "amx" the bf16 kernel's tiles (AMX-BF16, lent by
    Linux); "amx_int8" the int8 kernel's tiles (AMX-INT8, lent by Linux: its isa "amx")."""
    lib = _load()[0]
    if lib is None:
        return ()
    bits = lib.xlaserve_cpu_kernels_isas()
    return tuple(n for n, b in (("avx2", 2), ("avx512", 4), ("amx", 8), ("amx_int8", 16)) if bits & b) + ("scalar",)
