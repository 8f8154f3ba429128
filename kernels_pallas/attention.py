"""The one dispatch point for paged attention.

The model calls only :func:`paged_attention` and :func:`write_kv_pages`; which
implementation runs is an :class:`AttentionConfig` that the engine's backend
policy chose once, with :func:`select_attention`, from the user's setting and
the platform (no function here asks JAX which platform it is on)::

    attention_impl   platform   kernel
    "xla"            any        the pure-XLA reference (``paged_attention_xla``)
    "auto"           any        "xla" for now: the Pallas kernels become the default on GPU
                                and TPU once they have been run and timed there
                                (benchmarks/RESULTS.md)
    "pallas"         tpu        Mosaic kernels (``paged_attention_tpu``: scalar-prefetched
                                page tables, one page per grid step)
    "pallas"         gpu        Triton-style kernels (``paged_decode_pallas``, ``paged_prefill_pallas``)
    "pallas"         cpu        the same Triton-style kernels in the Pallas interpreter (tests)

Block sizes come from ``kernels_pallas.block_sizes``, the row of the platform
the kernel runs on. ``batch_invariant`` (the XLA reference only) sums each
query's softmax in a fixed order (``paged_attention_xla``), so its output does
not depend on the step's other rows, its bucket or prefill versus decode; with
it, ``dot_rows`` pads a decode step's per-(slot, KV head) dots, whose rows are
the head group's queries, to rows that run on the prefill dots' kernel
(``kernels_pallas.dot_rows``).
"""

from __future__ import annotations

import dataclasses

import jax

from kernels_pallas.block_sizes import decode_block_sizes, prefill_block_sizes
from kernels_pallas.dot_rows import DotRows
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
KERNELS = ("xla", "mosaic", "triton")
PLATFORMS = ("cpu", "gpu", "tpu")

__all__ = ["ATTENTION_IMPLS", "AttentionConfig", "paged_attention", "select_attention", "write_kv_pages"]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How paged attention runs (static: part of every compiled step).

    Attributes:
      kernel: "xla" (the reference), "mosaic" (Pallas on TPU) or "triton" (Pallas on GPU).
      interpret: run the Pallas kernel in the Pallas interpreter (CPU tests).
      block_sizes_row: the row of ``kernels_pallas.block_sizes`` to use: "cpu", "gpu" or "tpu".
      batch_invariant: fixed-order softmax sums (the "xla" kernel only: the Pallas
        kernels' online softmax runs over blocks that differ between prefill and decode).
      dot_rows: with ``batch_invariant``, the row padding of the decode dots
        (``paged_attention_xla.paged_decode_attention_xla``'s ``group_rows``).
      window_gather: the "xla" decode of a sliding-window layer gathers only the
        pages around its window (``paged_decode_attention_xla``'s ``window_bound``);
        False: the whole page table, as before (a benchmark's baseline).
    """

    kernel: str = "xla"
    interpret: bool = False
    block_sizes_row: str = "gpu"
    batch_invariant: bool = False
    dot_rows: DotRows = DotRows()
    window_gather: bool = True

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"attention kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.batch_invariant and self.kernel != "xla":
            raise ValueError(f"batch-invariant attention needs the xla kernel, got {self.kernel!r}")


def select_attention(impl: str, platform: str) -> AttentionConfig:
    """The attention configuration for a user setting on a platform.

    Args:
      impl: one of ATTENTION_IMPLS ("auto", "xla", "pallas").
      platform: "cpu", "gpu" (also "cuda", "rocm") or "tpu".

    Raises:
      ValueError: an unknown impl or platform.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; one of {PLATFORMS}")
    if impl in ("auto", "xla"):
        return AttentionConfig("xla", block_sizes_row=platform)
    if platform == "tpu":
        return AttentionConfig("mosaic", block_sizes_row="tpu")
    return AttentionConfig("triton", interpret=platform == "cpu", block_sizes_row=platform)


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
    config: AttentionConfig = AttentionConfig(),
    window_bound: int | None = None,
    bidirectional_spans: jax.Array | None = None,
) -> jax.Array:
    """Attention of a step's queries over the paged KV cache.

    Args:
      q: [T, num_heads, head_dim]: one row per slot in decode mode, the ragged
        chunk tokens in prefill mode.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] (or the stacked
        [layers, ...] cache with ``layer``), already holding this step's K/V.
      md: ``model.attention_metadata.AttentionMetadata``.
      scale, sliding_window, soft_cap, layer: see ``paged_attention_xla``.
      config: which implementation and block sizes (see :func:`select_attention`).
      window_bound: static bound of a traced ``sliding_window`` (the model's window);
        the XLA decode then gathers only a sliding layer's window of pages.
      bidirectional_spans: [T, 2] int32 or None, prefill only, the "xla" kernel only: keys
        each token sees beyond the causal rule (``paged_prefill_attention_xla``).

    Returns:
      [T, num_heads, head_dim] in q's dtype.

    Raises:
      ValueError: unknown attention mode; bidirectional spans in decode or with a Pallas kernel.
    """
    if md.mode not in ("decode", "prefill"):
        raise ValueError(f"unknown attention mode {md.mode!r}")
    if bidirectional_spans is not None and (md.mode != "prefill" or config.kernel != "xla"):
        raise ValueError("bidirectional spans (image tokens) need a prefill step on the xla attention "
                         f"kernel, got mode {md.mode!r}, kernel {config.kernel!r}")
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, layer=layer)
    head_dim, page_size = q.shape[-1], k_pages.shape[-2]
    if config.kernel != "xla":
        opts["interpret"] = config.interpret
    elif config.batch_invariant:
        opts["ordered_sums"] = True
        if md.mode == "decode":
            group = q.shape[1] // k_pages.shape[-4]
            opts["group_rows"] = config.dot_rows.count(group)
        else:  # query blocks whose dots keep the prefill rows' kernel
            opts["dot_rows"] = config.dot_rows
    if config.kernel == "triton":
        if md.mode == "decode":
            opts["pages_per_block"] = decode_block_sizes(
                config.block_sizes_row, head_dim, page_size).pages_per_block
        else:
            sizes = prefill_block_sizes(config.block_sizes_row, head_dim, page_size)
            opts.update(block_q=sizes.block_q, pages_per_block=sizes.pages_per_block)
    elif config.kernel == "mosaic" and md.mode == "prefill":
        opts["block_q"] = prefill_block_sizes(config.block_sizes_row, head_dim, page_size).block_q
    if md.mode == "decode":
        if config.kernel == "xla" and config.window_gather:
            opts["window_bound"] = window_bound
        fn = {"xla": paged_decode_attention_xla, "mosaic": paged_decode_attention_tpu,
              "triton": paged_decode_attention_pallas}[config.kernel]
        return fn(q, k_pages, v_pages, md.kv_lens, md.page_table, **opts)
    if bidirectional_spans is not None:
        opts["bidirectional_spans"] = bidirectional_spans
    fn = {"xla": paged_prefill_attention_xla, "mosaic": paged_prefill_attention_tpu,
          "triton": paged_prefill_attention_pallas}[config.kernel]
    return fn(q, k_pages, v_pages, md.cu_q_lens, md.kv_lens, md.page_table, md.num_seqs, **opts)
