"""Tokenizers of the models users bring, on the ``tokenizers`` library.

:class:`BPETokenizer` implements ``serving.contract.tokenizer_protocol.TextTokenizer``
(as ``model.tokenizer.Tokenizer`` does for Gemma's SentencePiece) around a
``tokenizers.Tokenizer``, built from:

- a Hugging Face checkpoint's ``tokenizer.json`` with ``tokenizer_config.json``
  and ``generation_config.json`` (:meth:`BPETokenizer.from_hf_dir`);
- a tiktoken BPE file, Meta's Llama 3 ``tokenizer.model``
  (:meth:`BPETokenizer.from_tiktoken`) and Mistral's Tekken JSON
  (:meth:`BPETokenizer.from_tekken`), converted by ``model.bpe_convert``;
- a GGUF's vocabulary, any type llama.cpp's test data has ("gpt2" byte-level
  BPE with every ``tokenizer.ggml.pre`` split, "llama" SentencePiece, "bert"
  WordPiece, "gemma4"), read by ``model.gguf_vocab`` (:meth:`BPETokenizer.from_gguf`).

User text never becomes control tokens: :meth:`~BPETokenizer.encode` runs with
special-token parsing off (``tokenizers``' ``encode_special_tokens``), so
``<|eot_id|>`` typed in a message is encoded as the characters it spells. Only
:meth:`~BPETokenizer.encode_markup`, for a chat template's own markup, turns
special tokens into their ids. The two run on two copies of the pipeline, so
threads encoding at once never see each other's setting.

BOS: ``encode(text, add_bos=True)`` prepends the BOS id only when the model
uses one (``add_bos``: ``tokenizer_config.json``'s ``add_bos_token``, else
whether ``tokenizer.json``'s post-processor adds ``bos_token``; Qwen's
tokenizers have no BOS). EOS: every id of ``generation_config.json``'s
``eos_token_id`` (an int or a list) and ``tokenizer_config.json``'s
``eos_token`` stops generation.

Thread safety: ``tokenizers``' encode and decode leave the pipeline as it was
(its BPE cache sits behind a lock) and both pipelines' settings are fixed at
construction, so one tokenizer serves all of the gateway's tokenizer threads.

This module must not import JAX: the gateway uses it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer

from model import bpe_convert, gguf_vocab

__all__ = ["BPETokenizer", "END_OF_TURN_TOKENS", "TURN_OPENING_TOKENS"]

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>",
                      "<|end|>", "<end_of_turn>")
"""Control tokens that end generation in a GGUF, besides its eos/eot/eom ids (llama.cpp
treats the same spellings as end-of-generation); HF checkpoints list theirs in
``generation_config.json`` instead."""

TURN_OPENING_TOKENS = ("<|start_header_id|>", "<|im_start|>", "<start_of_turn>", "[INST]")
"""Control tokens that open a chat turn (Llama 3, ChatML/Qwen, Gemma, Mistral): in a chat,
a model that opens the next turn has ended its own, so these join ``chat_stop_token_ids``."""


class BPETokenizer:
    """Text <-> token ids through ``tokenizers`` (implements ``TextTokenizer``).

    Args:
      tokenizer: the ``tokenizers.Tokenizer`` (its special added tokens are the
        control tokens).
      bos_id: the BOS id, or None (no BOS token).
      eos_ids: ids that end generation, the primary EOS first (at least one).
      add_bos: whether ``encode(..., add_bos=True)`` prepends ``bos_id``.
      chat_template_source: the Jinja chat template the files carry, if any
        (``tokenizer_config.json``'s ``chat_template``, a GGUF's
        ``tokenizer.chat_template``), kept for ``model.chat_template_source``;
        not rendered here.
      vocab_size: the model's vocabulary size when it exceeds the tokenizer's
        (Qwen2.5 pads its 151665 tokens to 151936 embedding rows); the ids in
        between are accepted and decode to "". None: the tokenizer's size.

    Attributes:
      vocab_size: ids are ``[0, vocab_size)`` (added tokens included).
      bos_id, eos_id: BOS (None if the model has none) and the primary EOS id.
      bos_token, eos_token: their spellings (``bos_token`` None without BOS).
      add_bos: see Args.
      chat_template_source: see Args.

    Raises:
      ValueError: no EOS id, an id outside the vocabulary, or a ``vocab_size``
        smaller than the tokenizer's.
    """

    def __init__(self, tokenizer: HFTokenizer, *, bos_id: int | None, eos_ids: Sequence[int],
                 add_bos: bool, chat_template_source: str | None = None,
                 vocab_size: int | None = None) -> None:
        self._markup = tokenizer
        self._markup.encode_special_tokens = False
        self._text = HFTokenizer.from_str(tokenizer.to_str())
        self._text.encode_special_tokens = True
        self._own_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and vocab_size < self._own_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's "
                             f"{self._own_size} tokens")
        self.vocab_size: int = self._own_size if vocab_size is None else int(vocab_size)
        eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        if not eos_ids:
            raise ValueError("the tokenizer has no EOS id")
        for i in (*eos_ids, *(() if bos_id is None else (bos_id,))):
            if not 0 <= i < self._own_size:
                raise ValueError(f"special id {i} is outside the tokenizer's vocabulary "
                                 f"[0, {self._own_size})")
        self.bos_id: int | None = None if bos_id is None else int(bos_id)
        self.eos_id: int = eos_ids[0]
        self._eos_ids = eos_ids
        self.add_bos: bool = bool(add_bos) and self.bos_id is not None
        self.bos_token: str | None = None if self.bos_id is None else tokenizer.id_to_token(self.bos_id)
        self.eos_token: str = tokenizer.id_to_token(self.eos_id)
        self.chat_template_source: str | None = chat_template_source
        self._control = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        openers = (tokenizer.token_to_id(t) for t in TURN_OPENING_TOKENS)
        self._chat_stops = tuple(dict.fromkeys(
            (*eos_ids, *(i for i in openers if i is not None and i in self._control))))

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, vocab_size: int | None = None) -> "BPETokenizer":
        """From a Hugging Face checkpoint directory (see :meth:`from_hf_files`; ``vocab_size``:
        the model's, ``config.json``'s, when it pads the tokenizer's, see the class).

        Raises:
          FileNotFoundError: the directory has no ``tokenizer.json`` (a
            SentencePiece-only ``tokenizer.model`` is not read here).
          ValueError: see :meth:`from_hf_files`.
        """
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        opt = [p if p.is_file() else None for p in (path / "tokenizer_config.json",
                                                     path / "generation_config.json")]
        return cls.from_hf_files(tj, *opt, vocab_size=vocab_size)

    @classmethod
    def from_hf_files(cls, tokenizer_json: str | os.PathLike,
                      tokenizer_config: str | os.PathLike | None = None,
                      generation_config: str | os.PathLike | None = None,
                      vocab_size: int | None = None) -> "BPETokenizer":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``).

        - BOS: ``bos_token`` of the tokenizer config (a string or
          ``{"content": ...}``; null: no BOS), else ``bos_token_id`` of the
          generation config. It is prepended when ``add_bos_token`` says so, or,
          without that key, when ``tokenizer.json``'s post-processor adds it.
        - EOS: ``eos_token_id`` of the generation config (an int or a list: every
          id stops), then ``eos_token`` of the tokenizer config.
        - ``chat_template`` of the tokenizer config (a string, or a list of
          ``{"name", "template"}`` of which "default" is taken).

        Raises:
          FileNotFoundError: a named file is missing.
          ValueError: unreadable JSON, a token spelling the vocabulary lacks, or no EOS
            (each naming the file and field).
        """
        tokenizer_json = Path(tokenizer_json)
        try:
            tok = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises its own Exception subclass
            if not tokenizer_json.is_file():
                raise FileNotFoundError(tokenizer_json) from None
            raise ValueError(f"{tokenizer_json.name} is not a tokenizers file: {e}") from None
        tc = _read_json(tokenizer_config) if tokenizer_config is not None else {}
        gc = _read_json(generation_config) if generation_config is not None else {}
        tc_name = Path(tokenizer_config).name if tokenizer_config is not None else "tokenizer_config.json"

        def token_id(field: str) -> int | None:
            content = _token_content(tc.get(field))
            if content is None:
                return None
            i = tok.token_to_id(content)
            if i is None:
                raise ValueError(f"{tc_name}: {field} {content!r} is not in {tokenizer_json.name}")
            return i

        bos_id = token_id("bos_token") if "bos_token" in tc else _int_or_none(gc.get("bos_token_id"))
        eos_ids = list(_ids(gc.get("eos_token_id")))
        tc_eos = token_id("eos_token")
        if tc_eos is not None:
            eos_ids.append(tc_eos)
        if not eos_ids and "sep_token" in tc:  # an encoder's (BERT's): it ends an input, generates nothing
            eos_ids.append(token_id("sep_token"))
        if not eos_ids:
            raise ValueError(f"{tokenizer_json.parent}: neither generation_config.json eos_token_id nor "
                             f"tokenizer_config.json eos_token (nor sep_token) names an EOS token")
        if isinstance(tc.get("add_bos_token"), bool):
            add_bos = tc["add_bos_token"]
        else:
            add_bos = bos_id is not None and _post_processor_adds(tok, bos_id)
        return cls(tok, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
                   chat_template_source=_template_source(tc.get("chat_template")), vocab_size=vocab_size)

    @classmethod
    def from_tiktoken(cls, path: str | os.PathLike, *, pattern: str = bpe_convert.LLAMA3_PATTERN,
                      special_tokens: Sequence[str] = bpe_convert.LLAMA3_SPECIAL_TOKENS,
                      bos_token: str | None = "<|begin_of_text|>",
                      eos_tokens: Sequence[str] = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                      add_bos: bool = True) -> "BPETokenizer":
        """From a tiktoken BPE file; the defaults are Meta's Llama 3 ``tokenizer.model``.

        Ranks become ids; ``special_tokens`` take the ids after the last rank,
        in order. Defaults as ``llama_models.llama3.tokenizer.Tokenizer``: Llama 3's
        split expression and 256 special tokens, BOS ``<|begin_of_text|>``,
        generation stopping at ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``.

        Raises:
          FileNotFoundError: no such file.
          ValueError: a malformed file, or a bos/eos token not among ``special_tokens``.
        """
        ranks = bpe_convert.read_tiktoken_ranks(path)
        base = len(ranks)
        specials = {t: base + k for k, t in enumerate(special_tokens)}
        tok = bpe_convert.from_ranks(ranks, pattern, specials)
        name = Path(path).name
        return cls(tok, bos_id=None if bos_token is None else _special(specials, bos_token, name),
                   eos_ids=[_special(specials, t, name) for t in eos_tokens], add_bos=add_bos)

    @classmethod
    def from_tekken(cls, path: str | os.PathLike) -> "BPETokenizer":
        """From Mistral's Tekken file (``tekken_*.json``, ``model.bpe_convert.read_tekken``).

        BOS ``<s>`` (prepended), EOS ``</s>``, as ``mistral_common``'s ``Tekkenizer``.

        Raises:
          FileNotFoundError: no such file.
          ValueError: not a Tekken file, or one without ``<s>`` / ``</s>``.
        """
        tok, specials = bpe_convert.read_tekken(path)
        name = Path(path).name
        return cls(tok, bos_id=_special(specials, "<s>", name), eos_ids=[_special(specials, "</s>", name)],
                   add_bos=True)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> "BPETokenizer":
        """From a GGUF's vocabulary (``model.gguf_vocab.read_gguf_tokenizer``: "gpt2" with any
        of llama.cpp's ``tokenizer.ggml.pre`` names, "llama" SentencePiece, "bert", "gemma4").

        BOS ``tokenizer.ggml.bos_token_id`` (prepended per ``add_bos_token``);
        generation stops at ``eos_token_id``, ``eot_token_id``, ``eom_token_id``
        and any control token of :data:`END_OF_TURN_TOKENS`; the GGUF's
        ``tokenizer.chat_template`` is kept.

        Building the ``tokenizers`` pipeline of a 128k-token vocabulary takes
        a second or more (SentencePiece vocabularies: their merge list); with ``cache_dir`` the
        result is saved there (:meth:`save`, keyed by the file's name, size and
        mtime) and later calls (:meth:`cached_gguf`) load that instead.

        Raises:
          FileNotFoundError: no such file.
          ValueError: a vocabulary type not read (``gguf_vocab.UnsupportedVocab``),
            an unknown ``tokenizer.ggml.pre``, or no EOS id.
        """
        hit = cls.cached_gguf(path, cache_dir)
        if hit is not None:
            return hit
        tok, meta = gguf_vocab.read_gguf_tokenizer(path)
        control = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        eos = [meta[k] for k in ("eos_id", "eot_id", "eom_id") if meta[k] is not None]
        eos += [i for i in (tok.token_to_id(t) for t in END_OF_TURN_TOKENS) if i in control]
        if not eos:
            raise ValueError(f"{Path(path).name} has no tokenizer.ggml.eos_token_id")
        out = cls(tok, bos_id=meta["bos_id"], eos_ids=eos, add_bos=meta["add_bos"],
                  chat_template_source=meta["chat_template"])
        if cache_dir is not None:
            target = _cache_path(path, cache_dir)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name, suffix=".tmp"))
            try:
                out.save(tmp)
                os.replace(tmp, target)
            except OSError:  # another process won the race, or the cache is read-only
                shutil.rmtree(tmp, ignore_errors=True)
        return out

    @classmethod
    def cached_gguf(cls, path: str | os.PathLike,
                    cache_dir: str | os.PathLike | None) -> "BPETokenizer | None":
        """The tokenizer :meth:`from_gguf` cached for this GGUF file, or None (no cache,
        or one that fails to load). Does not open the GGUF."""
        if cache_dir is None:
            return None
        target = _cache_path(path, cache_dir)
        if not (target / "tokenizer.json").is_file():
            return None
        try:
            return cls.from_hf_dir(target)
        except (OSError, ValueError):
            return None

    # --------------------------------------------------------------- protocol

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: every EOS id, the primary one first."""
        return self._eos_ids

    @property
    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """``stop_token_ids`` plus the control tokens of :data:`TURN_OPENING_TOKENS`
        the vocabulary has (a model opening the next turn has ended its own)."""
        return self._chat_stops

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers.Tokenizer`` (special-token parsing on); do not change its settings."""
        return self._markup

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Encode user text: special-token spellings stay plain text; no EOS.

        Args:
          text: any string.
          add_bos: prepend ``bos_id`` if the model uses a BOS (``self.add_bos``).

        Raises:
          TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._text.encode(text, add_special_tokens=False).ids if text else []
        return [self.bos_id, *ids] if add_bos and self.add_bos else list(ids)

    def encode_input(self, text: str) -> list[int]:
        """Encode a whole input as the model sees it alone: user text (special-token spellings
        stay plain text) framed by ``tokenizer.json``'s post-processor (its BOS, and the EOS
        an embedding model's tokenizer appends: EmbeddingGemma's, Qwen3-Embedding's), as
        sentence-transformers tokenizes an input for an embedding.

        Raises:
          TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode_input expects str, got {type(text).__name__}")
        return list(self._text.encode(text, add_special_tokens=True).ids)

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """Encode two texts as one input, framed by ``tokenizer.json``'s post-processor as a
        cross-encoder sees a (query, document) pair (BERT: ``[CLS] a [SEP] b [SEP]``; RoBERTa:
        ``<s> a </s></s> b </s>``); special-token spellings stay plain text.

        Returns:
          (token ids, the position of the first token of type 1: ``len(ids)`` when the
          post-processor gives every token type 0).

        Raises:
          TypeError: either text is not a ``str``.
        """
        if not isinstance(first, str) or not isinstance(second, str):
            raise TypeError("encode_pair expects two str")
        enc = self._text.encode(first, second, add_special_tokens=True)
        types = enc.type_ids
        return list(enc.ids), next((i for i, t in enumerate(types) if t), len(types))

    def encode_markup(self, text: str) -> list[int]:
        """Encode a chat template's own markup: special-token spellings become their ids.

        Never pass user text here (use :meth:`encode`). No BOS is added: a
        template that wants one spells ``bos_token``.

        Raises:
          TypeError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode_markup expects str, got {type(text).__name__}")
        return list(self._markup.encode(text, add_special_tokens=False).ids) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text; control ids decode to "".

        Bytes that do not form UTF-8 (a character cut between tokens) decode to
        U+FFFD, one per maximal invalid or incomplete sequence.

        Raises:
          ValueError: an id is outside ``[0, vocab_size)``.
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            if i < self._own_size:
                out.append(i)
        return self._markup.decode(out, skip_special_tokens=True) if out else ""

    def id_to_piece(self, i: int) -> str:
        """The vocabulary spelling of id ``i`` (byte-level tokens in GPT-2's byte
        alphabet, e.g. "Ġworld"; added tokens as their content; "" for a padding id).

        Raises:
          ValueError: ``i`` is outside ``[0, vocab_size)``.
        """
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
        return self._markup.id_to_token(i) if i < self._own_size else ""

    def token_id(self, token: str) -> int:
        """The id of a token by its spelling (e.g. ``"<|eot_id|>"``, ``"<|im_start|>"``).

        Raises:
          KeyError: the vocabulary has no such token.
        """
        i = self._markup.token_to_id(token)
        if i is None:
            raise KeyError(f"the vocabulary has no token {token!r}")
        return i

    def control_tokens(self) -> dict[str, int]:
        """``{spelling: id}`` of every control (special added) token."""
        dec = self._markup.get_added_tokens_decoder()
        return {dec[i].content: i for i in sorted(self._control)}

    @property
    def special_tokens(self) -> dict[str, str]:
        """Spellings of BOS and EOS as a Jinja chat template's variables
        (``{"bos_token": ..., "eos_token": ...}``; no ``bos_token`` without BOS),
        as ``model.tokenizer.Tokenizer.special_tokens``."""
        out = {"eos_token": self.eos_token}
        if self.bos_token is not None:
            out["bos_token"] = self.bos_token
        return out

    def is_control(self, i: int) -> bool:
        """Whether id ``i`` is a control token (a special added token, e.g. ``<|eot_id|>``)."""
        return int(i) in self._control

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Always refuses: this tokenizer has no chat format of its own. A chat template
        is served by wrapping it (``model.chat_template_source.TemplatedTokenizer``,
        which renders a Jinja template with :meth:`encode` and :meth:`encode_markup`).

        Raises:
          ValueError: always, saying so.
        """
        raise ValueError("this model's tokenizer has no chat template wired in; serve it with its "
                         "checkpoint's template or --chat-template FILE")

    def save(self, path: str | os.PathLike) -> Path:
        """Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``
        into directory ``path`` (created), so that :meth:`from_hf_dir` rebuilds this tokenizer.

        Returns:
          The directory.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._markup.save(str(path / "tokenizer.json"))
        tc: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                              "add_bos_token": self.add_bos}
        if self.chat_template_source is not None:
            tc["chat_template"] = self.chat_template_source
        (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=1, ensure_ascii=False))
        gc = {"eos_token_id": list(self._eos_ids)}
        if self.bos_id is not None:
            gc["bos_token_id"] = self.bos_id
        (path / "generation_config.json").write_text(json.dumps(gc, indent=1))
        return path

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, add_bos={self.add_bos}, "
                f"stop_token_ids={self._eos_ids})")


# ------------------------------------------------------------------ helpers


def _read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} holds a {type(data).__name__}, not an object")
    return data


def _token_content(v: Any) -> str | None:
    """A tokenizer_config token field: "text", {"content": "text", ...} or null."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return None if v is None else int(v)


def _ids(v: Any) -> Iterable[int]:
    if v is None:
        return ()
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def _template_source(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        named = {t.get("name"): t.get("template") for t in v if isinstance(t, dict)}
        return named.get("default")
    return None


def _post_processor_adds(tok: HFTokenizer, bos_id: int) -> bool:
    """Whether ``tokenizer.json``'s post-processor puts ``bos_id`` first (Llama 3's does)."""
    with_special = tok.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos_id and tok.encode(
        "a", add_special_tokens=False).ids[:1] != [bos_id]


_CACHE_RECIPE = 2  # bump when the conversion changes, so stale caches are not reused


def _cache_path(path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    path = Path(path)
    st = path.stat()
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir / f"{path.stem}.{st.st_size}-{st.st_mtime_ns}.bpe-v{_CACHE_RECIPE}"


def _special(specials: dict[str, int], token: str, source: str) -> int:
    try:
        return specials[token]
    except KeyError:
        raise ValueError(f"{source} has no special token {token!r}") from None
