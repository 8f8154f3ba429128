"""The paged KV cache of all layers (shared by every decoder in ``model/``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.kv_storage import storage_dtype
from model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged KV cache of all layers.

    Attributes:
      k, v: [num_layers, kv_heads, num_pages, page_size, head_dim] in the
        KV storage dtype (``kernels_pallas.kv_storage``: bfloat16 is held as
        uint16 bits on XLA:CPU). Page 0 is the null page (padding writes land there).
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

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> "KVCache":
        shape = cls.shape(cfg, num_pages, page_size)
        stored = storage_dtype(dtype)  # bf16 is kept as uint16 bits on XLA:CPU
        return cls(jnp.zeros(shape, stored), jnp.zeros(shape, stored))
