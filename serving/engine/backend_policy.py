"""The backend policy: every platform-specific choice of the engine, made once.

The model, the kernels and sampling compute in logical dtypes and never ask
JAX which platform they are on. The engine builds one :class:`BackendPolicy`
from the platform of its devices and the server settings, and hands each
piece what it needs:

    choice                        cpu (XLA:CPU)                         gpu / tpu
    KV-cache and stacked-weight   bfloat16 held as uint16 bits (XLA:CPU  as is
      storage                     scatters and slices bf16 slowly)
    one-row low-precision dots    computed as two rows (matrix-vector   as is
                                  products ~10x slower than 2-row ones)
    argmax over the vocabulary    blocked, 2048 columns (the variadic   jnp.argmax
                                  reduce runs at < 1 GB/s)
    attention implementation      "auto" -> the XLA reference; "pallas" -> the Pallas kernels
                                  (interpreted on CPU, Triton on GPU, Mosaic on TPU)
    MoE expert matmuls ("auto")   capacity einsum up to 128 rows,       ragged_dot (grouped GEMM)
                                  then ragged_dot
    smallest decode bucket        1 row                                 1 row
    sharded steps                 each waits for the previous one       dispatched back to back
                                  (XLA:CPU collectives share one thread
                                  pool and can deadlock when queued)
    batch-invariant reductions    on (bfloat16 serving only)            on (bfloat16 serving only;
                                                                        untested on hardware)
    batch-invariant matmul rows   by the CPU (``cpu_features``): at    (none)
                                  least 4 a tile where bf16 dots are
                                  native (AMX kernels differ below 4
                                  rows), at least 2 where they are not
    int8 x int8 products of the   --cpu-kernels: "auto": our kernel     XLA's dot
      int8 dots                   (``kernels_cpu``, AVX-512 VNNI) up to
                                  4 int8 rows (1-2 token rows of
                                  int8x2) where the CPU has AVX512_VNNI
                                  (SPR Xeon: decode steps 1.3-2.3x at
                                  1 row, 1.1-1.8x at 2, 1.0-1.1x at
                                  4, 0.6x at 8: XLA's AMX dot wins);
                                  above 4 rows the kernel's AMX-INT8
                                  tiles where the CPU has AMX and
                                  Linux lends them (32-stream decode
                                  step 1.04-1.26x, 256-token prefill
                                  0.95-1.18x the XLA dot's; about even
                                  per matmul; 2026-12-07), else and
                                  elsewhere XLA's dot;
                                  "on": the kernel
                                  at every row count (AVX2 path without
                                  VNNI); "off": XLA's dot. Exact integer
                                  sums: the same bits every way; one
                                  device only (no sharding rule). The
                                  kernel reads a layer's matrix in
                                  place in its [L, ...] stack (the
                                  layer scans hand it the stack and
                                  the index: no per-layer copy)
    bfloat16 matrix products      --cpu-kernels: "auto": our kernel     XLA's dot
      (2-D dots of the model)     (``kernels_cpu.Bf16Matmul``) up to 4
                                  rows where the CPU has AVX-512 and
                                  batch invariance is off (head 1.5-
                                  1.7x, layer 1.6-3x at 1-4 rows, 0.7x
                                  at 8); with batch invariance (the
                                  bf16 default) the output head's dot
                                  ([V, D] weight, >= 32768 columns) in
                                  the kernel's AMX path at every row
                                  count where the library runs it
                                  (no row padding; 1.2-1.5x XLA's dot
                                  at 4-64 rows), the rest XLA's dot;
                                  "on": the
                                  kernel at every row count (decode
                                  1.3-1.9x at 1-4 slots, even at 8;
                                  64-token prefill 0.35x); "off":
                                  XLA's dot. Float32 sums in one order
                                  per element, not XLA's order
    dot with an int8 weight       "int8x2": int8 weights x int8         "dequantize": the weight
      (--quantization int8)       activations split in two terms        converted to the matmul
                                  (one dot, int32 accumulation):        dtype inside the dot
                                  1.3-1.8x bf16 at 1-8 rows, even at    (exact for GGUF block
                                  32; converting int8 inside the dot    scales)
                                  runs the head 3-6x slower; GGUF
                                  block scales requantized per channel
    --quantization's default      "int8" for a bf16 model whose file    "none"
      (no flag given)             stores quantized blocks (the default
                                  GGUF) where the int8 dots get our
                                  kernel (--cpu-kernels auto: AVX512
                                  VNNI), one device; "none" otherwise
    int8 weights by row count     steps of up to: 8 token rows where    0: the served dtype always
      (--quantization auto)       bf16 dots are widened (AVX2 EPYC:     (not measured yet)
                                  int8 decode steps 1.2-2.2x faster at
                                  1-8 rows, even at 16, 0.92x at 32);
                                  2 with native bf16 dots (AVX512_BF16
                                  EPYC: the int8x2 dot won at 1-2
                                  rows, even at 8); 32 with AMX (faster
                                  at every count measured); batch
                                  invariance off

Batch invariance: in a low-precision serving dtype the RMSNorm means and the
attention softmax sums run in the fixed order of ``kernels_pallas.ordered_sum``
(``Compute.batch_invariant``, ``AttentionConfig.batch_invariant``): XLA:CPU
otherwise picks a row's summation order by the size of the whole array
(YNNPACK from 8 rows of 640 up, its own loop below), so a request's bfloat16
logits changed with its batch. The matmuls are left to the backend: on XLA:CPU
(YNNPACK) a bfloat16 row's product was measured bitwise the same at every row
count. A float32 model keeps the backend's reductions (``compute(dtype=...)``).
An int8 model keeps the property: the "int8" / "int8x2" dots quantize each row
on their own and accumulate integers (exact in any order), whatever the row
count (one formulation for every bucket, so a row never changes formulation
with its batch); the "dequantize" dot is a plain dot of the dtype's.

The CPU numbers are measurements on the 2-core test machine
(benchmarks/RESULTS.md, 2026-11-30; ``python -m benchmarks.moe_dispatch`` for
the MoE threshold; ``python -m benchmarks.engine --quantization none int8`` and
``python -m benchmarks.quantized_dot`` for the int8 rows, 2026-12-02 and 2026-12-05;
``python -m benchmarks.cpu_kernels`` and ``benchmarks.engine --cpu-kernels off on`` for the
kernels, on a 2-core Sapphire Rapids Xeon, 2026-12-06).
The accelerator column is the plain path, pending measurements on real hardware
(``benchmarks/device.sh``).

int8 weights by row count (``--quantization auto``): the engine holds the served
weights and an int8 copy (``model.factory.quantized_copy``) and runs a step of at
most ``int8_max_rows`` token rows (decode: its batch rows; prefill and verify: its
tokens) with the int8 one, where a few-row int8 dot reads half the bytes and the
CPU's bf16 dot of few rows runs far below its memory bandwidth. A request's tokens
then depend on how many rows share its step, so batch invariance is off with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.attention import AttentionConfig, select_attention
from kernels_pallas.dot_rows import DotRows
from kernels_pallas.kv_storage import storage_dtype, to_storage
from model.compute import MOE_IMPLS, Compute, MoEConfig
from model.quantization import DOT_FORMULATIONS, QuantizedArray, requantize_per_channel
from serving.engine.cpu_features import CpuFeatures, host_cpu

log = logging.getLogger(__name__)

PLATFORMS = ("cpu", "gpu", "tpu")
CPU_KERNELS = ("auto", "on", "off")
CPU_KERNEL_MAX_ROWS = 4
CPU_BF16_KERNEL_MAX_ROWS = 4
CPU_BF16_HEAD_MIN_COLUMNS = 32768
CPU_ARGMAX_BLOCK = 2048
CPU_MOE_CAPACITY_MAX_ROWS = 128
CPU_INVARIANT_DOT_ROWS = DotRows(min_rows=4, tile=16)
CPU_WIDENED_BF16_DOT_ROWS = DotRows(min_rows=2, tile=16)
CPU_WIDENED_BF16_INT8_MAX_ROWS = 8
CPU_BF16_DOT_INT8_MAX_ROWS = 2
CPU_AMX_INT8_MAX_ROWS = 32


@dataclasses.dataclass(frozen=True)
class BackendPolicy:
    """Platform-specific choices of one engine.

    Attributes:
      platform: "cpu", "gpu" or "tpu"; it also picks the storage of bfloat16 KV
        pages and stacked layer weights (``kernels_pallas.kv_storage.storage_dtype``).
      pad_single_row: compute one-row low-precision matmuls as two rows.
      argmax_block: the blocked argmax's block (None: ``jnp.argmax``).
      attention: the paged-attention implementation.
      moe_impl: "auto", "ragged" or "capacity".
      moe_capacity_max_rows: "auto" uses the capacity einsum up to this many rows.
      min_decode_batch: the smallest decode batch bucket (rows).
      sync_sharded_steps: a step on a multi-device mesh waits for the previous one
        before it is dispatched.
      batch_invariant: low-precision models reduce in a fixed order (see above).
      invariant_dot_rows: with batch invariance, the row padding of low-precision
        matmuls (model and decode attention; ``kernels_pallas.dot_rows``).
      quantized_dot: how a dot with an int8 weight runs, "int8x2", "int8" or
        "dequantize" (``model.quantization``); with the int8 ones,
        :meth:`store_params` requantizes block-scaled weights per channel.
      int8_max_rows: steps of at most this many token rows run int8 weights
        (``--quantization auto``, :meth:`int8_rows_for`); 0: every step runs the served ones.
      lora_onehot_max_columns: the LoRA update runs as the one-hot einsum while
        slots x rank is at most this, else as a gather (:meth:`lora_formulation`).
      cpu: the host CPU's features the CPU entries were chosen by (None off the CPU).
      int8_matmul: the integer product of the int8 dots (``Compute.int8_matmul``): a
        ``kernels_cpu.Int8Matmul`` (``--cpu-kernels``, :meth:`cpu_int8_matmul`), or None: XLA's dot.
      bf16_matmul: the bfloat16 matrix products (``Compute.bf16_matmul``): a
        ``kernels_cpu.Bf16Matmul`` (``--cpu-kernels``, :meth:`cpu_bf16_matmul`), or None: XLA's dot.
    """

    platform: str
    pad_single_row: bool = False
    argmax_block: int | None = None
    attention: AttentionConfig = AttentionConfig()
    moe_impl: str = "auto"
    moe_capacity_max_rows: int = 0
    min_decode_batch: int = 1
    sync_sharded_steps: bool = False
    batch_invariant: bool = False
    invariant_dot_rows: DotRows = DotRows()
    quantized_dot: str = "dequantize"
    int8_max_rows: int = 0
    lora_onehot_max_columns: int = 256
    cpu: CpuFeatures | None = None
    int8_matmul: Callable | None = None
    bf16_matmul: Callable | None = None

    def lora_formulation(self, num_slots: int, max_rank: int) -> str:
        """How each row's LoRA update is computed (``model.lora``): "onehot" (two dense dots
        over all ``num_slots`` x ``max_rank`` columns, masked) while that is at most
        ``lora_onehot_max_columns``, else "gather" (each row's own slot)."""
        return "onehot" if num_slots * max_rank <= self.lora_onehot_max_columns else "gather"

    @classmethod
    def for_platform(cls, platform: str, *, attention_impl: str = "auto",
                     moe_impl: str = "auto", batch_invariant: bool | None = None,
                     quantized_dot: str = "auto", cpu: CpuFeatures | None = None,
                     quantization: str = "none", cpu_kernels: str = "off") -> "BackendPolicy":
        """The policy for a platform.

        Args:
          platform: "cpu", "gpu" (also "cuda", "rocm") or "tpu".
          attention_impl: "auto", "xla" or "pallas" (``kernels_pallas.attention``).
          moe_impl: "auto", "ragged" or "capacity" (``model.moe``).
          batch_invariant: fixed-order reductions for low-precision models (None: on
            unless the attention is a Pallas kernel, which has no such mode).
          quantized_dot: "auto" (the table above), "int8x2", "int8" or "dequantize"
            (benchmarks compare them).
          cpu: the CPU's features, for the "cpu" platform (default: this host's,
            ``cpu_features.host_cpu``).
          quantization: the server's ``--quantization``: "auto" sets ``int8_max_rows``
            (:meth:`int8_rows_for`) and, where that is above 0, batch invariance off.
          cpu_kernels: the server's ``--cpu-kernels``, "auto", "on" or "off" (:meth:`cpu_int8_matmul`;
            the CPU only).

        Raises:
          ValueError: an unknown platform, attention_impl, moe_impl, quantized_dot,
            quantization or cpu_kernels; batch invariance asked for with int8 weights by row count.
        """
        platform = "gpu" if platform in ("cuda", "rocm") else platform
        if platform not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r}; one of {PLATFORMS}")
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        if quantized_dot != "auto" and quantized_dot not in DOT_FORMULATIONS:
            raise ValueError(f"quantized_dot must be auto or one of {DOT_FORMULATIONS}, "
                             f"got {quantized_dot!r}")
        if quantized_dot == "auto":
            quantized_dot = "int8x2" if platform == "cpu" else "dequantize"
        if quantization not in ("none", "int8", "auto"):
            raise ValueError(f"quantization must be none, int8 or auto, got {quantization!r}")
        if cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {cpu_kernels!r}")
        attention = select_attention(attention_impl, platform)
        if platform == "cpu":
            cpu = cpu or host_cpu()
        int8_rows = cls.int8_rows_for(platform, cpu) if quantization == "auto" else 0
        if int8_rows and batch_invariant:
            raise ValueError("batch invariance needs one weight format for every step "
                             "(quantization none or int8, not auto)")
        if batch_invariant is None:
            batch_invariant = attention.kernel == "xla" and not int8_rows
        elif batch_invariant and attention.kernel != "xla":
            raise ValueError("batch invariance needs attention_impl xla (or auto)")
        if platform == "cpu":
            dot_rows = CPU_INVARIANT_DOT_ROWS if cpu.bf16_dot else CPU_WIDENED_BF16_DOT_ROWS
            return cls(platform, pad_single_row=True, argmax_block=CPU_ARGMAX_BLOCK,
                       attention=attention, moe_impl=moe_impl,
                       moe_capacity_max_rows=CPU_MOE_CAPACITY_MAX_ROWS, sync_sharded_steps=True,
                       batch_invariant=batch_invariant, invariant_dot_rows=dot_rows,
                       quantized_dot=quantized_dot, int8_max_rows=int8_rows, cpu=cpu,
                       int8_matmul=cls.cpu_int8_matmul(cpu_kernels, cpu),
                       bf16_matmul=cls.cpu_bf16_matmul(cpu_kernels, cpu, batch_invariant))
        return cls(platform, attention=attention, moe_impl=moe_impl, batch_invariant=batch_invariant,
                   quantized_dot=quantized_dot, int8_max_rows=int8_rows)

    @staticmethod
    def int8_rows_for(platform: str, cpu: CpuFeatures | None) -> int:
        """The most token rows of a step that runs int8 weights under ``--quantization auto``
        (the table above; 0: none): where int8x2 beat the bf16 dot in
        ``benchmarks.engine``'s decode steps or ``benchmarks.quantized_dot``'s dots
        (benchmarks/RESULTS.md, 2026-12-02 and 2026-12-05)."""
        if platform != "cpu" or cpu is None:
            return 0
        if cpu.amx:
            return CPU_AMX_INT8_MAX_ROWS
        return CPU_BF16_DOT_INT8_MAX_ROWS if cpu.bf16_dot else CPU_WIDENED_BF16_INT8_MAX_ROWS

    @classmethod
    def default_quantization(cls, platform: str, cpu: CpuFeatures | None = None, *, stored_quantized: bool,
                             dtype: str, cpu_kernels: str = "auto", devices: int = 1) -> str:
        """``--quantization``'s value when the operator gave none: "int8" or "none".

        "int8" where the weights are stored quantized (a GGUF of ggml blocks, e.g. the default
        gemma-3-270m Q4_K_M: ``serving.loading.model_source.stored_quantized``), the served
        dtype is bfloat16, the engine runs on one CPU device and ``--cpu-kernels`` (not "off")
        gives the int8 dots our kernel (:meth:`cpu_int8_matmul`: AVX512_VNNI with "auto"; the
        library built): a one-stream decode step then reads ~262 MB of int8 weights instead of
        ~535 MB of bf16 ones, the layers in place in their stacks (benchmarks/RESULTS.md,
        2026-12-07, "int8 by default"). Everything else keeps "none": float checkpoints (the
        file's own precision), ``--dtype float32`` (the parity path), accelerators and meshes
        (not measured), and CPUs where the kernel is not chosen.

        Args:
          platform: "cpu", "gpu" ("cuda", "rocm") or "tpu".
          cpu: the CPU's features (default: this host's; the "cpu" platform only).
          stored_quantized: the weights' file holds quantized blocks.
          dtype: the served dtype, "bfloat16" or "float32".
          cpu_kernels: the server's ``--cpu-kernels``.
          devices: the devices the model is served on (a mesh's size).

        Raises:
          ValueError: an unknown cpu_kernels.
        """
        if cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, got {cpu_kernels!r}")
        if platform != "cpu" or devices > 1 or not stored_quantized or str(dtype) != "bfloat16":
            return "none"
        return "int8" if cls.cpu_int8_matmul(cpu_kernels, cpu or host_cpu()) is not None else "none"

    @staticmethod
    def cpu_int8_matmul(setting: str, cpu: CpuFeatures) -> Callable | None:
        """The int8 dots' integer product on this CPU for ``--cpu-kernels`` ``setting``: a
        ``kernels_cpu.Int8Matmul``, or None (XLA's dot).

        "auto": the kernel for products of up to ``CPU_KERNEL_MAX_ROWS`` int8 rows (a decode
        step of 2 token rows under "int8x2") where the CPU has AVX512_VNNI, where
        ``benchmarks.cpu_kernels`` measured it faster than XLA's dot (benchmarks/RESULTS.md,
        2026-12-06), else None (the AVX2 path is not measured faster yet); above those rows
        the kernel's AMX-INT8 tiles (``amx=True``) where the CPU has AMX (``cpu.amx``) and the
        library runs them (``kernels_cpu.isas()`` lists "amx_int8": Linux lent the tiles), where
        ``benchmarks.engine --cpu-kernels auto auto-xla-rows`` measured the steps faster than
        with XLA's int8 dot (benchmarks/RESULTS.md, 2026-12-07), else XLA's dot. "on": the
        kernel's vector path at every row count. "off": None. Where the library is missing (no compiler at install
        time) "auto" and "on" log one warning and give None.
        """
        if setting == "off" or (setting == "auto" and not (cpu.avx512 and cpu.int8_dot)):
            return None
        kernels_cpu = _kernels_library(setting)
        if kernels_cpu is None:
            return None
        if setting == "on":
            return kernels_cpu.Int8Matmul()
        amx = cpu.amx and "amx_int8" in kernels_cpu.isas()  # AMX-INT8 and the tiles lent by Linux
        return kernels_cpu.Int8Matmul(max_rows=CPU_KERNEL_MAX_ROWS, amx=amx)

    @staticmethod
    def cpu_bf16_matmul(setting: str, cpu: CpuFeatures, batch_invariant: bool) -> Callable | None:
        """The bfloat16 matrix products on this CPU for ``--cpu-kernels`` ``setting``: a
        ``kernels_cpu.Bf16Matmul``, or None (XLA's dot).

        "auto": the kernel for products of up to ``CPU_BF16_KERNEL_MAX_ROWS`` rows where the
        CPU has AVX-512 (``benchmarks.cpu_kernels`` measured it 1.5-1.7x XLA's dot on the head
        and 1.6-3x on a layer matrix at 1-4 rows, 0.7x at 8; benchmarks/RESULTS.md,
        2026-12-06), but only without batch invariance: the kernel and XLA's dot round
        differently, so switching by row count would make a row's bits depend on its batch.
        With batch invariance (the default for bfloat16) "auto" serves the output head only,
        at every row count, where the CPU has AMX and the library runs its "amx" path: the
        dots with a [N, K] weight of at least ``CPU_BF16_HEAD_MIN_COLUMNS`` columns (a tied
        vocabulary head; chosen by shape, so that matmul is always the kernel's and the
        others always XLA's, each batch-invariant); the AMX path needs no row padding and
        measured 1.2-1.5x XLA's dot on Gemma's head at 4-64 rows (benchmarks/RESULTS.md,
        2026-12-07); without AMX it keeps XLA's dot (the AVX-512 path is slower from 16 rows).
        "on": the kernel at every row count for every 2-D dot (batch-invariant on its own).
        "off": None. Where the library is missing "auto" and "on" log one warning and give None.
        """
        if setting == "off" or (setting == "auto" and not cpu.avx512):
            return None
        if setting == "auto" and batch_invariant and not cpu.amx:
            return None
        kernels_cpu = _kernels_library(setting)
        if kernels_cpu is None:
            return None
        if setting == "on":
            return kernels_cpu.Bf16Matmul()
        if batch_invariant:
            if "amx" not in kernels_cpu.isas():  # no AMX tiles lent to this process
                return None
            return kernels_cpu.Bf16Matmul(isa="amx", contracts=(1,), min_columns=CPU_BF16_HEAD_MIN_COLUMNS)
        return kernels_cpu.Bf16Matmul(max_rows=CPU_BF16_KERNEL_MAX_ROWS)

    @classmethod
    def detect(cls, mesh=None, **kwargs) -> "BackendPolicy":
        """The policy for the platform of ``mesh``'s devices (default: JAX's default backend).

        The one place in the serving path that asks JAX which platform it runs on.
        kwargs: as :meth:`for_platform`. On a mesh of several devices ``cpu_kernels`` is "off":
        the kernels have no sharding rule (XLA would gather their sharded operands), so they
        serve one device only ("on" logs a warning).
        """
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        if mesh is not None and mesh.devices.size > 1 and kwargs.get("cpu_kernels", "off") != "off":
            if kwargs["cpu_kernels"] == "on":
                _warn_once("--cpu-kernels on: the CPU kernels serve one device only; this mesh uses XLA's dots")
            kwargs = {**kwargs, "cpu_kernels": "off"}
        return cls.for_platform(platform, **kwargs)

    def advice(self, dtype, quantized: bool) -> str | None:
        """A line for the operator when the served format is slow on this machine, else None:
        a bfloat16 model without ``--quantization int8`` or ``auto`` on a CPU with no native
        bf16 dot (there int8 weights decode one stream ~1.8x faster; benchmarks/RESULTS.md,
        2026-12-05)."""
        if self.cpu is None or self.cpu.bf16_dot or quantized or jnp.dtype(dtype) != jnp.bfloat16:
            return None
        return ("this CPU has no native bfloat16 dot (%s): bf16 matmuls are widened on the fly; "
                "--quantization int8 decodes a stream ~1.8x faster here (--quantization auto: int8 "
                "weights for steps of up to %d rows only)"
                % (self.cpu.describe(), self.int8_rows_for("cpu", self.cpu)))

    # -- what the pieces receive ------------------------------------------------------

    def compute(self, rules=None, dtype=jnp.float32) -> Compute:
        """What the model's ``__call__`` receives (``model.compute.Compute``).

        Args:
          rules: ``sharding.rules.ShardingRules`` when serving on a mesh: the MoE
            layer's expert, tensor and batch mesh axes are the ones the rules map
            the logical axes "expert", "mlp" and "batch" to.
          dtype: the model's serving dtype: batch invariance (fixed-order
            reductions) applies to a low-precision one; float32 runs as it always has.
        """
        axes = {}
        if rules is not None:
            axes = dict(expert_axis=rules.mesh_axis("expert"), tensor_axis=rules.mesh_axis("mlp"),
                        batch_axis=rules.mesh_axis("batch"))
        invariant = self.batch_invariant and jnp.dtype(dtype) != jnp.float32
        dot_rows = self.invariant_dot_rows if invariant else DotRows()
        attention = dataclasses.replace(self.attention, batch_invariant=invariant, dot_rows=dot_rows)
        return Compute(pad_single_row=self.pad_single_row, attention=attention,
                       moe=MoEConfig(self.moe_impl, self.moe_capacity_max_rows, **axes),
                       batch_invariant=invariant, dot_rows=dot_rows, quantized_dot=self.quantized_dot,
                       int8_matmul=self.int8_matmul, bf16_matmul=self.bf16_matmul)

    def kv_format(self, fmt: str | None, kv_dtype: str) -> str | None:
        """The KV cache's quantized format ("int8", "fp8") or None (pages of ``kv_dtype``).

        ``--kv-cache-dtype auto`` stays unquantized on every platform (bf16 pages, as
        before): int8 and fp8 are chosen, never defaulted. What they buy is capacity (~2x the
        tokens a byte); on XLA:CPU they decode at bf16's speed and move Gemma 3 270M's margins
        (benchmarks/RESULTS.md, "Quantized KV pages"); on accelerators they are untimed.
        The values are stored in ``storage_dtype`` of the format's dtype (fp8 as its uint8
        bits on XLA:CPU, whose float8 scatters convert the whole cache).

        Raises:
          ValueError: an unknown format.
        """
        if fmt not in (None, "int8", "fp8"):
            raise ValueError(f"unknown quantized KV format {fmt!r}")
        return fmt

    def storage_dtype(self, dtype) -> jnp.dtype:
        """The array dtype holding values of logical ``dtype`` (KV cache, stacked weights)."""
        return storage_dtype(dtype, self.platform)

    def store_params(self, state: nnx.State) -> nnx.State:
        """The parameters with every stacked layer weight (leading logical axis "layers")
        in its storage dtype (int8 stays int8), and with the "int8" dot every int8 weight
        with block scales (a GGUF Q8_0 tensor; ``name`` + ``name_scale``) requantized per
        channel; other parameters unchanged."""
        flat = list(nnx.to_flat_state(state))
        if self.quantized_dot != "dequantize":
            flat = _requantize_blocks(flat)
        out = []
        for path, v in flat:
            axes = v.get_metadata().get("logical_axes") or ()
            value = v.get_value()
            stored = self.storage_dtype(value.dtype)
            if axes[:1] == ("layers",) and stored != value.dtype:
                v = v.replace(_stored_weight(value, stored))
            out.append((path, v))
        return nnx.from_flat_state(out)


@functools.cache
def _kernels_library(setting: str):
    """The ``kernels_cpu`` module if its compiled library loads, else None after one warning
    (one line whichever kernels ``--cpu-kernels setting`` wanted: the dots then use XLA's)."""
    import kernels_cpu

    if kernels_cpu.available():
        return kernels_cpu
    _warn_once(f"--cpu-kernels {setting}: the CPU kernels are unavailable "
               f"({kernels_cpu.load_error()}); the dots use XLA's")
    return None


def _warn_once(message: str) -> None:
    log.warning(message)


def _stored_weight(value: jax.Array, stored) -> jax.Array:
    """``value`` in the storage dtype ``stored`` (``kernels_pallas.kv_storage.to_storage``).

    A bfloat16 weight on one CPU device becomes its uint16 bits without a copy: the same
    buffer seen through NumPy (XLA's CPU client lends its buffers to NumPy and adopts an
    aligned NumPy buffer in place). The model built by the loader still holds the bfloat16
    arrays, so a converted copy would hold every stacked weight twice: twice the weights'
    bytes of host memory at start-up (``benchmarks.real_size``).
    """
    if (value.dtype == jnp.bfloat16 and jnp.dtype(stored) == jnp.uint16
            and isinstance(value, jax.Array) and len(value.devices()) == 1
            and next(iter(value.devices())).platform == "cpu"):
        return jax.device_put(np.asarray(value).view(np.uint16), value.sharding)
    return to_storage(value, stored)


def _requantize_blocks(flat: list) -> list:
    """Flat ``(path, Param)`` pairs with every block-scaled int8 weight (its values at
    ``path``, its scales at ``path[:-1] + (name + "_scale",)``) requantized per channel."""
    from model.layers import SCALE_SUFFIX

    index = {path: i for i, (path, _) in enumerate(flat)}
    out = list(flat)
    for path, v in flat:
        name = str(path[-1])
        if not name.endswith(SCALE_SUFFIX):
            continue
        vpath = path[:-1] + (name[:-len(SCALE_SUFFIX)],)
        if vpath not in index:
            continue
        values = flat[index[vpath]][1]
        q = QuantizedArray(values.get_value(), v.get_value())
        r = requantize_per_channel(q)
        if r is not q:  # placed where the block-scaled arrays were (same logical axes)
            out[index[vpath]] = (vpath, values.replace(jax.device_put(r.values, q.values.sharding)))
            out[index[path]] = (path, v.replace(jax.device_put(r.scales, q.scales.sharding)))
    return out
