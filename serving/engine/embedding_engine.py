"""The embedding engine: a sentence-transformers model's forward pass over padded batches.

An embedding request keeps no KV cache and samples nothing, so the step is one pure function of
the parameters and the batch, jitted once per (batch bucket, length bucket)::

    embed_step(params, tokens [B, S] int32, lengths [B] int32[, type_starts [B] int32])
        -> embeddings [B, dim] float32
        = head(model.encode(tokens, lengths[, type_starts]))
                                  pooling, Dense layers, Normalize (model.sentence_transformers.EmbeddingHead),
                                  or a reranker's score head (model.score_heads: dim 1, the score)

``type_starts`` (each row's first token of type 1) goes to encoders that take token types
(``takes_token_types``: ``model.bert.BertEncoder``, a cross-encoder's pair framing) only.

``B`` is a power of two up to ``max_batch``; ``S`` a power of two from ``min_len`` up to
``max_len`` (the last bucket is ``max_len`` itself). Padding rows have length 1 and their
outputs are dropped; padding tokens are masked by the attention and the pooling, so a vector
does not depend on its bucket or its neighbours beyond float rounding. The attention is the
padded XLA path (``kernels_pallas.padded_attention_xla``: causal, or bidirectional for
EmbeddingGemma) on every platform; the backend policy still decides the dot and the storage of
stacked weights. Single device (no mesh).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.sentence_transformers import EmbeddingHead
from serving.engine.backend_policy import BackendPolicy

log = logging.getLogger(__name__)

__all__ = ["EmbeddingEngine", "length_bucket", "batch_bucket"]


def _pow2(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def length_bucket(n: int, min_len: int, max_len: int) -> int:
    """The padded length of a batch whose longest input has ``n`` tokens (``n <= max_len``)."""
    return _pow2(n, min_len, max_len)


def batch_bucket(n: int, max_batch: int) -> int:
    """The padded row count of a batch of ``n <= max_batch`` inputs."""
    return _pow2(n, 1, max_batch)


def _embed_step(graphdef, head: EmbeddingHead, compute, params, tokens, lengths, type_starts=None):
    model = nnx.merge(graphdef, params)
    if type_starts is None:
        return head(model.encode(tokens, lengths, compute), lengths)
    return head(model.encode(tokens, lengths, compute, type_starts=type_starts), lengths)


class EmbeddingEngine:
    """Parameters plus the compiled embedding step. Not thread-safe: one caller (the loop).

    Args:
      model: a decoder of ``model/`` with ``encode`` (``model.gemma3.Gemma3``, ``model.llama.Llama``),
        or an encoder (``model.bert.BertEncoder``).
      head: the sentence-transformers modules after the transformer, or a score head
        (``model.score_heads``).
      max_len: the longest input, in tokens (default: the head's ``max_seq_length``, else the
        model's ``max_position``).
      max_batch: the most inputs in one step (a power of two).
      max_batch_tokens: the most padded tokens (rows x length bucket) in one step.
      min_len: the smallest length bucket.
      policy: the backend policy (default: JAX's default backend's).

    Raises:
      ValueError: a model without ``encode``, or sizes that cannot hold one input of ``max_len``.
    """

    def __init__(self, model: nnx.Module, head: EmbeddingHead, *, max_len: int | None = None,
                 max_batch: int = 16, max_batch_tokens: int = 8192, min_len: int = 16,
                 policy: BackendPolicy | None = None):
        if not hasattr(model, "encode"):
            raise ValueError(f"{type(model).__name__} cannot encode: it is not an embedding model's transformer")
        if max_batch < 1 or max_batch & (max_batch - 1):
            raise ValueError(f"max_batch must be a power of two, got {max_batch}")
        self.model_cfg = model.cfg
        self.head = head
        self.max_len = int(max_len or head.max_seq_length or model.cfg.max_position)
        self.max_len = min(self.max_len, model.cfg.max_position)
        if max_batch_tokens < self.max_len:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must hold one input of max_len "
                             f"({self.max_len})")
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.min_len = min(min_len, self.max_len)
        self.policy = policy or BackendPolicy.detect()
        graphdef, params = nnx.split(model)
        self.params = self.policy.store_params(params)
        compute = self.policy.compute(dtype=model.dtype)
        self._step = jax.jit(functools.partial(_embed_step, graphdef, head, compute))
        self.takes_token_types = bool(getattr(model, "takes_token_types", False))
        self.compile_times: dict[tuple[int, int], float] = {}
        self.steps = 0  # steps run so far

    @property
    def dim(self) -> int:
        return self.head.dim

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    def rows_per_step(self, longest: int) -> int:
        """How many inputs one step can take when its longest has ``longest`` tokens."""
        S = length_bucket(longest, self.min_len, self.max_len)
        return max(1, min(self.max_batch, self.max_batch_tokens // S))

    def embed(self, inputs: Sequence[Sequence[int]], type_starts: Sequence[int] | None = None) -> np.ndarray:
        """One step over ``inputs`` (at most :meth:`rows_per_step` of their longest).

        Args:
          inputs: token id sequences, each 1 .. max_len long, ids in 0 .. vocab_size - 1.
          type_starts: each input's first token of type 1 (>= its length: none), for an encoder
            that takes token types; ignored by others; None: all type 0.

        Returns:
          [len(inputs), dim] float32.

        Raises:
          ValueError: an empty batch, an empty or too-long input, an id outside the vocabulary,
            or more inputs than one step takes.
        """
        if not inputs:
            raise ValueError("embed: no inputs")
        longest = max(len(r) for r in inputs)
        if min(len(r) for r in inputs) < 1 or longest > self.max_len:
            raise ValueError(f"embed: every input needs 1..{self.max_len} tokens")
        if len(inputs) > self.rows_per_step(longest):
            raise ValueError(f"embed: {len(inputs)} inputs exceed one step ({self.rows_per_step(longest)})")
        B = batch_bucket(len(inputs), self.max_batch)
        S = length_bucket(longest, self.min_len, self.max_len)
        tokens = np.zeros((B, S), np.int32)
        lengths = np.ones((B,), np.int32)
        for i, row in enumerate(inputs):
            ids = np.asarray(row, np.int64)
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise ValueError(f"embed: token ids must lie in 0..{self.vocab_size - 1}")
            tokens[i, :len(row)] = ids
            lengths[i] = len(row)
        t0 = time.perf_counter()
        if self.takes_token_types:
            starts = np.full((B,), S, np.int32)
            if type_starts is not None:
                starts[:len(inputs)] = np.minimum(np.asarray(type_starts, np.int64), S)
            out = np.asarray(self._step(self.params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(starts)))
        else:
            out = np.asarray(self._step(self.params, jnp.asarray(tokens), jnp.asarray(lengths)))
        self.steps += 1
        if (B, S) not in self.compile_times:
            self.compile_times[(B, S)] = time.perf_counter() - t0
        return out[:len(inputs)].astype(np.float32, copy=False)

    def warmup(self, lengths: Sequence[int] | None = None) -> None:
        """Compiles the step for every batch bucket at the given length buckets (default: the
        smallest), so the first requests do not wait for XLA."""
        for S in lengths or (self.min_len,):
            b = 1
            while b <= self.rows_per_step(S):
                self.embed([[0] * S] * b)
                b *= 2
        log.info("embedding engine warm: %d shapes", len(self.compile_times))
