"""Weight-only int8 quantization: the quantized weight, quantize / dequantize, and the quantized dot.

A weight ``w`` is held as int8 ``values`` of its own shape and float32
``scales`` of its rank, with ``w ~= values * scales`` (scales broadcast over
blocks of the contraction axis):

  * per output channel (quantizing bfloat16 / float32 weights): each output
    column's absolute maximum maps to 127 over the whole contraction
    (symmetric, round to nearest; the contraction axes of ``scales`` have size 1);
  * per block of 32 contraction values (loading GGUF Q8_0, and the Q4_0 / Q5_0
    types whose blocks are ``d * q`` with small integer q): the GGUF's own
    block scales and integers, so ``dequantize`` gives exactly the float32
    values ``gguf.quants.dequantize`` gives (llama.cpp's ``block_q8_0``).

Two formulations of ``x @ w`` (the backend policy picks one, ``Compute.quantized_dot``):

  * ``"dequantize"``: ``w`` converted to the matmul-input dtype and an ordinary
    dot with float32 accumulation (per-channel scales applied to the output,
    block scales to the weight). Exact for both scale layouts; on XLA:CPU the
    convert fused into the dot of the 262144-row output head runs ~3x slower
    than a bfloat16 dot (benchmarks/RESULTS.md, issue 7).
  * ``"int8"``: the activations quantized per row (symmetric, absolute maximum
    to 127, as LLM.int8() / SmoothQuant's dynamic per-token quantization:
    Dettmers et al. 2022, Xiao et al. 2022), an int8 x int8 dot accumulated in
    int32 (VNNI / AMX on x86), then ``row scale * column scale`` on the output.
    Needs per-channel scales (``requantize_per_channel`` turns block scales
    into them). Integer accumulation is exact, so a row's result never depends
    on its batch neighbours.
  * ``"int8x2"``: as "int8" with each activation row split into two int8 terms,
    ``x ~= s * q_hi + (s / 254) * q_lo`` (the second quantizes the first's
    rounding error), both computed in one dot of 2T rows that reads the weight
    once: ~16-bit activations for the price of an int8 weight read. On Gemma 3
    270M one-term int8 activations moved the golden greedy ids at margins up to
    1.1 logits; two terms leave only the weights' rounding (benchmarks/RESULTS.md).

Logical axes: ``scales`` keep the weight's logical axes except the contraction
axes, which are not split (``scale_axes``), so both place on a mesh by the rules
the float weight uses.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = ("none", "int8")
"""Values of ``--quantization``."""

DOT_FORMULATIONS = ("dequantize", "int8", "int8x2")
"""Values of ``Compute.quantized_dot``."""

GGUF_BLOCK = 32
"""Values per scale in GGUF's Q8_0 / Q4_0 / Q5_0 blocks."""

CONTRACTION_AXES = {
    # the decoders' matmul weights (stacked layouts of model.gemma3 / model.llama): the axes a dot
    # sums over; every other axis is an output channel with its own scale
    "embed": (1,),      # [V, D], the tied output head "sd,vd->sv"
    "lm_head": (0,),    # [D, V]
    "wq": (1,),         # [L, D, N, H]
    "wk": (1,),         # [L, D, K, H]
    "wv": (1,),         # [L, D, K, H]
    "wo": (1, 2),       # [L, N, H, D]
    "w_gate": (1,),     # [L, D, F]
    "w_up": (1,),       # [L, D, F]
    "w_down": (1,),     # [L, F, D]
}
"""Which parameters ``--quantization int8`` quantizes, and their contraction axes."""

_QMAX = 127


def check_quantization(value: str) -> str:
    """``value`` if it is a known quantization, else ValueError naming the choices."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {value!r}")
    return value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """An int8 weight and its scales (a pytree: ``lax.scan`` slices both leaves).

    Attributes:
      values: int8, the weight's shape.
      scales: float32, the weight's rank; size 1 on per-channel contraction axes,
        ``size / block`` on a block-quantized one, the weight's size elsewhere.
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    def reshape(self, rows: int, cols: int) -> "QuantizedArray":
        """As a ``[rows, cols]`` matrix whose leading axes (the contraction, merged into
        ``rows``) come first: ``[D, N, H] -> [D, N*H]``, ``[N, H, D] -> [N*H, D]``."""
        return QuantizedArray(self.values.reshape(rows, cols), self.scales.reshape(-1, cols))

    def full_scales(self) -> jax.Array:
        """``scales`` repeated over each block: the weight's shape (float32)."""
        s = self.scales
        for axis, (n, m) in enumerate(zip(self.values.shape, s.shape)):
            if m != n and m != 1:
                s = jnp.repeat(s, n // m, axis=axis)
        return s

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``values * scales`` (computed in float32, exact for GGUF blocks) in ``dtype``."""
        return (self.values.astype(jnp.float32) * self.full_scales()).astype(dtype)


@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Layer ``layer`` of a stacked ``QuantizedArray``, not sliced out of its stack.

    Built inside a layer scan (``Compute.layer_weights``) for an integer matmul that reads a
    layer's matrix in place (``reads_stacked``, e.g. ``kernels_cpu.Int8Matmul``): a weight
    scanned as ``xs`` is copied out of its stack first, two more passes over its bytes.

    Attributes:
      stack: the weights of every layer, ``values [L, ...]`` int8 with ``scales [L, ...]``.
      layer: int32 scalar, the layer this view is.
    """

    stack: QuantizedArray
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.values.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, rows: int, cols: int) -> "StackedLayer":
        """As ``QuantizedArray.reshape``, each layer's matrix (the stack stays in place)."""
        v, s = self.stack.values, self.stack.scales
        return StackedLayer(QuantizedArray(v.reshape(v.shape[0], rows, cols),
                                           s.reshape(s.shape[0], -1, cols)), self.layer)

    def sliced(self) -> QuantizedArray:
        """This layer's weight as its own ``QuantizedArray`` (a copy out of the stack)."""
        take = lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False)  # noqa: E731
        return QuantizedArray(take(self.stack.values), take(self.stack.scales))


def _scales_for(absmax):
    """float32 scales mapping ``absmax`` to 127 (1 where a channel is all zeros)."""
    s = absmax.astype(jnp.float32) / _QMAX
    return jnp.where(s == 0, jnp.float32(1), s)


def quantize_per_channel(w, contract_axes: tuple[int, ...]) -> QuantizedArray:
    """Symmetric int8 with one scale per output channel.

    Args:
      w: float weight (any float dtype; numpy or jax).
      contract_axes: the axes a dot sums over (``CONTRACTION_AXES``).

    Returns:
      QuantizedArray; each element's error is at most half its channel's scale
      (``max |w| / 254``).
    """
    return QuantizedArray(*_per_channel(w, tuple(contract_axes)))


@functools.partial(jax.jit, static_argnums=1)
def _per_channel(w, contract_axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 scales) of ``quantize_per_channel``: one program per weight shape
    (as eager operations it was one per operation and shape)."""
    w = jnp.asarray(w, jnp.float32)
    s = _scales_for(jnp.max(jnp.abs(w), axis=contract_axes, keepdims=True))
    return jnp.clip(jnp.round(w / s), -_QMAX, _QMAX).astype(jnp.int8), s


def quantize_blocks(w, axis: int, block: int = GGUF_BLOCK) -> QuantizedArray:
    """Symmetric int8 with one scale per ``block`` consecutive values along ``axis``
    (Q8_0's layout, with float32 scales).

    Raises:
      ValueError: the axis is not a multiple of ``block``.
    """
    axis = axis % len(w.shape)
    if w.shape[axis] % block:
        raise ValueError(f"axis {axis} of size {w.shape[axis]} is not a multiple of the block {block}")
    return QuantizedArray(*_blocks(w, axis, block))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _blocks(w, axis: int, block: int) -> tuple[jax.Array, jax.Array]:
    """(int8 values, float32 block scales) of ``quantize_blocks``, one program per shape."""
    w = jnp.asarray(w, jnp.float32)
    split = w.shape[:axis] + (w.shape[axis] // block, block) + w.shape[axis + 1:]
    s = _scales_for(jnp.max(jnp.abs(w.reshape(split)), axis=axis + 1))
    q = jnp.clip(jnp.round(w.reshape(split) / jnp.expand_dims(s, axis + 1)), -_QMAX, _QMAX)
    return q.astype(jnp.int8).reshape(w.shape), s


def is_per_channel(w: QuantizedArray) -> bool:
    """True when every axis of ``scales`` is either the weight's size or 1."""
    return all(m in (n, 1) for n, m in zip(w.values.shape, w.scales.shape))


def requantize_per_channel(w: QuantizedArray) -> QuantizedArray:
    """A block-quantized weight as per-channel int8 (of its exact dequantized values;
    adds per-channel rounding error); a per-channel one unchanged."""
    if is_per_channel(w):
        return w
    axes = tuple(i for i, (n, m) in enumerate(zip(w.values.shape, w.scales.shape)) if m != n)
    return quantize_per_channel(w.dequantize(), axes)


def scale_axes(axes: tuple, contract_axes: tuple[int, ...]) -> tuple:
    """The logical axes of a weight's scales: the weight's, with the contraction axes unsplit."""
    return tuple(None if i in contract_axes else a for i, a in enumerate(axes))


def gguf_blocks(raw: np.ndarray, dequantized: np.ndarray, type_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 integers and float32 block scales of a GGUF Q8_0 / Q4_0 / Q5_0 tensor.

    Each 32-value block of these types starts with its scale ``d`` (float16) and
    holds ``d * q`` for integers q in [-128, 127] (Q8_0), [-8, 7] (Q4_0) or
    [-16, 15] (Q5_0), so ``q = dequantized / d`` exactly, and ``values * scales``
    in float32 equals ``dequantized`` bit for bit (signed zeros included).

    Args:
      raw: the tensor's bytes (uint8, ``type_size`` bytes per block, row-major blocks).
      dequantized: ``gguf.quants.dequantize`` of it, float32 ``(rows, cols)``.
      type_size: bytes per block.

    Returns:
      (values int8 ``(rows, cols)``, scales float32 ``(rows, cols / 32)``).
    """
    rows, cols = dequantized.shape
    d = np.ascontiguousarray(raw.reshape(-1, type_size)[:, :2]).view(np.float16).astype(np.float32)
    d = d.reshape(rows, cols // GGUF_BLOCK)
    blocks = dequantized.reshape(rows, cols // GGUF_BLOCK, GGUF_BLOCK)
    safe = np.where(d == 0, np.float32(1), d)
    # A zero scale gives +-0 (``d * q``'s sign): q = -1 where that sign differs from d's, so
    # that ``values * scales`` keeps the sign bit too (bit-exact, not only equal).
    zero_q = np.where(np.signbit(blocks) != np.signbit(d)[..., None], -1, 0)
    q = np.where(d[..., None] == 0, zero_q, np.rint(blocks / safe[..., None]))
    return q.astype(np.int8).reshape(rows, cols), d


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic symmetric int8 per row: ``x: [T, K]`` float -> (int8 [T, K], float32 scales [T, 1])."""
    x = x.astype(jnp.float32)
    s = _scales_for(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    return jnp.clip(jnp.round(x / s), -_QMAX, _QMAX).astype(jnp.int8), s


def quantize_rows_two_terms(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x: [T, K]`` as two int8 terms per row: (int8 [2T, K] = [q_hi; q_lo], float32
    scales [2T, 1] = [s; s / 254]) with ``x ~= s * q_hi + s / 254 * q_lo`` (error at most
    ``max|x| / 64516`` per element: the low term quantizes the high one's rounding,
    which is at most s / 2)."""
    x = x.astype(jnp.float32)
    hi, s = quantize_rows(x)
    lo_scale = s / (2 * _QMAX)
    lo = jnp.clip(jnp.round((x - hi.astype(jnp.float32) * s) / lo_scale), -_QMAX, _QMAX)
    return jnp.concatenate([hi, lo.astype(jnp.int8)]), jnp.concatenate([s, lo_scale])


def _parse(eq: str, w: QuantizedArray) -> int:
    """The contraction axis of the 2-D weight in ``eq`` (checks the supported form:
    ``x: [T, K]`` with K last, ``w: [K, N]`` or ``[N, K]``, output ``[T, N]``)."""
    ins, out = eq.replace(" ", "").split("->")
    a, b = ins.split(",")
    contract = [i for i, c in enumerate(b) if c not in out]
    if (len(b) != 2 or w.ndim != 2 or len(contract) != 1 or a[-1] != b[contract[0]]
            or out != a[:-1] + b[1 - contract[0]]):
        raise ValueError(f"quantized dot supports 'tk,kn->tn' / 'tk,nk->tn' forms, got {eq!r} "
                         f"with a weight of shape {w.shape}")
    return contract[0]


def quantized_dot(eq: str, x: jax.Array, w: QuantizedArray, dtype, formulation: str,
                  pad_single_row: bool = False, int8_matmul=None) -> jax.Array:
    """``einsum(eq, x, dequantize(w))`` in the given formulation (module docstring).

    Args:
      eq: ``"tk,kn->tn"`` or ``"tk,nk->tn"`` (any letters): x's last axis is the contraction.
      x: [T, K] float activations.
      w: 2-D QuantizedArray, [K, N] or [N, K]; or a ``StackedLayer`` of such matrices, read
        in place by an ``int8_matmul`` with ``reads_stacked`` ("int8" / "int8x2"), else sliced.
      dtype: the matmul-input dtype of the "dequantize" formulation (float32 or bfloat16).
      formulation: "dequantize", "int8" or "int8x2".
      pad_single_row: compute a one-row product as two rows (some backends run
        matrix-vector products far slower; ``Compute.pad_single_row``).
      int8_matmul: the "int8" / "int8x2" dots' integer product ``(xq: [M, K] int8, w.values,
        contract axis[, layer=]) -> [M, N] int32`` (``Compute.int8_matmul``: a kernel the backend chose);
        None: ``jnp.einsum`` with int32 accumulation. Integer sums are exact, so both give
        the same bits.

    Returns:
      [T, N] float32.

    Raises:
      ValueError: an unknown formulation, an unsupported equation, or "int8"
        with block scales (requantize them per channel first).
    """
    if formulation not in DOT_FORMULATIONS:
        raise ValueError(f"quantized dot formulation must be one of {DOT_FORMULATIONS}, "
                         f"got {formulation!r}")
    stacked = None
    if isinstance(w, StackedLayer):
        if formulation in ("int8", "int8x2") and getattr(int8_matmul, "reads_stacked", False):
            stacked = w
            w = QuantizedArray(jax.ShapeDtypeStruct(w.shape, jnp.int8),  # (values: their shape only)
                               jax.lax.dynamic_index_in_dim(w.stack.scales, w.layer, 0, keepdims=False))
        else:
            w = w.sliced()
    c = _parse(eq, w)
    rows = x.shape[0]
    # (int8x2 already computes 2 rows for one)
    padded = pad_single_row and rows == 1 and ((formulation == "int8" and int8_matmul is None) or (
        formulation == "dequantize" and jnp.dtype(dtype) != jnp.float32))
    if padded:
        x = jnp.concatenate([x, x])
    per_channel = w.scales.shape[c] == 1
    if formulation in ("int8", "int8x2"):
        if not per_channel:
            raise ValueError(f"the {formulation} dot needs per-channel scales; requantize_per_channel first")
        xq, xs = quantize_rows(x) if formulation == "int8" else quantize_rows_two_terms(x)
        if stacked is not None:
            acc = int8_matmul(xq, stacked.stack.values, c, layer=stacked.layer)
        elif int8_matmul is not None:
            acc = int8_matmul(xq, w.values, c)
        else:
            acc = jnp.einsum(eq, xq, w.values, preferred_element_type=jnp.int32)
        acc = acc.astype(jnp.float32) * xs
        if formulation == "int8x2":
            acc = acc[:rows] + acc[rows:]
        out = acc * w.scales.reshape(1, -1)
    elif per_channel:
        out = jnp.einsum(eq, x.astype(dtype), w.values.astype(dtype),
                         preferred_element_type=jnp.float32) * w.scales.reshape(1, -1)
    else:
        out = jnp.einsum(eq, x.astype(dtype), w.dequantize(dtype), preferred_element_type=jnp.float32)
    return out[:rows] if padded else out
