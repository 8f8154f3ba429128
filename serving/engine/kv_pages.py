"""Whole KV pages in and out of the device cache: the copies behind KV transfer and the host tier.

Two jitted programs over :class:`~model.kv_cache.KVCache`, one compiled shape
each for a fixed chunk of ``C`` pages (callers pad the page ids with the null
page 0, whose content is never read unmasked):

    read_pages(cache, ids [C] int32)          -> k, v [layers, kv_heads, C, page_size, head_dim]
    write_pages(state, ids [C] int32, k, v)   -> state with those pages overwritten (donated)

A chunk carries every layer of its pages ("layer-stacked"), so moving a
prompt's KV costs ``ceil(pages / C)`` messages, never one per layer and page
(tpu-inference's TPU connector and vLLM's NIXL connector move whole blocks of
all layers the same way). Values are in the cache's storage dtype (uint16
bfloat16 bits on the CPU policy), copied bit for bit.

Both run on the engine loop's thread, ordered with the steps by dispatch
order: a read dispatched before a step that overwrites its pages reads the
old contents; a write dispatched before a step is seen by it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.kv_cache import KVCache


def pad_page_ids(page_ids: Sequence[int], chunk_pages: int) -> np.ndarray:
    """[chunk_pages] int32: the ids, then the null page 0.

    Raises:
      ValueError: more ids than ``chunk_pages``.
    """
    if len(page_ids) > chunk_pages:
        raise ValueError(f"{len(page_ids)} pages do not fit a chunk of {chunk_pages}")
    ids = np.zeros((chunk_pages,), np.int32)
    ids[:len(page_ids)] = page_ids
    return ids


def chunks(page_ids: Sequence[int], chunk_pages: int) -> list[tuple[int, ...]]:
    """``page_ids`` cut into runs of at most ``chunk_pages``, in order."""
    return [tuple(page_ids[i:i + chunk_pages]) for i in range(0, len(page_ids), chunk_pages)]


@jax.jit
def read_pages(cache: KVCache, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pages ``ids`` [C] of every layer: (k, v), each [layers, kv_heads, C, page_size, head_dim]."""
    return cache.k[:, :, ids], cache.v[:, :, ids]


def _write_pages(state, ids: jax.Array, k: jax.Array, v: jax.Array):
    cache = state.kv_cache
    return dataclasses.replace(state, kv_cache=KVCache(cache.k.at[:, :, ids].set(k.astype(cache.k.dtype)),
                                                       cache.v.at[:, :, ids].set(v.astype(cache.v.dtype))))


def write_pages_fn(out_shardings=None):
    """The jitted ``write_pages(state, ids [C], k, v) -> state`` (``state`` donated), with the
    engine's state sharding as its output sharding (None: unsharded)."""
    return jax.jit(_write_pages, donate_argnames=("state",), out_shardings=out_shardings)


def page_bytes(cache: KVCache) -> int:
    """Bytes of one page of every layer, K and V together."""
    L, H, _, ps, D = cache.k.shape
    return 2 * L * H * ps * D * jnp.dtype(cache.k.dtype).itemsize
