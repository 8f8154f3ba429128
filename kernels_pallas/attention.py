"""The one dispatch point for paged attention.

``attention_impl``:
  * "xla": the pure-XLA reference (``paged_attention_xla``), the CPU path.
  * "pallas": the Pallas kernels. On TPU the Mosaic kernels
    (``paged_attention_tpu``: scalar-prefetched page tables, one page per grid
    step); elsewhere the GPU-style kernels (``paged_decode_pallas``,
    ``paged_prefill_pallas``), lowered with Triton on GPUs and run in interpret
    mode on CPU (tests).
  * "auto": "xla" everywhere for now: the Pallas kernels become the default on
    GPU and TPU once they have been run and timed there (benchmarks/RESULTS.md).
The model calls only :func:`paged_attention` and :func:`write_kv_pages`.
"""

from __future__ import annotations

import jax

from kernels_pallas.paged_attention_tpu import (
    paged_decode_attention_tpu,
    paged_prefill_attention_tpu,
)
from kernels_pallas.paged_attention_xla import (
    paged_decode_attention_xla,
    paged_prefill_attention_xla,
    write_kv_pages,
)
from kernels_pallas.paged_decode_pallas import paged_decode_attention_pallas
from kernels_pallas.paged_prefill_pallas import paged_prefill_attention_pallas

ATTENTION_IMPLS = ("auto", "xla", "pallas")

__all__ = ["ATTENTION_IMPLS", "paged_attention", "write_kv_pages"]


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md,
    *,
    scale: float,
    sliding_window=None,
    soft_cap: float | None = None,
    layer=None,
    impl: str = "auto",
) -> jax.Array:
    """Attention of a step's queries over the paged KV cache.

    Args:
      q: [T, num_heads, head_dim]: one row per slot in decode mode, the ragged
        chunk tokens in prefill mode.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], already
        holding this step's K/V.
      md: ``model.attention_metadata.AttentionMetadata``.
      scale, sliding_window, soft_cap, layer: see ``paged_attention_xla``.
      impl: one of ATTENTION_IMPLS.

    Returns:
      [T, num_heads, head_dim] in q's dtype.

    Raises:
      ValueError: unknown impl or mode.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if md.mode not in ("decode", "prefill"):
        raise ValueError(f"unknown attention mode {md.mode!r}")
    backend = jax.default_backend()
    kernel = "xla" if impl in ("auto", "xla") else ("tpu" if backend == "tpu" else "triton")
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, layer=layer)
    if kernel == "triton":
        opts["interpret"] = backend == "cpu"
    if md.mode == "decode":
        fn = {"xla": paged_decode_attention_xla, "tpu": paged_decode_attention_tpu,
              "triton": paged_decode_attention_pallas}[kernel]
        return fn(q, k_pages, v_pages, md.kv_lens, md.page_table, **opts)
    fn = {"xla": paged_prefill_attention_xla, "tpu": paged_prefill_attention_tpu,
          "triton": paged_prefill_attention_pallas}[kernel]
    return fn(q, k_pages, v_pages, md.cu_q_lens, md.kv_lens, md.page_table, md.num_seqs, **opts)
