"""Builds the tiny sentence-transformers embedding models in this folder and their embeddings.

Used by tests/model/test_sentence_transformers.py (and the engine, gateway and e2e embedding
tests), which load the same directories through ``model.sentence_transformers`` (no torch at
test time) and must reproduce sentence-transformers' float32 embeddings (cosine >= 0.9999).

Run once, in a throwaway virtualenv (torch's CPU wheel), from the repository root::

    python -m venv /tmp/st-ref
    /tmp/st-ref/bin/pip install torch==2.13.0 transformers==5.24.0 sentence-transformers==6.2.0 \\
        safetensors tokenizers numpy
    /tmp/st-ref/bin/python tests/data/st_tiny/make_fixtures.py

Two models, weights drawn at random (seeded; norms too, so a mis-mapped tensor shows):

  * ``gemma3_embed/``: EmbeddingGemma's architecture: a ``Gemma3TextModel`` with
    ``use_bidirectional_attention`` (sliding window 4 on layer 0: a token sees 2 on each side;
    layer 1 global), mean pooling, Dense 48 -> 64 (no bias, Identity), Dense 64 -> 32 (bias,
    Identity), Normalize; ``config_sentence_transformers.json`` says ``matryoshka_dims``
    [32, 16, 8]. Its tokenizer frames an input as ``<bos> ... <eos>`` (EmbeddingGemma's does).
  * ``qwen3_embed/``: Qwen3-Embedding's: a ``Qwen3Model`` (QK-norm, GQA), last-token pooling,
    Normalize; the tokenizer appends ``<|endoftext|>`` (Qwen3-Embedding's does) and pads on
    the left. Not Matryoshka.

Both tokenizers are tiny ``tokenizers`` WordLevel vocabularies built here from ``WORDS``
(whitespace split, lower-cased by the normalizer), saved as ``tokenizer.json`` with
``tokenizer_config.json``.

Each folder also holds ``golden.json`` (the inputs, the token ids sentence-transformers' tokenizer
gave each, the versions used) and ``embeddings.npy`` (float32 [inputs, dim]:
``SentenceTransformer.encode`` of all inputs in one padded batch, eager attention).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

HERE = Path(__file__).resolve().parent

WORDS = ("the a an of to in is was it and for on with as by at from that this be are "
         "cat dog bird fish sat ran flew swam mat tree sky sea red blue green small big "
         "quick brown fox jumps over lazy paris france capital city river bank money "
         "embedding vector model search query document sentence meaning similar").split()

INPUTS = [
    "the cat sat on the mat",
    "a quick brown fox jumps over the lazy dog",
    "paris",
    "the capital of france is paris and it is a big city on a river",
    "search query : similar sentence meaning",
    "the river bank was green",
    "money in the bank",
    "blue sky over the small sea with a bird that flew from the tree to the fish",
]


def word_level(specials: list[str], unk: str, template: str, pair: str) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + [":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special_ids = [(s, vocab[s]) for s in specials if s in template]
    tok.post_processor = processors.TemplateProcessing(single=template, pair=pair, special_tokens=special_ids)
    return tok


def fill_random(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) + (0.0 if "gemma" in type(model).__name__.lower()
                                                                    else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def save_tokenizer(tok: Tokenizer, path: Path, config: dict) -> None:
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build(case: str, base: torch.nn.Module, tok_dir: Path, pooling: str, dense: list[tuple[int, int, bool]],
          st_config: dict, seed: int) -> None:
    out = HERE / case
    torch.manual_seed(seed)
    fill_random(base, seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base.save_pretrained(tmp)
        for f in tok_dir.iterdir():
            shutil.copy(f, tmp / f.name)
        transformer = Transformer(str(tmp), max_seq_length=64,
                                  model_kwargs={"attn_implementation": "eager", "dtype": torch.float32})
        mods = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
        for i, (n_in, n_out, bias) in enumerate(dense):
            d = Dense(n_in, n_out, bias=bias, activation_function=torch.nn.Identity())
            g = torch.Generator().manual_seed(seed + 10 + i)
            with torch.no_grad():
                d.linear.weight.copy_(torch.randn(d.linear.weight.shape, generator=g) / n_in ** 0.5)
                if bias:
                    d.linear.bias.copy_(0.1 * torch.randn(d.linear.bias.shape, generator=g))
            mods.append(d)
        mods.append(Normalize())
        st = SentenceTransformer(modules=mods, device="cpu")
        if out.exists():
            shutil.rmtree(out)
        st.save(str(out))
    (out / "README.md").unlink(missing_ok=True)  # the generated model card: nothing we read
    cfg_path = out / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update(st_config)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

    # Reload from disk, as a user would, and embed every input in one padded batch.
    st = SentenceTransformer(str(out), device="cpu", model_kwargs={"attn_implementation": "eager"})
    st.eval()
    emb = st.encode(INPUTS, batch_size=len(INPUTS), convert_to_numpy=True).astype(np.float32)
    one_by_one = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in INPUTS])
    assert np.allclose(emb, one_by_one, atol=1e-5), "padding changed sentence-transformers' embeddings"
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    hf_tok = st.tokenizer if hasattr(st, "tokenizer") else st[0].tokenizer
    ids = [hf_tok(t)["input_ids"] for t in INPUTS]
    np.save(out / "embeddings.npy", emb)
    golden = {
        "inputs": INPUTS, "token_ids": ids, "dim": int(emb.shape[1]),
        "versions": {"sentence_transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(case, emb.shape, [len(i) for i in ids])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        gemma_tok = Path(tmp) / "gemma"
        gemma_tok.mkdir()
        save_tokenizer(word_level(["<pad>", "<eos>", "<bos>", "<unk>"], "<unk>", "<bos> $A <eos>",
                                  "<bos> $A <eos> $B <eos>"), gemma_tok,
                       {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
                        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                        "padding_side": "right", "model_max_length": 64})
        gcfg = transformers.Gemma3TextConfig(
            vocab_size=len(WORDS) + 5, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=128, use_bidirectional_attention=True, pad_token_id=0,
            bos_token_id=2, eos_token_id=1, tie_word_embeddings=True)
        gcfg._attn_implementation = "eager"
        build("gemma3_embed", transformers.Gemma3TextModel(gcfg), gemma_tok, "mean",
              [(48, 64, False), (64, 32, True)], {"matryoshka_dims": [32, 16, 8]}, seed=1)

        qwen_tok = Path(tmp) / "qwen"
        qwen_tok.mkdir()
        save_tokenizer(word_level(["<|endoftext|>", "<unk>"], "<unk>", "$A <|endoftext|>",
                                  "$A <|endoftext|> $B <|endoftext|>"), qwen_tok,
                       {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "pad_token": "<|endoftext|>", "unk_token": "<unk>", "padding_side": "left",
                        "model_max_length": 64})
        qcfg = transformers.Qwen3Config(
            vocab_size=len(WORDS) + 3, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            tie_word_embeddings=False, rope_theta=10_000.0)
        qcfg._attn_implementation = "eager"
        build("qwen3_embed", transformers.Qwen3Model(qcfg), qwen_tok, "lasttoken", [], {}, seed=2)


if __name__ == "__main__":
    main()
