"""Whole KV pages in and out of the device cache: the copies behind KV transfer and the host tier.

Two jitted programs over :class:`~model.kv_cache.KVCache`, one compiled shape
each for a fixed chunk of ``C`` pages (callers pad the page ids with the null
page 0, whose content is never read unmasked):

    read_pages(cache, ids [C] int32)            -> {name: array}: the chunk's payload
    write_pages(state, ids [C] int32, payload)  -> state with those pages overwritten (donated)

A payload is a dict of named arrays (:func:`payload_names`): "k" and "v", each
[layers, kv_heads, C, page_size, head_dim] in the storage dtype, and for a
quantized cache (``kernels_pallas.kv_quant``, int8 or fp8) also "k_scale" and
"v_scale", each [layers, kv_heads, C, page_size] float32: the scale pages travel
with their pages, bit for bit. Whoever stores a payload (the host tier, KV
transfer) keeps every array it holds and gives them all back.

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

from kernels_pallas.kv_quant import QuantizedPages, split_pages
from model.kv_cache import KVCache


def payload_names(cache: KVCache) -> tuple[str, ...]:
    """The arrays of a page payload of ``cache``: ("k", "v"), or with scale pages
    ("k", "k_scale", "v", "v_scale")."""
    return ("k", "k_scale", "v", "v_scale") if cache.quantized else ("k", "v")


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
def read_pages(cache: KVCache, ids: jax.Array) -> dict[str, jax.Array]:
    """Pages ``ids`` [C] of every layer: the payload {name: [layers, kv_heads, C, page_size(, head_dim)]}
    (:func:`payload_names`)."""
    out = {}
    for name, pages in (("k", cache.k), ("v", cache.v)):
        data, scale = split_pages(pages)
        out[name] = data[:, :, ids]
        if scale is not None:
            out[f"{name}_scale"] = scale[:, :, ids]
    return out


def _write_pages(state, ids: jax.Array, payload: dict[str, jax.Array]):
    cache = state.kv_cache

    def put(pages, name):
        if isinstance(pages, QuantizedPages):
            return QuantizedPages(pages.data.at[:, :, ids].set(payload[name].astype(pages.data.dtype)),
                                  pages.scale.at[:, :, ids].set(payload[f"{name}_scale"].astype(pages.scale.dtype)),
                                  pages.logical)
        return pages.at[:, :, ids].set(payload[name].astype(pages.dtype))

    return dataclasses.replace(state, kv_cache=KVCache(put(cache.k, "k"), put(cache.v, "v")))


def write_pages_fn(out_shardings=None):
    """The jitted ``write_pages(state, ids [C], payload) -> state`` (``state`` donated), with the
    engine's state sharding as its output sharding (None: unsharded)."""
    return jax.jit(_write_pages, donate_argnames=("state",), out_shardings=out_shardings)


def check_payload(cache: KVCache, payload) -> None:
    """Raises ValueError unless ``payload`` holds exactly ``cache``'s arrays (its format's)."""
    if set(payload) != set(payload_names(cache)):
        raise ValueError(f"KV pages with arrays {sorted(payload)} do not fit a {cache.kv_format} cache "
                         f"(arrays {sorted(payload_names(cache))})")


def page_bytes(cache: KVCache) -> int:
    """Bytes of one page of every layer, K and V together, scale pages included."""
    L, H, _, ps, D = cache.k.shape
    total = 0
    for pages in (cache.k, cache.v):
        data, scale = split_pages(pages)
        total += L * H * ps * D * jnp.dtype(data.dtype).itemsize
        if scale is not None:
            total += L * H * ps * jnp.dtype(scale.dtype).itemsize
    return total
