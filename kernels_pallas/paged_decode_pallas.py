"""Paged decode attention as a Pallas kernel (GPU/Triton-style; runs in interpret mode on CPU).

One program per (slot, kv head). It walks only the page blocks that hold the
slot's live tokens (from the first page inside the sliding window to
``cdiv(length, block)``), gathers ``pages_per_block`` pages per iteration
through the slot's page-table row, and keeps an online softmax (Milakov &
Gimelshein, "Online normalizer calculation for softmax", 2018; as in
FlashAttention) in float32. All query heads that share a KV head are one
block of rows (GQA/MQA), padded to ``_MIN_ROWS`` because Triton dots want at
least 16 rows.

Same signature and semantics as ``paged_decode_attention_xla`` (the
reference): ``layer`` selects a layer of the stacked cache inside the kernel,
so a layer scan never copies the cache. Keys outside the window or past the
length, and pages the slot does not own, never reach the output: scores are
masked before the max and values are zeroed before the weighted sum, so even
NaN garbage there is harmless.

Block sizes come from ``kernels_pallas.block_sizes``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.block_sizes import decode_block_sizes
from kernels_pallas.kernel_io import as_stacked_cache, cache_refs, load_pages

_MIN_ROWS = 16
_MASK_VALUE = -1e30


def _decode_kernel(layer_ref, window_ref, lengths_ref, page_table_ref, q_ref, *refs, quantized: bool,
                   scale: float, soft_cap: float | None, pages_per_block: int, page_size: int,
                   num_cols: int):
    k_ref, ks_ref, v_ref, vs_ref, o_ref = cache_refs(refs, quantized)
    b = pl.program_id(0)
    h = pl.program_id(1)
    layer = layer_ref[0]
    window = window_ref[0]
    length = lengths_ref[b]
    block_tokens = pages_per_block * page_size
    q = q_ref[0, 0].astype(jnp.float32)  # [rows, d]
    rows, head_dim = q.shape
    q_pos = length - 1
    first_tok = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)
    start = first_tok // block_tokens
    end = jnp.minimum(pl.cdiv(length, block_tokens), num_cols // pages_per_block)

    def body(i, carry):
        o, m, l = carry
        pages = page_table_ref[b, pl.ds(i * pages_per_block, pages_per_block)]  # [ppb]
        k = load_pages(k_ref, ks_ref, (layer, h, pages)).reshape(block_tokens, head_dim)
        v = load_pages(v_ref, vs_ref, (layer, h, pages)).reshape(block_tokens, head_dim)
        pos = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        valid = (pos < length) & (pos >= first_tok)  # [block]
        s = jnp.dot(q, k.T) * scale  # [rows, block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(valid[None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        v = jnp.where(valid[:, None], v, 0.0)
        o = o * corr[:, None] + jnp.dot(p, v)
        l = l * corr + p.sum(axis=-1)
        return o, m_new, l

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(start, end, body, init)
    o_ref[0, 0] = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


def _compiler_params():
    """Triton on NVIDIA/AMD GPUs (Pallas' default GPU lowering is Mosaic GPU)."""
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=4, num_stages=2)


def paged_decode_attention_pallas(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    *,
    scale: float,
    sliding_window=None,
    soft_cap: float | None = None,
    layer=None,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """One query token per slot against that slot's pages (see the module docstring).

    Args:
      q: [slots, num_heads, head_dim].
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], or with
        ``layer`` the stacked [num_layers, kv_heads, num_pages, page_size, head_dim]; or
        ``kernels_pallas.kv_quant.QuantizedPages`` (dequantized right after each page gather).
      lengths: [slots] int32, tokens in the cache including the current one (0: padding slot).
      page_table: [slots, P] int32.
      scale: multiplies q.k.
      sliding_window: None or an int / int32 scalar (<= 0: unlimited).
      soft_cap: optional tanh soft-cap on scores.
      layer: None or an int / int32 scalar selecting the layer of a stacked cache.
      pages_per_block: pages gathered per inner iteration (default: the block-size
        table's GPU row; ``kernels_pallas.attention`` passes the row of the backend it runs on).
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      [slots, num_heads, head_dim] in q's dtype; padding slots get 0.

    Raises:
      ValueError: num_heads not a multiple of kv_heads.
    """
    slots, num_heads, head_dim = q.shape
    k_pages, v_pages, k_scale, v_scale, layer, group = as_stacked_cache(k_pages, v_pages, layer, num_heads)
    _, kv_heads, _, page_size, _ = k_pages.shape
    rows = max(_MIN_ROWS, group)
    ppb = pages_per_block or decode_block_sizes("gpu", head_dim, page_size).pages_per_block
    num_cols = page_table.shape[1]
    ppb = min(ppb, num_cols)
    if num_cols % ppb:  # pad the table with null pages to whole blocks
        page_table = jnp.pad(page_table, ((0, 0), (0, ppb - num_cols % ppb)))
        num_cols = page_table.shape[1]
    qg = q.reshape(slots, kv_heads, group, head_dim)
    if rows > group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    quantized = k_scale is not None
    cache = (k_pages, k_scale, v_pages, v_scale) if quantized else (k_pages, v_pages)
    kernel = functools.partial(_decode_kernel, quantized=quantized, scale=scale, soft_cap=soft_cap, pages_per_block=ppb,
                               page_size=page_size, num_cols=num_cols)
    full = lambda shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
    out = pl.pallas_call(
        kernel,
        grid=(slots, kv_heads),
        in_specs=[
            full((1,)), full((1,)), full(lengths.shape), full(page_table.shape),
            pl.BlockSpec((1, 1, rows, head_dim), lambda b, h: (b, h, 0, 0)),
            *(full(x.shape) for x in cache),
        ],
        out_specs=pl.BlockSpec((1, 1, rows, head_dim), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(),
        name="xlaserve_paged_decode",
    )(layer_arr, window, lengths.astype(jnp.int32), page_table.astype(jnp.int32), qg, *cache)
    return out[:, :, :group].reshape(slots, num_heads, head_dim)
