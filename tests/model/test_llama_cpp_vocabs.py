"""GGUF vocabularies against llama.cpp's own tokenizer test data.

Every ``models/ggml-vocab-*.gguf`` of llama.cpp that has ``.inp``/``.out``
pairs (tests/support/llama_cpp_vocab.py downloads them with the pinned
llama-cpp-python sdist) must give llama.cpp's ids for every input through
``BPETokenizer.from_gguf`` (``encode``: special tokens not parsed, no BOS, as
``test-tokenizer-0.cpp`` tokenizes). The tokenizers are cached under
``cache_dir("tokenizer")`` in a folder named after a hash of the conversion
code, so only the first run after a change reads the GGUFs' metadata (minutes)
and a stale cache never hides a change.
"""

from __future__ import annotations

import gguf
import pytest
from tokenizers import Regex

from model import gguf_pretokenizers as gp
from model.bpe_tokenizer import BPETokenizer
from model.gguf_vocab import UnsupportedVocab, read_gguf_tokenizer
from tests.support import llama_cpp_vocab as lv


@pytest.fixture(scope="module")
def models():
    return lv.models_dir()


def _tokenizer(models, name: str) -> BPETokenizer:
    return BPETokenizer.from_gguf(models / f"ggml-vocab-{name}.gguf", cache_dir=lv.tokenizer_cache())


def test_the_sdist_holds_the_vocabularies_tested(models):
    found = sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in models.glob("ggml-vocab-*.gguf.inp"))
    assert found == sorted(lv.TESTED_VOCABS)


@pytest.mark.parametrize("name", lv.TESTED_VOCABS)
def test_ids_equal_llama_cpps(models, name):
    tok = _tokenizer(models, name)
    cases = lv.vocab_cases(models, name)
    assert len(cases) >= 40
    wrong = [(text, got, want) for text, want in cases if (got := tok.encode(text)) != want]
    assert not wrong, f"{name}: {len(wrong)}/{len(cases)} differ, first {wrong[0]!r}"


def test_gguf_tokenizer_serves_sentencepiece_vocabularies(models, monkeypatch):
    """A Llama 2 / Phi-3 SentencePiece GGUF (refused before: no Gemma chat pieces) serves
    through the model registry: BOS 1 prepended (add_bos_token), EOS from the metadata, the
    GGUF's chat template kept, control tokens typed by a user stay text."""
    from serving.loading import model_registry

    monkeypatch.setattr(model_registry, "cache_dir", lambda kind: lv.tokenizer_cache())
    for name, eos, control in (("llama-spm", 2, "</s>"), ("phi-3", 32000, "<|end|>")):
        tok = model_registry.gguf_tokenizer(models / f"ggml-vocab-{name}.gguf")
        assert isinstance(tok, BPETokenizer) and tok.add_bos and (tok.bos_id, tok.eos_id) == (1, eos), name
        ids = tok.encode(" Hello world", add_bos=True)
        assert ids[0] == 1 and tok.decode(ids[1:]) == " Hello world", name
        assert len(tok.encode(control)) > 1 and tok.encode_markup(control) == [tok.token_id(control)], name
    # Phi-3: <|end|> (32007, control) ends a turn; the template is the GGUF's.
    assert "<|assistant|>" in tok.chat_template_source and 32007 in tok.stop_token_ids


def test_every_llama_cpp_pre_name_has_a_split_rule():
    assert len(gp.GGUF_PRE_TOKENIZERS) == 90  # llama.cpp's 91 names but "whitespace"
    for name in gp.GGUF_PRE_TOKENIZERS:
        fam = gp.family(name)
        for pattern in fam.patterns:
            Regex(pattern)
        gp.split_pre_tokenizer(fam)
    assert gp.family(None).name == gp.family("default").name == "default"
    assert gp.family("glm4").ignore_merges and not gp.family("chatglm-bpe").ignore_merges
    with pytest.raises(ValueError, match=r"unknown tokenizer.ggml.pre 'no-such'; xlaserve reads .*qwen2"):
        gp.family("no-such")


def _split(name: str, text: str) -> list[str]:
    fam = gp.family(name)
    fam = gp.PreTokenizerFamily(fam.name, fam.patterns, byte_level=False)
    return [p for p, _ in gp.split_pre_tokenizer(fam).pre_tokenize_str(text)]


def test_families_without_test_data_split_as_their_expressions_say():
    assert _split("llama3", "12345 it's") == ["123", "45", " it", "'s"]
    assert _split("qwen2", "12345") == ["1", "2", "3", "4", "5"]
    assert _split("tiny_aya", "1234567") == ["1", "234", "567"]
    assert _split("gpt-4o", "HelloWorld's") == ["Hello", "World's"]
    assert _split("kimi-k2", "abc中文def") == ["abc", "中文", "def"]
    assert _split("bloom", "hi, there") == ["hi", ",", " there"]
    assert _split("gemma4", "a b\n\nc") == ["a b", "\n\n", "c"]


def test_unsupported_vocabulary_type_is_named(tmp_path):
    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_tokenizer_model("rwkv")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedVocab, match=r"tokenizer.ggml.model 'rwkv' is not one xlaserve reads"):
        read_gguf_tokenizer(path)
