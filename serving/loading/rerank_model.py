"""Loads a reranker (``serve --task rerank``): a cross-encoder or a decoder scored by label tokens.

Two kinds, told apart by the checkpoint's ``config.json``:

  * a sequence-classification cross-encoder (``model.cross_encoder``: BERT, XLM-RoBERTa; what
    sentence-transformers' ``CrossEncoder`` saves): ``model.bert.BertEncoder`` with a
    ``ClassifierHead``; a pair is framed by the tokenizer's post-processor (``encode_pair``);
  * any decoder this server generates with (Qwen3-Reranker is a ``Qwen3ForCausalLM``): its
    ``encode`` with a ``LabelTokenHead`` over the output head's rows of the template's two label
    tokens; a pair is framed by the template (``model.rerank_prompt``).

Either way the result runs on the embedding engine (one score per input, ``dim == 1``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.cross_encoder import is_cross_encoder, load_cross_encoder
from model.factory import build_model
from model.rerank_prompt import QWEN3_RERANKER, RerankPrompt, RerankTemplate
from model.safetensors_loader import load_hf_checkpoint
from model.score_heads import ClassifierHead, LabelTokenHead
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.loading.model_registry import hf_tokenizer
from serving.loading.model_source import resolve_model

log = logging.getLogger(__name__)

__all__ = ["RerankModel", "load_rerank_model"]


@dataclasses.dataclass(frozen=True)
class RerankModel:
    """What ``--task rerank`` serves.

    Attributes:
      model: the encoder (``encode(tokens [B, S], lengths [B], ...) -> [B, S, D] f32``).
      head: its score head (``[B, S, D], [B] -> [B, 1] f32``).
      tokenizer: the checkpoint's tokenizer.
      pair_encoder: ``encode_pair(query, document) -> (ids, type_start)``.
      name: the served name.
      kind: "cross-encoder" or "label-tokens".
    """

    model: nnx.Module
    head: ClassifierHead | LabelTokenHead
    tokenizer: TextTokenizer
    pair_encoder: object
    name: str
    kind: str


def load_rerank_model(name: str, dtype: str = "float32", revision: str | None = None,
                      template: RerankTemplate | None = None, progress: bool = True) -> RerankModel:
    """Loads ``name`` (a directory or Hub id) as a reranker.

    Args:
      name: a cross-encoder or decoder checkpoint.
      dtype: "float32" or "bfloat16" (the transformer's matmul inputs; the heads run in float32).
      revision: a Hub id's branch, tag or commit.
      template: a decoder reranker's prompt and labels (default: Qwen3-Reranker's); ignored for
        a cross-encoder.
      progress: show a progress bar while reading a decoder's weights.

    Raises:
      ValueError: not a Hugging Face checkpoint, an architecture neither kind reads, a label
        that is not one token, or what the loaders raise.
    """
    t0 = time.perf_counter()
    source = resolve_model(name, revision=revision)
    if not source.is_hf:
        raise ValueError(f"--task rerank needs a Hugging Face checkpoint directory or Hub id; {name!r} is not one")
    if is_cross_encoder(source.path):
        model, head = load_cross_encoder(source.path, dtype)
        tokenizer = hf_tokenizer(source.path, model.cfg.vocab_size)
        if not hasattr(tokenizer, "encode_pair"):
            raise ValueError(f"{source.path}: a cross-encoder needs a tokenizer.json (its pair framing)")
        out = RerankModel(model, head, tokenizer, tokenizer, source.name, "cross-encoder")
    else:
        cfg, params = load_hf_checkpoint(source.path, dtype, name=source.name, progress=progress)
        tokenizer = hf_tokenizer(source.path, cfg.vocab_size)
        prompt = RerankPrompt(template or QWEN3_RERANKER, tokenizer)
        ids = list(prompt.label_ids)
        if cfg.tie_embeddings:
            rows = np.asarray(params["embed"][np.asarray(ids)], np.float32)
        else:
            rows = np.asarray(params["lm_head"][:, np.asarray(ids)], np.float32).T
        head = LabelTokenHead(label_w=rows, label_ids=prompt.label_ids, soft_cap=cfg.final_logit_softcap)
        model = build_model(cfg, params=params, dtype=jnp.dtype(dtype))
        out = RerankModel(model, head, tokenizer, prompt, source.name, "label-tokens")
    log.info("loaded reranker %s (%s) in %.1f s", out.name, out.kind, time.perf_counter() - t0)
    return out
