"""Structured output on the host: grammars, matchers and token bitmasks, with llguidance.

A request's :class:`~serving.contract.engine_client.StructuredOutput` becomes an
llguidance grammar (:func:`grammar_of`), compiled once per ``(kind, value)``
against the served tokenizer (:class:`Grammars`, which hands each request a
copy of the compiled matcher). Before every step that samples for a
constrained request, the engine loop asks its matcher for the tokens allowed
next as one row of a ``[rows, ceil(vocab / 32)] int32`` bitmask
(:meth:`Grammars.fill`; bit ``t % 32`` of word ``t // 32`` set = token ``t``
allowed), which the jitted sampler applies on device
(``serving.engine.sample.token_bitmask``); after the step it feeds the sampled token back
(``LLMatcher.consume_token``). The stop tokens (the tokenizer's
``stop_token_ids``) are allowed exactly where the grammar accepts, so a
request ends with "stop" when its text is complete.

What each kind means (llguidance's documents the grammar languages):
  json_schema   the schema as JSON text (llguidance's JSON-schema subset; a
                keyword it does not implement is an error unless the schema
                sets ``"x-guidance": {"lenient": true}``).
  json_object   any JSON object.
  regex         the pattern (Rust ``regex`` syntax), matched in full.
  choice        a JSON list of strings: exactly one of them.
  grammar       a Lark grammar in llguidance's dialect (a GBNF grammar is
                converted to it).

JSON is generated with fixed separators (``", "`` and ``": "``, as Python's
``json.dumps``) and no other whitespace between tokens, so a sampled model
cannot spend its tokens on blank lines; a schema's own ``x-guidance``
options override this.

Nothing here imports JAX: the gateway uses :func:`validate` to answer an
invalid grammar with a 400 before submitting.

Thread safety: building the llguidance tokenizer and compiling grammars are
guarded by locks; a matcher belongs to one request and is used by one thread
at a time (the engine loop's). llguidance releases the GIL while it compiles
and computes masks.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import weakref
from typing import Any, Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

from serving.contract.engine_client import STRUCTURED_KINDS, StructuredOutput
from serving.contract.tokenizer_protocol import TextTokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compile options by default (a schema's ``x-guidance`` overrides them)."""

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept per tokenizer (least recently used dropped first)."""

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class StructuredOutputError(ValueError):
    """A structured-output constraint that cannot be compiled (the message says why)."""


def words(vocab_size: int) -> int:
    """int32 words of one bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def grammar_of(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of a constraint; not yet checked.

    Raises:
      StructuredOutputError: an unknown kind, a ``choice`` value that is not a
        non-empty JSON list of strings, a ``json_schema`` that is not JSON (or
        is ``false``), or what llguidance refuses while building the grammar.
    """
    try:
        return _grammar_of(so)
    except ValueError as e:  # llguidance's own refusals (StructuredOutputError is one too)
        raise StructuredOutputError(str(e)) from None


def _grammar_of(so: StructuredOutput) -> str:
    kind, value = so.kind, so.value
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
        if schema is False:
            raise StructuredOutputError("the JSON schema false accepts nothing")
        if schema is True:  # any JSON value
            value = "{}"
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        try:
            choices = json.loads(value)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise StructuredOutputError("a choice must be a non-empty list of strings")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", value)
    raise StructuredOutputError(f"unknown structured output kind {kind!r}; expected one of {STRUCTURED_KINDS}")


# --------------------------------------------------------------- tokenizer


class _TokenBytes:
    """What ``llguidance.TokenizerWrapper`` reads from a SentencePiece tokenizer:
    each id's bytes, the special ids, EOS/BOS and an encode function."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        unk = getattr(tok, "unk_id", None)
        tokens, special = [], []
        for i in range(tok.vocab_size):
            piece = tok.id_to_piece(i)
            if not piece or i == unk or tok.is_control(i):
                # llguidance names special tokens by these bytes; they never match grammar text.
                tokens.append(piece.encode() or f"<[{i}]>".encode())
                special.append(i)
            elif m := _BYTE_PIECE.fullmatch(piece):
                tokens.append(bytes([int(m.group(1), 16)]))
            else:
                tokens.append(piece.replace("\u2581", " ").encode())
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


def build_ll_tokenizer(tok: TextTokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a served tokenizer (about 2 s for Gemma's 262k pieces).

    A ``tokenizers``-based tokenizer (``model.bpe_tokenizer.BPETokenizer``: it
    has ``backend``) is handed over as its JSON; a SentencePiece one
    (``model.tokenizer.Tokenizer``: ``id_to_piece``, ``is_control``) as each
    piece's bytes (``▁`` a space, ``<0xAB>`` byte pieces one byte, control and
    unknown pieces special). EOS: every id of ``stop_token_ids``.

    Raises:
      StructuredOutputError: a tokenizer of neither kind.
    """
    eos = list(tok.stop_token_ids)
    backend = getattr(tok, "backend", None)
    if backend is not None and hasattr(backend, "to_str"):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
    if callable(getattr(tok, "id_to_piece", None)) and callable(getattr(tok, "is_control", None)):
        wrapper = llguidance.TokenizerWrapper(_TokenBytes(tok))
        return llguidance.LLTokenizer(wrapper, n_vocab=tok.vocab_size, eos_token=eos)
    raise StructuredOutputError(f"structured output does not support {type(tok).__name__} tokenizers")


# ---------------------------------------------------------------- grammars


class Grammars:
    """Compiled grammars of one tokenizer, and the bitmask rows of their matchers.

    Args:
      tok: the served tokenizer.
      cache_size: compiled grammars kept, keyed by (kind, value).

    Raises:
      StructuredOutputError: an unsupported tokenizer (see :func:`build_ll_tokenizer`).
    """

    def __init__(self, tok: TextTokenizer, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.ll_tokenizer = build_ll_tokenizer(tok)
        self._ll_words = words(self.ll_tokenizer.vocab_size)
        self._cache: collections.OrderedDict[StructuredOutput, llguidance.LLMatcher] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for `so` (a copy of the cached compiled one; the first
        compile of a grammar can take up to about a second for huge grammars).

        Raises:
          StructuredOutputError: the grammar does not compile (llguidance's message).
        """
        with self._lock:
            proto = self._cache.get(so)
            if proto is not None:
                self._cache.move_to_end(so)
                return proto.deep_copy()
        proto = llguidance.LLMatcher(self.ll_tokenizer, grammar_of(so), log_level=0)
        if proto.is_error():
            raise StructuredOutputError(proto.get_error())
        with self._lock:
            self._cache[so] = proto
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def fill(self, matchers: Sequence[tuple[llguidance.LLMatcher, int]], rows: int,
             vocab_size: int) -> np.ndarray:
        """The bitmask of one step: matcher rows as their grammars allow, others all ones.

        Args:
          matchers: (matcher, row) pairs, rows distinct and < `rows`.
          rows: rows of the step's batch.
          vocab_size: the model's vocabulary (>= the tokenizer's; ids the
            tokenizer lacks are never allowed in a matcher row).

        Returns:
          [rows, words(vocab_size)] int32 (all bits set: unconstrained).

        Raises:
          ValueError: `vocab_size` below the tokenizer's.
        """
        if vocab_size < self.ll_tokenizer.vocab_size:
            raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than the "
                             f"tokenizer's ({self.ll_tokenizer.vocab_size})")
        mask = np.full((rows, words(vocab_size)), -1, np.int32)
        if not matchers:
            return mask
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        own = np.zeros((rows, self._ll_words), np.int32)
        llnp.fill_next_token_bitmask_par(self._executor, list(matchers), own)
        for _, i in matchers:
            mask[i, :self._ll_words] = own[i]
            mask[i, self._ll_words:] = 0
        return mask


_GRAMMARS: "weakref.WeakKeyDictionary[Any, Grammars]" = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def grammars_for(tok: TextTokenizer) -> Grammars:
    """The process's :class:`Grammars` of `tok` (built on first use, then shared by the
    gateway's validation and the engine loop, so a grammar is compiled once).

    Raises:
      StructuredOutputError: an unsupported tokenizer.
    """
    with _GRAMMARS_LOCK:
        g = _GRAMMARS.get(tok)
        if g is None:
            g = _GRAMMARS[tok] = Grammars(tok)
        return g


def validate(so: StructuredOutput, tok: TextTokenizer) -> None:
    """Compiles `so` against `tok` (cached for the engine), or says why it cannot.

    Raises:
      StructuredOutputError: the constraint does not compile.
    """
    grammars_for(tok).matcher(so)
