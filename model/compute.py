"""What a decoder needs from the platform it runs on, handed to it by its caller.

The decoders in ``model/`` compute in logical dtypes and never ask JAX which
platform they run on. Every backend-specific choice they depend on arrives in
one static :class:`Compute` argument of ``__call__``, made once by the engine's
backend policy (``serving.engine.backend_policy``):

  * how a matmul with very few rows is computed (``pad_single_row``, ``dot_rows``),
  * which paged-attention implementation and block sizes run (``attention``),
  * how the MoE expert matmuls run and over which mesh axes (``moe``),
  * whether a row's reductions keep one order whatever shares its batch
    (``batch_invariant``: the norms here, the attention softmax in ``attention``),
  * how a dot with an int8 weight is computed (``quantized_dot``, ``model.quantization``),
    and by what integer matmul (``int8_matmul``: a kernel of the backend's, or XLA's dot),
  * how a bfloat16 matrix product is computed (``bf16_matmul``: a kernel of the backend's,
    or XLA's dot),
  * how each row's LoRA update is computed (``lora``, ``model.lora``).

The defaults are the plain reference path (what a reader of the model expects):
``einsum`` dots, the pure-XLA attention, ``ragged_dot`` experts, no mesh axes.

Weights may arrive in a storage representation (bfloat16 held as uint16 bits,
``kernels_pallas.kv_storage``); :meth:`Compute.load` turns a stored array back
into its logical dtype and is a no-op for everything else (int8 weights,
``model.quantization.QuantizedArray``, stay int8 until their dot).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from kernels_pallas.attention import AttentionConfig
from kernels_pallas.dot_rows import DotRows, repeat_last
from kernels_pallas.kv_storage import from_storage
from kernels_pallas.ordered_sum import ordered_sum
from model.lora import LORA_FORMULATIONS, lora_delta
from model.quantization import DOT_FORMULATIONS, QuantizedArray, StackedLayer, quantized_dot

MOE_IMPLS = ("auto", "ragged", "capacity")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How the mixture-of-experts layers run (see ``model.moe``).

    Attributes:
      impl: "ragged" (grouped matmul with ``jax.lax.ragged_dot``), "capacity"
        (dense one-hot dispatch), or "auto": "capacity" for at most
        ``capacity_max_rows`` token-expert assignment rows, else "ragged".
      capacity_max_rows: the "auto" threshold (0: always "ragged").
      expert_axis: the mesh axis the experts are split over (None: not split).
      tensor_axis: the mesh axis each expert's hidden columns are split over (None: not split).
      batch_axis: the mesh axis tokens are split over besides the expert axis (None: not split).
    """

    impl: str = "auto"
    capacity_max_rows: int = 0
    expert_axis: str | None = None
    tensor_axis: str | None = None
    batch_axis: str | None = None

    def __post_init__(self):
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {self.impl!r}")


@dataclasses.dataclass(frozen=True)
class Compute:
    """Platform-dependent choices a decoder receives (static: part of every compiled step).

    Attributes:
      pad_single_row: compute a one-row low-precision matmul as a two-row one
        (some backends run matrix-vector products far slower than small matrix
        products; the backend policy knows which).
      attention: the paged-attention implementation (``kernels_pallas.attention``).
      moe: the MoE implementation and mesh axes.
      dot_rows: the rows a low-precision matmul of few rows runs with, so a row's
        result does not depend on how many rows share it (``kernels_pallas.dot_rows``;
        the backend policy sets it with batch invariance).
      batch_invariant: the reductions of the decoder's own layers (the RMSNorm mean,
        :meth:`mean`) run in the fixed order of ``kernels_pallas.ordered_sum``, so
        a row's result never depends on how many rows share the step (the
        attention's softmax follows ``attention.batch_invariant``).
      quantized_dot: how :meth:`dot` computes with an int8 weight: "dequantize"
        (convert it to the matmul-input dtype; exact for any scale layout) or
        "int8" (dynamically quantized int8 activations, int32 accumulation;
        per-channel scales only). See ``model.quantization``.
      lora: how :meth:`lora_dot` computes each row's LoRA update: "onehot" (dense
        over every slot, masked) or "gather" (each row's own slot); ``model.lora``.
      int8_matmul: the integer product of the "int8" / "int8x2" dots, ``(xq: [M, K] int8,
        w: int8 [K, N] or [N, K], contract axis of w) -> [M, N] int32`` exactly (a kernel the
        backend policy chose, e.g. ``kernels_cpu.Int8Matmul``; hashable, as this class is a
        static argument); None: XLA's dot. One with a true ``reads_stacked`` also takes a
        stack ``[L, ...]`` and ``layer=`` (int32 scalar) and reads that layer in place; the
        layer scans then hand it their int8 matrices unsliced (:meth:`layer_weights`).
      bf16_matmul: how :meth:`dot` computes a bfloat16 product of a 2-D ``[rows, K]`` by a
        2-D weight (``"tk,kn->tn"`` / ``"tk,nk->tn"`` forms): ``(a: [M, K] bfloat16, b:
        bfloat16 [K, N] or [N, K], contract axis of b) -> [M, N] float32`` for the products its
        ``serves(contract, N)`` accepts (a kernel the backend policy chose, e.g.
        ``kernels_cpu.Bf16Matmul``; it must keep a row's result independent of the row count, as
        it replaces the ``dot_rows`` padding); the others, and None: XLA's dot.
    """

    pad_single_row: bool = False
    attention: AttentionConfig = AttentionConfig()
    moe: MoEConfig = MoEConfig()
    batch_invariant: bool = False
    dot_rows: DotRows = DotRows()
    quantized_dot: str = "dequantize"
    lora: str = "onehot"
    int8_matmul: Callable | None = None
    bf16_matmul: Callable | None = None

    def __post_init__(self):
        if self.quantized_dot not in DOT_FORMULATIONS:
            raise ValueError(f"quantized_dot must be one of {DOT_FORMULATIONS}, got {self.quantized_dot!r}")
        if self.lora not in LORA_FORMULATIONS:
            raise ValueError(f"lora must be one of {LORA_FORMULATIONS}, got {self.lora!r}")

    def lora_dot(self, x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array, dtype) -> jax.Array:
        """Each row's LoRA update ``(x[t] @ a[slot[t]]) @ b[slot[t]]`` (``model.lora.lora_delta``).

        Args:
          x: [T, in]; a: [S, in, R]; b: [S, R, out] (scaling folded in);
          token_slots: [T] int32; dtype: the matmul-input dtype.

        Returns:
          [T, out] float32.
        """
        return lora_delta(x, a, b, token_slots, dtype, self.lora)

    def mean(self, x: jax.Array) -> jax.Array:
        """Mean over the last axis, keepdims: ``x: [..., n]`` -> ``[..., 1]`` in x's dtype
        (``jnp.mean``, or with ``batch_invariant`` the ordered sum divided by n)."""
        if self.batch_invariant:
            return ordered_sum(x, keepdims=True) / x.shape[-1]
        return jnp.mean(x, axis=-1, keepdims=True)

    def dot(self, eq: str, a: jax.Array, b, dtype) -> jax.Array:
        """``einsum(eq, a, b)`` with both inputs in ``dtype`` and float32 accumulation.

        A low-precision ``a`` whose leading axis is rows (not in ``b``) is computed with
        ``dot_rows.count(rows)`` rows (at least 2 with ``pad_single_row``), its last row
        repeated; only the real rows come back.

        Args:
          eq: an einsum equation whose first operand's leading axis is the rows (tokens).
          a, b: the operands (any float dtype; cast to ``dtype``); ``b`` may be a 2-D
            ``QuantizedArray``, computed as ``quantized_dot`` says.
          dtype: the matmul-input dtype (float32 or bfloat16).

        Returns:
          float32 result.
        """
        if isinstance(b, (QuantizedArray, StackedLayer)):
            return quantized_dot(eq, a, b, dtype, self.quantized_dot, self.pad_single_row, self.int8_matmul)
        a, b = a.astype(dtype), b.astype(dtype)
        if self.bf16_matmul is not None and a.dtype == jnp.bfloat16:
            contract = matrix_contract_axis(eq)
            if (contract is not None and a.ndim == 2 and b.ndim == 2
                    and self.bf16_matmul.serves(contract, b.shape[1 - contract])):
                return self.bf16_matmul(a, b, contract)
        rows = a.shape[0]
        padded = rows
        if a.dtype != jnp.float32 and eq[0] not in eq.split("->")[0].split(",")[1]:  # rows: not in b
            padded = self.dot_rows.count(rows)
            if self.pad_single_row and padded == 1:
                padded = 2
        if padded > rows:
            return jnp.einsum(eq, repeat_last(a, padded), b, preferred_element_type=jnp.float32)[:rows]
        return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)

    @staticmethod
    def load(w):
        """A stored weight (any shape) as its logical dtype (uint16 bits -> bfloat16); a
        ``QuantizedArray`` as it is."""
        return w if isinstance(w, (QuantizedArray, StackedLayer)) else from_storage(w)

    def layer_weights(self, params: dict) -> tuple[dict, dict]:
        """The stacked layer weights ``params`` (name -> ``[L, ...]`` array or QuantizedArray)
        split in (scanned, resident): a layer scan takes ``scanned`` as its ``xs`` (XLA slices
        each layer out) and closes over ``resident``, whose layer it views with
        :meth:`layer_view`. Resident: the int8 matrices, when ``int8_matmul`` reads a layer of
        a stack in place (``reads_stacked``) and the dot formulation is "int8" / "int8x2";
        else nothing (every weight scanned, as before)."""
        if not (getattr(self.int8_matmul, "reads_stacked", False) and self.quantized_dot in ("int8", "int8x2")):
            return params, {}
        resident = {n: w for n, w in params.items() if isinstance(w, QuantizedArray) and w.ndim >= 3}
        return {n: w for n, w in params.items() if n not in resident}, resident

    @staticmethod
    def layer_view(resident: dict, layer: jax.Array) -> dict:
        """Layer ``layer`` (int32 scalar) of each of :meth:`layer_weights`' resident weights,
        as a ``model.quantization.StackedLayer`` (read in place by the int8 matmul)."""
        return {n: StackedLayer(w, layer) for n, w in resident.items()}


def matrix_contract_axis(eq: str) -> int | None:
    """For a matrix product ``"tk,kn->tn"`` (0) or ``"tk,nk->tn"`` (1), any letters: the axis
    of the second operand that is summed; None for any other equation."""
    try:
        ins, out = eq.replace(" ", "").split("->")
        a, b = ins.split(",")
    except ValueError:
        return None
    if len(a) != 2 or len(b) != 2 or len(set(a + b)) != 3 or a[1] not in b or a[0] in b:
        return None
    contract = b.index(a[1])
    return contract if out == a[0] + b[1 - contract] else None


REFERENCE = Compute()
"""The plain reference path: the default of every decoder's ``__call__``."""
