"""``--task``: auto picks embed for a sentence-transformers directory only; an embedding model's
base config reads without a head; a directory that is not a sentence-transformers model is refused
for --task embed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.hf_config import config_from_hf
from serving.loading.embedding_model import load_embedding_model
from serving.loading.model_source import resolve_task
from tests.support.embedding_models import ST_TINY

HF_TINY = Path(__file__).resolve().parents[2] / "data" / "hf_tiny"


def test_auto_task():
    assert resolve_task("auto", str(ST_TINY / "gemma3_embed")) == "embed"
    assert resolve_task("auto", str(HF_TINY / "llama")) == "generate"
    assert resolve_task("auto", "tiny-random") == "generate"
    assert resolve_task("generate", str(ST_TINY / "qwen3_embed")) == "generate"
    with pytest.raises(ValueError, match="--task must be one of"):
        resolve_task("classify", "tiny-random")


def test_base_model_configs():
    d = json.loads((ST_TINY / "qwen3_embed" / "config.json").read_text())
    assert d["architectures"] == ["Qwen3Model"] and d["tie_word_embeddings"] is False
    cfg = config_from_hf(d)
    assert cfg.tie_embeddings and cfg.causal and cfg.qk_norm  # no head to read
    with pytest.raises(ValueError, match="Gemma 3"):
        config_from_hf({**d, "use_bidirectional_attention": True})


def test_embed_task_needs_a_sentence_transformers_model():
    with pytest.raises(ValueError, match="modules.json"):
        load_embedding_model(str(HF_TINY / "llama"), progress=False)
