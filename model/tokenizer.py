"""SentencePiece tokenizers: Gemma 3's, rebuilt from the GGUF vocabulary, and real ``.model`` files.

:class:`Tokenizer` wraps any SentencePiece model (implements
``serving.contract.tokenizer_protocol.TextTokenizer``). Its constructors:

- :meth:`Tokenizer.from_gguf` / :meth:`~Tokenizer.from_pieces` /
  :meth:`~Tokenizer.tiny`: Gemma 3's vocabulary by the recipe of `model.gemma_vocab` (these
  require Gemma's ``<start_of_turn>`` / ``<end_of_turn>`` control pieces);
- :meth:`Tokenizer.from_file`: a real SentencePiece ``.model`` file as its
  maker ships it (e.g. Mistral's ``mistral_instruct_tokenizer_240323.model.v3``),
  its normalizer, BOS and EOS read from the model proto (or overridden);
- :meth:`Tokenizer.from_hf_dir`: a Hugging Face checkpoint directory's
  ``tokenizer.model`` with BOS/EOS from ``tokenizer_config.json`` and
  ``generation_config.json``.

In every case ``encode`` never produces a CONTROL piece from user text
(SentencePiece never matches control pieces in its input), while
``encode_markup`` (for a chat template's own markup) turns their spellings
into their ids. USER_DEFINED pieces (Gemma's whitespace runs, Mistral v3's
``[REF]``) are ordinary text to SentencePiece and are matched by both, as
their makers' tokenizers do.

Gemma's vocabulary is rebuilt from its GGUF by the recipe in
:mod:`model.gemma_vocab`; control tokens stay CONTROL, so user text that spells
``<start_of_turn>`` is encoded as plain text. Only the chat template
(``model.chat_template``) inserts control ids.

This module must not import JAX: the gateway uses it through
``serving.contract.tokenizer_protocol.TextTokenizer``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import sentencepiece as spm

from model import gemma_vocab
from model.gemma_vocab import END_OF_TURN as _END_OF_TURN
from model.gemma_vocab import START_OF_TURN as _START_OF_TURN
from model.gemma_vocab import build_model_proto

__all__ = ["Tokenizer", "build_model_proto"]  # build_model_proto: see model.gemma_vocab

_FROM_MODEL = object()  # Tokenizer(bos_id=...) default: the model proto's


class Tokenizer:
    """Text <-> token ids through SentencePiece (implements ``TextTokenizer``).

    Wraps a ``sentencepiece.SentencePieceProcessor``. Construct it with
    :meth:`from_gguf` (Gemma 3's real vocabulary, rebuilt by
    :func:`build_model_proto`), :meth:`from_pieces` or :meth:`tiny` (a small
    Gemma-like vocabulary for random-weight test models), :meth:`from_file`
    (a real ``.model`` file) or :meth:`from_hf_dir`.

    Args:
      serialized_model: a serialized SentencePiece ``ModelProto`` (``.model`` bytes).
      bos_id: the BOS id; by default the model's (``trainer_spec.bos_id``; none
        when that is -1); None: no BOS.
      eos_ids: ids that end generation, the primary EOS first; by default the
        model's EOS, then the control pieces of
        ``model.bpe_tokenizer.END_OF_TURN_TOKENS`` it has (Gemma: (1, 106)).
      add_bos: whether ``encode(..., add_bos=True)`` prepends ``bos_id``.
      chat_template_source: the Jinja chat template the files carry, if any
        (kept for ``model.chat_template_source``; not rendered here).
      name: where the model came from, for error messages.
      vocab_size: the model's vocabulary size when it exceeds the tokenizer's
        (embedding rows padded past the pieces); the ids in between are
        accepted and decode to "". None: the number of pieces.

    Attributes:
      bos_id, eos_id, pad_id, unk_id: special ids (Gemma: 2, 1, 0, 3; Mistral
        v3: 1, 2, None, 0); ``bos_id`` / ``pad_id`` None when the model has none.
      start_of_turn_id, end_of_turn_id: Gemma's chat control ids (105, 106), or
        None when the vocabulary lacks those control pieces.
      vocab_size: ids are ``[0, vocab_size)`` (Gemma: 262144; Mistral v3: 32768).
      add_bos, chat_template_source: see Args.

    Raises:
      ValueError: bytes that are not a SentencePiece model, no EOS, an id
        outside the vocabulary, or a ``vocab_size`` below the number of pieces
        (each naming ``name``).
    """

    def __init__(self, serialized_model: bytes, *, bos_id: int | None | object = _FROM_MODEL,
                 eos_ids: Sequence[int] | None = None, add_bos: bool = True,
                 chat_template_source: str | None = None, name: str = "SentencePiece model",
                 vocab_size: int | None = None):
        from model.bpe_tokenizer import END_OF_TURN_TOKENS, TURN_OPENING_TOKENS

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(serialized_model)
        except (RuntimeError, OSError, TypeError) as e:
            raise ValueError(f"{name} is not a SentencePiece model: {e}") from None
        self._serialized = serialized_model
        sp = self._sp
        self._own_size = sp.GetPieceSize()
        if vocab_size is not None and vocab_size < self._own_size:
            raise ValueError(f"{name}: vocab_size {vocab_size} is smaller than its {self._own_size} pieces")
        self.vocab_size: int = self._own_size if vocab_size is None else int(vocab_size)
        if bos_id is _FROM_MODEL:
            bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        # Ids that decode to "" (control and unknown pieces), and {control spelling: id}.
        silent = [i for i in range(self._own_size) if sp.IsControl(i) or sp.IsUnknown(i)]
        self._silent_ids = frozenset(silent)
        control = {sp.IdToPiece(i): i for i in silent if sp.IsControl(i)}
        if eos_ids is None:
            eos_ids = ([sp.eos_id()] if sp.eos_id() >= 0 else []) + [
                control[t] for t in END_OF_TURN_TOKENS if t in control]
        eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        if not eos_ids:
            raise ValueError(f"{name} has no EOS piece")
        for i in (*eos_ids, *(() if bos_id is None else (bos_id,))):
            if not 0 <= i < self._own_size:
                raise ValueError(f"{name}: special id {i} is outside the vocabulary [0, {self._own_size})")
        self.bos_id: int | None = None if bos_id is None else int(bos_id)
        self.eos_id: int = eos_ids[0]
        self._eos_ids = eos_ids
        self.pad_id: int | None = sp.pad_id() if sp.pad_id() >= 0 else None
        self.unk_id: int = sp.unk_id()
        self.add_bos: bool = bool(add_bos) and self.bos_id is not None
        self.chat_template_source: str | None = chat_template_source
        self.start_of_turn_id: int | None = control.get(_START_OF_TURN)
        self.end_of_turn_id: int | None = control.get(_END_OF_TURN)
        openers = [control[t] for t in TURN_OPENING_TOKENS if t in control]
        self._chat_stops = tuple(dict.fromkeys((*eos_ids, *openers)))
        # For encode_markup: {control spelling: id} and a regex of them (built on first use).
        self._control_ids: dict[str, int] = {k: v for k, v in control.items() if k}
        self._control_re: re.Pattern | None = None

    @classmethod
    def _gemma(cls, serialized_model: bytes) -> "Tokenizer":
        """A tokenizer of Gemma's recipe: it must have Gemma's chat control pieces.

        Raises:
          ValueError: no ``<start_of_turn>`` / ``<end_of_turn>`` control piece.
        """
        tok = cls(serialized_model)
        for piece, i in ((_START_OF_TURN, tok.start_of_turn_id), (_END_OF_TURN, tok.end_of_turn_id)):
            if i is None:
                raise ValueError(f"SentencePiece model has no control piece {piece!r}")
        return tok

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
        return cls._gemma(proto.SerializeToString())

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> "Tokenizer":
        """From a SentencePiece ``.model`` file as its maker ships it (e.g. Mistral's
        ``mistral_instruct_tokenizer_240323.model.v3``, a checkpoint's ``tokenizer.model``).

        Its normalizer (Mistral: a dummy prefix), BOS and EOS are the model
        proto's; ``kwargs`` (``bos_id``, ``eos_ids``, ``add_bos``,
        ``chat_template_source``) override them, as in the class.

        Raises:
          FileNotFoundError: no such file.
          ValueError: the file is not a SentencePiece model (e.g. a tiktoken
            ``tokenizer.model``), or has no EOS; each naming the file.
        """
        path = Path(path)
        return cls(path.read_bytes(), name=str(path), **kwargs)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, vocab_size: int | None = None) -> "Tokenizer":
        """From a Hugging Face checkpoint directory that ships a SentencePiece ``tokenizer.model``
        (``vocab_size``: the model's, ``config.json``'s, when it pads the pieces; see the class).

        BOS: ``tokenizer_config.json``'s ``bos_token`` (a string or
        ``{"content": ...}``; null: none), else the model's; prepended unless
        ``add_bos_token`` is false. EOS: ``generation_config.json``'s
        ``eos_token_id`` (an int or a list: every id stops), then
        ``tokenizer_config.json``'s ``eos_token``, else the model's. The
        ``chat_template`` of ``tokenizer_config.json`` is kept (as ``BPETokenizer.from_hf_files``
        reads these files).

        Raises:
          FileNotFoundError: no ``tokenizer.model``.
          ValueError: it is not a SentencePiece model, a config file is not a
            JSON object, or a token spelling the vocabulary lacks (naming file and field).
        """
        from model.bpe_tokenizer import _ids, _read_json, _template_source, _token_content

        path = Path(path)
        tc, gc = ({} if not (path / f).is_file() else _read_json(path / f)
                  for f in ("tokenizer_config.json", "generation_config.json"))
        probe = cls.from_file(path / "tokenizer.model")

        def token_id(field: str) -> int | None:
            content = _token_content(tc.get(field))
            if content is None:
                return None
            i = probe._sp.PieceToId(content)
            if probe._sp.IdToPiece(i) != content:
                raise ValueError(f"{path / 'tokenizer_config.json'}: {field} {content!r} is not a piece "
                                 f"of tokenizer.model")
            return i

        kwargs: dict = {}
        if "bos_token" in tc:
            kwargs["bos_id"] = token_id("bos_token")
        eos_ids = list(_ids(gc.get("eos_token_id")))
        tc_eos = token_id("eos_token")
        if tc_eos is not None:
            eos_ids.append(tc_eos)
        if eos_ids:
            kwargs["eos_ids"] = eos_ids
        if isinstance(tc.get("add_bos_token"), bool):
            kwargs["add_bos"] = tc["add_bos_token"]
        return cls(probe.serialized_model, name=str(path / "tokenizer.model"), vocab_size=vocab_size,
                   chat_template_source=_template_source(tc.get("chat_template")), **kwargs)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """Build the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

        Reads ``tokenizer.ggml.tokens``, ``.scores``, ``.token_type``,
        ``.bos_token_id``, ``.eos_token_id`` (and ``.padding_token_id`` /
        ``.unknown_token_id`` when present, else 0 / 3) with
        :func:`model.gguf_metadata.read_gguf_header` (tensor data is not read).

        Reading Gemma's 262144 token strings takes ~0.5 s (``gguf.GGUFReader``
        took ~20 s); building and loading the proto ~0.4 s; loading a cached
        model ~0.15 s.
        With ``cache_dir``, the serialized SentencePiece model is stored there,
        keyed by the GGUF file's name, size and mtime (and the recipe version),
        and later calls load it without opening the GGUF.

        Args:
          path: the GGUF file.
          cache_dir: optional directory for the cached ``.model`` file; created
            if missing. A cache file that fails to load is rebuilt.

        Raises:
          FileNotFoundError: ``path`` does not exist.
          ValueError: the GGUF lacks the tokenizer fields, they are inconsistent, or
            the vocabulary has no ``<start_of_turn>`` / ``<end_of_turn>`` control pieces
            (Gemma's recipe; e.g. a Llama 2 SentencePiece GGUF, which
            ``model.bpe_tokenizer.BPETokenizer.from_gguf`` reads, as
            ``serving.loading.model_registry.gguf_tokenizer`` does after this fails).
        """
        path = Path(path)
        st = path.stat()
        cache_file = None
        if cache_dir is not None:
            cache_dir = Path(cache_dir)
            cache_file = cache_dir / (
                f"{path.stem}.{st.st_size}-{st.st_mtime_ns}.spm-v{gemma_vocab.RECIPE_VERSION}.model"
            )
            if cache_file.is_file():
                try:
                    return cls._gemma(cache_file.read_bytes())
                except Exception:  # corrupt/partial cache file: rebuild below
                    pass

        pieces, scores, types, ids = gemma_vocab.read_gguf_vocab(path)
        proto = build_model_proto(pieces, scores, types, **ids)
        data = proto.SerializeToString()
        tok = cls._gemma(data)
        if cache_file is not None:
            gemma_vocab.atomic_write(cache_file, data)
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
        pieces, scores, types = gemma_vocab.tiny_vocab(vocab_size)
        return cls.from_pieces(pieces, scores, types, bos_id=2, eos_id=1, pad_id=0, unk_id=3)

    # --------------------------------------------------------------- protocol

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation, the primary EOS first (Gemma: ``(eos_id,
        end_of_turn_id)`` = (1, 106); Mistral v3: (2,))."""
        return self._eos_ids

    @property
    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a chat turn: ``stop_token_ids`` and the turn-opening control
        pieces of ``model.bpe_tokenizer.TURN_OPENING_TOKENS`` the vocabulary has (a
        model opening the next turn has ended its own; Gemma: (1, 106, 105),
        Mistral v3: (2, 3), ``[INST]``)."""
        return self._chat_stops

    @property
    def serialized_model(self) -> bytes:
        """The SentencePiece ``.model`` bytes this tokenizer was loaded from."""
        return self._serialized

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Encode ``text`` to token ids (no EOS) by the model's normalizer (Gemma: no
        dummy prefix; Mistral: one).

        Control-token spellings such as ``<start_of_turn>`` or ``[INST]`` in
        ``text`` are encoded as plain text. With ``add_bos`` the ids start with
        ``bos_id`` when the model uses one (``self.add_bos``).

        Raises:
          TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._sp.EncodeAsIds(text) if text else []
        return [self.bos_id, *ids] if add_bos and self.add_bos else list(ids)

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
            if i < self._own_size and i not in self._silent_ids:
                out.append(i)
        return self._sp.DecodeIds(out) if out else ""

    def id_to_piece(self, i: int) -> str:
        """The SentencePiece piece string of id ``i`` (spaces spelled "▁"; "" for a padding id).

        Raises:
          ValueError: ``i`` is outside ``[0, vocab_size)``.
        """
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
        return self._sp.IdToPiece(i) if i < self._own_size else ""

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``, or ``unk_id`` if it is not in the vocabulary."""
        return self._sp.PieceToId(piece)

    def is_control(self, i: int) -> bool:
        """Whether id ``i`` is a control piece (e.g. ``<bos>``, ``<end_of_turn>``)."""
        i = int(i)
        return 0 <= i < self._own_size and bool(self._sp.IsControl(i))

    @property
    def special_tokens(self) -> dict[str, str]:
        """Spellings of the special tokens, as a Jinja chat template's variables
        (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, those the model
        has; Gemma: ``<bos>``, ...; Mistral v3: ``<s>``, ``</s>``, no ``pad_token``)."""
        return {name: self._sp.IdToPiece(i) for name, i in (
            ("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id),
            ("unk_token", self.unk_id)) if i is not None}

    def encode_input(self, text: str) -> list[int]:
        """A whole input as the model sees it alone (embeddings): ``encode(text, add_bos=True)``
        (SentencePiece models frame an input with BOS only)."""
        return self.encode(text, add_bos=True)

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
            # Longest spelling first, so one that is a prefix of another never wins.
            alternatives = sorted(self._control_ids, key=len, reverse=True)
            self._control_re = re.compile("|".join(map(re.escape, alternatives)))
        ids: list[int] = []
        pos = 0
        for m in self._control_re.finditer(text):
            ids += self.encode(text[pos:m.start()])
            ids.append(self._control_ids[m.group()])
            pos = m.end()
        return ids + self.encode(text[pos:])

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Render chat messages (and `tools`) with the Gemma 3 template and generation prompt.

        Delegates to :func:`model.chat_template.render_gemma3_chat`. A model
        without Gemma's chat pieces (e.g. Mistral's) is served with its own
        Jinja template instead (``model.chat_template_source.TemplatedTokenizer``).

        Raises:
          ValueError: empty list, unknown role, system message not first, or
            non-text content; or the vocabulary has no Gemma chat pieces.
        """
        from model.chat_template import render_gemma3_chat

        if self.start_of_turn_id is None or self.end_of_turn_id is None:
            raise ValueError("this model's tokenizer has no chat template wired in (its vocabulary lacks "
                             "Gemma's <start_of_turn>/<end_of_turn>); serve it with its checkpoint's "
                             "template or --chat-template FILE")
        return render_gemma3_chat(messages, self, tools=tools)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"start_of_turn_id={self.start_of_turn_id}, end_of_turn_id={self.end_of_turn_id})"
        )
