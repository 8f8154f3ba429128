"""The paged KV cache of all layers (shared by every decoder in ``model/``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.kv_quant import QuantizedPages
from kernels_pallas.kv_storage import logical_dtype
from model.config import ModelConfig


def _take(pages, fn):
    """``fn`` applied to a cache array, or to both arrays of quantized pages."""
    return pages.map(fn) if isinstance(pages, QuantizedPages) else fn(pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged KV cache of all layers.

    Attributes:
      k, v: [num_layers, kv_heads, num_pages, page_size, head_dim] in the
        KV storage dtype (``kernels_pallas.kv_storage``: uint16 holds bfloat16
        bits; the engine's backend policy picks the storage). Page 0 is the null
        page (padding writes land there). A quantized cache holds
        ``kernels_pallas.kv_quant.QuantizedPages`` instead: int8 or float8_e4m3fn values
        of that shape and a float32 scale page [num_layers, kv_heads, num_pages, page_size]
        beside each page.
        Logical axes: ``sharding.rules.KV_CACHE_AXES``.
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @staticmethod
    def shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> "KVCache":
        """The cache with page ``src[i]`` copied onto page ``dst[i]`` in every layer, K and V.

        Args:
          src, dst: [C] int32 page ids; the copies read the cache as it was
            (none reads another's destination). Unused entries copy the
            null page 0 onto itself.
        """
        copy = lambda a: a.at[:, :, dst].set(a[:, :, src])
        return KVCache(_take(self.k, copy), _take(self.v, copy))

    @property
    def quantized(self) -> bool:
        return isinstance(self.k, QuantizedPages)

    @property
    def kv_format(self) -> str:
        """"int8" or "fp8" for a quantized cache, else its values' dtype name ("bfloat16" for
        uint16 bits)."""
        return self.k.format if self.quantized else logical_dtype(self.k.dtype).name

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, kv_format: str | None = None,
              quantized_stored=None) -> "KVCache":
        """An all-zero cache; ``dtype`` is the stored dtype (float32, bfloat16, or uint16 bits),
        or with ``kv_format`` "int8" / "fp8" the dtype dequantized values are read in
        (quantized pages with their scale pages, values held in ``quantized_stored``:
        default the format's dtype; uint8 holds fp8 bits)."""
        shape = cls.shape(cfg, num_pages, page_size)
        if kv_format in ("int8", "fp8"):
            logical = logical_dtype(dtype)
            return cls(*(QuantizedPages.zeros(shape, kv_format, logical, quantized_stored) for _ in "kv"))
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
