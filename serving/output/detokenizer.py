"""Incremental, UTF-8-safe detokenization with stop strings.

The engine streams token ids; the gateway turns them into text deltas. Two
things make this harder than ``decode(new_ids)``:

* **Split characters.** With SentencePiece byte fallback a character such as
  "中" may arrive as three byte tokens; with byte-level BPE (Llama 3, Qwen) a
  token holds any run of bytes, part of a character or the end of one and the
  start of the next. Decoding a token alone yields U+FFFD. Text is therefore
  held back while the decoded window ends in U+FFFD and released once the
  character is complete.
* **Context-dependent decoding.** Some tokenizers decode a token differently at
  the start of a sequence (e.g. strip a leading space), so a token is never
  decoded on its own: a small window that starts one emission earlier is
  decoded, and the new text is what the window adds to the previous emission.

This is the "prefix offset / read offset" scheme of vLLM's incremental
detokenizer (``vllm/transformers_utils/detokenizer_utils.py``,
``detokenize_incrementally``) and of Hugging Face's ``TextStreamer``:
``prefix_text = decode(ids[prefix:read])``, ``new_text = decode(ids[prefix:])``,
emit ``new_text[len(prefix_text):]`` when it is complete, then slide the window
(``prefix, read = read, len(ids)``). The window only spans the tokens since the
previous emission, so each token costs O(1) amortized decoding work; the whole
output is never re-decoded.

Stop strings are matched on the text stream, across token boundaries: the
longest suffix of the not-yet-emitted text that is a prefix of some stop string
is held back, and when a stop string completes only the text before it is
emitted (the stop string itself never is).
"""

from __future__ import annotations

from typing import Sequence

from serving.contract.tokenizer_protocol import TextTokenizer

_REPLACEMENT = "\ufffd"
# An incomplete UTF-8 character has at most 3 of its (at most 4) bytes, so (each
# token holding at least one byte) it starts within the last 3 tokens.
_MAX_INCOMPLETE_TOKENS = 3


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Feed ids with :meth:`add` as they arrive and call :meth:`flush` once at the
    end of the stream. The concatenation of everything returned equals the
    decoded output truncated before the first stop string (if any).

    Args:
      tokenizer: a :class:`~serving.contract.tokenizer_protocol.TextTokenizer`; only
        ``decode`` is used.
      stop: stop strings (empty strings are ignored). Generation text ends
        right before the earliest-completing occurrence of any of them; among
        stop strings completing at the same character, the one starting first
        wins.
      min_tokens: stop strings are armed only from the token after the first
        ``min_tokens`` (vLLM's rule, as ``min_tokens`` masks stop ids on the
        device): an occurrence counts when it completes in the text that a later
        token adds (it may start earlier); one that completes within the first
        ``min_tokens`` tokens' text is ordinary text.

    Attributes:
      stopped: True once a stop string matched; later :meth:`add` calls return "".
      stop_string: the stop string that matched, or None.
      text: all text emitted so far (the concatenation of returned deltas).

    Guarantees: a character split across tokens (byte-fallback pieces, or
    byte-level BPE tokens holding parts of characters) is never emitted as
    U+FFFD (text is held back until it completes); U+FFFD is emitted only for
    bytes that can no longer form a valid character, or by :meth:`flush` for an
    incomplete character at the very end. Stop strings are
    never emitted, even partially.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        self._tokenizer = tokenizer
        self._min_tokens = max(int(min_tokens), 0)
        self._fed = 0  # ids given to add() so far
        # Matches must end past this many characters of ``_pending`` (None: not armed yet).
        self._armed_at: int | None = 0 if self._min_tokens == 0 else None
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Token window: ids[prefix:read] produced the previous emission,
        # ids[read:] are not yet emitted. Ids before `prefix` are dropped.
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        # Decoded text held back because it might begin a stop string.
        self._pending = ""
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (str)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
            self._parts = [self._text_cache]
        return self._text_cache

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated token ids; return the text they complete.

        Args:
          token_ids: new ids in generation order (stop tokens such as EOS should
            not be fed; control tokens are harmless if they decode to "").

        Returns:
          The new text delta, possibly "" (text held back for an incomplete
          character or a possible stop-string prefix, or already stopped).

        Raises:
          Whatever ``tokenizer.decode`` raises (e.g. ValueError for an id
          outside the vocabulary).
        """
        if self.stopped or not token_ids:
            return ""
        out = ""
        for t in token_ids:  # one at a time: stop strings arm after exactly min_tokens ids
            if self._armed_at is None and self._fed >= self._min_tokens:
                self._armed_at = len(self._pending)
            self._fed += 1
            self._ids.append(int(t))
            out += self._emit(self._decode_new())
            if self.stopped:
                break
        return out

    def skip(self) -> None:
        """Counts a generated id that is not fed (a stop id dropped from the text) toward
        ``min_tokens``."""
        self._fed += 1

    def flush(self) -> str:
        """End of stream: release everything still held back.

        An incomplete trailing character is emitted as U+FFFD (there is nothing
        left to complete it); held-back stop-string prefixes are emitted unless
        they complete a stop string. Call once; the detokenizer is then empty.

        Returns:
          The final text delta, possibly "".
        """
        if self.stopped:
            return ""
        delta = ""
        if self._read < len(self._ids):
            new_text = self._tokenizer.decode(self._ids[self._prefix :])
            delta = new_text[len(self._prefix_text) :]
        self._ids, self._prefix, self._read, self._prefix_text = [], 0, 0, ""
        out = self._emit(delta)
        if not self.stopped and self._pending:
            out += self._release(len(self._pending))
        return out

    # ----------------------------------------------------------- internals

    def _decode_new(self) -> str:
        """UTF-8 stage: the complete new text in the window, advancing it."""
        ids, prefix, read = self._ids, self._prefix, self._read
        n = len(ids)
        new_text = self._tokenizer.decode(ids[prefix:])
        cut = n
        if new_text.endswith(_REPLACEMENT):
            # Possibly an incomplete character: it starts within the last 3
            # tokens. Emit up to the latest cut point that decodes cleanly.
            cut = 0
            for c in range(n - 1, max(read, n - 1 - _MAX_INCOMPLETE_TOKENS), -1):
                text = self._tokenizer.decode(ids[prefix:c])
                if not text.endswith(_REPLACEMENT):
                    cut, new_text = c, text
                    break
            else:
                # Every candidate ends in U+FFFD. Either the bytes before the
                # last 3 tokens can no longer form a character (invalid output),
                # or byte-level BPE tokens that straddle characters (the end of
                # one and the start of the next) leave no clean cut. In the first
                # case the later tokens left the text up to that point as it was;
                # in the second they completed its last character: wait.
                c = n - _MAX_INCOMPLETE_TOKENS
                if c > read:
                    text = self._tokenizer.decode(ids[prefix:c])
                    if new_text.startswith(text):
                        cut, new_text = c, text
            if cut == 0:
                return ""
        if len(new_text) <= len(self._prefix_text):
            # Nothing visible yet (e.g. tokens that decode to ""); keep the
            # window so the next decode still has its left context.
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide: the tokens just emitted become the next window's left context.
        self._prefix_text = self._tokenizer.decode(ids[read:cut])
        del ids[:read]
        self._prefix, self._read = 0, cut - read
        return delta

    def _emit(self, delta: str) -> str:
        """Stop-string stage: returns the part of `delta` safe to emit."""
        if not self._stops:
            self._pending += delta
            return self._release(len(self._pending))
        if not delta:
            return ""
        self._pending += delta
        pending = self._pending
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = pending.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if self._armed_at is None:
            best = None  # within the first min_tokens tokens: no stop string yet
        elif best is not None and best[0] <= self._armed_at:
            # The earliest match completed in text before arming: look for one that ends later.
            best = None
            for s in self._stops:
                i = pending.find(s, max(self._armed_at - len(s) + 1, 0))
                if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                    best = (i + len(s), i, s)
        if best is not None:
            out = self._release(best[1])
            self._pending = ""
            self.stopped = True
            self.stop_string = best[2]
            return out
        # Hold back the longest suffix that is a proper prefix of a stop string.
        hold = 0
        for k in range(min(len(pending), self._max_stop_len - 1), 0, -1):
            suffix = pending[-k:]
            if any(s.startswith(suffix) for s in self._stops):
                hold = k
                break
        if self._armed_at is not None:  # the arming point moves with the released text
            self._armed_at = max(self._armed_at - (len(pending) - hold), 0)
        return self._release(len(pending) - hold)

    def _release(self, n: int) -> str:
        """Emit the first `n` pending characters."""
        out, self._pending = self._pending[:n], self._pending[n:]
        if out:
            self._parts.append(out)
            self._text_cache = None
        return out
