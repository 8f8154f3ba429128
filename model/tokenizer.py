"""Gemma 3 tokenizer: a SentencePiece BPE model rebuilt from the GGUF vocabulary.

The GGUF file stores the vocabulary (``tokenizer.ggml.tokens``, ``.scores``,
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

This module must not import JAX: the gateway uses it through
``serving.tokenizer_protocol.TextTokenizer``.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Sequence

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

__all__ = ["Tokenizer", "build_model_proto"]

# Bump when the proto recipe below changes, so stale cache files are not reused.
_RECIPE_VERSION = 1

_WS = "\u2581"  # SentencePiece's escaped space, "▁"

# SentencePiece piece types (equal to GGUF's tokenizer.ggml.token_type numbers).
_NORMAL = sp_pb2.ModelProto.SentencePiece.NORMAL  # 1
_UNKNOWN = sp_pb2.ModelProto.SentencePiece.UNKNOWN  # 2
_CONTROL = sp_pb2.ModelProto.SentencePiece.CONTROL  # 3
_USER_DEFINED = sp_pb2.ModelProto.SentencePiece.USER_DEFINED  # 4
_UNUSED = sp_pb2.ModelProto.SentencePiece.UNUSED  # 5
_BYTE = sp_pb2.ModelProto.SentencePiece.BYTE  # 6

_START_OF_TURN = "<start_of_turn>"
_END_OF_TURN = "<end_of_turn>"


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


class Tokenizer:
    """Text <-> token ids for Gemma 3 (implements ``TextTokenizer``).

    Wraps a ``sentencepiece.SentencePieceProcessor`` built by
    :func:`build_model_proto` (the reference README's recipe). Construct it
    with :meth:`from_gguf` (the real vocabulary), :meth:`from_pieces` or
    :meth:`tiny` (a small vocabulary for random-weight test models).

    Attributes:
      bos_id, eos_id, pad_id, unk_id: special ids (Gemma: 2, 1, 0, 3).
      start_of_turn_id, end_of_turn_id: chat control ids (Gemma: 105, 106).
      vocab_size: number of pieces (Gemma: 262144).
    """

    def __init__(self, serialized_model: bytes):
        """Load from a serialized SentencePiece ``ModelProto`` (``.model`` bytes).

        Raises:
          RuntimeError/OSError: (from sentencepiece) the bytes are not a valid model.
          ValueError: the model lacks ``<start_of_turn>``/``<end_of_turn>`` pieces
            or a bos/eos/pad/unk piece.
        """
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(serialized_model)
        self._serialized = serialized_model
        sp = self._sp
        self.vocab_size: int = sp.GetPieceSize()
        self.bos_id: int = sp.bos_id()
        self.eos_id: int = sp.eos_id()
        self.pad_id: int = sp.pad_id()
        self.unk_id: int = sp.unk_id()
        for name in ("bos_id", "eos_id", "pad_id", "unk_id"):
            if getattr(self, name) < 0:
                raise ValueError(f"SentencePiece model has no piece for {name}")
        self.start_of_turn_id: int = self._control_id(_START_OF_TURN)
        self.end_of_turn_id: int = self._control_id(_END_OF_TURN)
        # Ids that decode to "" (control and unknown pieces).
        self._silent_ids = frozenset(
            i for i in range(self.vocab_size) if sp.IsControl(i) or sp.IsUnknown(i)
        )
        # Built on first use by encode_markup: {control spelling: id} and a regex of them.
        self._control_ids: dict[str, int] = {}
        self._control_re: re.Pattern | None = None

    def _control_id(self, piece: str) -> int:
        i = self._sp.PieceToId(piece)
        if i == self._sp.unk_id() or not self._sp.IsControl(i):
            raise ValueError(f"SentencePiece model has no control piece {piece!r}")
        return i

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_pieces(
        cls,
        pieces: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        bos_id: int,
        eos_id: int,
        *,
        pad_id: int = 0,
        unk_id: int = 3,
    ) -> "Tokenizer":
        """Build from a GGUF-style vocabulary (``V`` pieces, scores and types).

        See :func:`build_model_proto` for the arguments and the recipe.

        Raises:
          ValueError: inconsistent vocabulary, or no ``<start_of_turn>`` /
            ``<end_of_turn>`` control pieces.
        """
        proto = build_model_proto(
            pieces, scores, types, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, unk_id=unk_id
        )
        return cls(proto.SerializeToString())

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """Build the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

        Reads ``tokenizer.ggml.tokens``, ``.scores``, ``.token_type``,
        ``.bos_token_id``, ``.eos_token_id`` (and ``.padding_token_id`` /
        ``.unknown_token_id`` when present, else 0 / 3) with
        ``gguf.GGUFReader`` (memory-mapped; tensor data is not read).

        Note ``GGUFReader`` parses every metadata field on open, which for
        Gemma's 262144 token strings takes ~11-13 s; building and loading the
        proto takes ~0.4 s; loading a cached model ~0.15 s.
        With ``cache_dir``, the serialized SentencePiece model is stored there,
        keyed by the GGUF file's name, size and mtime (and the recipe version),
        and later calls load it without opening the GGUF.

        Args:
          path: the GGUF file.
          cache_dir: optional directory for the cached ``.model`` file; created
            if missing. A cache file that fails to load is rebuilt.

        Raises:
          FileNotFoundError: ``path`` does not exist.
          ValueError: the GGUF lacks the tokenizer fields or they are inconsistent.
        """
        path = Path(path)
        st = path.stat()
        cache_file = None
        if cache_dir is not None:
            cache_dir = Path(cache_dir)
            cache_file = cache_dir / (
                f"{path.stem}.{st.st_size}-{st.st_mtime_ns}.spm-v{_RECIPE_VERSION}.model"
            )
            if cache_file.is_file():
                try:
                    return cls(cache_file.read_bytes())
                except Exception:  # corrupt/partial cache file: rebuild below
                    pass

        pieces, scores, types, ids = _read_gguf_vocab(path)
        proto = build_model_proto(pieces, scores, types, **ids)
        data = proto.SerializeToString()
        tok = cls(data)
        if cache_file is not None:
            _atomic_write(cache_file, data)
        return tok

    @classmethod
    def tiny(cls, vocab_size: int = 512) -> "Tokenizer":
        """A small self-contained vocabulary for random-weight test models.

        Layout (Gemma-like control ids): 0 ``<pad>``, 1 ``<eos>``, 2 ``<bos>``,
        3 ``<unk>``; 4-97 the printable ASCII characters ``!``..``~``; 98 ``▁``;
        99-104 ``<unused0..5>`` (control); 105 ``<start_of_turn>``, 106
        ``<end_of_turn>`` (control, as in Gemma); 107 ``\\n`` (user-defined);
        108-363 byte-fallback pieces ``<0x00>``..``<0xFF>``; then user-defined
        whitespace runs (``▁▁``..``▁▁▁▁``, ``\\n\\n``, ``\\t``), then common English
        word/subword pieces (every prefix included, so BPE can reach them) and
        finally ``<unusedK>`` control pieces up to ``vocab_size``.

        Any Unicode text encodes (via byte fallback) and decodes back exactly,
        except that a literal U+2581 "▁" decodes as a space (as in Gemma).

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
        put(_START_OF_TURN, _CONTROL)
        put(_END_OF_TURN, _CONTROL)
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
        return cls.from_pieces(pieces, scores, types, bos_id=2, eos_id=1, pad_id=0, unk_id=3)

    # --------------------------------------------------------------- protocol

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: ``(eos_id, end_of_turn_id)`` (Gemma: (1, 106))."""
        return (self.eos_id, self.end_of_turn_id)

    @property
    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a chat turn: ``stop_token_ids`` and ``start_of_turn_id``
        (a model opening the next turn has ended its own; Gemma: (1, 106, 105))."""
        return (*self.stop_token_ids, self.start_of_turn_id)

    @property
    def serialized_model(self) -> bytes:
        """The SentencePiece ``.model`` bytes this tokenizer was loaded from."""
        return self._serialized

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Encode ``text`` to token ids (no dummy prefix, no EOS).

        Control-token spellings such as ``<start_of_turn>`` in ``text`` are
        encoded as plain text. With ``add_bos`` the ids start with ``bos_id``.

        Raises:
          TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._sp.EncodeAsIds(text) if text else []
        return [self.bos_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text; control (and ``<unk>``) ids decode to "".

        Byte-fallback pieces are reassembled into UTF-8; an incomplete or
        invalid byte sequence decodes to U+FFFD.

        Raises:
          ValueError: an id is outside ``[0, vocab_size)``.
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            if i not in self._silent_ids:
                out.append(i)
        return self._sp.DecodeIds(out) if out else ""

    def id_to_piece(self, i: int) -> str:
        """The SentencePiece piece string of id ``i`` (spaces spelled "▁").

        Raises:
          ValueError: ``i`` is outside ``[0, vocab_size)``.
        """
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
        return self._sp.IdToPiece(i)

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``, or ``unk_id`` if it is not in the vocabulary."""
        return self._sp.PieceToId(piece)

    def is_control(self, i: int) -> bool:
        """Whether id ``i`` is a control piece (e.g. ``<bos>``, ``<end_of_turn>``)."""
        return bool(self._sp.IsControl(int(i)))

    @property
    def special_tokens(self) -> dict[str, str]:
        """Spellings of the special tokens, as a Jinja chat template's variables
        (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``; Gemma: ``<bos>``, ...)."""
        return {name: self._sp.IdToPiece(i) for name, i in (
            ("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id),
            ("unk_token", self.unk_id))}

    def encode_markup(self, text: str) -> list[int]:
        """Encode a chat template's markup: control-piece spellings become their ids.

        ``<bos>``, ``<start_of_turn>``, ``<end_of_turn>`` (any CONTROL piece) in
        ``text`` become their ids; the text between them is encoded as
        :meth:`encode` does. Only for template markup
        (``model.jinja_chat_template``); user text goes through :meth:`encode`.

        Raises:
          TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode_markup expects str, got {type(text).__name__}")
        if self._control_re is None:
            control = {self._sp.IdToPiece(i): i for i in range(self.vocab_size)
                       if self._sp.IsControl(i) and self._sp.IdToPiece(i)}
            # Longest spelling first, so one that is a prefix of another never wins.
            alternatives = sorted(control, key=len, reverse=True)
            self._control_ids = control
            self._control_re = re.compile("|".join(map(re.escape, alternatives)))
        ids: list[int] = []
        pos = 0
        for m in self._control_re.finditer(text):
            ids += self.encode(text[pos:m.start()])
            ids.append(self._control_ids[m.group()])
            pos = m.end()
        return ids + self.encode(text[pos:])

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        """Render chat messages with the Gemma 3 template and generation prompt.

        Delegates to :func:`model.chat_template.render_gemma3_chat`.

        Raises:
          ValueError: empty list, unknown role, system message not first, or
            non-text content.
        """
        from model.chat_template import render_gemma3_chat

        return render_gemma3_chat(messages, self)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"start_of_turn_id={self.start_of_turn_id}, end_of_turn_id={self.end_of_turn_id})"
        )


# ------------------------------------------------------------------ helpers


def _field_scalar(reader, key: str, default: int | None = None) -> int:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file has no {key!r} field")
        return default
    return int(field.contents())


def _read_gguf_vocab(path: Path) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """Read pieces, scores, types and special ids from a GGUF's metadata."""
    import gguf  # local import: only needed on a cold build

    reader = gguf.GGUFReader(path, "r")
    fields = reader.fields
    try:
        pieces = fields["tokenizer.ggml.tokens"].contents()
        scores = fields["tokenizer.ggml.scores"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
    except KeyError as e:
        raise ValueError(f"GGUF file {path.name} has no tokenizer field {e.args[0]!r}") from None
    ids = {
        "bos_id": _field_scalar(reader, "tokenizer.ggml.bos_token_id"),
        "eos_id": _field_scalar(reader, "tokenizer.ggml.eos_token_id"),
        "pad_id": _field_scalar(reader, "tokenizer.ggml.padding_token_id", 0),
        "unk_id": _field_scalar(reader, "tokenizer.ggml.unknown_token_id", 3),
    }
    return pieces, scores, types, ids


def _atomic_write(target: Path, data: bytes) -> None:
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


# Words for Tokenizer.tiny (every prefix of each is added as a piece).
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

