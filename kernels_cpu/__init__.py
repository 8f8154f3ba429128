"""Matmul kernels of our own for XLA:CPU, called from jitted code through XLA's typed FFI.

``csrc/`` holds the C++ (``bf16_matmul_amx.cc``: the bf16 kernel's AMX tiles;
``int8_matmul_amx.cc``: the int8 kernel's AMX-INT8 tiles for many rows; built by ``pip
install`` with CMake into ``_kernels.so``,
``CMakeLists.txt``; an editable install does not rebuild it by itself: run ``pip install -e .``
again after editing ``csrc/``), ``library.py`` finds and loads it and registers its FFI
targets, ``int8_matmul.py`` and ``bf16_matmul.py`` are the JAX entries. Where no compiler was found at install time the
library is absent, :func:`available` is False, and callers keep XLA's dots (the backend
policy decides).

May import: nothing of ours.
"""

from kernels_cpu.bf16_matmul import Bf16Matmul, bf16_matmul, reference_bf16_matmul
from kernels_cpu.int8_matmul import ISAS, Int8Matmul, int8_matmul, reference_int8_matmul
from kernels_cpu.library import available, isas, load_error

__all__ = ["ISAS", "Bf16Matmul", "Int8Matmul", "available", "bf16_matmul", "int8_matmul", "isas", "load_error", "reference_bf16_matmul", "reference_int8_matmul"]
