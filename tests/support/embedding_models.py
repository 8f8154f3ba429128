"""The tiny sentence-transformers models of tests/data/st_tiny, loaded once per process for the
engine, loop and gateway embedding tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

ST_TINY = Path(__file__).resolve().parents[1] / "data" / "st_tiny"


def golden(case: str) -> tuple[dict, np.ndarray]:
    """(golden.json, embeddings.npy) of a case ("gemma3_embed" or "qwen3_embed")."""
    return json.loads((ST_TINY / case / "golden.json").read_text()), np.load(ST_TINY / case / "embeddings.npy")


@functools.lru_cache(maxsize=None)
def embedding_engine(case: str, max_batch: int = 4, max_batch_tokens: int = 128):
    """An ``EmbeddingEngine`` of a case in float32 (max_len 32, length buckets 16 and 32)."""
    from model.factory import build_model
    from model.safetensors_loader import load_hf_checkpoint
    from model.sentence_transformers import read_sentence_transformer
    from serving.engine.embedding_engine import EmbeddingEngine

    head = read_sentence_transformer(ST_TINY / case)
    cfg, params = load_hf_checkpoint(head.transformer_dir, progress=False)
    return EmbeddingEngine(build_model(cfg, params=params), head, max_len=32, max_batch=max_batch,
                           max_batch_tokens=max_batch_tokens)
