"""Reads a sequence-classification cross-encoder checkpoint (sentence-transformers ``CrossEncoder``).

A directory whose ``config.json`` names ``BertForSequenceClassification`` or
``XLMRobertaForSequenceClassification`` / ``RobertaForSequenceClassification`` (one label), with
``model.safetensors`` and a ``tokenizer.json``. sentence-transformers' activation comes from
``config_sentence_transformers.json``'s ``activation_fn`` (release 5+) or ``config.json``'s
``sentence_transformers.activation_fn`` (earlier releases); a model that names none gets
Sigmoid, as ``CrossEncoder`` gives one-label models. ``sentence_bert_config.json``'s
``max_seq_length`` (or ``max_length``) bounds the input when present.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from model.bert import BertConfig, BertEncoder
from model.score_heads import SCORE_ACTIVATIONS, ClassifierHead
from model.sentence_transformers import read_json

__all__ = ["CROSS_ENCODER_ARCHITECTURES", "is_cross_encoder", "load_cross_encoder"]

CROSS_ENCODER_ARCHITECTURES = {"BertForSequenceClassification": "bert",
                               "XLMRobertaForSequenceClassification": "roberta",
                               "RobertaForSequenceClassification": "roberta"}
"""config.json ``architectures`` served as cross-encoders, and their weights' prefix."""

_LAYER_NAMES = {"wq": "attention.self.query.weight", "bq": "attention.self.query.bias",
                "wk": "attention.self.key.weight", "bk": "attention.self.key.bias",
                "wv": "attention.self.value.weight", "bv": "attention.self.value.bias",
                "wo": "attention.output.dense.weight", "bo": "attention.output.dense.bias",
                "ln1_w": "attention.output.LayerNorm.weight", "ln1_b": "attention.output.LayerNorm.bias",
                "wi": "intermediate.dense.weight", "bi": "intermediate.dense.bias",
                "wout": "output.dense.weight", "bout": "output.dense.bias",
                "ln2_w": "output.LayerNorm.weight", "ln2_b": "output.LayerNorm.bias"}
_EMB_NAMES = {"word_emb": "embeddings.word_embeddings.weight", "pos_emb": "embeddings.position_embeddings.weight",
              "type_emb": "embeddings.token_type_embeddings.weight", "emb_ln_w": "embeddings.LayerNorm.weight",
              "emb_ln_b": "embeddings.LayerNorm.bias"}
_HEAD_NAMES = {"bert": ("bert.pooler.dense", "classifier"), "roberta": ("classifier.dense", "classifier.out_proj")}




def is_cross_encoder(path: str | os.PathLike) -> bool:
    """Whether ``path``'s ``config.json`` names a sequence-classification architecture this reads."""
    cfg = Path(path) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(a in CROSS_ENCODER_ARCHITECTURES for a in archs)


def _activation(root: Path, hf: dict) -> str:
    st_path = root / "config_sentence_transformers.json"
    name = read_json(st_path).get("activation_fn") if st_path.is_file() else None
    name = name or (hf.get("sentence_transformers") or {}).get("activation_fn") or "Sigmoid"
    name = str(name).rsplit(".", 1)[-1]
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(f"{root}: activation {name!r} is not supported ({', '.join(SCORE_ACTIVATIONS)})")
    return name


def load_cross_encoder(path: str | os.PathLike, dtype: str = "float32") -> tuple[BertEncoder, ClassifierHead]:
    """The encoder and its classification head.

    Args:
      path: the checkpoint directory.
      dtype: "float32" or "bfloat16" (the encoder's matmul inputs; the head runs in float32).

    Raises:
      FileNotFoundError: no ``config.json`` or ``model.safetensors``.
      ValueError: an architecture, activation or label count (not 1) this server does not
        serve, or weights missing or misshapen (named).
    """
    from safetensors.numpy import load_file

    root = Path(path)
    hf = read_json(root / "config.json")
    arch = next((a for a in hf.get("architectures") or [] if a in CROSS_ENCODER_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{root}: architectures {hf.get('architectures')} is not a cross-encoder this server reads "
                         f"({', '.join(CROSS_ENCODER_ARCHITECTURES)})")
    labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 1))
    if labels != 1:
        raise ValueError(f"{root}: {labels} labels; rerank and score need a one-label cross-encoder")
    family = CROSS_ENCODER_ARCHITECTURES[arch]
    offset = int(hf.get("pad_token_id", 1)) + 1 if family == "roberta" else 0
    cfg = BertConfig(name=root.resolve().name, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                     num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
                     intermediate_size=int(hf["intermediate_size"]),
                     max_position=int(hf["max_position_embeddings"]) - offset,
                     type_vocab_size=int(hf.get("type_vocab_size", 2)), position_offset=offset,
                     layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)), hidden_act=hf.get("hidden_act", "gelu"))
    weights = root / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{root} has no model.safetensors (pytorch_model.bin is not read)")
    tensors = load_file(str(weights))

    def get(name: str) -> np.ndarray:
        for key in (f"{family}.{name}", name):
            if key in tensors:
                return tensors[key].astype(np.float32)
        raise ValueError(f"{weights}: tensor {family}.{name} is missing")

    params = {k: get(n) for k, n in _EMB_NAMES.items()}
    for k, n in _LAYER_NAMES.items():
        params[k] = np.stack([get(f"encoder.layer.{i}.{n}") for i in range(cfg.num_layers)])
    dense, out = _HEAD_NAMES[family]
    st_path = root / "sentence_bert_config.json"
    st = read_json(st_path) if st_path.is_file() else {}
    max_len = st.get("max_seq_length") or st.get("max_length")
    head = ClassifierHead(dense_w=get(f"{dense}.weight"), dense_b=get(f"{dense}.bias"), out_w=get(f"{out}.weight"),
                          out_b=get(f"{out}.bias"), activation=_activation(root, hf),
                          max_seq_length=int(max_len) if max_len else None)
    return BertEncoder(cfg, params, dtype=jnp.dtype(dtype)), head
