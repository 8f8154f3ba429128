"""What the gateway needs from a reranker: a pair framed as token ids, and a score per pair.

A rerank model (``serve --task rerank``) runs on the embedding loop
(``serving.runtime.embedding_loop.EmbeddingLoop``), which implements :class:`ScoringClient` beside
``EmbeddingClient``; the model's :class:`PairEncoder` (a cross-encoder's tokenizer, or a decoder
reranker's prompt) frames each (query, document) pair. Nothing here imports JAX.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

__all__ = ["PairEncoder", "ScoringClient"]


class PairEncoder(Protocol):
    """Frames a (query, document) pair as one input, as the model was trained to read it."""

    def encode_pair(self, query: str, document: str) -> tuple[list[int], int]:
        """(token ids, the position of the first token of type 1; ``len(ids)`` when all are type 0).

        Raises:
          TypeError: a text that is not a ``str``.
        """


class ScoringClient(Protocol):
    """An engine that scores framed pairs (in process: the embedding loop over a score head)."""

    @property
    def max_model_len(self) -> int:
        """The longest framed pair in tokens."""

    async def score(self, inputs: Sequence[Sequence[int]], type_starts: Sequence[int],
                    priority: str = "default") -> np.ndarray:
        """Scores each framed pair (batched with other requests' inputs, as embeddings are).

        Args:
          inputs: one or more non-empty token-id sequences, each at most :attr:`max_model_len`.
          type_starts: each input's first token of type 1 (``len(input)``: none).
          priority: "default", or "batch" (Batch API lines).

        Returns:
          [len(inputs)] float32 scores, in input order (a cross-encoder's activation applied:
          Sigmoid by default; a label-token reranker's P(yes) in (0, 1)).

        Raises:
          RequestRejectedError: an empty or too long input, ids outside the vocabulary, or
            ``type_starts`` of another length.
          EngineOverloadedError: too many inputs wait already.
          RuntimeError: the step failed.
        """
