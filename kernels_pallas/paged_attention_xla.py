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
around its window when that is narrower, see ``paged_decode_attention_xla``),
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
chunk's (tokens x group rows, a multiple of 16): ``group_rows`` pads them
(``kernels_pallas.dot_rows``).

Sliding window semantics (Gemma 3, see the reference README): query at
position i sees key j iff ``j <= i and i - j < window``; ``window <= 0``
means unlimited. ``window`` may be a traced int32 scalar so a layer scan can
carry one window per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.dot_rows import repeat_last
from kernels_pallas.kv_storage import from_storage, to_storage
from kernels_pallas.ordered_sum import ordered_sum

_MASK_VALUE = -1e30


def _gather_pages(pages: jax.Array, page_table: jax.Array, layer) -> jax.Array:
    """[(layers,) kv_heads, num_pages, page_size, d] x [seqs, P] -> [seqs, kv_heads, P * page_size, d].

    With ``layer`` given, ``pages`` is the stacked cache of all layers and the
    layer is selected inside the same gather, so no per-layer copy is made.
    """
    kv_heads, _, page_size, head_dim = pages.shape[-4:]
    seqs, num_cols = page_table.shape
    if layer is None:
        g = pages[:, page_table]  # [kv_heads, seqs, P, page_size, d]
    else:
        g = pages[layer, :, page_table].transpose(2, 0, 1, 3, 4)  # [seqs, P, kv, ...] -> [kv, seqs, P, ...]
    g = from_storage(g)
    return g.reshape(kv_heads, seqs, num_cols * page_size, head_dim).transpose(1, 0, 2, 3)


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
) -> jax.Array:
    """A ragged batch of prompt chunks against their sequences' pages (chunk included).

    The chunk's own K/V must already be written into the pages. Sequence i owns
    query tokens ``cu_q_lens[i]:cu_q_lens[i+1]``, whose positions are the last
    ``q_len_i`` positions before ``kv_lens[i]``; so a chunk may start mid-sequence
    (a later chunk, or a prompt that hit the prefix cache).

    Args:
      q: [num_tokens, num_heads, head_dim]; tokens past cu_q_lens[num_seqs] are padding.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim].
      cu_q_lens: [S + 1] int32, cumulative query lengths (non-decreasing).
      kv_lens: [S] int32, tokens in the cache for sequence i after this chunk.
      page_table: [S, P] int32.
      num_seqs: [] int32, rows that are real.
      scale, sliding_window, soft_cap, layer, ordered_sums: as in :func:`paged_decode_attention_xla`.

    Returns:
      [num_tokens, num_heads, head_dim] in q's dtype; padding tokens get 0.

    Cost: this dense reference scores every token against every sequence's
    pages (S x the useful work), so the engine keeps S small on CPU.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[-4]
    group = num_heads // kv_heads
    max_seqs = kv_lens.shape[0]
    k = _gather_pages(k_pages, page_table, layer)  # [S, kv, L, d]
    v = _gather_pages(v_pages, page_table, layer)
    seq = token_sequence_ids(cu_q_lens, num_tokens)  # [T]
    valid_tok = (jnp.arange(num_tokens) < cu_q_lens[num_seqs]) & (seq < num_seqs)
    seq = jnp.minimum(seq, max_seqs - 1)
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    q_pos = kv_lens[seq] - q_len[seq] + (jnp.arange(num_tokens) - cu_q_lens[seq])  # [T]
    # KV-head-major layout, so every dot has its batch axis (the KV head) leading on
    # both operands: the canonical batched-matmul form.
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [K, T, G, d]
    L = k.shape[2]
    k_pos = jnp.arange(L, dtype=jnp.int32)
    out = jnp.zeros((kv_heads, num_tokens, group, head_dim), jnp.float32)
    # One pass per sequence slot (S is small and static); each token only
    # keeps the pass of its own sequence.
    for s in range(max_seqs):
        scores = jnp.einsum("ktgd,kld->ktgl", qg, k[s], preferred_element_type=jnp.float32) * scale
        mask = (
            _window_mask(q_pos[:, None], k_pos[None, :], sliding_window)
            & (k_pos[None, :] < kv_lens[s])
            & ((seq == s) & valid_tok)[:, None]
        )  # [T, L]
        probs = _softmax_weighted_sum(scores, mask[None, :, None, :], v, soft_cap, ordered_sums)
        vs = jnp.where(((k_pos < kv_lens[s]) & (s < num_seqs))[None, :, None], v[s], 0)
        out = out + jnp.einsum("ktgl,kld->ktgd", probs.astype(vs.dtype), vs,
                               preferred_element_type=jnp.float32)
    out = out.transpose(1, 0, 2, 3)  # [T, K, G, d]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


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
      (A uint16 cache holds bfloat16 bits: see ``kernels_pallas.kv_storage``.)

    Returns:
      The updated (k_pages, v_pages).
    """
    page_size = k_pages.shape[-2]
    page = slot_mapping // page_size
    off = slot_mapping % page_size
    k, v = to_storage(k, k_pages.dtype), to_storage(v, v_pages.dtype)
    if layer is None:
        k_pages = k_pages.at[:, page, off].set(k.transpose(1, 0, 2))
        v_pages = v_pages.at[:, page, off].set(v.transpose(1, 0, 2))
    else:  # indices (layer, :, page, off): the advanced dims lead -> [T, kv_heads, d]
        k_pages = k_pages.at[layer, :, page, off].set(k)
        v_pages = v_pages.at[layer, :, page, off].set(v)
    return k_pages, v_pages
