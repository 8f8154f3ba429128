"""Tool calls in a model's generated text, found as it streams.

A parser is fed the generated text delta by delta (as the detokenizer yields
it) and splits it into plain content and tool calls, the latter as OpenAI's
streamed ``tool_calls`` deltas; after :meth:`ToolParser.finish`,
:attr:`ToolParser.calls` holds the complete calls for a non-streamed reply.
One class per model family's format (:data:`TOOL_PARSERS`):

- ``hermes``: Hermes' / Qwen's function-calling format (NousResearch
  Hermes-Function-Calling; Qwen 2.5 and Qwen3 chat templates): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; any
  number of them, with content before, between or after.
- ``llama3_json``: Meta's Llama 3.1 / 3.2 / 3.3 JSON tool calling ("Model
  Cards & Prompt formats", JSON based tool calling): the whole output is
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too),
  optionally after ``<|python_tag|>``, several calls separated by ``;``.
- ``pythonic``: Google's Gemma function-calling docs and Llama 3.2 / 4's
  pythonic format: the whole output is a Python list of calls with keyword
  arguments, ``[get_weather(city="Paris"), get_time()]``, optionally in a
  ```` ```tool_code ```` fence.

The rules all formats share:

- The result does not depend on how the text is chunked: the same text fed
  in any deltas gives the same ``calls`` and the same concatenated content.
  A decision that needs text not yet seen (``<tool_`` at the end of a delta,
  an output that so far is only whitespace) waits for it.
- A call's first delta carries its ``index``, ``id`` and ``name`` with
  ``arguments=""``; later deltas carry argument fragments, which concatenated
  equal :attr:`ToolCall.arguments`. ``index`` counts the calls of the
  completion whose first delta was sent (0, 1, ...).
- ``arguments`` is JSON text of an object. In the JSON formats it is the
  arguments object's text exactly as the model wrote it (no re-serialising),
  so its fragments stream as they arrive; an arguments value given as a JSON
  string holding an object (``"arguments": "{\\"a\\": 1}"``) is unwrapped to
  that string's text (sent in one fragment when the string closes); a
  missing, ``null``, ``{}`` or empty-string value is ``"{}"``. In the
  pythonic format it is ``json.dumps(kwargs, ensure_ascii=False)`` of the
  literal keyword arguments (``", "`` and ``": "`` separators), sent in one
  fragment when the call's text is complete; ``g()`` is ``"{}"``.
- A malformed call is content, never an exception: its raw text (tags
  included) is returned as content. Malformed means invalid JSON (``NaN``
  included), no string ``name``, a name not in ``tool_names`` (when given),
  arguments that are not an object, or (pythonic) positional or non-literal
  arguments. So is the text of a call that is unfinished at :meth:`finish`,
  unless its JSON object (or pythonic call) is already complete, which then
  is a call. A JSON call's first delta is sent as soon as its name is known,
  and its arguments stream, so a call can turn out malformed (invalid JSON
  later on, or cut off by ``max_tokens``) after deltas for it were sent: its
  index is then listed in :attr:`ToolParser.abandoned`, its text comes back
  as content, and the next call takes the next index (indexes are not
  reused). Pythonic calls are only sent once complete and never abandoned.
- Whitespace that only separates calls (before a ``<tool_call>`` tag, around
  ``;``, after the last call when nothing else follows) is dropped; any other
  text outside calls is content, unchanged.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass
from typing import Callable, Collection


@dataclass
class ToolCall:
    """A complete tool call.

    ``id`` is ``"call_"`` and 24 hex digits (from the parser's ``new_id``);
    ``arguments`` is JSON text of an object, ``"{}"`` for a call without
    parameters.
    """

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """One piece of OpenAI's streamed ``tool_calls`` delta.

    ``index``: the call's position among this completion's calls. ``id`` and
    ``name`` are set on the call's first delta only (whose ``arguments`` is
    ``""``), ``None`` on the rest, whose ``arguments`` are fragments.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


def new_call_id() -> str:
    """A fresh tool call id: ``"call_"`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def _held_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of
    `marker` (text that may yet turn out to be the marker)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_strict_json = json.JSONDecoder(parse_constant=_reject_constant).decode
"""``json.loads`` without the ``NaN`` / ``Infinity`` extension."""


class ToolParser:
    """Splits a model's generated text into content and tool calls, as it
    streams (see the module docstring for the formats and the rules).

    `tool_names`: the request's function names; a call naming another is
    content. ``None`` accepts any name. `new_id`: makes call ids
    (:func:`new_call_id` by default; tests pass a deterministic one).

    Attributes: ``calls`` (list[ToolCall]): the complete calls so far, in
    order, all of them after :meth:`finish`; ``abandoned`` (list[int]): the
    indexes of calls whose deltas were sent but which then turned out
    malformed or unfinished (their text was returned as content instead).
    """

    def __init__(self, tool_names: Collection[str] | None = None,
                 new_id: Callable[[], str] | None = None):
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.calls: list[ToolCall] = []
        self.abandoned: list[int] = []
        self._new_id = new_id or new_call_id
        self._buf = ""                    # text seen but not yet emitted or consumed
        self._state = "start"
        self._content: list[str] = []     # output of the current feed()/finish()
        self._deltas: list[ToolCallDelta] = []
        self._open: dict[int, tuple[str, str]] = {}   # index -> (id, name) of calls being sent
        self._next_index = 0
        self._finished = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next generated text; returns (content safe to emit now,
        tool call deltas). Raises RuntimeError after :meth:`finish`."""
        if self._finished:
            raise RuntimeError("ToolParser.feed() after finish()")
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: returns what was held back, as content or the
        deltas of a call that is complete now. Later calls return nothing."""
        if self._finished:
            return "", []
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        while getattr(self, "_" + self._state)(final):
            pass
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    # Each state handler reads self._buf and returns True when it changed the
    # state (run the next handler), False when it needs more text.

    def _content_rest(self, final: bool) -> bool:
        """Everything from here on is content."""
        self._emit(self._buf)
        self._buf = ""
        return False

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def accepts(self, name: str) -> bool:
        """Whether a call may name function `name` (it is one of ``tool_names``)."""
        return self.tool_names is None or name in self.tool_names

    def _start_call(self, name: str) -> int:
        index, call_id = self._next_index, self._new_id()
        self._next_index += 1
        self._open[index] = (call_id, name)
        self._deltas.append(ToolCallDelta(index, call_id, name, ""))
        return index

    def _send_arguments(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == index and last.id is None:
            last.arguments += fragment
        else:
            self._deltas.append(ToolCallDelta(index, None, None, fragment))

    def _end_call(self, index: int, arguments: str) -> None:
        call_id, name = self._open.pop(index)
        self.calls.append(ToolCall(call_id, name, arguments))

    def _abandon(self, index: int | None) -> None:
        if index is not None:
            self._open.pop(index)
            self.abandoned.append(index)


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
                self.key = _strict_json(text[self.key_start:i + 1])
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
                name = _strict_json(text[a:b])
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
            whole = _strict_json(text[s.start:s.end])
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
            if _strict_json(arguments) != value:    # a repeated key: json kept the last
                return "bad"
        elif isinstance(value, str) and not value.strip():
            arguments = "{}"
        elif isinstance(value, str):
            try:
                unwrapped = _strict_json(value)
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
        safe = len(buf[:len(buf) - _held_suffix(buf, self.OPEN)].rstrip())
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
        safe = max(self._body_at, len(buf) - max(_held_suffix(buf, self.CLOSE),
                                                  _held_suffix(buf, self.OPEN)))
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


_IDENTIFIER = re.compile(r"[^\W\d]\w*")


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.expr):
    """The JSON value a literal expression stands for (``true`` / ``false`` /
    ``null`` accepted as well); raises _NotLiteral for anything else."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    raise _NotLiteral(ast.dump(node))


def _pythonic_call(text: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of one call ``f(a=1, b="x")`` with literal
    keyword arguments; None when `text` is anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(kw.arg is None for kw in node.keywords):    # **kwargs
        return None
    try:
        kwargs = {kw.arg: _literal(kw.value) for kw in node.keywords}
        return node.func.id, json.dumps(kwargs, ensure_ascii=False, allow_nan=False)
    except ValueError:                   # _NotLiteral, or an infinite float
        return None


class _PythonicElement:
    """Finds where one element of a pythonic call list ends (the ``,`` or
    ``]`` after it, outside brackets and strings), checking on the way that it
    starts ``name(`` with an accepted name."""

    def __init__(self, parser: ToolParser, start: int):
        self.parser = parser
        self.start = self.pos = start
        self.depth = 0
        self.quote = ""                   # the open string's quote character
        self.called = False               # the "(" after the name was seen

    def scan(self, text: str) -> tuple[str, int]:
        """("more", -1), ("bad", -1), or (terminator "," / "]", its index)."""
        i, n = self.pos, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if c == "\\":
                    if i + 1 >= n:
                        break
                    i += 1
                elif c == self.quote:
                    self.quote = ""
            elif self.depth:
                if c in "\"'":
                    self.quote = c
                elif c in "([{":
                    self.depth += 1
                elif c in ")]}":
                    self.depth -= 1
            elif c in ",]":
                if self.called or (c == "]" and not text[self.start:i].strip()):
                    self.pos = i
                    return c, i
                return "bad", -1
            elif not self.called and c == "(":
                name = text[self.start:i].strip()
                if not _IDENTIFIER.fullmatch(name) or not self.parser.accepts(name):
                    return "bad", -1
                self.called, self.depth = True, 1
            elif not (c.isspace() or (not self.called and (c.isalnum() or c == "_"))):
                return "bad", -1
            i += 1
        self.pos = i
        return "more", -1


class PythonicToolParser(ToolParser):
    """The pythonic format of Google's Gemma function-calling docs and of
    Llama 3.2 / Llama 4: the output is a Python list of calls with literal
    keyword arguments, ``[get_weather(city="Paris"), get_time()]``, optionally
    in a ```` ```tool_code ```` fence. Only an output that starts (after
    whitespace and the fence) with ``[`` is read as calls; any other output is
    content, unchanged. Each call is sent (first delta, then its arguments in
    one fragment) once its text is complete. From the first element that is
    not a valid call (positional or non-literal arguments, an unknown name,
    not a call at all) on, the text is content; text after the list is
    content too."""

    FENCE_OPEN, FENCE_CLOSE = "```tool_code", "```"

    def __init__(self, tool_names: Collection[str] | None = None,
                 new_id: Callable[[], str] | None = None):
        super().__init__(tool_names, new_id)
        self._fenced = False
        self._element: _PythonicElement | None = None

    def _start(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(self.FENCE_OPEN):
            rest = body[len(self.FENCE_OPEN):]
            body = rest.lstrip()
            if rest[:1].isspace() and body.startswith("["):
                self._fenced = True
            elif rest and not rest.isspace():
                body = "content"
        elif self.FENCE_OPEN.startswith(body):        # "" or a prefix of the fence
            body = ""
        if body.startswith("["):
            self._element = _PythonicElement(self, len(self._buf) - len(body) + 1)
            self._state = "list"
            return True
        if not body and not final:
            return False
        self._state = "content_rest"
        return True

    def _list(self, final: bool) -> bool:
        element = self._element
        result, at = element.scan(self._buf)
        if result == "more" and final and element.called and not element.depth:
            result, at = "]", len(self._buf)           # a complete call, the list cut off
        if result == "more" and not final:
            return False
        if result in (",", "]"):
            call = _pythonic_call(self._buf[element.start:at])
            if call is not None:
                index = self._start_call(call[0])
                self._send_arguments(index, call[1])
                self._end_call(index, call[1])
            elif element.called:
                result = "bad"
        if result in (",", "]"):
            self._buf = self._buf[at + 1:]
            if result == ",":
                self._element = _PythonicElement(self, 0)
            else:
                self._state = "end"
            return True
        # Malformed or cut off: the text from this element on (all of it if
        # no call was sent) is content.
        self._state = "content_rest"
        return True

    def _end(self, final: bool) -> bool:
        """After the list: the closing fence, then any text is content."""
        body = self._buf.lstrip()
        if self._fenced and body.startswith(self.FENCE_CLOSE):
            self._buf, self._fenced = body[len(self.FENCE_CLOSE):], False
            return True
        if body and not (self._fenced and self.FENCE_CLOSE.startswith(body)):
            self._state = "content_rest"
            return True
        if final:
            self._buf = ""                # whitespace, a cut off fence
        return False


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}
"""The tool call formats by name (the names vLLM's ``--tool-call-parser`` uses)."""


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class (a factory taking ``tool_names``, ``new_id``) of
    format `name`; raises ValueError naming the known formats."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
