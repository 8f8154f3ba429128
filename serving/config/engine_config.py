"""The engine's static sizes and the shape buckets its steps compile for (no JAX).

Shapes are fixed per compilation and come from small bucket sets (JetStream's
approach), so the number of compiled programs stays small:

  * T: prefill token-count buckets, powers of two from 16 up to the prefill chunk.
  * B: decode batch buckets, powers of two from ``min_decode_batch`` up to the
    slot count; a step's rows are the running slots, so a lone stream does not
    pay for 32 slots.
  * P: page-table width buckets, powers of two (in pages) from 128 tokens'
    worth (64 in a prefill step) up to ``max_pages_per_seq``, covering the
    longest sequence in the step, so attention work follows the real context
    length.
  * S: prefill rows, ``max_prefill_seqs`` (at most ``max_slots``: each row is a
    running request in its own slot); from 16 up, :data:`FEW_PREFILL_ROWS` for a
    step of that many prompts or fewer. A step computes the LM head and samples at
    all S rows, so a lone prompt does not pay for 32 rows of logits.
"""

from __future__ import annotations

import dataclasses

from serving.config.speculative_config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")
"""``--kv-cache-dtype``: auto (the pages of ``kv_dtype``, as before), bfloat16, or a quantized
format: int8 or fp8 (float8_e4m3fn) values with a float32 scale per token and KV head
(``kernels_pallas.kv_quant``)."""

_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "fp8": 1}
SCALE_BYTES = 4
"""Bytes of one scale (float32) of a quantized format: one per token, KV head and layer, K and V."""


def kv_page_bytes(model_cfg, page_size: int, kv_dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV page of every layer, K and V, scale pages included.

    ``2 * layers * kv_heads * page_size * (head_dim * value_bytes + scale_bytes)``: value bytes
    2 (bfloat16) or 4 (float32), scale bytes 0; int8 / fp8: value bytes 1, scale bytes 4.
    For Gemma 3 270M (18 layers, 1 KV head, head_dim 256) and 16-token pages: 294,912 bytes in
    bfloat16, 149,760 in int8 (1.97x the tokens in the same memory).

    Args:
      model_cfg: anything with ``num_layers``, ``num_kv_heads``, ``head_dim``.
      kv_dtype: "float32" or "bfloat16" (the unquantized cache's dtype).
      kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`.
    """
    fmt = kv_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    scale = SCALE_BYTES if fmt in ("int8", "fp8") else 0
    per_token = model_cfg.num_kv_heads * (model_cfg.head_dim * _VALUE_BYTES[fmt] + scale)
    return 2 * model_cfg.num_layers * page_size * per_token


def pages_for_bytes(kv_cache_bytes: int, page_bytes: int) -> int:
    """The pool size in pages (the null page 0 included) that ``kv_cache_bytes`` holds.

    Raises:
      ValueError: fewer than 2 pages fit.
    """
    pages = kv_cache_bytes // page_bytes
    if pages < 2:
        raise ValueError(f"kv_cache_bytes {kv_cache_bytes} holds {pages} pages of {page_bytes} bytes; "
                         "at least 2 are needed (page 0 is reserved)")
    return pages


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the engine.

    Attributes:
      max_slots: decode rows (concurrently running sequences).
      page_size: tokens per KV page.
      num_pages: KV pool size in pages, including the null page 0.
      max_model_len: context window in tokens (prompt + generated).
      prefill_chunk: most tokens in one prefill step (a power of two >= 16).
      max_prefill_seqs: sequences packed into one prefill step (S); above
        ``max_slots`` it is lowered to ``max_slots`` (each row takes a slot).
      min_decode_batch: smallest decode batch bucket in rows (None: the backend
        policy's, ``serving.engine.backend_policy``).
      kv_dtype: KV cache dtype name ("float32" or "bfloat16"); the backend
        policy decides how it is stored. With a quantized ``kv_cache_dtype``, the
        dtype its pages are dequantized to.
      kv_cache_dtype: the KV format, one of :data:`KV_CACHE_DTYPES` ("auto": pages
        of ``kv_dtype``; "int8" / "fp8": quantized pages with scale pages).
      speculative: n-gram speculative decoding (None: off); its ``num_tokens`` (K)
        shapes the verify step, T = rows * (K + 1) tokens (``serving.engine.verify_step``).
      max_loras: LoRA adapters resident on the device at once (0: no LoRA; the stacks
        have ``max_loras + 1`` slots, ``model.lora``).
      max_lora_rank: the largest adapter rank served (the stacks' R).
    """

    max_slots: int = 32
    page_size: int = 16
    num_pages: int = 4096
    max_model_len: int = 8192
    prefill_chunk: int = 512
    max_prefill_seqs: int = 32
    min_decode_batch: int | None = None
    kv_dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    speculative: SpeculativeConfig | None = None
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self):
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, "
                             f"{self.max_lora_rank}")
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
        if self.max_model_len % self.page_size:
            raise ValueError("max_model_len must be a multiple of page_size")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "bfloat16":
            object.__setattr__(self, "kv_dtype", "bfloat16")
        if self.max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs must be >= 1, got {self.max_prefill_seqs}")
        if self.max_prefill_seqs > self.max_slots:
            object.__setattr__(self, "max_prefill_seqs", self.max_slots)
        if self.min_decode_batch is not None and self.min_decode_batch < 1:
            raise ValueError(f"min_decode_batch must be >= 1, got {self.min_decode_batch}")
        # A pool smaller than one full context is allowed: requests that could
        # never fit are rejected at submit (RequestRejectedError).

    @property
    def kv_format(self) -> str | None:
        """"int8" or "fp8" for a quantized KV cache, else None."""
        return self.kv_cache_dtype if self.kv_cache_dtype in ("int8", "fp8") else None

    @property
    def max_pages_per_seq(self) -> int:
        return self.max_model_len // self.page_size

    @classmethod
    def from_server_config(cls, server, model_cfg) -> "EngineConfig":
        """The engine sizes of ``xlaserve serve`` (and of every process of a multi-host job).

        Args:
          server: a ``serving.config.server_config.ServerConfig``.
          model_cfg: the served model's ``model.config.ModelConfig``: the context
            window is the smaller of ``server.max_model_len`` and ``max_position``; with
            ``server.kv_cache_bytes`` the pool holds as many pages as fit those bytes
            (:func:`kv_page_bytes`) instead of ``server.num_pages``.

        Raises:
          ValueError: ``kv_cache_bytes`` holds fewer than 2 pages.
        """
        kv_dtype = server.kv_dtype or server.dtype
        num_pages = server.num_pages
        if server.kv_cache_bytes is not None:
            num_pages = pages_for_bytes(server.kv_cache_bytes, kv_page_bytes(
                model_cfg, server.page_size, kv_dtype, server.kv_cache_dtype))
        return cls(
            max_slots=server.max_slots, page_size=server.page_size, num_pages=num_pages,
            max_model_len=min(server.max_model_len, model_cfg.max_position),
            prefill_chunk=server.prefill_chunk, max_prefill_seqs=server.max_prefill_seqs,
            min_decode_batch=server.min_decode_batch, kv_dtype=kv_dtype, kv_cache_dtype=server.kv_cache_dtype,
            speculative=SpeculativeConfig.from_settings(
                server.speculative, server.num_speculative_tokens, server.prompt_lookup_min,
                server.prompt_lookup_max, server.speculative_max_batch, server.draft_model,
                server.speculative_token_budget, server.draft_vocab),
            max_loras=server.lora_slots, max_lora_rank=server.max_lora_rank)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def token_bucket(n: int, cfg: EngineConfig) -> int:
    """Prefill token-count bucket for n tokens (16, 32, ..., prefill_chunk)."""
    return _pow2_at_least(n, 16, cfg.prefill_chunk)


MIN_PAGE_BUCKET_TOKENS = 128
"""The narrowest page-table bucket of a decode (and verify) step, in tokens. The
XLA decode attention gathers and scores the table's whole width for every row,
so at 32 slots of ~150-token contexts a 512-token table made the attention
about a third of Gemma 3 270M's bf16 step on a 2-core CPU; 128 cuts that work
4x for short contexts at the cost of two more decode widths (128, 256) to
compile per batch bucket (benchmarks/RESULTS.md, issue 17)."""


def page_bucket(num_pages: int, cfg: EngineConfig) -> int:
    """Page-table width bucket covering num_pages (powers of two, >= 128 tokens' worth)."""
    lo = max(1, min(MIN_PAGE_BUCKET_TOKENS // cfg.page_size, cfg.max_pages_per_seq))
    return _pow2_at_least(num_pages, lo, cfg.max_pages_per_seq)


MIN_PREFILL_PAGE_BUCKET_TOKENS = 64
"""The narrowest page-table bucket of a prefill step, in tokens. The XLA prefill
gathers the table's width once per query block (``paged_prefill_attention_xla``),
so a step of short packed prompts over a 512-token table did 8x the attention
work of one over 64 tokens (``python -m benchmarks.prefill_packing attention``,
benchmarks/RESULTS.md); decode keeps :data:`MIN_PAGE_BUCKET_TOKENS`."""


def prefill_page_bucket(num_pages: int, cfg: EngineConfig) -> int:
    """Page-table width bucket of a prefill step covering num_pages (powers of two,
    >= 64 tokens' worth)."""
    lo = max(1, min(MIN_PREFILL_PAGE_BUCKET_TOKENS // cfg.page_size, cfg.max_pages_per_seq))
    return _pow2_at_least(num_pages, lo, cfg.max_pages_per_seq)


FEW_PREFILL_ROWS = 4
"""The smaller prefill row bucket (S). A prefill step computes the LM head at each of its
S rows: for Gemma 3 270M (262,144 vocabulary entries) in bfloat16 on a 2-core CPU, 32
rows of head took 125 ms of the 235 ms prefill of one 16-token prompt, 4 rows ~35 ms
(benchmarks/RESULTS.md, issue 34). Two buckets, not one per power of two, and two only
when ``max_prefill_seqs`` is at least 4x this: each bucket is another program per (T, P)
to compile (~3 s each for Gemma 3 270M on that CPU), and a head of 8 rows costs little
more than one of 4."""


def prefill_rows_bucket(n: int, cfg: EngineConfig) -> int:
    """Prefill row bucket (S) for a step of n rows: FEW_PREFILL_ROWS (n <= it, and
    max_prefill_seqs >= 4 x it) or max_prefill_seqs."""
    if cfg.max_prefill_seqs < 4 * FEW_PREFILL_ROWS or n > FEW_PREFILL_ROWS:
        return cfg.max_prefill_seqs
    return FEW_PREFILL_ROWS


def batch_bucket(n: int, cfg: EngineConfig) -> int:
    """Decode batch bucket for n running slots (``cfg.min_decode_batch`` resolved, see Engine)."""
    return _pow2_at_least(n, min(cfg.min_decode_batch or 1, cfg.max_slots), cfg.max_slots)
