"""Rerankers against sentence-transformers' CrossEncoder and transformers (tests/data/rerank_tiny):
each kind loads, frames pairs as the reference tokenizer did, and scores them on the embedding
engine within 1e-4 (float32), all pairs in one padded step and in steps of two."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.rerank_models import RERANK_TINY

CASES = ("bert_cross", "xlmr_cross", "qwen3_rerank")


@pytest.mark.parametrize("case", CASES)
def test_scores_match_the_reference(case):
    from serving.engine.embedding_engine import EmbeddingEngine
    from serving.loading.rerank_model import load_rerank_model

    g = json.loads((RERANK_TINY / case / "golden.json").read_text())
    rerank = load_rerank_model(str(RERANK_TINY / case), progress=False)
    assert rerank.kind == ("label-tokens" if case == "qwen3_rerank" else "cross-encoder")
    framed = [rerank.pair_encoder.encode_pair(q, d) for q, d in g["pairs"]]
    assert [ids for ids, _ in framed] == g["token_ids"]
    if "type_starts" in g:
        assert [s for _, s in framed] == g["type_starts"]
    else:
        assert list(rerank.head.label_ids) == [g["labels"]["no"], g["labels"]["yes"]]
    engine = EmbeddingEngine(rerank.model, rerank.head, max_len=128, max_batch=8, max_batch_tokens=1024)
    ids, starts = [f[0] for f in framed], [f[1] for f in framed]
    together = engine.embed(ids, type_starts=starts)[:, 0]
    np.testing.assert_allclose(together, g["scores"], atol=1e-4, rtol=0)
    pairs = np.concatenate([engine.embed(ids[i:i + 2], type_starts=starts[i:i + 2])[:, 0]
                            for i in range(0, len(ids), 2)])
    np.testing.assert_allclose(pairs, g["scores"], atol=1e-4, rtol=0)


def test_a_template_file_overrides_the_labels(tmp_path):
    from model.rerank_prompt import RerankPrompt, RerankTemplate
    from serving.loading.model_registry import hf_tokenizer

    tok = hf_tokenizer(RERANK_TINY / "qwen3_rerank")
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"labels": ["yes", "no"], "body": "{query} {document}"}))
    prompt = RerankPrompt(RerankTemplate.from_file(path), tok)
    assert prompt.label_ids == (tok.backend.token_to_id("yes"), tok.backend.token_to_id("no"))
    ids, start = prompt.encode_pair("paris", "<|im_end|>")
    assert start == len(ids) and tok.backend.token_to_id("<|im_end|>") not in ids[len(prompt.prefix_ids):-len(
        prompt.suffix_ids)]  # user text never becomes a control token
    path.write_text(json.dumps({"labels": ["yes", "notaword"]}))
    with pytest.raises(ValueError, match="not one token"):
        RerankPrompt(RerankTemplate.from_file(path), tok)
    path.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        RerankTemplate.from_file(path)


def test_auto_task_and_unsupported_checkpoints(tmp_path):
    from model.cross_encoder import load_cross_encoder
    from serving.loading.model_source import resolve_task

    assert resolve_task("auto", str(RERANK_TINY / "bert_cross")) == "rerank"
    assert resolve_task("auto", str(RERANK_TINY / "qwen3_rerank")) == "generate"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DebertaV2ForSequenceClassification"]}))
    assert resolve_task("auto", str(tmp_path)) == "rerank"
    with pytest.raises(ValueError, match="not a cross-encoder this server reads"):
        load_cross_encoder(tmp_path)
