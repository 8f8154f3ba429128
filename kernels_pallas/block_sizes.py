"""Block sizes of the Pallas kernels, per backend and head_dim (one table, no scattered constants).

Pages per compute block trade gather width against loop trip count: a block
of ``pages_per_block * page_size`` keys is scored per inner iteration of the
Triton-style kernels (the TPU kernels move one page per grid step and use
only ``block_q``). The values are starting points sized so a block holds about
128 keys (a Triton dot tile); they are to be tuned by ``benchmarks/kernels.py``
on real hardware and recorded in RESULTS.md.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    pages_per_block: int


_KEYS_PER_BLOCK = {
    # (backend, head_dim) -> keys scored per inner iteration; None matches any head_dim.
    ("gpu", 256): 64,
    ("gpu", None): 128,
    ("tpu", None): 128,
    ("cpu", None): 128,
}


def decode_block_sizes(backend: str, head_dim: int, page_size: int) -> DecodeBlockSizes:
    """Block sizes for the paged decode kernel.

    Args:
      backend: "cpu", "gpu" (or "cuda"/"rocm") or "tpu".
      head_dim: per-head width.
      page_size: tokens per page.
    """
    backend = "gpu" if backend in ("cuda", "rocm") else backend
    keys = _KEYS_PER_BLOCK.get((backend, head_dim)) or _KEYS_PER_BLOCK.get((backend, None), 128)
    return DecodeBlockSizes(pages_per_block=max(1, keys // page_size))


@dataclasses.dataclass(frozen=True)
class PrefillBlockSizes:
    block_q: int
    pages_per_block: int


_QUERY_BLOCK = {
    # (backend, head_dim) -> query tokens per program; None matches any head_dim.
    ("gpu", 256): 16,
    ("gpu", None): 32,
    ("tpu", None): 32,
    ("cpu", None): 32,
}


def prefill_block_sizes(backend: str, head_dim: int, page_size: int) -> PrefillBlockSizes:
    """Block sizes for the chunked-prefill kernel (same arguments as :func:`decode_block_sizes`)."""
    backend = "gpu" if backend in ("cuda", "rocm") else backend
    bq = _QUERY_BLOCK.get((backend, head_dim)) or _QUERY_BLOCK.get((backend, None), 32)
    return PrefillBlockSizes(block_q=bq,
                             pages_per_block=decode_block_sizes(backend, head_dim, page_size).pages_per_block)
