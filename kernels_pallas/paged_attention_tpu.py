"""Paged attention for TPU (Mosaic): decode and chunked prefill, one KV page per grid step.

TPU kernels cannot gather pages inside the kernel the way the Triton ones do;
instead the page table, lengths and layer are *scalar-prefetched* into SMEM
and the K/V BlockSpecs' index maps look the page up, so Pallas' pipeline DMAs
exactly the pages a sequence owns, in order, while the previous one is being
used::

    decode   grid = (slots, kv_heads, pages_per_seq)
             k block (layer, h, page_table[b, clamp(i)], :, :)   one page [page_size, head_dim]
    prefill  grid = (max_seqs, kv_heads, q_blocks, pages_per_seq)
             q, out: per-sequence slabs [max_seqs, T, kv_heads, group, head_dim] (block aligned)

Grid steps outside a sequence's live pages (past its length, or before its
sliding window) clamp the page index to the nearest live page, so the block
index repeats and no new DMA is issued, and skip the compute (``pl.when``).
The online softmax (running max, sum and accumulator) lives in VMEM scratch
across the page axis, which is the innermost ("arbitrary") grid dimension.

Same signatures and semantics as the XLA reference; ``interpret=True`` runs
them in the Pallas TPU interpreter on CPU (tests), and ``jax.export`` with
``platforms=["tpu"]`` checks the Mosaic lowering without a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.block_sizes import prefill_block_sizes
from kernels_pallas.kernel_io import as_stacked_cache, cache_refs, ragged_from_slabs

_MASK_VALUE = -1e30
_SUBLANES = 8  # query rows are padded to a multiple of the TPU sublane count


def _div(a, b):
    """Floor division of non-negative int32 scalars/vectors. (``//`` lowers through ``sign``,
    which Mosaic only lowers for a known TPU generation, so export without a TPU would fail.)"""
    return jax.lax.div(a, jnp.asarray(b, jnp.int32))


def _cdiv(a, b):
    return _div(a + b - 1, b)


def _online_softmax_step(q, k, v, valid, m_ref, l_ref, acc_ref, scale, soft_cap):
    """One page of the online softmax. q [rows, d] f32; k, v [page, d] f32; valid [rows, page]."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid, s, _MASK_VALUE)
    m_prev = m_ref[...]  # [rows, 1]
    m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m_prev - m_new)
    v = jnp.where(valid.any(axis=0)[:, None], v, 0.0)  # keys no row may see: never multiply garbage
    acc_ref[...] = acc_ref[...] * corr + jnp.dot(p, v, preferred_element_type=jnp.float32)
    l_ref[...] = l_ref[...] * corr + p.sum(axis=-1, keepdims=True)
    m_ref[...] = m_new


def _cache_operands(k_pages, v_pages, k_scale, v_scale, kv_spec, kv_index, page_size):
    """The cache operands of a kernel and their BlockSpecs: (k, v), or with scale pages
    (k, k_scale, v, v_scale), a scale page fetched by the same page index. Scale pages go in
    as [layers, kv_heads, pages, 1, page_size] (a free reshape) so a block's last two
    dimensions are the array's, as Mosaic requires of blocks narrower than (8, 128)."""
    if k_scale is None:
        return (k_pages, v_pages), (kv_spec, kv_spec)
    k_scale, v_scale = (s.reshape(s.shape[:3] + (1, page_size)) for s in (k_scale, v_scale))
    scale_spec = pl.BlockSpec((1, 1, 1, 1, page_size), kv_index)
    return (k_pages, k_scale, v_pages, v_scale), (kv_spec, scale_spec, kv_spec, scale_spec)


def _page(ref, scale_ref) -> jax.Array:
    """The block's page [page_size, head_dim] in float32, times its scale page when quantized."""
    x = ref[0, 0, 0].astype(jnp.float32)
    if scale_ref is None:
        return x
    return x * scale_ref[0, 0, 0, 0].astype(jnp.float32)[:, None]


def _init(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _finish(o_ref, m_ref, l_ref, acc_ref, shape):
    out = acc_ref[...] / jnp.maximum(l_ref[...], 1e-30)
    o_ref[...] = out.reshape(shape).astype(o_ref.dtype)


# ----------------------------------------------------------------------------- decode


def _decode_page_range(b, layer_ref, window_ref, lengths_ref, page_size):
    length = lengths_ref[b]
    window = window_ref[0]
    first_tok = jnp.where(window > 0, jnp.maximum(length - window, 0), 0)
    return first_tok, length, _div(first_tok, page_size), _cdiv(length, page_size)


def _decode_index(b, h, i, layer_ref, window_ref, lengths_ref, pt_ref, *, page_size, num_cols):
    _, _, first, end = _decode_page_range(b, layer_ref, window_ref, lengths_ref, page_size)
    col = jnp.clip(i, first, jnp.maximum(end - 1, first))
    return (layer_ref[0], h, pt_ref[b * num_cols + jnp.minimum(col, num_cols - 1)], 0, 0)


def _decode_kernel(layer_ref, window_ref, lengths_ref, pt_ref, q_ref, *refs, quantized, scale, soft_cap,
                   page_size):
    k_ref, ks_ref, v_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref = cache_refs(refs, quantized)
    b, i = pl.program_id(0), pl.program_id(2)
    first_tok, length, first, end = _decode_page_range(b, layer_ref, window_ref, lengths_ref, page_size)

    @pl.when(i == 0)
    def _():
        _init(m_ref, l_ref, acc_ref)

    @pl.when((i >= first) & (i < end))
    def _():
        q = q_ref[0, 0].astype(jnp.float32)  # [rows, d]
        pos = i * page_size + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], page_size), 1)
        valid = (pos < length) & (pos >= first_tok)
        _online_softmax_step(q, _page(k_ref, ks_ref), _page(v_ref, vs_ref),
                             valid, m_ref, l_ref, acc_ref, scale, soft_cap)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        _finish(o_ref, m_ref, l_ref, acc_ref, o_ref.shape)


def paged_decode_attention_tpu(q, k_pages, v_pages, lengths, page_table, *, scale, sliding_window=None,
                               soft_cap=None, layer=None, interpret: bool = False):
    """Decode attention on TPU; arguments and result as ``paged_decode_attention_xla``.

    Raises:
      ValueError: num_heads not a multiple of kv_heads.
    """
    slots, num_heads, head_dim = q.shape
    k_pages, v_pages, k_scale, v_scale, layer, group = as_stacked_cache(k_pages, v_pages, layer, num_heads)
    _, kv_heads, _, page_size, _ = k_pages.shape
    rows = -(-group // _SUBLANES) * _SUBLANES
    num_cols = page_table.shape[1]
    qg = q.reshape(slots, kv_heads, group, head_dim)
    if rows > group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    scalars = (jnp.asarray(layer, jnp.int32).reshape(1),
               jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1),
               lengths.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1))
    kv_index = functools.partial(_decode_index, page_size=page_size, num_cols=num_cols)
    kv_spec = pl.BlockSpec((1, 1, 1, page_size, head_dim), kv_index)
    cache, cache_specs = _cache_operands(k_pages, v_pages, k_scale, v_scale, kv_spec, kv_index, page_size)
    q_spec = pl.BlockSpec((1, 1, rows, head_dim), lambda b, h, i, *_: (b, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(slots, kv_heads, num_cols),
        in_specs=[q_spec, *cache_specs], out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, head_dim), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_decode_kernel, quantized=k_scale is not None, scale=scale, soft_cap=soft_cap, page_size=page_size),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, rows, head_dim), q.dtype),
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="xlaserve_paged_decode_tpu",
    )(*scalars, qg, *cache)
    return out[:, :, :group].reshape(slots, num_heads, head_dim)


# ----------------------------------------------------------------------------- prefill


def _prefill_geometry(s, j, window_ref, cu_ref, kv_lens_ref, num_seqs_ref, block_q, page_size):
    """Rows, positions and live page range of query block j of sequence s."""
    real = s < num_seqs_ref[0]
    q_len = jnp.where(real, cu_ref[s + 1] - cu_ref[s], 0)
    kv_len = jnp.where(real, kv_lens_ref[s], 0)
    first_row = j * block_q
    rows_here = jnp.clip(q_len - first_row, 0, block_q)
    pos0 = kv_len - q_len + first_row  # position of the block's first row
    window = window_ref[0]
    lo = jnp.where(window > 0, jnp.maximum(pos0 - window + 1, 0), 0)
    first = _div(lo, page_size)
    end = jnp.where(rows_here > 0, _cdiv(pos0 + rows_here, page_size), first)
    return rows_here, pos0, kv_len, window, first, end


def _prefill_index(s, h, j, i, layer_ref, window_ref, cu_ref, kv_lens_ref, num_seqs_ref, pt_ref, *,
                   block_q, page_size, num_cols):
    _, _, _, _, first, end = _prefill_geometry(s, j, window_ref, cu_ref, kv_lens_ref, num_seqs_ref,
                                               block_q, page_size)
    col = jnp.minimum(jnp.clip(i, first, jnp.maximum(end - 1, first)), num_cols - 1)
    return (layer_ref[0], h, pt_ref[s * num_cols + col], 0, 0)


def _prefill_kernel(layer_ref, window_ref, cu_ref, kv_lens_ref, num_seqs_ref, pt_ref, q_ref, *refs, quantized,
                    scale, soft_cap, block_q, group, page_size):
    k_ref, ks_ref, v_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref = cache_refs(refs, quantized)
    s, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    rows_here, pos0, kv_len, window, first, end = _prefill_geometry(
        s, j, window_ref, cu_ref, kv_lens_ref, num_seqs_ref, block_q, page_size)

    @pl.when(i == 0)
    def _():
        _init(m_ref, l_ref, acc_ref)

    @pl.when((i >= first) & (i < end))
    def _():
        rows = block_q * group
        q = q_ref[0, :, 0].reshape(rows, -1).astype(jnp.float32)  # [bq * group, d]
        row = _div(jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0), group)
        key = i * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        qpos = pos0 + row
        valid = (row < rows_here) & (key <= qpos) & (key < kv_len)
        valid &= (window <= 0) | (qpos - key < window)
        _online_softmax_step(q, _page(k_ref, ks_ref), _page(v_ref, vs_ref),
                             valid, m_ref, l_ref, acc_ref, scale, soft_cap)

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        _finish(o_ref, m_ref, l_ref, acc_ref, o_ref.shape)


def paged_prefill_attention_tpu(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, *, scale,
                                sliding_window=None, soft_cap=None, layer=None, block_q: int | None = None,
                                interpret: bool = False):
    """Chunked-prefill attention on TPU; arguments and result as ``paged_prefill_attention_xla``.

    ``block_q`` query tokens per program (default: the block-size table); K/V
    move one page per grid step.

    The ragged queries are first laid out as per-sequence slabs (an XLA
    gather) so every kernel block is aligned; the output comes back the same way.

    Raises:
      ValueError: num_heads not a multiple of kv_heads.
    """
    num_tokens, num_heads, head_dim = q.shape
    k_pages, v_pages, k_scale, v_scale, layer, group = as_stacked_cache(k_pages, v_pages, layer, num_heads)
    _, kv_heads, _, page_size, _ = k_pages.shape
    max_seqs, num_cols = page_table.shape
    block_q = block_q or prefill_block_sizes("tpu", head_dim, page_size).block_q
    bq = max(_SUBLANES, min(block_q, num_tokens))
    num_q_blocks = pl.cdiv(num_tokens, bq)
    slab_rows = num_q_blocks * bq
    cu = cu_q_lens.astype(jnp.int32)
    # q_slab[s, r] = q[cu[s] + r] (rows past the sequence are masked in the kernel).
    src = jnp.clip(cu[:-1, None] + jnp.arange(slab_rows, dtype=jnp.int32)[None, :], 0, num_tokens - 1)
    q_slab = q.reshape(num_tokens, kv_heads, group, head_dim)[src]  # [S, rows, kv, group, d]
    scalars = (jnp.asarray(layer, jnp.int32).reshape(1),
               jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1),
               cu, kv_lens.astype(jnp.int32), jnp.asarray(num_seqs, jnp.int32).reshape(1),
               page_table.astype(jnp.int32).reshape(-1))
    kv_index = functools.partial(_prefill_index, block_q=bq, page_size=page_size, num_cols=num_cols)
    kv_spec = pl.BlockSpec((1, 1, 1, page_size, head_dim), kv_index)
    cache, cache_specs = _cache_operands(k_pages, v_pages, k_scale, v_scale, kv_spec, kv_index, page_size)
    q_spec = pl.BlockSpec((1, bq, 1, group, head_dim), lambda s, h, j, i, *_: (s, j, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(max_seqs, kv_heads, num_q_blocks, num_cols),
        in_specs=[q_spec, *cache_specs], out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((bq * group, 1), jnp.float32), pltpu.VMEM((bq * group, 1), jnp.float32),
                        pltpu.VMEM((bq * group, head_dim), jnp.float32)])
    slab = pl.pallas_call(
        functools.partial(_prefill_kernel, quantized=k_scale is not None, scale=scale, soft_cap=soft_cap, block_q=bq, group=group,
                          page_size=page_size),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_slab.shape, q.dtype),
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="xlaserve_paged_prefill_tpu",
    )(*scalars, q_slab, *cache)
    return ragged_from_slabs(slab, cu, num_seqs, num_tokens)
