"""Paged attention in plain XLA: the reference implementation and the CPU path.

Layout (shared with the Pallas kernels that replace these behind the same
signatures)::

    k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim]
    page_table:       [seqs, pages_per_seq] int32   row i = sequence i's pages, in order
    token t of sequence i lives at  page_table[i, t // page_size], offset t % page_size

    page 0 is the engine's null page: padding rows and padding tokens point at it,
    and it is never read unmasked.

Both functions gather the pages named by ``page_table`` (its width is the
caller's length bucket, so work follows the longest sequence in the step;
in decode a sliding-window layer gathers only two aligned blocks of pages
around its window when that is narrower, see ``paged_decode_attention_xla``;
prefill per query block of one row, see :func:`paged_prefill_attention_xla`),
mask by length, causality and sliding window, and run a dense softmax in
float32. Masked probabilities are exactly zero and masked values are replaced
by zero before the weighted sum, so garbage (even NaN) in pages a sequence
does not own never reaches the output.

With ``ordered_sums`` the softmax denominator is summed in the fixed order of
``kernels_pallas.ordered_sum``: a query's probabilities then do not depend on
the number of rows in the step, on its place among them, nor on the page-table
bucket (trailing masked keys add exact zeros), so decode and prefill give a
token bitwise the same attention output (the backend policy's batch-invariant
mode; the weighted sums are dots whose reduction runs over the key axis). A
decode step's dots have the KV head's query group as rows (1 to 8 for common
models), and a backend may run so few rows on another kernel than a prefill
query block's (block tokens x group rows, a size ``dot_rows`` leaves as it is):
``group_rows`` pads them (``kernels_pallas.dot_rows``).

Sliding window semantics (Gemma 3, see the reference README): query at
position i sees key j iff ``j <= i and i - j < window``; ``window <= 0``
means unlimited. ``window`` may be a traced int32 scalar so a layer scan can
carry one window per layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.dot_rows import DotRows, repeat_last
from kernels_pallas.kv_quant import QuantizedPages, dequantize, logical_kv_dtype, quantize, split_pages
from kernels_pallas.kv_storage import from_storage, to_storage
from kernels_pallas.ordered_sum import ordered_sum

_MASK_VALUE = -1e30


def _gather_pages(pages, page_table: jax.Array, layer) -> jax.Array:
    """[(layers,) kv_heads, num_pages, page_size, d] x [seqs, P] -> [seqs, kv_heads, P * page_size, d].

    With ``layer`` given, ``pages`` is the stacked cache of all layers and the
    layer is selected inside the same gather, so no per-layer copy is made.
    Quantized pages (``kernels_pallas.kv_quant.QuantizedPages``) gather their scale
    pages the same way and are dequantized right after the gather, into their logical dtype.
    """
    kv_heads, _, page_size, head_dim = pages.shape[-4:]
    seqs, num_cols = page_table.shape

    def gather(a):
        if layer is None:
            return jnp.moveaxis(a[:, page_table], 0, 2)  # [kv, seqs, P, ...] -> [seqs, P, kv, ...]
        return a[layer, :, page_table]  # [seqs, P, kv, ...]

    data, scale = split_pages(pages)
    g = gather(data)
    if scale is None:
        g = from_storage(g)
    else:
        g = dequantize(g, gather(scale), logical_kv_dtype(pages))
    return g.transpose(0, 2, 1, 3, 4).reshape(seqs, kv_heads, num_cols * page_size, head_dim)


def _window_mask(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
    """True where key position k_pos is inside query q_pos's (causal, sliding) window."""
    causal = k_pos <= q_pos
    if window is None:
        return causal
    window = jnp.asarray(window, jnp.int32)
    return causal & ((window <= 0) | (q_pos - k_pos < window))


def _softmax_weighted_sum(scores, mask, v, soft_cap, ordered_sums=False):
    """scores: [..., L] f32, mask broadcastable, v gathered; returns probabilities [..., L].
    ``ordered_sums``: the denominator by ``ordered_sum`` (fixed order), else ``jnp.sum``."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask, scores, _MASK_VALUE)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    if ordered_sums:
        denom = ordered_sum(p, keepdims=True)
    else:
        denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.maximum(denom, 1e-30)


def _window_span_tokens(window_bound, page_size: int, table_tokens: int) -> int | None:
    """Keys a sliding-window decode gathers: two aligned blocks of B tokens, B the
    smallest power of two >= ``window_bound`` (and >= ``page_size``); None when
    that is no narrower than the page table (or B is not a whole number of pages)."""
    if window_bound is None or window_bound <= 0:
        return None
    block = 1 << (max(int(window_bound), page_size) - 1).bit_length()
    if block % page_size or 2 * block >= table_tokens:
        return None
    return 2 * block


def _decode_over_keys(q, k, v, k_pos, lengths, *, scale, sliding_window, soft_cap, ordered_sums,
                      group_rows):
    """Decode attention over gathered keys.

    q: [slots, num_heads, head_dim]; k, v: [slots, kv_heads, n, head_dim];
    k_pos: [slots or 1, n] int32 absolute key positions. Returns [slots, num_heads, head_dim] f32.
    """
    slots, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    qg = repeat_last(q.reshape(slots, kv_heads, group, head_dim), group_rows or group, axis=2)
    scores = jnp.einsum("skgd,skld->skgl", qg, k, preferred_element_type=jnp.float32) * scale
    q_pos = (lengths - 1)[:, None]
    mask = _window_mask(q_pos, k_pos, sliding_window) & (k_pos < lengths[:, None])  # [slots, n]
    probs = _softmax_weighted_sum(scores, mask[:, None, None, :], v, soft_cap, ordered_sums)
    v = jnp.where(mask[:, None, :, None], v, 0)
    out = jnp.einsum("skgl,skld->skgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out[:, :, :group].reshape(slots, num_heads, head_dim)


def paged_decode_attention_xla(
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
    ordered_sums: bool = False,
    group_rows: int | None = None,
    window_bound: int | None = None,
) -> jax.Array:
    """One query token per slot against that slot's pages.

    A layer with a sliding window reads only the pages around its window when
    that is narrower than the page table: two blocks of B tokens (B the smallest
    power of two >= the window, so the window always fits), starting at a
    multiple of B. The keys keep their absolute positions, and since the window's
    keys sit at the same offsets within aligned B-blocks as in the full table,
    the fixed-order softmax sum (``ordered_sums``) adds the same numbers in the
    same order: the output is bitwise that of the whole page table. Global layers
    (and every layer when the table is narrow) gather the whole page table.

    Args:
      q: [slots, num_heads, head_dim], any float dtype.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
      lengths: [slots] int32, tokens in the cache including the current one;
        the query sits at position lengths - 1. 0 marks a padding slot (output 0).
      page_table: [slots, P] int32, P * page_size >= max(lengths).
      scale: multiplies q.k (e.g. 1/sqrt(head_dim)).
      sliding_window: None, or an int / int32 scalar (<= 0: unlimited).
      soft_cap: optional tanh soft-cap on scores.
      layer: None, or an int / int32 scalar: then k_pages and v_pages are the
        stacked cache [num_layers, kv_heads, num_pages, page_size, head_dim]
        and this layer's pages are read (a layer scan passes its index).
      ordered_sums: sum the softmax denominator in a fixed order (see the module
        docstring; the batch-invariant mode).
      group_rows: compute each (slot, KV head) dot with this many query rows, the
        group's last query repeated (None or <= num_heads / kv_heads: as is); the
        batch-invariant mode's ``kernels_pallas.dot_rows`` padding.
      window_bound: a static int >= every positive value ``sliding_window``
        takes (the model's sliding window), so a traced window can read only
        its pages (a python-int window needs none); None: sliding layers read
        the whole page table.

    Returns:
      [slots, num_heads, head_dim] in q's dtype.
    """
    page_size = k_pages.shape[-2]
    num_cols = page_table.shape[1]
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, ordered_sums=ordered_sums,
                group_rows=group_rows)

    def whole_table(_):
        k = _gather_pages(k_pages, page_table, layer)  # [slots, kv, P * page_size, d]
        v = _gather_pages(v_pages, page_table, layer)
        k_pos = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
        return _decode_over_keys(q, k, v, k_pos, lengths, **opts)

    static_window = sliding_window is None or isinstance(sliding_window, int)
    bound = sliding_window if static_window else window_bound
    span = _window_span_tokens(bound, page_size, num_cols * page_size)
    if span is None or (static_window and (sliding_window is None or sliding_window <= 0)):
        return whole_table(None).astype(q.dtype)

    def window_only(_):
        block = span // 2
        first = jnp.maximum(lengths - jnp.asarray(sliding_window, jnp.int32), 0)
        start = first // block * block  # [slots] tokens, a multiple of the block and of the page
        cols = start[:, None] // page_size + jnp.arange(span // page_size, dtype=jnp.int32)[None, :]
        # Columns past the table read the null page 0 (masked: beyond the length).
        table = jnp.pad(page_table, ((0, 0), (0, span // page_size)))
        table = jnp.take_along_axis(table, cols, axis=1)
        k = _gather_pages(k_pages, table, layer)  # [slots, kv, span, d]
        v = _gather_pages(v_pages, table, layer)
        k_pos = start[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]
        return _decode_over_keys(q, k, v, k_pos, lengths, **opts)

    if static_window:
        return window_only(None).astype(q.dtype)
    out = jax.lax.cond(jnp.asarray(sliding_window, jnp.int32) > 0, window_only, whole_table, None)
    return out.astype(q.dtype)


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """[num_tokens] int32: the sequence each ragged token belongs to (cu_q_lens: [S + 1])."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)


PREFILL_BLOCK_GATHER_ROWS = 32
"""What gathering one query block's pages costs, in scored query rows (rows x heads x keys):
the block-size rule of :func:`prefill_query_blocks` (measured on XLA:CPU,
``python -m benchmarks.prefill_packing attention``, benchmarks/RESULTS.md)."""


def prefill_query_blocks(num_tokens: int, max_seqs: int, block_q: int | None = None, *, group: int = 1,
                         dot_rows: DotRows = DotRows()) -> tuple[int, int]:
    """(block_q, num_blocks) of the blocked prefill below for a step of ``num_tokens`` tokens
    (the token bucket T) in at most ``max_seqs`` rows (S), ``group`` query heads per KV head.

    Each row's chunk is cut into blocks of ``block_q`` tokens (its last one partial), so
    ``num_blocks`` covers the worst case: every row wastes at most ``block_q - 1`` query
    slots, and no step has more rows than tokens. With one row the block is the whole
    step (the single-sequence form). Otherwise ``block_q`` is the power of two minimising
    ``num_blocks * (block_q + PREFILL_BLOCK_GATHER_ROWS)``: scored query slots plus each
    block's gather of its row's pages, counted in query rows' worth of work; among the
    sizes whose dots (``block_q * group`` rows) ``dot_rows`` leaves unpadded, so every
    block's rows run on the kernel of a long chunk's (batch invariance,
    ``kernels_pallas.dot_rows``).

    Raises:
      ValueError: num_tokens or max_seqs below 1, or a block_q below 1.
    """
    if num_tokens < 1 or max_seqs < 1:
        raise ValueError(f"num_tokens and max_seqs must be >= 1, got {num_tokens}, {max_seqs}")
    if block_q is not None and block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    rows = min(max_seqs, num_tokens)

    def blocks(bq: int) -> int:
        return min(num_tokens, (num_tokens + rows * (bq - 1)) // bq) if rows > 1 else -(-num_tokens // bq)

    if block_q is None:
        if rows == 1:
            return num_tokens, 1
        candidates = [1 << i for i in range(num_tokens.bit_length())
                      if dot_rows.count((1 << i) * group) == (1 << i) * group] or [num_tokens]
        block_q = min(candidates, key=lambda bq: (blocks(bq) * (bq + PREFILL_BLOCK_GATHER_ROWS), bq))
    return block_q, blocks(block_q)


def paged_prefill_attention_xla(
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
    ordered_sums: bool = False,
    block_q: int | None = None,
    dot_rows: DotRows = DotRows(),
    bidirectional_spans: jax.Array | None = None,
) -> jax.Array:
    """A ragged batch of prompt chunks against their sequences' pages (chunk included).

    The chunk's own K/V must already be written into the pages. Sequence i owns
    query tokens ``cu_q_lens[i]:cu_q_lens[i+1]``, whose positions are the last
    ``q_len_i`` positions before ``kv_lens[i]``; so a chunk may start mid-sequence
    (a later chunk, or a prompt that hit the prefix cache).

    Blocked ragged form (the work of ragged paged attention, e.g. vLLM's
    ``ragged_paged_attention`` for TPU, in dense XLA ops): each row's chunk is cut
    into query blocks of ``block_q`` tokens aligned to the row's first token, and
    each block gathers only its own row's pages and scores its tokens against
    them. A step's work is then about ``(T + S * block_q) x L`` scores (L = the
    page-table width) instead of ``S x T x L`` when every token is scored against
    every packed row. The block table is computed on the device from
    ``cu_q_lens``; the static block count covers the worst case
    (:func:`prefill_query_blocks`). A key's index in its block's score row is its
    position in the sequence, as in decode, so with ``ordered_sums`` a token's
    output does not depend on the other rows of the step.

    Args:
      q: [num_tokens, num_heads, head_dim]; tokens past cu_q_lens[num_seqs] are padding.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
      cu_q_lens: [S + 1] int32, cumulative query lengths (non-decreasing, from 0).
      kv_lens: [S] int32, tokens in the cache for sequence i after this chunk.
      page_table: [S, P] int32.
      num_seqs: [] int32, rows that are real.
      scale, sliding_window, soft_cap, layer, ordered_sums: as in :func:`paged_decode_attention_xla`.
      block_q: query tokens per block (None: :func:`prefill_query_blocks`'s rule).
      dot_rows: the batch-invariant mode's row padding of low-precision dots: block
        sizes whose dots it would pad are not chosen (see :func:`prefill_query_blocks`).
      bidirectional_spans: [num_tokens, 2] int32 or None: token t also sees the keys at
        positions ``spans[t, 0] <= j < spans[t, 1]`` of its own sequence, later ones
        included (Gemma 3's image tokens: full attention within each image; as
        transformers' ``create_masks_for_vision_model``, AND(sliding window, OR(causal,
        span)): a sliding layer still hides keys ``window`` or more positions back);
        an empty span (start >= end) adds nothing. The span must lie within the keys the
        row holds after this chunk (a span is never split across chunks).

    Returns:
      [num_tokens, num_heads, head_dim] in q's dtype; padding tokens get 0.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_pages.shape[-4]
    max_seqs = kv_lens.shape[0]
    bq, num_blocks = prefill_query_blocks(num_tokens, max_seqs, block_q, group=group, dot_rows=dot_rows)
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, layer=layer,
                ordered_sums=ordered_sums, spans=bidirectional_spans)
    blocked = functools.partial(_blocked_prefill, q, k_pages, v_pages, bq=bq, num_blocks=num_blocks, **opts)
    if max_seqs == 1 or block_q is not None or (num_blocks == 1 and bq == num_tokens):
        return blocked(cu_q_lens, kv_lens, page_table, num_seqs)
    # A step of one row (a lone prompt in a program compiled for S rows) takes the
    # single-sequence form: one block of the whole step against the row's pages, instead
    # of the worst case's many small blocks each gathering that row's whole table (a
    # 512-token prompt took 2.2x as long in a 32-row program as in a one-row one;
    # benchmarks/RESULTS.md). Both forms score each token against the same keys with
    # dots of rows DotRows leaves unpadded, so a token's output is the same either way.
    one = functools.partial(_blocked_prefill, q, k_pages, v_pages, bq=num_tokens, num_blocks=1, **opts)
    return jax.lax.cond(num_seqs == 1,
                        lambda: one(cu_q_lens[:2], kv_lens[:1], page_table[:1], jnp.int32(1)),
                        lambda: blocked(cu_q_lens, kv_lens, page_table, num_seqs))


def _blocked_prefill(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, *, bq: int,
                     num_blocks: int, scale: float, sliding_window, soft_cap, layer, ordered_sums: bool,
                     spans=None):
    """The blocked ragged form of :func:`paged_prefill_attention_xla` with its block size
    ``bq`` and block count ``num_blocks`` resolved (operands as there)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[-4]
    group = num_heads // kv_heads
    max_seqs = kv_lens.shape[0]
    rows = jnp.arange(max_seqs, dtype=jnp.int32)
    q_len = jnp.where(rows < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    row_blocks = (q_len + bq - 1) // bq
    blk_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(row_blocks, dtype=jnp.int32)])  # [S + 1]
    # The block table: block b is the j-th block of row blk_row[b].
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    blk_row = jnp.minimum(jnp.searchsorted(blk_cu[1:], b, side="right"), max_seqs - 1).astype(jnp.int32)
    first = (b - blk_cu[blk_row]) * bq  # [NB] the block's first token, counted in its chunk
    in_chunk = first[:, None] + jnp.arange(bq, dtype=jnp.int32)[None, :]  # [NB, bq]
    real = (b < blk_cu[max_seqs])[:, None] & (in_chunk < q_len[blk_row][:, None])  # [NB, bq]
    tok = jnp.where(real, cu_q_lens[blk_row][:, None] + in_chunk, 0)
    q_pos = (kv_lens - q_len)[blk_row][:, None] + in_chunk  # [NB, bq]
    blk_kv_len = jnp.where(b < blk_cu[max_seqs], kv_lens[blk_row], 0)  # [NB]
    k = _gather_pages(k_pages, page_table[blk_row], layer)  # [NB, kv, L, d]
    v = _gather_pages(v_pages, page_table[blk_row], layer)
    single = num_blocks == 1 and bq == num_tokens  # one row: the block is the step, in order
    qb = (q if single else q[tok]).reshape(num_blocks, bq, kv_heads, group, head_dim)
    qb = qb.transpose(0, 2, 1, 3, 4)  # [NB, kv, bq, G, d]: the KV head leads with the block
    scores = jnp.einsum("bkqgd,bkld->bkqgl", qb, k, preferred_element_type=jnp.float32) * scale
    k_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    key_ok = k_pos[None, :] < blk_kv_len[:, None]  # [NB, L]
    mask = (_window_mask(q_pos[:, :, None], k_pos[None, None, :], sliding_window)
            & key_ok[:, None, :] & real[:, :, None])  # [NB, bq, L]
    if spans is not None:
        sp = spans[tok]  # [NB, bq, 2]
        kp = k_pos[None, None, :]
        in_span = (kp >= sp[:, :, :1]) & (kp < sp[:, :, 1:])
        if sliding_window is not None:  # the window still bounds the past: AND(window, OR(causal, span))
            w = jnp.asarray(sliding_window, jnp.int32)
            in_span = in_span & ((w <= 0) | (q_pos[:, :, None] - kp < w))
        mask = mask | (in_span & key_ok[:, None, :] & real[:, :, None])
    probs = _softmax_weighted_sum(scores, mask[:, None, :, None, :], v, soft_cap, ordered_sums)
    v = jnp.where(key_ok[:, None, :, None], v, 0)
    out = jnp.einsum("bkqgl,bkld->bkqgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_blocks * bq, num_heads, head_dim)
    # Back to the ragged token order: token t is row s's token t - cu[s].
    seq = token_sequence_ids(cu_q_lens, num_tokens)
    valid_tok = (jnp.arange(num_tokens) < cu_q_lens[num_seqs]) & (seq < num_seqs)
    seq = jnp.minimum(seq, max_seqs - 1)
    off = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    if not single:
        out = out[jnp.where(valid_tok, (blk_cu[seq] + off // bq) * bq + off % bq, 0)]
    out = jnp.where(valid_tok[:, None, None], out, 0)
    return out.astype(q.dtype)


def write_kv_pages(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
    layer=None,
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V rows into their pages (a fused XLA scatter, in place when donated).

    Args:
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], or with
        ``layer`` the stacked [num_layers, kv_heads, num_pages, page_size, head_dim].
      k, v: [num_tokens, kv_heads, head_dim].
      slot_mapping: [num_tokens] int32 flat cache slot ``page * page_size + offset``;
        padding tokens point into the null page 0.
      (A uint16 cache holds bfloat16 bits: see ``kernels_pallas.kv_storage``. Quantized
      pages, ``kernels_pallas.kv_quant.QuantizedPages``, get each row quantized per token
      and KV head, its scale written into the scale page at the same slot.)

    Returns:
      The updated (k_pages, v_pages).
    """
    page_size = k_pages.shape[-2]
    page = slot_mapping // page_size
    off = slot_mapping % page_size

    def scatter(pages, rows):  # rows: [T, kv_heads, ...]
        if layer is None:
            return pages.at[:, page, off].set(jnp.moveaxis(rows, 0, 1))
        # indices (layer, :, page, off): the advanced dims lead -> [T, kv_heads, ...]
        return pages.at[layer, :, page, off].set(rows)

    def write(pages, x):
        if isinstance(pages, QuantizedPages):
            data, scale = quantize(x, pages.format)
            return QuantizedPages(scatter(pages.data, to_storage(data, pages.data.dtype)),
                                  scatter(pages.scale, scale), pages.logical)
        return scatter(pages, to_storage(x, pages.dtype))

    return write(k_pages, k), write(v_pages, v)
