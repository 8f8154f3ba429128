"""The pythonic tool call format (Gemma 3, Llama 3.2 / 4): a Python list of
calls with literal keyword arguments, read with Python's own parser (``ast``)."""

from __future__ import annotations

import ast
import json
import re
from typing import Callable, Collection

from serving.gateway.tools.tool_parsers.base import ToolParser

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
        fenced = body.startswith(self.FENCE_OPEN)
        if fenced:
            rest = body[len(self.FENCE_OPEN):]
            if rest and not rest[0].isspace():          # "```tool_codes": no fence
                self._state = "content_rest"
                return True
            body = rest.lstrip()
        elif self.FENCE_OPEN.startswith(body):        # "" or a prefix of the fence
            body = ""
        if body.startswith("["):
            self._fenced = fenced
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
