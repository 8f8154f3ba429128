"""Byte-level BPE vocabularies from other formats, as ``tokenizers`` pipelines.

Three sources become one kind of object, a ``tokenizers.Tokenizer`` with a
byte-level BPE model (GPT-2's scheme: text is split by a regular expression,
each piece's UTF-8 bytes are spelled with GPT-2's 256-character byte alphabet,
then merged by rank):

- **tiktoken files** (Meta's Llama 3 ``tokenizer.model``): one token per line,
  ``base64(token bytes) rank``; the id of a token is its rank. tiktoken merges
  by rank alone (the adjacent pair whose concatenation has the lowest rank goes
  first), so the merge list is derived from the ranks: the merge that builds a
  token of rank ``r`` is the last step of BPE run on the token's own bytes with
  only ranks below ``r`` allowed (the scheme of tiktoken's ``_educational.py``
  and of transformers' ``TikTokenConverter``; our own code). A token that no
  such run reaches gets no merge; ``ignore_merges`` still finds it when it is a
  whole piece, as tiktoken does.
- **Tekken files** (Mistral's ``tekken_*.json``): the same, with the ranks,
  split pattern and special tokens inside one JSON file; token ids are the
  ranks shifted past the special tokens (``mistral_common``'s layout).
- **GGUF "gpt2" vocabularies** (``tokenizer.ggml.model == "gpt2"``): tokens
  already in the byte alphabet, merges given, and ``tokenizer.ggml.pre``
  naming the split rule (read by :mod:`model.gguf_vocab` with the rules of
  :mod:`model.gguf_pretokenizers`, through :func:`byte_level_bpe`).

Special tokens become ``tokenizers`` added tokens at their own ids, marked
``special`` (control): ``BPETokenizer.encode`` turns their parsing off, so a
user typing ``<|eot_id|>`` gets plain-text ids.

No JAX here: the gateway's tokenizer path imports this module.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

__all__ = [
    "LLAMA3_PATTERN", "QWEN2_PATTERN", "TEKKEN_PATTERN", "LLAMA3_SPECIAL_TOKENS",
    "byte_alphabet", "read_tiktoken_ranks", "merges_from_ranks", "byte_level_bpe",
    "from_ranks", "read_tekken",
]

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's split expression (``pat_str`` of ``llama_models.llama3.tokenizer.Tokenizer``):
contractions, letter runs with one leading non-letter, digits in threes,
punctuation runs, newline runs and whitespace runs."""

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's split expression (its ``tokenizer.json``): Llama 3's with single digits."""

TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Mistral's Tekken split expression (``config.pattern`` of ``tekken_240911.json``):
case-aware letter runs, single digits, punctuation runs that keep a trailing "/"."""

def _llama3_special_tokens() -> tuple[str, ...]:
    named = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>", "<|image|>")
    reserved = tuple(f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named)))
    return named + reserved


LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _llama3_special_tokens()
"""Llama 3's 256 special tokens in id order after the 128000 ranks (ids 128000-128255),
as ``llama_models.llama3.tokenizer.Tokenizer`` defines them: 12 named ones
(``<|begin_of_text|>`` 128000, ``<|end_of_text|>`` 128001, ``<|start_header_id|>``
128006, ``<|end_header_id|>`` 128007, ``<|eom_id|>`` 128008, ``<|eot_id|>`` 128009,
...), then ``<|reserved_special_token_2|>`` .. ``<|reserved_special_token_245|>``."""


def byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet: ``alphabet[b]`` is the character that spells byte ``b``.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) spell
    themselves; the other 68 bytes take ``chr(256)``, ``chr(257)``, ... in byte
    order (so space is "Ġ", newline "Ċ"). Source: GPT-2's ``encoder.py``
    ``bytes_to_unicode``, which ``tokenizers``' ``ByteLevel`` uses too.

    Returns:
      256 one-character strings, indexed by byte value.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(
        range(ord("®"), ord("ÿ") + 1))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


_ALPHABET = byte_alphabet()
_SPELL = {b: c for b, c in enumerate(_ALPHABET)}


def _spell(token: bytes) -> str:
    return "".join(_SPELL[b] for b in token)


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Reads a tiktoken BPE file: ``{token bytes: rank}``.

    Each non-empty line is ``base64(token bytes) rank`` (Meta's Llama 3
    ``tokenizer.model``, OpenAI's ``*.tiktoken``).

    Raises:
      FileNotFoundError: no such file.
      ValueError: a malformed line (named by number), or a token or rank that repeats.
    """
    path = Path(path)
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                tok_b64, rank_s = line.split()
                token, rank = base64.b64decode(tok_b64, validate=True), int(rank_s)
            except ValueError as e:
                raise ValueError(f"{path.name} line {n} is not 'base64-token rank': {e}") from None
            if token in ranks or rank in seen:
                raise ValueError(f"{path.name} line {n}: token or rank {rank} repeats")
            ranks[token] = rank
            seen.add(rank)
    if not ranks:
        raise ValueError(f"{path.name} holds no tokens")
    return ranks


def _bpe_last_merge(token: bytes, ranks: Mapping[bytes, int], max_rank: int) -> tuple[bytes, bytes] | None:
    """BPE on ``token``'s bytes with merges of rank < ``max_rank``: the final two parts, or None."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            return None
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def merges_from_ranks(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list equivalent to rank-ordered BPE over ``ranks`` (see the module docstring).

    Args:
      ranks: ``{token bytes: rank}``; lower ranks merge first.

    Returns:
      ``(left, right)`` byte pairs, in the rank order of ``left + right``; one
      per multi-byte token that rank-restricted BPE on its own bytes reaches.
    """
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        pair = _bpe_last_merge(token, ranks, rank)
        if pair is not None and ranks.get(pair[0], rank) < rank and ranks.get(pair[1], rank) < rank:
            out.append(pair)
    return out


def byte_level_bpe(vocab: Mapping[str, int], merges: Sequence[tuple[str, str]], pattern: str, *,
                   special_tokens: Mapping[str, int] = {}, user_tokens: Mapping[str, int] = {},
                   nfc: bool = False, pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
                   ignore_merges: bool = True) -> Tokenizer:
    """A ``tokenizers.Tokenizer``: byte-level BPE split by ``pattern``.

    The pipeline is Hugging Face's for Llama 3 / Qwen2 ``tokenizer.json``:
    optional NFC normalizer; ``Split(pattern, "isolated")`` then
    ``ByteLevel(add_prefix_space=False, use_regex=False)``; a BPE model with
    ``ignore_merges=True`` (a piece that is itself a token is that token, as in
    tiktoken and llama.cpp's "llama-bpe"); the ``ByteLevel`` decoder.

    Args:
      vocab: ``{token spelled in the byte alphabet: id}``.
      merges: merge pairs in priority order, spelled in the byte alphabet.
      pattern: the split expression (Oniguruma syntax, as in ``tokenizer.json``).
      special_tokens: ``{content: id}`` of control tokens: added tokens marked
        special (recognized only by markup encoding, decoded to "" when skipped).
      user_tokens: ``{content: id}`` of non-special added tokens (recognized in
        any text, decoded as their text; GGUF "user-defined" tokens).
      nfc: NFC-normalize input first (Qwen2).
      pre_tokenizer: replaces the ``Split(pattern)`` + ``ByteLevel`` pipeline
        (a GGUF family's several splits, ``model.gguf_pretokenizers``).
      ignore_merges: see above (False: every piece goes through the merges).

    Raises:
      ValueError: an added token's id is another entry's, its spelling is
        another id's, or the ids leave gaps.
    """
    vocab = dict(vocab)
    n = max(vocab.values(), default=-1) + 1
    added = ([(c, i, True) for c, i in special_tokens.items()]
             + [(c, i, False) for c, i in user_tokens.items()])
    by_id = {i: t for t, i in vocab.items()}
    for content, i, _ in added:
        if i in by_id and by_id[i] != content:
            raise ValueError(f"added token {content!r} has id {i}, which the vocabulary gives to "
                             f"{by_id[i]!r}")
        if vocab.get(content, i) != i:
            raise ValueError(f"added token {content!r} has id {i}, but the vocabulary spells "
                             f"id {vocab[content]} the same")
        vocab.setdefault(content, i)
        by_id[i] = content
    n = max(n, max(by_id, default=-1) + 1)
    missing = [i for i in range(n) if i not in by_id]
    if missing:
        raise ValueError(f"the vocabulary has no token for ids {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} ({len(missing)} gaps)")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), ignore_merges=ignore_merges,
                               fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer if pre_tokenizer is not None else pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added tokens keep their ids because their content is already in `vocab`.
    tok.add_tokens([AddedToken(c, special=s, normalized=False) for c, _, s in
                    sorted(added, key=lambda a: a[1])])
    return tok


def from_ranks(ranks: Mapping[bytes, int], pattern: str, special_tokens: Mapping[str, int],
               id_offset: int = 0) -> Tokenizer:
    """A tiktoken-style vocabulary (``{bytes: rank}``) as a ``tokenizers`` byte-level BPE.

    Args:
      ranks: ``{token bytes: rank}``; a token's id is ``rank + id_offset``.
      pattern: the split expression.
      special_tokens: ``{content: id}``; these ids must not collide with the ranks'.
      id_offset: added to every rank (Tekken: the number of special tokens).

    Raises:
      ValueError: ids collide or leave gaps (see :func:`byte_level_bpe`).
    """
    vocab = {_spell(t): r + id_offset for t, r in ranks.items()}
    merges = [(_spell(a), _spell(b)) for a, b in merges_from_ranks(ranks)]
    return byte_level_bpe(vocab, merges, pattern, special_tokens=special_tokens)


def read_tekken(path: str | os.PathLike) -> tuple[Tokenizer, dict[str, int]]:
    """Mistral's Tekken file (``tekken_*.json``) as a ``tokenizers`` byte-level BPE.

    Layout (``mistral_common.tokens.tokenizers.tekken.Tekkenizer``):
    ``config.default_vocab_size`` ids in all; the first
    ``config.default_num_special_tokens`` are special tokens (the file's
    ``special_tokens`` list by ``rank``, the rest filled as ``<SPECIAL_{id}>``;
    files without the list use ``<unk>``, ``<s>``, ``</s>``, ``[INST]``,
    ``[/INST]``, ... ``[TOOL_CONTENT]`` (ids 0-19), as mistral_common's
    ``DEPRECATED_SPECIAL_TOKENS``); then the ``vocab`` entries with rank
    below ``default_vocab_size - num_special``, at id ``rank + num_special``,
    split by ``config.pattern``.

    Returns:
      (tokenizer, ``{special token: id}``).

    Raises:
      FileNotFoundError: no such file.
      ValueError: a missing field or an inconsistent vocabulary, naming the file.
    """
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        cfg = data["config"]
        pattern, size, n_special = cfg["pattern"], int(cfg["default_vocab_size"]), int(
            cfg["default_num_special_tokens"])
        listed = data.get("special_tokens")
        if listed is None:
            listed = [{"rank": i, "token_str": s} for i, s in enumerate(_TEKKEN_LEGACY_SPECIALS)]
        specials = {t["token_str"]: int(t["rank"]) for t in listed}
        inner = size - n_special
        ranks = {base64.b64decode(t["token_bytes"]): int(t["rank"]) for t in data["vocab"]
                 if int(t["rank"]) < inner}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path.name} is not a Tekken tokenizer file: {type(e).__name__} {e}") from None
    if len(specials) != len(listed) or len(specials) > n_special:
        raise ValueError(f"{path.name}: {len(listed)} special tokens, {len(specials)} distinct, "
                         f"for {n_special} special ids")
    for i in range(n_special):
        if i not in specials.values():
            specials[f"<SPECIAL_{i}>"] = i
    if sorted(ranks.values()) != list(range(inner)):
        raise ValueError(f"{path.name}: the vocabulary's ranks are not 0..{inner - 1}")
    return from_ranks(ranks, pattern, specials, id_offset=n_special), specials


# The special tokens of Tekken files without a special_tokens list (tekken_240911.json), ids
# 0-19, as mistral_common's Tekkenizer.DEPRECATED_SPECIAL_TOKENS names them.
_TEKKEN_LEGACY_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)
