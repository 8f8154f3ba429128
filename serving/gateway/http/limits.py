"""The gateway's request limits: body size, file size, prompt length, stalled streams, tokenizer threads.

Each bounds the work or memory one request can cost the server before the
engine sees it:

* ``max_request_bytes``: a larger request body is refused with 413 before it
  is read (``body_limit.py``);
* ``max_file_bytes``: the same for an upload to ``POST /v1/files`` (which is
  held to this limit instead of ``max_request_bytes``; ``files.py``);
* ``max_prompt_chars``: a longer prompt (a completion's ``prompt``, the total
  of a chat's message contents) is refused with 400 before it is tokenized;
* ``stream_write_timeout``: a streamed response whose client does not accept
  a write within this many seconds is ended, its engine request cancelled and
  metered (``disconnect.py``);
* ``tokenizer_threads``: prompts are tokenized, rendered and decoded in at
  most this many worker threads at once (``prompts.py``), never on the event
  loop;
* ``media`` (:class:`MediaLimits`): image inputs' bytes, pixels and count per request, and
  the hosts whose image URLs are fetched (``serving.gateway.media.image_input``). A data
  URL travels in the body, so ``max_request_bytes`` bounds it first (413).

The per-stream buffer between the engine and the HTTP writer is bounded by
the engine loop (``EngineLoop(max_queued_events=...)``, the server's
``stream_buffer_events``). ``ServerConfig`` and ``configs/server.yaml`` carry
the same defaults as this module.
"""

from __future__ import annotations

import dataclasses

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""4 MiB: far above any prompt that fits a context window, far below what stalls a server."""

DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
"""100 MiB: a large batch input file (OpenAI allows 200 MB per batch file)."""

DEFAULT_MAX_PROMPT_CHARS = 1_000_000
"""About half a second of SentencePiece work in a worker thread (Gemma's vocabulary)."""

DEFAULT_STREAM_WRITE_TIMEOUT_S = 30.0

DEFAULT_TOKENIZER_THREADS = 4
"""Enough that one large prompt does not hold up small ones; SentencePiece releases
the GIL, so the threads run in parallel up to the number of cores."""


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What an image input may be (``serving.gateway.media.image_input``).

    Attributes:
      max_image_bytes: encoded bytes per image (after base64 decoding; a fetch stops there).
      max_image_pixels: width x height per image (checked from the header, before decoding).
      max_images: images per request.
      allowed_media_domains: hosts whose ``http(s)`` image URLs are fetched (exact names or
        ``*.example.com``); empty: remote URLs are refused.
      fetch_timeout_s: seconds a remote fetch may take in all.
      max_tenant_image_pixels: pixels one tenant may have waiting for a decode or decoding,
        all its requests together (``serving.gateway.media.tenant_decodes``; beyond it: 429);
        None: four images of ``max_image_pixels``.
      tenant_image_pixel_rate: pixels a second one tenant's images may decode (a token bucket
        of two images of ``max_image_pixels``; ``serving.gateway.media.tenant_decodes``);
        None: no bound.
    """

    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images: int = 8
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    max_tenant_image_pixels: int | None = None
    tenant_image_pixel_rate: float | None = 20_000_000

    def __post_init__(self) -> None:
        if self.tenant_image_pixel_rate is not None and not self.tenant_image_pixel_rate > 0:
            raise ValueError(f"tenant_image_pixel_rate must be positive, got {self.tenant_image_pixel_rate!r}")
        if self.max_tenant_image_pixels is None:
            object.__setattr__(self, "max_tenant_image_pixels", 4 * self.max_image_pixels)
        elif self.max_tenant_image_pixels < 1:
            raise ValueError(f"max_tenant_image_pixels must be positive, got {self.max_tenant_image_pixels!r}")


@dataclasses.dataclass(frozen=True)
class GatewayLimits:
    """Per-request limits of the gateway (see the module docstring).

    Attributes:
      max_request_bytes: largest request body in bytes; None: unlimited.
      max_file_bytes: largest uploaded file in bytes; None: unlimited.
      max_prompt_chars: largest prompt in characters (Unicode code points);
        None: unlimited.
      stream_write_timeout: seconds one write of a streamed response may take;
        None: no timeout.
      tokenizer_threads: worker threads for tokenization (>= 1).
      media: image inputs' limits.

    Raises:
      ValueError: a limit that is not positive.
    """

    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES
    max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS
    stream_write_timeout: float | None = DEFAULT_STREAM_WRITE_TIMEOUT_S
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    media: MediaLimits = MediaLimits()

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_file_bytes", "max_prompt_chars", "stream_write_timeout", "tokenizer_threads"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
