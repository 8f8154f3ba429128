"""Builds the tiny rerankers in this folder and their reference scores.

Used by tests/model/test_rerank_parity.py and tests/e2e/test_serve_rerank.py, which load the same
directories without torch and must reproduce these float32 scores within 1e-4.

Run once, in a throwaway virtualenv (torch's CPU wheel), from the repository root::

    python -m venv /tmp/st-ref
    /tmp/st-ref/bin/pip install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu
    /tmp/st-ref/bin/pip install transformers==5.24.0 sentence-transformers==6.2.0 safetensors tokenizers numpy
    /tmp/st-ref/bin/python tests/data/rerank_tiny/make_fixtures.py

Three models, weights drawn at random (seeded; LayerNorm weights and biases too, so a mis-mapped
tensor shows):

  * ``bert_cross/``: a sentence-transformers ``CrossEncoder`` over ``BertForSequenceClassification``
    (one label; the default Sigmoid activation); the tokenizer frames a pair as
    ``[CLS] a [SEP] b [SEP]`` with token types 0 then 1.
  * ``xlmr_cross/``: the same over ``XLMRobertaForSequenceClassification`` (positions from
    ``pad_token_id + 1``, one token type, the ``dense -> tanh -> out_proj`` head); pairs framed as
    ``<s> a </s> </s> b </s>``.
  * ``qwen3_rerank/``: a ``Qwen3ForCausalLM`` scored Qwen3-Reranker's way (its model card's
    recipe: a chat prefix, ``<Instruct>: ...\\n<Query>: ...\\n<Document>: ...``, a suffix, then
    ``softmax([logit(no), logit(yes)])[1]`` at the last position), one pair at a time, unpadded.

Tokenizers are tiny ``tokenizers`` WordLevel vocabularies built here from ``WORDS``. Each folder
holds ``golden.json``: the pairs, the token ids (and each pair's first token of type 1 for the
cross-encoders) the reference tokenizer gave, the scores, and the versions used.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import CrossEncoder
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

HERE = Path(__file__).resolve().parent

WORDS = ("the a an of to in is was it and for on with as by at from that this be are what where who "
         "cat dog bird fish sat ran flew swam mat tree sky sea red blue green small big "
         "quick brown fox jumps over lazy paris france capital city river bank money "
         "query document instruct judge whether meets requirements based provided note answer can "
         "only yes no given web search retrieve relevant passages system user assistant").split()

QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the cat sat on the mat",
    "a quick brown fox jumps over the lazy dog",
    "the river bank was green",
    "money in the bank",
    "france is a big city",
]
PAIRS = [[QUERY, d] for d in DOCUMENTS] + [["blue sky", "a small bird flew over the sea"]]

QWEN_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
               "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
               "<|im_start|>user\n")
QWEN_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def word_level(specials: list[str], unk: str, post: processors.PostProcessor | None) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + [":", ",", ".", "<", ">", "\""])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    if post is not None:
        tok.post_processor = post
    return tok


def fill_random(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def versions() -> dict:
    return {"sentence_transformers": sentence_transformers.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "tokenizers": tokenizers.__version__}


def save_tokenizer(tok: Tokenizer, path: Path, config: dict) -> None:
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_cross(case: str, model: torch.nn.Module, tok: Tokenizer, tok_config: dict, seed: int) -> None:
    out = HERE / case
    fill_random(model, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(tok, Path(tmp), tok_config)
        ce = CrossEncoder(tmp, device="cpu", max_length=64, model_kwargs={"attn_implementation": "eager"})
        if out.exists():
            shutil.rmtree(out)
        ce.save(str(out))
    (out / "README.md").unlink(missing_ok=True)
    ce = CrossEncoder(str(out), device="cpu", model_kwargs={"attn_implementation": "eager"})  # as a user would
    scores = ce.predict(PAIRS, batch_size=len(PAIRS), convert_to_numpy=True).astype("float32")
    one = [float(ce.predict([p], convert_to_numpy=True)[0]) for p in PAIRS]
    assert max(abs(a - b) for a, b in zip(scores.tolist(), one)) < 1e-5, "padding changed the scores"
    enc = [ce.tokenizer(a, b) for a, b in PAIRS]
    assert case != "bert_cross" or all(1 in e["token_type_ids"] for e in enc), "no token types reach BERT"
    ids = [e["input_ids"] for e in enc]
    type_starts = [(e["token_type_ids"].index(1) if 1 in e.get("token_type_ids", []) else len(e["input_ids"]))
                   for e in enc]
    golden = {"pairs": PAIRS, "token_ids": ids, "type_starts": type_starts, "scores": scores.tolist(),
              "versions": versions()}
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(case, scores.round(4).tolist())


def build_qwen(seed: int) -> None:
    out = HERE / "qwen3_rerank"
    specials = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = word_level(specials, "<unk>", None)
    cfg = transformers.Qwen3Config(
        vocab_size=len(WORDS) + len(specials) + 6, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, rope_theta=10_000.0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(cfg)
    fill_random(model, seed)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    model.save_pretrained(out)
    save_tokenizer(tok, out, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                              "pad_token": "<|endoftext|>", "unk_token": "<unk>", "padding_side": "left",
                              "model_max_length": 256})
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    prefix = hf_tok(QWEN_PREFIX, add_special_tokens=False)["input_ids"]
    suffix = hf_tok(QWEN_SUFFIX, add_special_tokens=False)["input_ids"]
    yes, no = hf_tok.convert_tokens_to_ids("yes"), hf_tok.convert_tokens_to_ids("no")
    ids, scores = [], []
    for q, d in PAIRS:
        body = f"<Instruct>: {QWEN_INSTRUCTION}\n<Query>: {q}\n<Document>: {d}"
        row = prefix + hf_tok(body, add_special_tokens=False)["input_ids"] + suffix
        with torch.no_grad():
            logits = model(torch.tensor([row])).logits[0, -1]
        pair = torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)
        ids.append(row)
        scores.append(float(pair[1].exp()))
    golden = {"pairs": PAIRS, "token_ids": ids, "labels": {"no": no, "yes": yes}, "scores": scores,
              "prefix": QWEN_PREFIX, "suffix": QWEN_SUFFIX, "instruction": QWEN_INSTRUCTION,
              "versions": versions()}
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print("qwen3_rerank", [round(s, 4) for s in scores], [len(r) for r in ids])


def main() -> None:
    torch.manual_seed(0)
    bert_specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab_size = len(WORDS) + len(bert_specials) + 6
    bert_tok = word_level(bert_specials, "[UNK]", processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A:0 [SEP]:0 $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]))
    bcfg = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                                   num_labels=1, pad_token_id=0)
    build_cross("bert_cross", transformers.BertForSequenceClassification(bcfg), bert_tok,
                {"tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
                 "pad_token": "[PAD]", "unk_token": "[UNK]", "model_max_length": 64,
                 "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}, seed=3)

    xlmr_specials = ["<s>", "<pad>", "</s>", "<unk>"]
    xlmr_tok = word_level(xlmr_specials, "<unk>", processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]))
    xcfg = transformers.XLMRobertaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=66,
                                         type_vocab_size=1, num_labels=1, pad_token_id=1, bos_token_id=0,
                                         eos_token_id=2)
    build_cross("xlmr_cross", transformers.XLMRobertaForSequenceClassification(xcfg), xlmr_tok,
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                 "model_max_length": 64}, seed=4)
    build_qwen(seed=5)


if __name__ == "__main__":
    main()
