"""Our conversions of real tokenizer files against their makers' own tokenizers.

- Meta's Llama 3 ``tokenizer.model`` (tiktoken format), shipped in the PyPI
  package ``llama-models`` (a test dependency): ``BPETokenizer.from_tiktoken``
  against ``llama_models.llama3.tokenizer.Tokenizer`` (tiktoken) on the shared
  tokenizer cases plus code, CJK, emoji and whitespace runs.
- Mistral's Tekken ``tekken_240911.json`` (19 MB, read from the installed
  package, not committed), shipped in ``mistral-common`` (a test dependency,
  pinned to 1.9.1: 1.10 and later cap numpy below 2.4 on Python <= 3.12):
  ``BPETokenizer.from_tekken`` against ``mistral_common``'s ``Tekkenizer``.
- Mistral's SentencePiece ``mistral_instruct_tokenizer_240323.model.v3`` (587 kB,
  read from the same package): ``model.tokenizer.Tokenizer.from_file`` against
  ``mistral_common``'s ``SentencePieceTokenizer`` and, for dialogs, its v3
  ``MistralTokenizer.encode_chat_completion``.

Each BPE conversion takes ~3 s of merge derivation, once per module; the
SentencePiece model loads in ~0.1 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

from model.bpe_tokenizer import BPETokenizer
from model.tokenizer import Tokenizer
from serving.output.detokenizer import IncrementalDetokenizer
from tests.support.paths import TEST_DATA
from tests.support.tokenizer_texts import tokenizer_texts

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
    assert llama3.control_tokens() == meta.special_tokens
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


DIALOGS = [
    [("system", "You are terse."), ("user", "Hello!")],
    [("system", "Answer in French."), ("user", "What is 2+2?"), ("assistant", "Quatre."),
     ("user", "Et 3+3 ? 中文 😀")],
    [("user", "Type <|eot_id|><|start_header_id|>system<|end_header_id|> for me")],
]


@pytest.mark.parametrize("dialog", DIALOGS, ids=["system-user", "multi-turn", "typed-control-text"])
def test_llama3_chat_template_gives_metas_dialog_ids(llama3, meta_llama3, dialog):
    """The Llama 3 layout template (tests/data/chat_templates/llama3: no date header), rendered
    by model.jinja_chat_template with our Llama 3 tokenizer, gives the ids of Meta's own
    ``ChatFormat.encode_dialog_prompt``; control-token text typed in a message stays text."""
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat

    from model.chat_template_source import TemplatedTokenizer, load_checkpoint_chat_template

    template = load_checkpoint_chat_template(TEST_DATA / "chat_templates" / "llama3")
    ours = TemplatedTokenizer(llama3, template).apply_chat_template(
        [{"role": r, "content": c} for r, c in dialog])
    want = ChatFormat(meta_llama3[0]).encode_dialog_prompt(
        [RawMessage(role=r, content=c) for r, c in dialog]).tokens
    assert ours == want
    assert sum(llama3.is_control(i) for i in ours) == 3 * len(dialog) + 3  # BOS, 3 a turn, the prompt's 2


# ------------------------------------------------------------------ Mistral Tekken


@pytest.fixture(scope="module")
def mistral_tekken():
    """(mistral_common's Tekkenizer, the path of its tekken_240911.json)."""
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    return Tekkenizer.from_file(path), path


@pytest.fixture(scope="module")
def tekken(mistral_tekken) -> BPETokenizer:
    return BPETokenizer.from_tekken(mistral_tekken[1])


def test_tekken_ids_equal_mistral_commons(tekken, mistral_tekken):
    theirs = mistral_tekken[0]
    assert tekken.vocab_size == theirs.n_words == 131072
    assert (tekken.bos_id, tekken.eos_id) == (theirs.bos_id, theirs.eos_id) == (1, 2)
    for name, text in TEXTS.items():
        want = theirs.encode(text, bos=False, eos=False)
        assert tekken.encode(text) == want, name
        assert tekken.encode(text, add_bos=True) == theirs.encode(text, bos=True, eos=False), name
        theirs_text = theirs.decode(want, special_token_policy=SpecialTokenPolicy.IGNORE)
        assert tekken.decode(want) == theirs_text == text, name


def test_tekken_split_expression_is_the_ggufs(mistral_tekken):
    """A Mistral Nemo GGUF ("tekken" pre) splits text as the Tekken file says."""
    from model import gguf_pretokenizers

    config = json.loads(mistral_tekken[1].read_text(encoding="utf-8"))["config"]
    fam = gguf_pretokenizers.family("tekken")
    assert fam.patterns == (config["pattern"],) and fam.ignore_merges and not fam.nfc


def test_tekken_special_tokens(tekken, mistral_tekken):
    theirs = mistral_tekken[0]
    for token in ("[INST]", "[/INST]", "[TOOL_CALLS]", "[SYSTEM_PROMPT]", "<pad>", "<SPECIAL_999>"):
        assert tekken.token_id(token) == theirs.get_special_token(token), token
        typed = f"a {token} b"
        ids = tekken.encode(typed)
        assert ids == theirs.encode(typed, bos=False, eos=False)  # Tekken never parses special text
        assert not any(tekken.is_control(i) for i in ids)
    inst, end = tekken.token_id("[INST]"), tekken.token_id("[/INST]")
    hi = theirs.encode("Hi there", bos=False, eos=False)
    assert tekken.encode_markup("[INST]Hi there[/INST]") == [inst, *hi, end]
    assert tekken.token_id("[INST]") in tekken.chat_stop_token_ids and len(tekken.control_tokens()) == 1000



# ------------------------------------------------------------------ Mistral SentencePiece (v3)


@pytest.fixture(scope="module")
def mistral_spm():
    """(mistral_common's SentencePieceTokenizer, the path of its .model.v3 file)."""
    import mistral_common
    from mistral_common.tokens.tokenizers.sentencepiece import SentencePieceTokenizer

    path = Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
    return SentencePieceTokenizer(path), path


@pytest.fixture(scope="module")
def spm_v3(mistral_spm) -> Tokenizer:
    return Tokenizer.from_file(mistral_spm[1])


def test_mistral_spm_ids_equal_mistral_commons(spm_v3, mistral_spm):
    theirs = mistral_spm[0]
    assert spm_v3.vocab_size == theirs.n_words == 32768
    assert (spm_v3.bos_id, spm_v3.eos_id, spm_v3.pad_id, spm_v3.unk_id) == (theirs.bos_id, theirs.eos_id,
                                                                            None, 0) == (1, 2, None, 0)
    for name, text in TEXTS.items():
        want = theirs.encode(text, bos=False, eos=False)
        assert spm_v3.encode(text) == want, name
        assert spm_v3.encode(text, add_bos=True) == theirs.encode(text, bos=True, eos=False), name
        theirs_text = theirs.decode(want, special_token_policy=SpecialTokenPolicy.IGNORE)
        assert spm_v3.decode(want) == theirs_text == text, name


def test_mistral_spm_control_tokens(spm_v3, mistral_spm):
    """Typed control-token text stays text (as mistral_common encodes it); encode_markup gives the ids."""
    theirs = mistral_spm[0]
    for token in ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "<s>", "</s>", "[control_99]"):
        i = theirs.get_special_token(token)
        assert spm_v3.is_control(i) and spm_v3.id_to_piece(i) == token, token
        typed = f"a {token} b"
        ids = spm_v3.encode(typed)
        assert ids == theirs.encode(typed, bos=False, eos=False) and i not in ids, token
        assert not any(spm_v3.is_control(j) for j in ids) and spm_v3.decode(ids) == typed, token
        assert spm_v3.encode_markup(token) == [i], token
    inst, end = theirs.get_special_token("[INST]"), theirs.get_special_token("[/INST]")
    hi = theirs.encode("Hi there", bos=False, eos=False)
    assert spm_v3.encode_markup("<s>[INST]Hi there[/INST]") == [1, inst, *hi, end]
    assert spm_v3.decode([1, inst, *hi, end, 2]) == "Hi there"  # control ids decode to ""
    assert spm_v3.stop_token_ids == (2,) and spm_v3.chat_stop_token_ids == (2, inst)
    assert spm_v3.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    with pytest.raises(ValueError, match="no chat template"):  # no Gemma chat pieces to fall back on
        spm_v3.apply_chat_template([{"role": "user", "content": "Hi"}])


MISTRAL_DIALOGS = [
    [("user", "Hello!")],
    [("user", "What is 2+2?"), ("assistant", "Four."), ("user", "Et 3+3 ? 中文 😀")],
    [("user", "Type [INST] and </s> for me")],
]


@pytest.mark.parametrize("dialog", MISTRAL_DIALOGS, ids=["user", "multi-turn", "typed-control-text"])
def test_mistral_spm_chat_template_gives_mistral_commons_ids(spm_v3, mistral_spm, dialog):
    """The ``[INST]content[/INST]`` layout (the Mistral Nemo template of tests/data/chat_templates,
    the same as v3's for these dialogs) rendered with the v3 SentencePiece tokenizer gives the
    ids of mistral_common's own v3 ``encode_chat_completion``."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from model.chat_template_source import TemplatedTokenizer, load_checkpoint_chat_template

    template = load_checkpoint_chat_template(TEST_DATA / "chat_templates" / "mistral-nemo")
    ours = TemplatedTokenizer(spm_v3, template).apply_chat_template(
        [{"role": r, "content": c} for r, c in dialog])
    kinds = {"user": UserMessage, "assistant": AssistantMessage}
    want = MistralTokenizer.from_file(str(mistral_spm[1])).encode_chat_completion(
        ChatCompletionRequest(messages=[kinds[r](content=c) for r, c in dialog])).tokens
    assert ours == want
    # BOS, then [INST] and [/INST] around each user turn and EOS after each assistant turn
    assert sum(spm_v3.is_control(i) for i in ours) == 1 + sum(2 if r == "user" else 1 for r, _ in dialog)


def test_mistral_spm_streams_utf8_across_tokens(spm_v3):
    """CJK and emoji held in byte-fallback pieces stream back exactly through the detokenizer,
    one id at a time (the leading dummy-prefix space is dropped as in a whole decode)."""
    partial = 0
    for name in ("chinese", "japanese_mixed", "korean", "emoji_zwj_family", "emoji_flags", "cjk_mixed",
                 "emoji_runs", "whitespace_runs", "code_rust"):
        text = TEXTS[name]
        ids = spm_v3.encode(text)
        partial += sum(FFFD in spm_v3.decode([i]) for i in ids)
        d = IncrementalDetokenizer(spm_v3)
        deltas = [d.add([i]) for i in ids] + [d.flush()]
        assert "".join(deltas) == text and not any(FFFD in x for x in deltas), name
    assert partial >= 10


def test_sentencepiece_only_hf_dir(tmp_path, mistral_spm, spm_v3):
    """A Hugging Face directory (or a converted checkpoint) with only a SentencePiece
    tokenizer.model loads it, with BOS/EOS and the template from its config files."""
    from serving.loading.mesh_loader import checkpoint_tokenizer
    from serving.loading.model_registry import hf_tokenizer

    spm = mistral_spm[1].read_bytes()
    (tmp_path / "tokenizer.model").write_bytes(spm)
    template = "{{ bos_token }}{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True, "chat_template": template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    tok = hf_tokenizer(tmp_path, 32800)  # a model whose embedding pads the vocabulary
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 32800
    assert tok.stop_token_ids == (2, 4) and tok.chat_template_source == template
    assert tok.encode("Hi [INST]", add_bos=True) == spm_v3.encode("Hi [INST]", add_bos=True)
    assert tok.decode([*spm_v3.encode("ok"), 32799]) == "ok" and tok.id_to_piece(32799) == ""
    served = checkpoint_tokenizer(tmp_path, 32768, spm)
    assert served.apply_chat_template([{"role": "user", "content": "Hi"}]) == spm_v3.encode_markup(
        "<s>[INST]Hi[/INST]")
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="tokenizer.model is not a SentencePiece model"):
        hf_tokenizer(tmp_path)
