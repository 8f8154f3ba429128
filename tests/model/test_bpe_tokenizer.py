"""model.bpe_tokenizer / model.bpe_convert on a tiny byte-level BPE vocabulary.

The tiny vocabulary (tests/support/bpe_fixtures.py) is read from a tiktoken file, saved as
Hugging Face files and written into GGUFs, so every constructor runs in milliseconds;
tests/model/test_real_tokenizers.py checks the same code on Meta's and Mistral's files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model import bpe_convert
from model.bpe_tokenizer import BPETokenizer
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.output.detokenizer import IncrementalDetokenizer
from tests.support import bpe_fixtures as bf
from tests.support.bpe_fixtures import _bpe_gguf
from tests.support.paths import REPO_ROOT

FFFD = "\ufffd"
TEXTS = ["hello world", "hello   the thing\n\nin 123 4567", "中文中文中文", "😀😁 hello😀", "",
         " leading", "trailing ", "<|eot_id|> and <|begin_of_text|>", "a\x00b\tc\r\n", "é vs é"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> BPETokenizer:
    return bf.tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


def _rank_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm on one piece: a whole-token piece is that token; otherwise
    merge the adjacent pair whose concatenation has the lowest rank, until none has one."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        cands = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                 if parts[i] + parts[i + 1] in ranks]
        if not cands:
            return [ranks[p] for p in parts]
        _, i = min(cands)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_implements_the_protocol_and_round_trips(tok):
    members = {n for n in vars(TextTokenizer) if not n.startswith("_")} | set(TextTokenizer.__annotations__)
    assert {"bos_id", "stop_token_ids", "encode", "decode", "apply_chat_template"} <= members
    for name in members:
        assert hasattr(tok, name), name
    assert tok.vocab_size == 256 + len(bf.TINY_TOKENS) + len(bf.SPECIALS)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode("hello world") == [tok.token_id("hello"), tok.token_id("Ġworld")]
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id == tok.token_id("<|begin_of_text|>")
    assert tok.encode("") == [] and tok.encode("", add_bos=True) == [tok.bos_id]


def test_merges_derived_from_ranks_encode_as_rank_bpe(tok):
    """Our merge list reproduces tiktoken's rank-ordered BPE on every piece."""
    ranks = bf.tiny_ranks()
    alphabet = {c: b for b, c in enumerate(bpe_convert.byte_alphabet())}
    split = tok.backend.pre_tokenizer.pre_tokenize_str
    for text in TEXTS + ["hellohello wor the theinging 1234567 中文😀😀😁中"]:
        want = [i for piece, _ in split(text) for i in _rank_bpe(bytes(alphabet[c] for c in piece), ranks)]
        assert tok.encode(text) == want, text


def test_byte_alphabet_is_gpt2s():
    a = bpe_convert.byte_alphabet()
    assert len(set(a)) == 256 and a[ord("A")] == "A" and a[ord(" ")] == "Ġ" and a[ord("\n")] == "Ċ"
    assert a[0] == "Ā" and a[0xAD] == "Ń" and a[0xFF] == "ÿ"  # soft hyphen: the 68th unprintable byte
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(a) == set(ByteLevel.alphabet())
    # tokenizers spells text bytes with the same characters: "é" is C3 A9
    assert ByteLevel(add_prefix_space=False).pre_tokenize_str("é")[0][0] == a[0xC3] + a[0xA9]


def test_user_text_never_becomes_control_tokens(tok):
    for special in bf.SPECIALS:
        ids = tok.encode(f"a {special}b")
        assert not any(tok.is_control(i) for i in ids), special
        assert tok.decode(ids) == f"a {special}b"
        assert tok.encode_markup(special) == [tok.token_id(special)]
        assert tok.is_control(tok.token_id(special))
    markup = "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
    assert tok.encode_markup(markup) == [tok.token_id("<|start_header_id|>"), *tok.encode("user"),
                                         tok.token_id("<|end_header_id|>"), *tok.encode("\n\nhello"),
                                         tok.token_id("<|eot_id|>")]
    assert tok.decode(tok.encode_markup(markup)) == "user\n\nhello"  # control ids decode to ""
    assert tok.control_tokens() == {s: tok.token_id(s) for s in bf.SPECIALS}
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    with pytest.raises(KeyError, match="no token '<\\|nope\\|>'"):
        tok.token_id("<|nope|>")
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_threads_encoding_text_and_markup_at_once_never_mix(tok):
    """The gateway's tokenizer threads share one tokenizer: encode (special tokens off) and
    encode_markup (on) run on separate pipelines, so neither sees the other's setting
    (``tokenizers`` releases the GIL while encoding: one pipeline whose setting is switched
    per call gives wrong ids here in about a third of the calls)."""
    from concurrent.futures import ThreadPoolExecutor

    text = "hello <|eot_id|> world " * 1000
    plain, markup = tok.encode(text), tok.encode_markup(text)
    assert plain != markup

    def work(k: int) -> bool:
        return (tok.encode_markup(text) == markup) if k % 2 else (tok.encode(text) == plain)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(60)))


def test_stop_ids_and_chat_stops(tok):
    assert tok.stop_token_ids == (tok.token_id("<|end_of_text|>"), tok.token_id("<|eot_id|>"))
    assert tok.eos_id == tok.stop_token_ids[0]
    assert tok.chat_stop_token_ids == (*tok.stop_token_ids, tok.token_id("<|start_header_id|>"),
                                       tok.token_id("<|im_start|>"))


def test_decode_and_piece_errors(tok):
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="outside"):
        tok.id_to_piece(tok.vocab_size)
    assert tok.id_to_piece(tok.token_id("Ġworld")) == "Ġworld"
    half = tok.encode("😁")
    assert len(half) == 2 and tok.decode(half[:1]) == FFFD and tok.decode(half) == "😁"
    with pytest.raises(ValueError, match="no chat template wired in"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok2 = BPETokenizer(_copy(tok), bos_id=None, eos_ids=[1], add_bos=True)
    assert tok2.encode("he", add_bos=True) == tok.encode("he")  # no BOS token: nothing prepended
    assert tok2.special_tokens == {"eos_token": tok.id_to_piece(1)}


def test_bad_tiktoken_file_is_named(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"aGk= 0\nnot base64!! 1\n")
    with pytest.raises(ValueError, match="bad.model line 2"):
        BPETokenizer.from_tiktoken(bad)
    with pytest.raises(ValueError, match="has no special token '<\\|begin_of_text\\|>'"):
        BPETokenizer.from_tiktoken(bf.write_tiktoken(tmp_path / "t.model", bf.tiny_ranks()),
                                   special_tokens=("<|x|>",))


# ------------------------------------------------------------- streaming


def _stream(tok, ids, sizes):
    d = IncrementalDetokenizer(tok)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(d.add(ids[i:i + n]))
        i, k = i + n, k + 1
    out.append(d.flush())
    return out


def test_streaming_through_tokens_that_straddle_characters(tok):
    """"中文中文" is E4 | B8 AD E6 | 96 87 E4 | B8 AD E6 | 96 87: no prefix of these ids
    ends on a character boundary before the last, so nothing may come out before it
    (the detokenizer used to give up after 3 tokens and emit U+FFFD)."""
    ids = tok.encode("中文中文")
    assert len(ids) == 5 and all(FFFD in tok.decode([i]) for i in ids)
    assert all(tok.decode(ids[:k]).endswith(FFFD) for k in range(1, 5))
    deltas = _stream(tok, ids, [1])
    assert deltas[:4] == ["", "", "", ""] and "".join(deltas) == "中文中文"
    long = tok.encode("中文" * 20 + "!")
    assert "".join(d := _stream(tok, long, [1])) == "中文" * 20 + "!" and FFFD not in "".join(d)


def test_streaming_invalid_bytes_still_flows(tok):
    """A lone continuation byte never completes: it comes out as U+FFFD without stalling."""
    bad = [tok.token_id(bpe_convert.byte_alphabet()[0x80])] + tok.encode(" hello world the thing")
    deltas = _stream(tok, bad, [1])
    assert "".join(deltas) == FFFD + " hello world the thing"
    assert deltas[-1] == ""  # everything came out before the end of the stream


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["中", "文", "😀", "😁", "he", "llo", " ", "a", "\n", "é", "123"]),
                max_size=30).map("".join),
       st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_any_text_streams_back_exactly(tok, text, sizes):
    deltas = _stream(tok, tok.encode(text), sizes)
    assert "".join(deltas) == text
    assert not any(FFFD in x for x in deltas)


# ------------------------------------------------------------- Hugging Face files


def _copy(tok):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tok.backend.to_str())


def _hf_dir(tok, tmp_path: Path, tc: dict | None = None, gc: dict | None = None) -> Path:
    d = tok.save(tmp_path)
    if tc is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if gc is not None:
        (d / "generation_config.json").write_text(json.dumps(gc))
    return d


def test_hf_files_round_trip(tok, tmp_path):
    tok.chat_template_source = "{{ messages }}"
    try:
        back = BPETokenizer.from_hf_dir(_hf_dir(tok, tmp_path))
    finally:
        tok.chat_template_source = None
    for text in TEXTS:
        assert back.encode(text, add_bos=True) == tok.encode(text, add_bos=True)
        assert back.encode_markup(text) == tok.encode_markup(text)
    assert (back.stop_token_ids, back.chat_stop_token_ids) == (tok.stop_token_ids, tok.chat_stop_token_ids)
    assert back.chat_template_source == "{{ messages }}" and back.bos_token == "<|begin_of_text|>"


def test_hf_bos_and_eos_fields(tok, tmp_path):
    eot, eos, bos = tok.token_id("<|eot_id|>"), tok.token_id("<|end_of_text|>"), tok.bos_id
    # Qwen-like: no BOS token at all; eos_token as a dict; generation_config eos an int.
    q = BPETokenizer.from_hf_dir(_hf_dir(tok, tmp_path / "q", {"bos_token": None, "add_bos_token": False,
                                                               "eos_token": {"content": "<|eot_id|>"}},
                                         {"eos_token_id": eos}))
    assert q.bos_id is None and q.encode("he", add_bos=True) == tok.encode("he")
    assert q.stop_token_ids == (eos, eot)
    # Llama-3-like: no add_bos_token key; tokenizer.json's post-processor adds BOS; eos a list.
    from tokenizers import processors

    backend = _copy(tok)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    with_bos = BPETokenizer(backend, bos_id=bos, eos_ids=[eos], add_bos=True)
    d = _hf_dir(with_bos, tmp_path / "l", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                {"eos_token_id": [eos, eot], "bos_token_id": bos})
    l3 = BPETokenizer.from_hf_dir(d)
    assert l3.add_bos and l3.encode("he", add_bos=True) == [bos, *tok.encode("he")]
    assert l3.encode("he") == tok.encode("he")  # the post-processor never runs in encode
    assert l3.stop_token_ids == (eos, eot)
    (d / "generation_config.json").unlink()  # EOS from tokenizer_config.json alone
    l3 = BPETokenizer.from_hf_dir(d)
    assert l3.stop_token_ids == (eot,) and l3.add_bos
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                         "eos_token": "<|eot_id|>", "add_bos_token": False}))
    assert not BPETokenizer.from_hf_dir(d).add_bos  # the explicit key wins over the post-processor


def test_model_vocabulary_padding(tok, tmp_path):
    """Qwen-style: the model has more embedding rows than the tokenizer has tokens."""
    padded = BPETokenizer.from_hf_dir(_hf_dir(tok, tmp_path), vocab_size=tok.vocab_size + 7)
    assert padded.vocab_size == tok.vocab_size + 7
    ids = tok.encode("hello")
    assert padded.decode([*ids, tok.vocab_size, tok.vocab_size + 6]) == "hello"
    assert padded.id_to_piece(tok.vocab_size + 6) == ""
    with pytest.raises(ValueError, match="outside"):
        padded.decode([tok.vocab_size + 7])
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        BPETokenizer.from_hf_dir(tmp_path, vocab_size=tok.vocab_size - 1)


def test_hf_errors_name_the_file_and_field(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        BPETokenizer.from_hf_dir(tmp_path)
    d = _hf_dir(tok, tmp_path / "a", {"eos_token": "<|missing|>"})
    with pytest.raises(ValueError, match="tokenizer_config.json: eos_token '<\\|missing\\|>' is not in"):
        BPETokenizer.from_hf_dir(d)
    d = _hf_dir(tok, tmp_path / "b", {"bos_token": None}, {})
    with pytest.raises(ValueError, match="names an EOS token"):
        BPETokenizer.from_hf_dir(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        BPETokenizer.from_hf_dir(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizers file"):
        BPETokenizer.from_hf_dir(d)


def test_no_jax_on_import():
    code = ("import sys, model.bpe_tokenizer\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ------------------------------------------------------------- GGUF "gpt2" vocabularies


def test_gguf_bpe_vocabulary_serves_through_load_model(tok, tmp_path, monkeypatch):
    """A Llama-architecture GGUF with a "gpt2" vocabulary (pre "llama-bpe") loads with a
    tokenizer that encodes and decodes as the one it was written from (it used to be refused)."""
    from serving.loading.model_registry import load_model

    monkeypatch.setenv("XLASERVE_DATA_DIR", str(tmp_path / "data"))
    path = _bpe_gguf(tmp_path, tok, "llama-bpe")
    model, got = load_model(str(path), progress=False)
    assert isinstance(got, BPETokenizer) and model.cfg.vocab_size == got.vocab_size == tok.vocab_size
    for text in TEXTS:
        assert got.encode(text, add_bos=True) == tok.encode(text, add_bos=True), text
        assert got.decode(got.encode(text)) == text
        assert got.encode_markup(text) == tok.encode_markup(text)
    assert got.stop_token_ids[:1] == (tok.eos_id,) and tok.token_id("<|eot_id|>") in got.stop_token_ids
    assert got.chat_stop_token_ids[-2:] == (tok.token_id("<|start_header_id|>"), tok.token_id("<|im_start|>"))
    # The second load reads the cached tokenizer files, not the GGUF's metadata.
    cached = BPETokenizer.cached_gguf(path, tmp_path / "data" / "cache" / "tokenizer")
    assert cached is not None and cached.encode("hello 中文") == tok.encode("hello 中文")


def test_gguf_pre_tokenizers_and_bos(tok, tmp_path):
    """"qwen2" splits digits one by one and NFC-normalizes; without add_bos_token, only
    Llama 3's split prepends BOS (llama.cpp's defaults)."""
    llama = BPETokenizer.from_gguf(_bpe_gguf(tmp_path, tok, "llama-bpe", "l.gguf", add_bos=None))
    qwen = BPETokenizer.from_gguf(_bpe_gguf(tmp_path, tok, "qwen2", "q.gguf", add_bos=None))
    assert llama.add_bos and not qwen.add_bos and qwen.encode("he", add_bos=True) == tok.encode("he")
    assert llama.encode("123") == [tok.token_id("123")]
    assert qwen.encode("123") == [tok.token_id(c) for c in "123"]
    assert qwen.encode("e\u0301") == qwen.encode("\u00e9") != llama.encode("e\u0301")


def test_gguf_user_defined_tokens_and_chat_template(tok, tmp_path):
    """Type-4 (user-defined) tokens are matched in any text and decode as text, as in llama.cpp;
    the GGUF's tokenizer.chat_template is kept for the chat-template renderer."""
    path = _bpe_gguf(tmp_path, tok, "llama-bpe", user_defined=("<|im_start|>",), chat_template="{{ x }}")
    got = BPETokenizer.from_gguf(path)
    im = tok.token_id("<|im_start|>")
    assert got.encode("a<|im_start|>b") == [*tok.encode("a"), im, *tok.encode("b")]
    assert not got.is_control(im) and got.decode([im]) == "<|im_start|>"
    assert got.is_control(tok.token_id("<|eot_id|>")) and got.encode("<|eot_id|>") == tok.encode("<|eot_id|>")
    assert got.chat_template_source == "{{ x }}" and im not in got.chat_stop_token_ids


def test_gguf_unknown_pre_tokenizer_is_named(tok, tmp_path, monkeypatch):
    from serving.loading.model_registry import load_model

    monkeypatch.setenv("XLASERVE_DATA_DIR", str(tmp_path / "data"))
    path = _bpe_gguf(tmp_path, tok, "no-such-pre")
    with pytest.raises(ValueError, match="unknown tokenizer.ggml.pre 'no-such-pre'; xlaserve reads"):
        BPETokenizer.from_gguf(path)
    with pytest.raises(ValueError, match="carries no tokenizer xlaserve can use.*'no-such-pre'"):
        load_model(str(path), progress=False)
