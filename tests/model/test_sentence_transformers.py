"""Sentence-transformers embedding models (tests/data/st_tiny, made by its make_fixtures.py)
against sentence-transformers' float32 embeddings: EmbeddingGemma's architecture (bidirectional
Gemma 3 with a sliding window, mean pooling, two Dense layers, Normalize) and Qwen3-Embedding's
(causal Qwen3, last-token pooling, Normalize)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.bpe_tokenizer import BPETokenizer
from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from model.sentence_transformers import is_sentence_transformer, read_sentence_transformer

DATA = Path(__file__).resolve().parents[1] / "data" / "st_tiny"
CASES = ("gemma3_embed", "qwen3_embed")
SEQ = 32  # one padded length for every input (the longest has 19 tokens)


def _embed(case: str, dtype=jnp.float32, seq: int = SEQ, ids=None):
    head = read_sentence_transformer(DATA / case)
    cfg, params = load_hf_checkpoint(head.transformer_dir, dtype=jnp.dtype(dtype).name, progress=False)
    model = build_model(cfg, params=params, dtype=dtype)
    golden = json.loads((DATA / case / "golden.json").read_text())
    ids = ids or golden["token_ids"]
    tokens = np.zeros((len(ids), seq), np.int32)
    for i, row in enumerate(ids):
        tokens[i, :len(row)] = row
    lengths = jnp.asarray([len(r) for r in ids], jnp.int32)
    out = jax.jit(lambda t, n: head(model.encode(t, n), n))(jnp.asarray(tokens), lengths)
    return np.asarray(out), head, cfg


def _cosines(a, b):
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_sentence_transformers(case):
    got, head, _ = _embed(case)
    want = np.load(DATA / case / "embeddings.npy")
    assert got.shape == want.shape == (8, head.dim)
    cos = _cosines(got, want)
    print(f"{case} float32 cosine min {cos.min():.7f}")
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # bfloat16 weights and matmul inputs: reported, held to a looser bound.
    got16, _, _ = _embed(case, dtype=jnp.bfloat16)
    cos16 = _cosines(got16, want)
    print(f"{case} bfloat16 cosine min {cos16.min():.5f}")
    assert cos16.min() >= 0.99, cos16


@pytest.mark.parametrize("case", CASES)
def test_padding_does_not_change_an_embedding(case):
    golden = json.loads((DATA / case / "golden.json").read_text())
    short = [golden["token_ids"][2]]  # 2-3 tokens
    a, _, _ = _embed(case, seq=4, ids=short)
    b, _, _ = _embed(case, seq=SEQ, ids=short)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_configs_and_heads():
    gemma = read_sentence_transformer(DATA / "gemma3_embed")
    assert (gemma.pooling, gemma.normalize, gemma.dim, gemma.matryoshka_dims) == ("mean", True, 32, (32, 16, 8))
    assert [d.weight.shape for d in gemma.dense] == [(64, 48), (32, 64)]
    assert gemma.dense[0].bias is None and gemma.dense[1].bias is not None
    qwen = read_sentence_transformer(DATA / "qwen3_embed")
    assert (qwen.pooling, qwen.normalize, qwen.dim, qwen.matryoshka_dims) == ("lasttoken", True, 48, ())
    _, _, cfg = _embed("gemma3_embed", ids=[[2, 5, 1]], seq=4)
    assert not cfg.causal and cfg.layer_windows() == [4, 0]
    assert is_sentence_transformer(DATA / "qwen3_embed") and not is_sentence_transformer(DATA)


@pytest.mark.parametrize("case", CASES)
def test_tokenizer_frames_inputs_as_sentence_transformers(case):
    golden = json.loads((DATA / case / "golden.json").read_text())
    tok = BPETokenizer.from_hf_dir(DATA / case)
    assert [tok.encode_input(t) for t in golden["inputs"]] == golden["token_ids"]


def test_generation_is_refused_for_a_bidirectional_model():
    from model.attention_metadata import AttentionMetadata  # noqa: F401  (the paged path)
    from model.layers import attention_block

    cfg, params = load_hf_checkpoint(DATA / "gemma3_embed", progress=False)
    with pytest.raises(ValueError, match="bidirectionally"):
        attention_block(jnp.zeros((1, cfg.hidden_size)), {}, jnp.zeros((1,), jnp.int32), None, None, None, 0,
                        cfg=cfg, theta=1.0, window=None, dtype=jnp.float32, compute=None)


def _copy(tmp_path: Path, case: str) -> Path:
    out = tmp_path / case
    shutil.copytree(DATA / case, out)
    return out


def test_unsupported_modules_are_named(tmp_path):
    d = _copy(tmp_path, "qwen3_embed")
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 48, "pooling_mode": "max"}))
    with pytest.raises(ValueError, match="pooling"):
        read_sentence_transformer(d)
    d = _copy(tmp_path / "b", "gemma3_embed")
    cfg = json.loads((d / "2_Dense" / "config.json").read_text())
    (d / "2_Dense" / "config.json").write_text(json.dumps({**cfg, "activation_function": "torch.nn.Softsign"}))
    with pytest.raises(ValueError, match="Softsign"):
        read_sentence_transformer(d)
    (d / "config_sentence_transformers.json").write_text(json.dumps({"matryoshka_dims": [64]}))
    (d / "2_Dense" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="matryoshka_dims"):
        read_sentence_transformer(d)
