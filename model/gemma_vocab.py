"""Gemma 3's SentencePiece model, rebuilt from its GGUF vocabulary, and the tiny test vocabulary.

Gemma's GGUF file stores the vocabulary (``tokenizer.ggml.tokens``, ``.scores``,
``.token_type``) but no SentencePiece model file. We rebuild one as a
``sentencepiece_model_pb2.ModelProto`` following the recipe in the reference
README ("Rebuilding the SentencePiece model from the GGUF"):

- model type BPE; pieces, scores and types copied as they are (GGUF token-type
  numbers equal SentencePiece's ``ModelProto.SentencePiece.Type`` enum);
- normalizer ``identity`` with ``add_dummy_prefix=False``,
  ``remove_extra_whitespaces=False``, ``escape_whitespaces=True``;
  ``byte_fallback=True``;
- ``<unk>`` (id 3) typed UNKNOWN (the GGUF marks it CONTROL);
- the user-defined whitespace pieces (ids 138-167), stored in the GGUF with real
  spaces, re-spelled with U+2581 ("▁");
- control tokens stay CONTROL, so user text that spells ``<start_of_turn>`` is
  encoded as plain text. Only the chat template (``model.chat_template``)
  inserts control ids.

:class:`model.tokenizer.Tokenizer` builds on these (``from_gguf``,
``from_pieces``, ``tiny``). No JAX here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

from sentencepiece import sentencepiece_model_pb2 as sp_pb2

__all__ = ["build_model_proto", "read_gguf_vocab", "tiny_vocab", "atomic_write", "RECIPE_VERSION"]

# Bump when the proto recipe below changes, so stale cache files are not reused.
RECIPE_VERSION = 1

_WS = "\u2581"  # SentencePiece's escaped space, "▁"

# SentencePiece piece types (equal to GGUF's tokenizer.ggml.token_type numbers).
_NORMAL = sp_pb2.ModelProto.SentencePiece.NORMAL  # 1
_UNKNOWN = sp_pb2.ModelProto.SentencePiece.UNKNOWN  # 2
_CONTROL = sp_pb2.ModelProto.SentencePiece.CONTROL  # 3
_USER_DEFINED = sp_pb2.ModelProto.SentencePiece.USER_DEFINED  # 4
_UNUSED = sp_pb2.ModelProto.SentencePiece.UNUSED  # 5
_BYTE = sp_pb2.ModelProto.SentencePiece.BYTE  # 6

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"


def build_model_proto(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    unk_id: int = 3,
) -> sp_pb2.ModelProto:
    """Build a SentencePiece BPE ``ModelProto`` from a GGUF-style vocabulary.

    Follows the recipe of the reference README ("Rebuilding the SentencePiece
    model from the GGUF"); see the module docstring for the settings.

    Args:
      pieces: ``V`` piece strings, indexed by token id (GGUF spelling: words use
        "▁" for spaces; user-defined whitespace runs may use real spaces).
      scores: ``V`` floats, the BPE merge priorities (higher merges first).
      types: ``V`` ints, SentencePiece/GGUF token types (1 normal, 2 unknown,
        3 control, 4 user-defined, 5 unused, 6 byte).
      bos_id, eos_id, pad_id, unk_id: ids of ``<bos>``, ``<eos>``, ``<pad>``
        and ``<unk>``. ``unk_id`` is re-typed UNKNOWN whatever ``types`` says.

    Returns:
      The model proto; ``SerializeToString()`` gives a ``.model`` file.

    Raises:
      ValueError: lengths differ, an id is out of range, or a piece repeats.
    """
    n = len(pieces)
    if len(scores) != n or len(types) != n:
        raise ValueError(
            f"pieces, scores and types must have equal lengths, got {n}, {len(scores)}, {len(types)}"
        )
    for name, idx in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id), ("unk_id", unk_id)):
        if not 0 <= idx < n:
            raise ValueError(f"{name}={idx} is outside the vocabulary of {n} pieces")

    m = sp_pb2.ModelProto()
    ts = m.trainer_spec
    ts.model_type = sp_pb2.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = True
    # SentencePiece resolves bos_id()/eos_id()/... by these piece names.
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = unk_id, bos_id, eos_id, pad_id
    ts.unk_piece, ts.bos_piece = pieces[unk_id], pieces[bos_id]
    ts.eos_piece, ts.pad_piece = pieces[eos_id], pieces[pad_id]

    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = False
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True

    seen: set[str] = set()
    add = m.pieces.add
    for i, (piece, score, typ) in enumerate(zip(pieces, scores, types)):
        typ = int(typ)
        if i == unk_id:
            typ = _UNKNOWN
        elif typ == _USER_DEFINED and piece and piece.strip(" ") == "":
            # GGUF stores the whitespace-run pieces with real spaces; the
            # normalizer escapes input spaces to "▁", so spell them that way.
            piece = piece.replace(" ", _WS)
        if piece in seen:
            raise ValueError(f"duplicate piece {piece!r} at id {i}")
        seen.add(piece)
        add(piece=piece, score=float(score), type=typ)
    return m


def tiny_vocab(vocab_size: int = 512) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and types of ``Tokenizer.tiny``'s vocabulary (its docstring gives the
    layout; BOS 2, EOS 1, pad 0, unk 3).

    Raises:
      ValueError: ``vocab_size`` < 384.
    """
    min_size = 384
    if vocab_size < min_size:
        raise ValueError(f"Tokenizer.tiny needs vocab_size >= {min_size}, got {vocab_size}")
    pieces: list[str] = []
    types: list[int] = []

    def put(piece: str, typ: int) -> None:
        pieces.append(piece)
        types.append(typ)

    for p in ("<pad>", "<eos>", "<bos>", "<unk>"):
        put(p, _CONTROL)  # <unk> becomes UNKNOWN in build_model_proto
    for c in range(0x21, 0x7F):
        put(chr(c), _NORMAL)
    put(_WS, _NORMAL)
    for k in range(6):
        put(f"<unused{k}>", _CONTROL)
    assert len(pieces) == 105
    put(START_OF_TURN, _CONTROL)
    put(END_OF_TURN, _CONTROL)
    put("\n", _USER_DEFINED)
    for b in range(256):
        put(f"<0x{b:02X}>", _BYTE)
    for p in (_WS * 2, _WS * 3, _WS * 4, "\n\n", "\t"):
        put(p, _USER_DEFINED)
    seen = set(pieces)
    for word in _TINY_WORDS:
        for end in range(2, len(word) + 1):
            prefix = word[:end]
            if prefix not in seen and len(pieces) < vocab_size:
                seen.add(prefix)
                put(prefix, _NORMAL)
    k = 6
    while len(pieces) < vocab_size:
        put(f"<unused{k}>", _CONTROL)
        k += 1
    # Higher score = earlier merge; earlier (shorter, commoner) pieces first.
    scores = [0.0 if t != _NORMAL else -float(i) for i, t in enumerate(types)]
    return pieces, scores, types


def _field_scalar(fields: dict, key: str, default: int | None = None) -> int:
    value = fields.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF file has no {key!r} field")
        return default
    return int(value)


def read_gguf_vocab(path: Path) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """Pieces, scores, types and special ids (``bos_id``, ``eos_id``, ``pad_id``, ``unk_id``)
    from a GGUF's ``tokenizer.ggml.*`` metadata.

    Raises:
      ValueError: a tokenizer field is missing.
    """
    from model.gguf_metadata import read_gguf_header  # local import: only needed on a cold build

    fields = read_gguf_header(path).metadata
    try:
        pieces = fields["tokenizer.ggml.tokens"]
        scores = fields["tokenizer.ggml.scores"]
        types = fields["tokenizer.ggml.token_type"]
    except KeyError as e:
        raise ValueError(f"GGUF file {path.name} has no tokenizer field {e.args[0]!r}") from None
    ids = {
        "bos_id": _field_scalar(fields, "tokenizer.ggml.bos_token_id"),
        "eos_id": _field_scalar(fields, "tokenizer.ggml.eos_token_id"),
        "pad_id": _field_scalar(fields, "tokenizer.ggml.padding_token_id", 0),
        "unk_id": _field_scalar(fields, "tokenizer.ggml.unknown_token_id", 3),
    }
    return pieces, scores, types, ids


def atomic_write(target: Path, data: bytes) -> None:
    """Writes `data` to `target` through a temporary file and a rename (mode 0644)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is not secret
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# Words for tiny_vocab (every prefix of each is added as a piece).
_TINY_WORDS = (
    "▁the", "▁a", "▁and", "▁of", "▁to", "▁in", "▁is", "▁it", "▁that", "▁for",
    "▁you", "▁was", "▁on", "▁with", "▁as", "▁be", "▁at", "▁this", "▁have",
    "▁from", "▁or", "▁one", "▁by", "▁not", "▁but", "▁what", "▁all", "▁are",
    "▁were", "▁we", "▁when", "▁your", "▁can", "▁said", "▁there", "▁an",
    "▁each", "▁which", "▁do", "▁how", "▁if", "▁will", "▁up", "▁out", "▁so",
    "▁Hello", "▁hello", "▁world", "▁The", "▁I", "▁user", "▁model",
    "ing", "er", "ed", "es", "th", "he", "in", "on", "an", "re", "at", "en",
    "or", "ou", "is", "it", "al", "ar", "st", "nd", "to", "le", "ly", "ion",
    "Hello", "user", "model",
)

