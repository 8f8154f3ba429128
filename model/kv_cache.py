"""The paged KV cache of all layers (shared by every decoder in ``model/``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged KV cache of all layers.

    Attributes:
      k, v: [num_layers, kv_heads, num_pages, page_size, head_dim] in the
        KV storage dtype (``kernels_pallas.kv_storage``: uint16 holds bfloat16
        bits; the engine's backend policy picks the storage). Page 0 is the null
        page (padding writes land there).
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
        return KVCache(self.k.at[:, :, dst].set(self.k[:, :, src]),
                       self.v.at[:, :, dst].set(self.v[:, :, src]))

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> "KVCache":
        """An all-zero cache; ``dtype`` is the stored dtype (float32, bfloat16, or uint16 bits)."""
        shape = cls.shape(cfg, num_pages, page_size)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
