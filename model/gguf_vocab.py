"""Every GGUF vocabulary llama.cpp tokenizes, as a ``tokenizers`` pipeline.

``tokenizer.ggml.model`` names the vocabulary type (llama.cpp's
``llama_vocab::impl::load``); each becomes a ``tokenizers.Tokenizer`` whose
plain-text encoding (special tokens not parsed, no BOS/EOS) gives llama.cpp's
ids (``llama_tokenize(..., add_special=false, parse_special=false)``, as its
``tests/test-tokenizer-0.cpp`` runs it):

- **"gpt2"**: byte-level BPE; ``tokenizer.ggml.pre`` names the split rule
  (:mod:`model.gguf_pretokenizers`, every name llama.cpp knows).
- **"llama"**: SentencePiece BPE (Llama 2, Mistral v0.1, TinyLlama, Mixtral,
  Phi-3): ``tokenizer.ggml.scores`` rank the merges (the pair whose
  concatenation has the highest score merges first, as SentencePiece and
  llama.cpp's ``llm_tokenizer_spm`` do; the merge list is derived from the
  scores as Hugging Face's ``LlamaConverter`` derives it), spaces become "▁",
  a "▁" is prepended to each run of text when ``tokenizer.ggml.add_space_prefix``
  (default true), characters outside the vocabulary fall back to ``<0xNN>`` byte tokens.
- **"bert"**: WordPiece (GGUF spells word-initial pieces with a leading "▁"
  and continuations bare; here they become bare and "##"-prefixed), with
  BERT's normalizer (lower case, accents stripped, CJK characters isolated)
  and BERT's whitespace/punctuation split.
- **"gemma4"**: SentencePiece-style BPE over raw UTF-8 (spaces as "▁", merges
  given, newline runs split off, byte fallback).

Token types (``tokenizer.ggml.token_type``): control (3) and unknown (2)
tokens become ``tokenizers`` *special* added tokens (matched only when special
tokens are parsed: chat-template markup); user-defined (4) tokens become
plain added tokens, cut out of any text before the model runs, as llama.cpp's
``tokenizer_st_partition`` does. Phi-3 vocabularies (``general.name``
containing "phi-3"/"phi3") strip whitespace right of their added tokens, as
llama.cpp sets ``LLAMA_TOKEN_ATTR_RSTRIP`` for them.

No JAX here: the gateway's tokenizer path imports this module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from model import bpe_convert, gguf_pretokenizers
from model.gguf_metadata import read_gguf_header

__all__ = ["VOCAB_TYPES", "read_gguf_tokenizer", "spm_bpe", "wordpiece", "gemma4_bpe", "UnsupportedVocab"]

VOCAB_TYPES = ("gpt2", "llama", "bert", "gemma4")
"""The ``tokenizer.ggml.model`` values read."""

_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's ids where the GGUF names none (llama_vocab::impl::load).
_DEFAULT_IDS = {("llama", "bos"): 1, ("llama", "eos"): 2, ("llama", "unk"): 0,
                ("bert", "bos"): 101, ("bert", "eos"): 102, ("bert", "unk"): 100}
_WS = "\u2581"


class UnsupportedVocab(ValueError):
    """A GGUF whose ``tokenizer.ggml.model`` is none of :data:`VOCAB_TYPES` (a ValueError)."""


def _field(fields: dict[str, Any], key: str, default=None):
    v = fields.get(key)
    return default if v is None else v


def _added(pieces: Sequence[str], types: Sequence[int], rstrip: bool = False) -> list[AddedToken]:
    out = []
    for i, (p, t) in enumerate(zip(pieces, types)):
        if t in (_CONTROL, _UNKNOWN, _USER):
            strip = rstrip and p not in ("<unk>", "<s>", "<|endoftext|>")
            out.append(AddedToken(p, special=t != _USER, normalized=False, rstrip=strip))
    return out


def _vocab(pieces: Sequence[str], where: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, p in enumerate(pieces):
        if p in vocab:
            raise ValueError(f"{where}: token {p!r} appears at ids {vocab[p]} and {i}")
        vocab[p] = i
    return vocab


def spm_merges(vocab: dict[str, int], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """The BPE merge list equivalent to SentencePiece's score-ordered merging.

    Every split ``(left, right)`` of a normal or user-defined piece whose two
    halves are themselves pieces is a merge; merges are ordered by the merged
    piece's score, highest first (ties: lower merged id, then lower left and
    right ids). The scheme of Hugging Face's ``SentencePieceExtractor``; our code.
    """
    merges = []
    for piece, i in vocab.items():
        if types[i] not in (_NORMAL, _USER) or len(piece) < 2:
            continue
        local = []
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is not None and ib is not None:
                local.append((ia, ib, a, b))
        local.sort()
        merges.extend((-float(scores[i]), i, a, b) for _, _, a, b in local)
    merges.sort(key=lambda m: (m[0], m[1]))
    return [(a, b) for _, _, a, b in merges]


def _spm_decoder(strip_prefix: bool):
    steps = [decoders.Replace(_WS, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def spm_bpe(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], *, unk_id: int | None,
            add_space_prefix: bool = True, rstrip_added: bool = False, where: str = "vocabulary") -> Tokenizer:
    """A SentencePiece BPE vocabulary (GGUF "llama") as a ``tokenizers.Tokenizer``.

    Args:
      pieces, scores, types: ``V`` token strings ("▁" for spaces, ``<0xNN>``
        byte pieces), merge scores (higher merges first) and GGUF token types.
      unk_id: the unknown token's id, or None.
      add_space_prefix: prepend "▁" to each run of text (llama.cpp's
        ``add_space_prefix``; SentencePiece's ``add_dummy_prefix``).
      rstrip_added: added tokens swallow whitespace on their right (Phi-3).
      where: names the source in errors.

    Raises:
      ValueError: a piece repeats, or lengths differ.
    """
    if not len(pieces) == len(scores) == len(types):
        raise ValueError(f"{where}: {len(pieces)} tokens, {len(scores)} scores, {len(types)} types")
    vocab = _vocab(pieces, where)
    merges = spm_merges(vocab, scores, types)
    unk = None if unk_id is None else pieces[unk_id]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = ([normalizers.Prepend(_WS)] if add_space_prefix else []) + [normalizers.Replace(" ", _WS)]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = _spm_decoder(add_space_prefix)
    tok.add_tokens(_added(pieces, types, rstrip_added))
    return tok


def gemma4_bpe(pieces: Sequence[str], types: Sequence[int], merges: Sequence[tuple[str, str]], *,
               where: str = "vocabulary") -> Tokenizer:
    """A SentencePiece-style BPE with explicit merges over raw UTF-8 (GGUF "gemma4").

    Spaces become "▁" (no prefix), newline runs are split off
    (``gguf_pretokenizers.FAMILIES["gemma4"]``), characters outside the
    vocabulary fall back to ``<0xNN>`` byte tokens.

    Raises:
      ValueError: a piece repeats.
    """
    vocab = _vocab(pieces, where)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _WS)
    tok.pre_tokenizer = gguf_pretokenizers.split_pre_tokenizer(gguf_pretokenizers.FAMILIES["gemma4"])
    tok.decoder = _spm_decoder(False)
    tok.add_tokens(_added(pieces, types))
    return tok


def wordpiece(pieces: Sequence[str], types: Sequence[int], *, unk_id: int | None,
              where: str = "vocabulary") -> Tokenizer:
    """A GGUF "bert" vocabulary as a ``tokenizers`` WordPiece.

    llama.cpp's GGUF spells a word-initial piece "▁piece" and a continuation
    "piece"; BERT's ``vocab.txt`` spells them "piece" and "##piece", which is
    what ``tokenizers.models.WordPiece`` reads.

    Raises:
      ValueError: two tokens map to the same spelling.
    """
    spelled = []
    for p, t in zip(pieces, types):
        if t != _NORMAL:
            spelled.append(p)
        elif p.startswith(_WS) and len(p) > 1:
            spelled.append(p[1:])
        else:
            spelled.append("##" + p)
    vocab = _vocab(spelled, where)
    unk = "[UNK]" if unk_id is None else spelled[unk_id]
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk, continuing_subword_prefix="##",
                                     max_input_chars_per_word=10 ** 6))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_tokens(_added(spelled, types))
    return tok


def _split_merges(merges: Sequence[str], where: str, first_space_from: int = 0) -> list[tuple[str, str]]:
    out = []
    for k, m in enumerate(merges):
        cut = m.find(" ", first_space_from)
        if cut < 0:
            raise ValueError(f"{where}: tokenizer.ggml.merges[{k}] = {m!r} is not 'left right'")
        out.append((m[:cut], m[cut + 1:]))
    return out


def read_gguf_tokenizer(path: str | os.PathLike) -> tuple[Tokenizer, dict[str, Any]]:
    """A GGUF's vocabulary (any of :data:`VOCAB_TYPES`) as a ``tokenizers.Tokenizer``.

    Reads ``tokenizer.ggml.*`` with :func:`model.gguf_metadata.read_gguf_header` (metadata only).

    Returns:
      (tokenizer, metadata): ``{"model", "pre", "bos_id", "eos_id", "eot_id",
      "eom_id", "add_bos", "chat_template"}``; ids None where the GGUF has no
      such field (except llama.cpp's defaults: "llama" BOS 1 / EOS 2, "bert"
      ``cls_token_id`` / ``seperator_token_id``, else 101 / 102); ``add_bos`` is ``tokenizer.ggml.add_bos_token``, else
      llama.cpp's default for the vocabulary (true for "llama", "bert" and the
      llama3 / tekken / chameleon splits).

    Raises:
      FileNotFoundError: no such file.
      UnsupportedVocab: (a ValueError) another ``tokenizer.ggml.model``, named.
      ValueError: an unknown ``tokenizer.ggml.pre`` (named, with the known
        ones), or missing or inconsistent fields.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(path)
    fields = read_gguf_header(path).metadata
    kind = _field(fields, "tokenizer.ggml.model")
    if kind not in VOCAB_TYPES:
        raise UnsupportedVocab(f"{path.name}: tokenizer.ggml.model {kind!r} is not one xlaserve reads "
                               f"({', '.join(VOCAB_TYPES)})")
    where = path.name
    pieces = _field(fields, "tokenizer.ggml.tokens")
    if pieces is None:
        raise ValueError(f"{where} has no tokenizer.ggml.tokens")
    types = _field(fields, "tokenizer.ggml.token_type") or [_NORMAL] * len(pieces)
    if len(types) != len(pieces):
        raise ValueError(f"{where}: {len(pieces)} tokens but {len(types)} token types")
    unk_id = _field(fields, "tokenizer.ggml.unknown_token_id", _DEFAULT_IDS.get((kind, "unk")))
    pre = _field(fields, "tokenizer.ggml.pre")
    fam = gguf_pretokenizers.family(pre) if kind == "gpt2" else None
    add_bos_default = kind in ("llama", "bert") or (fam is not None and fam.name in ("llama3", "tekken",
                                                                                     "chameleon"))
    if fam is not None and fam.byte_level:
        merges = _field(fields, "tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"{where} has no tokenizer.ggml.merges")
        vocab, special, user = {}, {}, {}
        for i, (t, ty) in enumerate(zip(pieces, types)):
            (special if ty in (_CONTROL, _UNKNOWN) else user if ty == _USER else vocab)[t] = i
        tok = bpe_convert.byte_level_bpe(vocab, _split_merges(merges, where), "", special_tokens=special,
                                         user_tokens=user, pre_tokenizer=gguf_pretokenizers.split_pre_tokenizer(fam),
                                         ignore_merges=fam.ignore_merges, nfc=fam.nfc)
    elif kind == "llama":
        scores = _field(fields, "tokenizer.ggml.scores")
        if scores is None:
            raise ValueError(f"{where} has no tokenizer.ggml.scores")
        name = str(_field(fields, "general.name", "")).lower()
        tok = spm_bpe(pieces, scores, types, unk_id=unk_id, where=where,
                      add_space_prefix=bool(_field(fields, "tokenizer.ggml.add_space_prefix", True)),
                      rstrip_added="phi-3" in name or "phi3" in name)
    elif kind == "bert":
        tok = wordpiece(pieces, types, unk_id=unk_id, where=where)
    else:  # "gemma4", or a "gpt2" GGUF whose rule is SentencePiece-style (sarvam-moe)
        merges = _field(fields, "tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"{where} has no tokenizer.ggml.merges")
        tok = gemma4_bpe(pieces, types, _split_merges(merges, where, 1), where=where)
    meta: dict[str, Any] = {"model": kind, "pre": pre, "chat_template": _field(fields, "tokenizer.chat_template")}
    for key in ("bos", "eos", "eot", "eom"):
        v = _field(fields, f"tokenizer.ggml.{key}_token_id", _DEFAULT_IDS.get((kind, key)))
        if v is None and kind == "bert":  # BERT's [CLS] opens and [SEP] ends a sequence
            v = _field(fields, {"bos": "tokenizer.ggml.cls_token_id", "eos": "tokenizer.ggml.seperator_token_id"}
                       .get(key, ""), _DEFAULT_IDS.get(("bert", key)))
        meta[f"{key}_id"] = None if v is None else int(v)
    add_bos = _field(fields, "tokenizer.ggml.add_bos_token")
    meta["add_bos"] = bool(add_bos) if add_bos is not None else add_bos_default
    return tok, meta
