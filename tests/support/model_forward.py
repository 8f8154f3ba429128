"""Logits of a model over one prompt, prefilled in chunks through the paged KV cache: the parity
tests' forward pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.attention_metadata import AttentionMetadata
from model.compute import REFERENCE, Compute
from model.gemma3 import Gemma3, KVCache

PAGE_SIZE = 16


def prefill_logits(model: Gemma3, ids: list[int], rows: list[int], chunk: int | None = None,
                   compute: Compute = REFERENCE) -> np.ndarray:
    """Logits at positions ``rows`` of one sequence, prefilled in chunks of ``chunk`` tokens.

    Pages are handed out in reverse order so the page table is not the identity.
    """
    n = len(ids)
    chunk = chunk or n
    num_pages = -(-n // PAGE_SIZE)
    pages = np.arange(num_pages, 0, -1, dtype=np.int32)  # reversed, page 0 unused
    cache = KVCache.zeros(model.cfg, num_pages + 1, PAGE_SIZE, jnp.float32)
    out = {}
    for start in range(0, n, chunk):
        toks = ids[start:start + chunk]
        T = len(toks)
        positions = np.arange(start, start + T, dtype=np.int32)
        slot = pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        want = [r for r in rows if start <= r < start + T]
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slot), page_table=jnp.asarray(pages[None]),
            kv_lens=jnp.asarray([start + T], jnp.int32), cu_q_lens=jnp.asarray([0, T], jnp.int32),
            num_seqs=jnp.asarray(1, jnp.int32), mode="prefill")
        li = jnp.asarray([r - start for r in want] or [0], jnp.int32)
        logits, cache = model(jnp.asarray(toks, jnp.int32), jnp.asarray(positions), cache, md, li,
                              compute=compute)
        for r, row in zip(want, np.asarray(logits)):
            out[r] = row
    return np.stack([out[r] for r in rows])
