"""Loads an embedding model: a sentence-transformers directory (or Hub id) that ``--model`` names.

``serve --task embed`` (or ``--task auto`` with a model whose directory has ``modules.json``)
serves it through ``/v1/embeddings``: the base model (``model.hf_config.BASE_MODELS``, e.g.
EmbeddingGemma's bidirectional ``Gemma3TextModel`` or Qwen3-Embedding's ``Qwen3Model``) read by
``model.safetensors_loader``, the modules after it by ``model.sentence_transformers``, and the
tokenizer of the transformer's folder (``model_registry.hf_tokenizer``), whose post-processor
frames each input (``encode_input``).
"""

from __future__ import annotations

import logging
import time

import jax.numpy as jnp
from flax import nnx

from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from model.sentence_transformers import EmbeddingHead, is_sentence_transformer, read_sentence_transformer
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.loading.model_registry import hf_tokenizer
from serving.loading.model_source import resolve_model

log = logging.getLogger(__name__)

__all__ = ["load_embedding_model"]


def load_embedding_model(name: str, dtype: str = "float32", progress: bool = True,
                         revision: str | None = None) -> tuple[nnx.Module, EmbeddingHead, TextTokenizer, str]:
    """The transformer, the modules after it, the tokenizer and the served name of an embedding model.

    Args:
      name: a sentence-transformers directory or a Hub id of one.
      dtype: "float32" or "bfloat16" (the transformer's weights and matmul inputs; the
        pooling, Dense layers and Normalize run in float32).
      progress: show a progress bar while reading the weights.
      revision: a Hub id's branch, tag or commit.

    Raises:
      ValueError: not a sentence-transformers model (no ``modules.json``), modules or a base
        model this server does not read (named), or a tokenizer that does not load.
    """
    t0 = time.perf_counter()
    source = resolve_model(name, revision=revision)
    if not source.is_hf or not is_sentence_transformer(source.path):
        raise ValueError(f"--task embed needs a sentence-transformers model (a directory with modules.json); "
                         f"{name!r} is not one")
    head = read_sentence_transformer(source.path)
    cfg, params = load_hf_checkpoint(head.transformer_dir, dtype, name=source.name, progress=progress)
    model = build_model(cfg, params=params, dtype=jnp.dtype(dtype))
    tokenizer = hf_tokenizer(head.transformer_dir, cfg.vocab_size)
    log.info("loaded embedding model %s (%s pooling, %d Dense, %s; dim %d) in %.1f s", source.name,
             head.pooling, len(head.dense), "normalized" if head.normalize else "not normalized", head.dim,
             time.perf_counter() - t0)
    return model, head, tokenizer, source.name
