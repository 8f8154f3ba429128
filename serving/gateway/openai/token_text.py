"""How a token id is spelled in log-probability responses.

A token's *bytes* are the UTF-8 bytes it contributes to the decoded text,
taken out of context:

- a control token (``<eos>``, ``<end_of_turn>``, ...) contributes none
  (``bytes`` is null in chat responses) and is spelled as in the vocabulary;
- a byte-fallback piece (SentencePiece's ``<0xE2>``) is that one byte;
- a SentencePiece piece is its text with "▁" read as a space (Gemma's
  ``▁the`` is " the");
- otherwise the token's own decoding (``decode([id])``); when that holds
  U+FFFD (a byte-level BPE token that is part of a character, GPT-2's
  ``Ġ``-alphabet), the vocabulary spelling is read back through that byte
  alphabet.

A token's *text* (the ``token`` field, and the keys of completions'
``top_logprobs``) is its bytes as UTF-8 when they are valid UTF-8; a token
that carries part of a character is spelled ``bytes:`` followed by its bytes
as ``\\xNN`` escapes (``"bytes:\\xe2\\x80"``), as OpenAI's completions do,
on both endpoints (chat also gives the raw ``bytes``). vLLM spells such a
token U+FFFD instead, which loses the bytes. With
``return_tokens_as_token_ids`` every token is ``"token_id:ID"`` (vLLM's
extension; keys then never collide).

``text_offset`` (completions) counts characters of the returned text: a
token starts where the text of the bytes before it ends (a token inside a
multi-byte character starts at that character); control tokens are empty.

Nothing here imports JAX; only the tokenizer's ``decode``, and where it has
them ``id_to_piece`` and ``is_control``, are used.
"""

from __future__ import annotations

import codecs
import functools
import re

from serving.contract.tokenizer_protocol import TextTokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SP_SPACE = "\u2581"


@functools.cache
def _gpt2_byte_alphabet() -> dict[str, int]:
    """{character: byte} of GPT-2's byte-level BPE alphabet (printable bytes stand for
    themselves, the others are shifted to U+0100 onwards, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, shift = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + shift)] = b
            shift += 1
    return out


def spell(data: bytes) -> str:
    """The ``token`` text of a token with these bytes: the text, or ``bytes:\\xNN...``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenTexts:
    """Spellings of token ids for one tokenizer (cached per id; thread-compatible).

    Args:
      tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes | None] = {}

    def token_bytes(self, token_id: int) -> bytes | None:
        """The UTF-8 bytes `token_id` contributes to text; None for a control token."""
        got = self._bytes.get(token_id, b"?")
        if got == b"?":
            got = self._bytes[token_id] = self._compute_bytes(token_id)
        return got

    def text(self, token_id: int, as_id: bool = False) -> str:
        """The ``token`` string of `token_id` (``"token_id:ID"`` when `as_id`)."""
        if as_id:
            return f"token_id:{token_id}"
        data = self.token_bytes(token_id)
        if data is None:
            return self._piece(token_id) or ""
        return spell(data)

    def _piece(self, token_id: int) -> str | None:
        id_to_piece = getattr(self.tokenizer, "id_to_piece", None)
        if id_to_piece is None:
            return None
        try:
            return id_to_piece(token_id)
        except (ValueError, IndexError):
            return None

    def _is_control(self, token_id: int) -> bool:
        is_control = getattr(self.tokenizer, "is_control", None)
        return bool(is_control(token_id)) if is_control is not None else False

    def _compute_bytes(self, token_id: int) -> bytes | None:
        if self._is_control(token_id):
            return None
        piece = self._piece(token_id)
        if piece is not None and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if piece and _SP_SPACE in piece:
            return piece.replace(_SP_SPACE, " ").encode()
        text = self.tokenizer.decode([token_id])
        if "\ufffd" in text and piece:
            alphabet = _gpt2_byte_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return text.encode()


@functools.lru_cache(maxsize=16)
def token_texts(tokenizer: TextTokenizer) -> TokenTexts:
    """The shared :class:`TokenTexts` of `tokenizer` (one per served tokenizer, so its
    per-id cache lasts across requests; used on the event loop only)."""
    return TokenTexts(tokenizer)


class TextOffsets:
    """Running ``text_offset`` of one choice: where each next token starts, in characters.

    Args:
      start: the offset of the first token (the length of the text before it,
        e.g. the echoed prompt).
    """

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, data: bytes | None) -> int:
        """The offset of a token with these bytes (None: a control token); advances past it."""
        at = self.chars
        if data:
            self.chars += len(self._decoder.decode(data))
        return at

    def restart(self, start: int) -> None:
        """Continue at `start` characters with no partial character pending."""
        self.chars = start
        self._decoder.reset()
