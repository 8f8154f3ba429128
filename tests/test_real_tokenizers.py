"""Our conversions of real tokenizer files against their makers' own tokenizers.

- Meta's Llama 3 ``tokenizer.model`` (tiktoken format), shipped in the PyPI
  package ``llama-models`` (a test dependency): ``BPETokenizer.from_tiktoken``
  against ``llama_models.llama3.tokenizer.Tokenizer`` (tiktoken) on the shared
  tokenizer cases plus code, CJK, emoji and whitespace runs.
- Mistral's Tekken ``tekken_240911.json`` from ``mistral-common``:
  ``BPETokenizer.from_tekken`` against ids recorded once with mistral_common
  (tests/data/mistral_tokenizer_ids.json; mistral-common caps numpy below ours,
  so it is not installed here). See that file's ``source`` for where the
  Tekken file comes from at test time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.bpe_tokenizer import BPETokenizer
from serving.detokenizer import IncrementalDetokenizer
from tests.tokenizer_texts import tokenizer_texts

TEXTS = tokenizer_texts()
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def meta_llama3():
    """(llama_models' own Llama 3 tokenizer, the path of its tokenizer.model)."""
    from llama_models.llama3 import tokenizer as meta

    path = Path(meta.__file__).parent / "tokenizer.model"
    return meta.Tokenizer(path), path


@pytest.fixture(scope="module")
def llama3(meta_llama3) -> BPETokenizer:
    return BPETokenizer.from_tiktoken(meta_llama3[1])


def test_llama3_ids_equal_metas(llama3, meta_llama3):
    meta = meta_llama3[0]
    assert llama3.vocab_size == meta.n_words == 128256
    for name, text in TEXTS.items():
        want = meta.encode(text, bos=False, eos=False)
        assert llama3.encode(text) == want, name
        assert llama3.encode(text, add_bos=True) == meta.encode(text, bos=True, eos=False), name
        assert llama3.decode(want) == meta.decode(want) == text, name


def test_llama3_special_tokens_as_meta_defines_them(llama3, meta_llama3):
    meta = meta_llama3[0]
    assert llama3.special_tokens() == meta.special_tokens
    assert (llama3.bos_id, llama3.eos_id) == (meta.bos_id, meta.eos_id) == (128000, 128001)
    assert list(llama3.stop_token_ids) == meta.stop_tokens
    assert llama3.token_id("<|eot_id|>") == 128009
    assert llama3.token_id("<|start_header_id|>") in llama3.chat_stop_token_ids
    markup = "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    assert llama3.encode_markup(markup) == meta.encode(markup, bos=False, eos=False, allowed_special="all")
    for special in ("<|eot_id|>", "<|begin_of_text|>", "<|reserved_special_token_100|>"):
        typed = f"say {special} now"
        ids = llama3.encode(typed)
        assert ids == meta.encode(typed, bos=False, eos=False)  # Meta's default: special text is text
        assert not any(llama3.is_control(i) for i in ids) and llama3.decode(ids) == typed


def test_llama3_streams_utf8_across_tokens(llama3):
    """CJK and emoji split over several byte-level tokens stream back exactly, one id at a time."""
    partial = 0
    for name in ("chinese", "japanese_mixed", "korean", "emoji_zwj_family", "emoji_flags", "cjk_mixed",
                 "emoji_runs", "zalgo", "hindi", "arabic_rtl", "math_unicode"):
        text = TEXTS[name]
        ids = llama3.encode(text)
        partial += sum(FFFD in llama3.decode([i]) for i in ids)  # tokens holding part of a character
        d = IncrementalDetokenizer(llama3)
        deltas = [d.add([i]) for i in ids] + [d.flush()]
        assert "".join(deltas) == text and not any(FFFD in x for x in deltas), name
    assert partial >= 10


# ------------------------------------------------------------------ Mistral Tekken


