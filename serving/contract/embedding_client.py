"""What the gateway needs from an embedding engine: token ids in, float32 vectors out.

An embedding model (``serve --task embed``) is served by an engine that keeps no KV cache and
samples nothing: each input runs once, whole (``serving.runtime.embedding_loop.EmbeddingLoop``
in process). The gateway tokenizes, checks the inputs, meters the request and then awaits
:meth:`EmbeddingClient.embed`; it never imports JAX.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from serving.contract.engine_client import EngineStats

__all__ = ["EmbeddingClient"]


class EmbeddingClient(Protocol):
    """An engine that embeds token sequences (in-process: the embedding loop)."""

    @property
    def max_model_len(self) -> int:
        """The longest input in tokens (the model's ``max_seq_length`` / context window)."""

    @property
    def kv_capacity_tokens(self) -> int | None:
        """None: an embedding engine holds no KV cache (kept for ``ServedModel``)."""

    @property
    def embedding_dim(self) -> int:
        """The width of every vector :meth:`embed` returns."""

    @property
    def vocab_size(self) -> int:
        """Token ids must lie in 0 .. vocab_size - 1."""

    async def embed(self, inputs: Sequence[Sequence[int]], priority: str = "default") -> np.ndarray:
        """Embeds each input (its token ids, as the tokenizer framed it).

        Args:
          inputs: one or more non-empty sequences of token ids, each at most
            :attr:`max_model_len` long.
          priority: "default", or "batch" (Batch API lines: run after waiting default work).

        Returns:
          [len(inputs), embedding_dim] float32, in input order (normalized when the model
          ends with a Normalize module).

        Raises:
          RequestRejectedError: an empty input, one longer than :attr:`max_model_len`, or a
            token id outside the vocabulary (the message names the input).
          EngineOverloadedError: too many inputs wait already.
          RuntimeError: the step failed (only the requests in that step fail).
        """

    def is_ready(self) -> bool:
        """Whether the engine has started and compiled its shapes."""

    def stats(self) -> EngineStats:
        """Load for metrics: running and waiting requests."""
