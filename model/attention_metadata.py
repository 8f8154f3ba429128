"""Attention metadata: what a step tells every attention layer about its batch.

Registered as a pytree so it passes through ``jax.jit`` and ``lax.scan``;
array fields are data, ``mode`` is static (it selects the kernel).

Token layout of a step (flat, T = a token-count bucket)::

    prefill:  tokens [T] = seq0 chunk | seq1 chunk | ... | padding
              cu_q_lens [S+1] bounds each sequence's chunk
    decode:   tokens [B] = one token per slot (padding slots have length 0)
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step metadata shared by all layers.

    Attributes:
      slot_mapping: [T] int32, flat KV-cache slot (page * page_size + offset)
        each new token's K/V is written to; padding tokens point into page 0.
      page_table: [S, P] int32 (prefill) or [B, P] int32 (decode).
      kv_lens: [S] or [B] int32, tokens in the cache for each row AFTER this
        step (cached prefix + this step's tokens). 0 marks a padding row.
      cu_q_lens: [S + 1] int32 cumulative chunk lengths (prefill); for decode
        [B + 1] = arange(B + 1) (one token per slot).
      num_seqs: [] int32, real rows (prefill); B for decode.
      image_spans: [T, 2] int32 or None (prefill only): for each token, the positions
        ``[start, end)`` of the image it belongs to (its run of image soft tokens), which it
        attends to in full (bidirectionally); ``start >= end`` for text tokens. Gemma 3
        also takes the token's input embedding from the step's image embeddings where
        the span is not empty. None: no image in the step (the text-only program).
      mode: "prefill" or "decode" (static).
    """

    slot_mapping: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    image_spans: jax.Array | None = None
    mode: str = dataclasses.field(default="prefill", metadata=dict(static=True))
