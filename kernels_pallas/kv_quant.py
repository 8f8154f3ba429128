"""Quantized KV pages: int8 or fp8 values with a float32 scale per token and KV head.

A quantized cache stores, beside each page of values, a *scale page*::

    data:  [(layers,) kv_heads, num_pages, page_size, head_dim]   int8 or float8_e4m3fn
    scale: [(layers,) kv_heads, num_pages, page_size]             float32

Token t's head-h vector x (head_dim values) is stored symmetrically by its absolute maximum
(absmax quantization, as in LLM.int8(), Dettmers et al. 2022, applied per token and head as
vLLM's and SGLang's fp8 KV caches apply per-head scales)::

    scale = max|x| / QMAX          (QMAX: 127 for int8, 448 for float8_e4m3fn)
    data  = round(x / scale)       (int8: rounded to nearest and clipped; fp8: cast, round-to-nearest-even)
    x'    = data * scale           (dequantized right after a page gather, in float32)

An all-zero vector (the null page, padding) gets scale 0 and dequantizes to 0. The relative
error of a value is at most 1/254 of its vector's absmax for int8 and 2^-4 of the value for
e4m3 (3 mantissa bits).

:class:`QuantizedPages` is a pytree of the two arrays that stands where a cache's ``k`` or
``v`` array stands (``model.kv_cache.KVCache``): the KV write (``write_kv_pages``) and every
attention path (the XLA reference, the Pallas kernels) accept either. Its ``shape`` and
``dtype`` are those of ``data``, so code that reads a cache's geometry reads it unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.kv_storage import from_storage, logical_dtype

KV_FORMATS = ("bfloat16", "int8", "fp8")
"""KV cache formats: bfloat16 values as today (no scales), or quantized with scale pages."""

_QDTYPE = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {"int8": 127.0, "fp8": 448.0}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def quantized_dtype(fmt: str) -> jnp.dtype:
    """The stored value dtype of a quantized format ("int8" or "fp8").

    Raises:
      ValueError: not a quantized format.
    """
    if fmt not in _QDTYPE:
        raise ValueError(f"not a quantized KV format: {fmt!r}; one of {tuple(_QDTYPE)}")
    return _QDTYPE[fmt]


def format_of(dtype) -> str:
    """The quantized format ("int8" or "fp8") of stored value dtype ``dtype`` (uint8: fp8 bits,
    ``kernels_pallas.kv_storage``).

    Raises:
      ValueError: not a quantized value dtype.
    """
    dtype = logical_dtype(dtype)
    for fmt, d in _QDTYPE.items():
        if d == dtype:
            return fmt
    raise ValueError(f"{dtype} is not a quantized KV dtype")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """Quantized KV pages and their scale pages (see the module docstring).

    Attributes:
      data: [..., num_pages, page_size, head_dim] int8 or float8_e4m3fn (or its uint8 bits where
        the backend policy stores bits, ``kernels_pallas.kv_storage``).
      scale: [..., num_pages, page_size] float32 (``data``'s shape without head_dim).
      logical: the dtype dequantized values are handed to attention in (static; bfloat16
        unless the cache was built otherwise).
    """

    data: jax.Array
    scale: jax.Array
    logical: str = dataclasses.field(default="bfloat16", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def format(self) -> str:
        return format_of(self.data.dtype)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], fmt: str, logical="bfloat16", stored=None) -> "QuantizedPages":
        """All-zero pages of ``shape`` ([..., page_size, head_dim]) in format ``fmt``, values
        held in ``stored`` (default: the format's dtype; uint8: fp8 bits)."""
        stored = quantized_dtype(fmt) if stored is None else jnp.dtype(stored)
        if format_of(stored) != fmt:
            raise ValueError(f"{stored} does not hold {fmt} values")
        return cls(jnp.zeros(shape, stored), jnp.zeros(shape[:-1], SCALE_DTYPE), jnp.dtype(logical).name)

    def map(self, fn) -> "QuantizedPages":
        """``fn`` applied to ``data`` and to ``scale`` (an indexing or update that leaves
        head_dim alone, e.g. ``lambda a: a[:, :, ids]``)."""
        return QuantizedPages(fn(self.data), fn(self.scale), self.logical)


def quantize(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantization over the last axis.

    Args:
      x: [..., head_dim], any float dtype.
      fmt: "int8" or "fp8".

    Returns:
      (data [..., head_dim] in ``quantized_dtype(fmt)``, scale [...] float32).

    Raises:
      ValueError: not a quantized format.
    """
    qdtype, qmax = quantized_dtype(fmt), _QMAX[fmt]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    y = x * inv[..., None]
    if fmt == "int8":
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    else:
        y = jnp.clip(y, -qmax, qmax)
    return y.astype(qdtype), scale.astype(SCALE_DTYPE)


def dequantize(data: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``data * scale[..., None]`` in ``dtype`` (computed in float32).

    Args:
      data: [..., head_dim] int8 or float8_e4m3fn (or its uint8 bits); scale: [...] float32.
    """
    return (from_storage(data).astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def logical_kv_dtype(pages) -> jnp.dtype:
    """The dtype attention sees for a cache's ``k``: the dequantized dtype of
    :class:`QuantizedPages`, else the stored dtype (uint16 bits read as bfloat16)."""
    if isinstance(pages, QuantizedPages):
        return jnp.dtype(pages.logical)
    return logical_dtype(pages.dtype)


def split_pages(pages):
    """(values, scale or None): a quantized cache's two arrays, or an array and None."""
    if isinstance(pages, QuantizedPages):
        return pages.data, pages.scale
    return pages, None
