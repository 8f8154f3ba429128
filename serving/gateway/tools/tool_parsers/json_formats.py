"""The JSON tool call formats: Hermes' / Qwen's ``<tool_call>`` blocks and
Meta's Llama 3.x JSON calls, sharing one incremental reader of a call's JSON
object that streams the arguments object's text as it arrives."""

from __future__ import annotations

import re
from typing import Callable, Collection

from serving.gateway.tools.tool_parsers.base import ToolParser, held_suffix, strict_json

_ARGUMENT_KEYS = ("arguments", "parameters")
_STRING_STOP = re.compile(r'["\\]')


class _JsonObjectScanner:
    """Where the top-level members of one JSON object are, as its text
    arrives: each member's value span, and where the object ends. Nested
    values are only bracket-counted; ``json`` checks the whole object once it
    is closed. ``broken`` is set at the first character that cannot be valid."""

    def __init__(self, start: int):
        self.start = start                # index of the object's "{"
        self.pos = start                  # next index to look at
        self.depth = 0
        self.in_string = False
        self.expect = "open"              # open, key, keystr, colon, value, valstr, valscalar, valnest, comma
        self.key = ""
        self.key_start = -1
        self.value_start = -1
        self.open_key: str | None = None  # member whose value is being read
        self.members: dict[str, tuple[int, int]] = {}   # key -> value span (first occurrence)
        self.end = -1                     # index after the closing "}", once seen
        self.broken = False

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end < 0 and not self.broken:
            if self.in_string:
                m = _STRING_STOP.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if text[i] == "\\":
                    if i + 1 >= n:
                        break             # what it escapes is not here yet
                    i += 2
                    continue
                self.in_string = False
                self._string_closed(text, i)
            else:
                self._char(text, i)
            i += 1
        self.pos = i

    def _string_closed(self, text: str, i: int) -> None:
        if self.depth != 1:
            return
        if self.expect == "keystr":
            try:
                self.key = strict_json(text[self.key_start:i + 1])
            except ValueError:
                self.broken = True
            self.expect = "colon"
        elif self.expect == "valstr":
            self._close_value(i + 1)

    def _close_value(self, end: int) -> None:
        self.members.setdefault(self.open_key, (self.value_start, end))
        self.open_key = None
        self.expect = "comma"

    def _char(self, text: str, i: int) -> None:
        c = text[i]
        if self.depth == 0:
            if c == "{":
                self.depth, self.expect = 1, "key"
            else:
                self.broken = True
            return
        if self.depth >= 2:
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._close_value(i + 1)
            return
        if self.expect == "valscalar":
            if not (c in ",}" or c.isspace()):
                return
            self._close_value(i)
        if c.isspace():
            return
        e = self.expect
        if e == "key" and c == '"':
            self.in_string, self.key_start, self.expect = True, i, "keystr"
        elif e in ("key", "comma") and c == "}":
            self.depth, self.end = 0, i + 1
        elif e == "colon" and c == ":":
            self.expect = "value"
        elif e == "comma" and c == ",":
            self.expect = "key"
        elif e == "value" and c not in ",:}]":
            self.open_key, self.value_start = self.key, i
            if c == '"':
                self.in_string, self.expect = True, "valstr"
            elif c in "{[":
                self.depth, self.expect = 2, "valnest"
            else:
                self.expect = "valscalar"
        else:
            self.broken = True


class _JsonCall:
    """One call written as a JSON object ``{"name": ..., "arguments": ...}``
    (or ``"parameters"``), starting at index `start` of the parser's buffer:
    sends its first delta once the name is known and accepted, then the
    arguments object's text as it arrives."""

    def __init__(self, parser: ToolParser, start: int):
        self.parser = parser
        self.scanner = _JsonObjectScanner(start)
        self.index: int | None = None
        self.name: str | None = None
        self.argument_key: str | None = None
        self.sent = 0                     # characters of the arguments sent

    def advance(self, text: str) -> str:
        """Read `text` (the buffer, grown); returns "more", "done" or "bad"."""
        s = self.scanner
        s.scan(text)
        if s.broken:
            return "bad"
        if self.name is None and "name" in s.members:
            a, b = s.members["name"]
            try:
                name = strict_json(text[a:b])
            except ValueError:
                return "bad"
            if not isinstance(name, str) or not self.parser.accepts(name):
                return "bad"
            self.name = name
            self.index = self.parser._start_call(name)
        if self.argument_key is None:
            keys = [*s.members, s.open_key]
            self.argument_key = next((k for k in keys if k in _ARGUMENT_KEYS), None)
        if self.index is not None and self.argument_key is not None:
            a, b = s.members.get(self.argument_key, (s.value_start, s.pos))
            if text[a] == "{":            # an object: its raw text is the arguments
                self.parser._send_arguments(self.index, text[a + self.sent:b])
                self.sent = b - a
        return "more" if s.end < 0 else self._complete(text)

    def _complete(self, text: str) -> str:
        s = self.scanner
        try:
            whole = strict_json(text[s.start:s.end])
        except ValueError:
            return "bad"
        if self.index is None or whole.get("name") != self.name:
            return "bad"
        value = whole.get(self.argument_key)
        if self.argument_key is None or value is None:
            arguments = "{}"
        elif isinstance(value, dict):
            a, b = s.members[self.argument_key]
            arguments = text[a:b]
            if strict_json(arguments) != value:    # a repeated key: json kept the last
                return "bad"
        elif isinstance(value, str) and not value.strip():
            arguments = "{}"
        elif isinstance(value, str):
            try:
                unwrapped = strict_json(value)
            except ValueError:
                return "bad"
            if not isinstance(unwrapped, dict):
                return "bad"
            arguments = value.strip()
        else:
            return "bad"
        self.parser._send_arguments(self.index, arguments[self.sent:])
        self.parser._end_call(self.index, arguments)
        return "done"


class _JsonFormatParser(ToolParser):
    """The state the JSON formats share: a call's JSON object being read."""

    _on_malformed = "content_rest"        # the state a malformed call leads to

    def __init__(self, tool_names: Collection[str] | None = None,
                 new_id: Callable[[], str] | None = None):
        super().__init__(tool_names, new_id)
        self._json: _JsonCall | None = None
        self._after_call = False          # no content since the last call

    def _begin_call(self, at: int) -> bool:
        self._json, self._state = _JsonCall(self, at), "call"
        return True

    def _call(self, final: bool) -> bool:
        result = self._json.advance(self._buf)
        if result == "more" and not final:
            return False
        if result == "done":
            self._buf = self._buf[self._json.scanner.end:]
            self._state, self._after_call = "after", True
        else:
            self._abandon(self._json.index)
            self._state = self._on_malformed
        self._json = None
        return True

class HermesToolParser(_JsonFormatParser):
    """Hermes' / Qwen's format: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    blocks anywhere in the text (NousResearch Hermes-Function-Calling; the
    Qwen 2.5 / Qwen3 chat templates). A block holding several JSON objects
    is several calls; a block whose close tag is missing ends with its JSON
    object. A malformed block is content up to and including its
    ``</tool_call>`` (or up to the next ``<tool_call>``)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _on_malformed = "malformed"

    def __init__(self, tool_names: Collection[str] | None = None,
                 new_id: Callable[[], str] | None = None):
        super().__init__(tool_names, new_id)
        self._state = "text"
        self._body_at = 0                 # where the current block's body starts in the buffer

    def _text(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(self.OPEN)
        if i >= 0:
            # The whitespace before the tag is dropped with the call, kept if it is malformed.
            j = len(buf[:i].rstrip())
            self._emit_text(buf[:j])
            self._buf, self._state = buf[j:], "tag"
            return True
        if final:
            if buf.strip() or not self._after_call:
                self._emit_text(buf)
            self._buf = ""
            return False
        # Hold back what may be the start of a tag, and whitespace that may precede one.
        safe = len(buf[:len(buf) - held_suffix(buf, self.OPEN)].rstrip())
        self._emit_text(buf[:safe])
        self._buf = buf[safe:]
        return False

    def _emit_text(self, text: str) -> None:
        if text:
            self._emit(text)
            self._after_call = False

    def _tag(self, final: bool) -> bool:
        """The buffer is whitespace and the open tag; a JSON object should follow."""
        self._body_at = self._buf.index(self.OPEN) + len(self.OPEN)
        body = self._buf[self._body_at:].lstrip()
        if not body and not final:
            return False
        if body.startswith("{"):
            return self._begin_call(len(self._buf) - len(body))
        self._state = "malformed"
        return True

    def _malformed(self, final: bool) -> bool:
        """The buffer starts a malformed block (its body at self._body_at):
        content up to its end."""
        buf = self._buf
        ends = [(j + len(self.CLOSE)) for j in [buf.find(self.CLOSE, self._body_at)] if j >= 0]
        ends += [j for j in [buf.find(self.OPEN, self._body_at)] if j >= 0]
        if ends:
            end = min(ends)
            self._emit_text(buf[:end])
            self._buf, self._state = buf[end:], "text"
            return True
        if final:
            self._emit_text(buf)
            self._buf = ""
            return False
        safe = max(self._body_at, len(buf) - max(held_suffix(buf, self.CLOSE),
                                                  held_suffix(buf, self.OPEN)))
        self._emit_text(buf[:safe])
        self._buf, self._body_at = buf[safe:], 0
        return False

    def _after(self, final: bool) -> bool:
        """Just after a call's JSON object: the close tag, another object, or text."""
        rest = self._buf.lstrip()
        if rest.startswith(self.CLOSE):
            self._buf, self._state = rest[len(self.CLOSE):], "text"
        elif rest.startswith("{"):
            self._buf, self._body_at = rest, 0
            return self._begin_call(0)
        elif not rest or self.CLOSE.startswith(rest):
            if not final:
                return False
            self._buf = ""                # only the (cut off) close tag was left
            return False
        else:
            self._state = "text"
        return True


class Llama3JsonToolParser(_JsonFormatParser):
    """Meta's Llama 3.1 / 3.2 / 3.3 JSON tool calling ("Model Cards & Prompt
    formats": JSON based tool calling): the output is ``{"name": ...,
    "parameters": {...}}`` (``"arguments"`` also accepted), optionally after
    ``<|python_tag|>``, calls separated by ``;`` (or just whitespace). Only an
    output that starts (after whitespace and the tag) with ``{`` is read as
    calls; any other output is content, unchanged. A JSON object that is not
    a call (no string ``name``) is content, as is everything after it; so is
    text after the last call."""

    PYTHON_TAG = "<|python_tag|>"

    def _start(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        elif self.PYTHON_TAG.startswith(body):        # "" or a prefix of the tag
            if not final:
                return False
            body = ""
        if body.startswith("{"):
            return self._begin_call(len(self._buf) - len(body))
        if not body and not final:
            return False
        self._state = "content_rest"
        return True

    def _after(self, final: bool) -> bool:
        """After a call: ``;`` and the next call, or the rest is content."""
        body = self._buf.lstrip()
        if body.startswith(";"):
            body = body[1:].lstrip()
        if body.startswith("{"):
            self._buf = body
            return self._begin_call(0)
        if body:
            self._state = "content_rest"
            return True
        if final:
            self._buf = ""                # separators only
        return False
