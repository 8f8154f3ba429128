"""Chunked-prefill paged attention as a Pallas kernel (GPU/Triton-style; interpret mode on CPU).

The prefill step's ragged batch: sequence s owns query tokens
``cu_q_lens[s]:cu_q_lens[s+1]``, the last ``q_len`` positions before
``kv_lens[s]`` (its cached prefix plus this chunk, whose K/V are already in
the pages). One program per (sequence, kv head, query block)::

    grid = (max_seqs, kv_heads, cdiv(T, block_q))
    program (s, h, j): query rows cu[s] + j*bq ... (clipped to the sequence)
                       x every query head of kv head h   -> one [bq * group, head_dim] tile
                       walks the page blocks from the first key any row may see
                       (causal + sliding window) to the last, online softmax

Each program writes its rows into a per-sequence output slab
``[max_seqs, T, heads, head_dim]``; the ragged output is gathered from it
afterwards, so no two programs ever write the same element and no masked
stores are needed. Programs past a sequence's rows run zero iterations.

Same signature and semantics as ``paged_prefill_attention_xla``. Masking
makes keys outside a row's window, past kv_len and in pages the sequence does
not own unable to reach the output (scores masked before the max, values
zeroed before the weighted sum), so NaN garbage there is harmless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.block_sizes import prefill_block_sizes
from kernels_pallas.kernel_io import as_stacked_cache, cache_refs, load_pages, ragged_from_slabs
from kernels_pallas.paged_decode_pallas import _MASK_VALUE, _compiler_params


def _prefill_kernel(layer_ref, window_ref, cu_ref, kv_lens_ref, num_seqs_ref, page_table_ref, q_ref,
                    *refs, quantized: bool, scale: float, soft_cap: float | None, block_q: int,
                    group: int, pages_per_block: int, page_size: int, num_cols: int):
    k_ref, ks_ref, v_ref, vs_ref, o_ref = cache_refs(refs, quantized)
    s = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    layer = layer_ref[0]
    window = window_ref[0]
    head_dim = q_ref.shape[-1]
    real = s < num_seqs_ref[0]
    q_begin = cu_ref[s]
    q_len = jnp.where(real, cu_ref[s + 1] - q_begin, 0)
    kv_len = jnp.where(real, kv_lens_ref[s], 0)
    first_row = j * block_q
    rows_here = jnp.clip(q_len - first_row, 0, block_q)  # real query rows of this block
    # Row r (token first_row + r of the chunk) sits at this position:
    row_pos = kv_len - q_len + first_row + jnp.arange(block_q, dtype=jnp.int32)
    row_pos = jnp.repeat(row_pos, group)  # [bq * group], query heads of a token are adjacent
    row_ok = jnp.repeat(jnp.arange(block_q) < rows_here, group)
    q = q_ref[pl.ds(q_begin + first_row, block_q), h].reshape(block_q * group, head_dim)
    q = q.astype(jnp.float32)
    block_tokens = pages_per_block * page_size
    last_pos = kv_len - q_len + first_row + rows_here - 1
    lo_pos = jnp.where(window > 0, jnp.maximum(kv_len - q_len + first_row - window + 1, 0), 0)
    start = lo_pos // block_tokens
    end = jnp.where(rows_here > 0,
                    jnp.minimum(pl.cdiv(last_pos + 1, block_tokens), num_cols // pages_per_block), start)

    def body(i, carry):
        o, m, l = carry
        pages = page_table_ref[s, pl.ds(i * pages_per_block, pages_per_block)]
        k = load_pages(k_ref, ks_ref, (layer, h, pages)).reshape(block_tokens, head_dim)
        v = load_pages(v_ref, vs_ref, (layer, h, pages)).reshape(block_tokens, head_dim)
        key_pos = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        valid = ((key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
                 & row_ok[:, None])
        valid &= (window <= 0) | (row_pos[:, None] - key_pos[None, :] < window)
        sc = jnp.dot(q, k.T) * scale  # [rows, block]
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        sc = jnp.where(valid, sc, _MASK_VALUE)
        m_new = jnp.maximum(m, sc.max(axis=-1))
        p = jnp.where(valid, jnp.exp(sc - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        key_ok = key_pos < kv_len
        v = jnp.where(key_ok[:, None], v, 0.0)
        o = o * corr[:, None] + jnp.dot(p, v)
        l = l * corr + p.sum(axis=-1)
        return o, m_new, l

    rows = block_q * group
    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(start, end, body, init)
    o = o / jnp.maximum(l, 1e-30)[:, None]
    o_ref[0, :, 0] = o.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def paged_prefill_attention_pallas(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    sliding_window=None,
    soft_cap: float | None = None,
    layer=None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """A ragged batch of prompt chunks against their sequences' pages (see the module docstring).

    Args:
      q: [num_tokens, num_heads, head_dim]; tokens past cu_q_lens[num_seqs] are padding.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], or with ``layer``
        the stacked [num_layers, kv_heads, num_pages, page_size, head_dim]; or
        ``kernels_pallas.kv_quant.QuantizedPages`` (dequantized right after each page gather).
      cu_q_lens: [S + 1] int32; kv_lens: [S] int32 (cache length after this chunk);
      page_table: [S, P] int32; num_seqs: [] int32.
      scale, sliding_window, soft_cap, layer: as in ``paged_prefill_attention_xla``.
      block_q, pages_per_block: tile sizes (default: the block-size table's GPU row;
        ``kernels_pallas.attention`` passes the row of the backend it runs on).
      interpret: run in the Pallas interpreter (CPU tests).

    Returns:
      [num_tokens, num_heads, head_dim] in q's dtype; padding tokens get 0.

    Raises:
      ValueError: num_heads not a multiple of kv_heads.
    """
    num_tokens, num_heads, head_dim = q.shape
    k_pages, v_pages, k_scale, v_scale, layer, group = as_stacked_cache(k_pages, v_pages, layer, num_heads)
    _, kv_heads, _, page_size, _ = k_pages.shape
    max_seqs = kv_lens.shape[0]
    sizes = prefill_block_sizes("gpu", head_dim, page_size)
    bq = min(block_q or sizes.block_q, num_tokens)
    ppb = min(pages_per_block or sizes.pages_per_block, page_table.shape[1])
    num_cols = page_table.shape[1]
    if num_cols % ppb:
        page_table = jnp.pad(page_table, ((0, 0), (0, ppb - num_cols % ppb)))
        num_cols = page_table.shape[1]
    num_q_blocks = pl.cdiv(num_tokens, bq)
    # Padding rows so every block's dynamic slice stays in bounds.
    qg = jnp.pad(q.reshape(num_tokens, kv_heads, group, head_dim), ((0, bq), (0, 0), (0, 0), (0, 0)))
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    scalars = [jnp.asarray(layer, jnp.int32).reshape(1), window, cu_q_lens.astype(jnp.int32),
               kv_lens.astype(jnp.int32), jnp.asarray(num_seqs, jnp.int32).reshape(1),
               page_table.astype(jnp.int32)]
    quantized = k_scale is not None
    cache = (k_pages, k_scale, v_pages, v_scale) if quantized else (k_pages, v_pages)
    kernel = functools.partial(_prefill_kernel, quantized=quantized, scale=scale, soft_cap=soft_cap, block_q=bq, group=group,
                               pages_per_block=ppb, page_size=page_size, num_cols=num_cols)
    full = lambda shape: pl.BlockSpec(shape, lambda s, h, j: (0,) * len(shape))
    slab = pl.pallas_call(
        kernel,
        grid=(max_seqs, kv_heads, num_q_blocks),
        in_specs=[full(x.shape) for x in scalars] + [full(qg.shape)] + [full(x.shape) for x in cache],
        out_specs=pl.BlockSpec((1, bq, 1, group, head_dim), lambda s, h, j: (s, j, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((max_seqs, num_q_blocks * bq, kv_heads, group, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(),
        name="xlaserve_paged_prefill",
    )(*scalars, qg, *cache)
    return ragged_from_slabs(slab, cu_q_lens, num_seqs, num_tokens)
