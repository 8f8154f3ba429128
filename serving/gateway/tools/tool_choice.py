"""Forced tool calls: ``tool_choice`` "required" or a named function, generated
under a JSON schema (structured output), whatever the model's own call format.

As vLLM does, a forced call does not rely on the model choosing its own call
syntax: the output is constrained to JSON and parsed as such.

- A named function: the output *is* its arguments object, under the
  function's ``parameters`` schema (:func:`named_schema`).
- "required": the output is a JSON array of at least one
  ``{"name": <one of the tools>, "parameters": {...}}`` object, each under its
  function's schema (at most one item when ``parallel_tool_calls`` is false;
  :func:`required_schema`).

The parsers have the interface of ``serving.gateway.tools.tool_parsers``'s (``feed``, ``finish``,
``calls``), so the chat output treats them alike. Their ``arguments`` are the
JSON text as generated (llguidance writes it compactly, with ", " and ": "
separators), streamed as it arrives for a named function and one whole
fragment per call for "required".
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from serving.gateway.tools.tool_parsers import ToolCall, ToolCallDelta, new_call_id
from serving.gateway.tools.tool_protocol import FunctionDefinition


def named_schema(function: FunctionDefinition) -> str:
    """The JSON schema (as text) of a forced call of `function`: its arguments object."""
    return json.dumps(function.schema())


def required_schema(functions: Sequence[FunctionDefinition], parallel: bool) -> str:
    """The JSON schema (as text) of "required": a non-empty array of calls of `functions`
    (at most one unless `parallel`)."""
    items = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.schema()},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


class NamedCallParser:
    """The output of a forced named call: the whole text is the call's arguments.

    Args:
      name: the function forced.
      new_id: makes the call's id (default :func:`new_call_id`).
    """

    def __init__(self, name: str, new_id: Callable[[], str] | None = None) -> None:
        self.name = name
        self.id = (new_id or new_call_id)()
        self.calls: list[ToolCall] = []
        self.abandoned: list[int] = []  # the schema keeps the call well formed: never set
        self._args: list[str] = []
        self._opened = False

    def _header(self) -> list[ToolCallDelta]:
        if self._opened:
            return []
        self._opened = True
        return [ToolCallDelta(index=0, id=self.id, name=self.name, arguments="")]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """No content; the call's header on the first text, then argument fragments."""
        if not text:
            return "", []
        self._args.append(text)
        return "", self._header() + [ToolCallDelta(index=0, id=None, name=None, arguments=text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The call, complete (arguments "{}" when nothing was generated)."""
        deltas = self._header()
        args = "".join(self._args).strip()
        if not args:
            args = "{}"
            deltas.append(ToolCallDelta(index=0, id=None, name=None, arguments=args))
        if not self.calls:
            self.calls.append(ToolCall(id=self.id, name=self.name, arguments=args))
        return "", deltas


class RequiredCallsParser:
    """The output of ``tool_choice: "required"``: a JSON array of
    ``{"name", "parameters"}`` objects; each call comes out once its object is complete.

    Args:
      new_id: makes each call's id (default :func:`new_call_id`).
    """

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self.new_id = new_id or new_call_id
        self.calls: list[ToolCall] = []
        self.abandoned: list[int] = []  # calls come out whole: never set
        self._buf = ""
        self._pos: int | None = None  # where the next array item starts (after "[" or ",")
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """No content; each call's header and whole arguments once its object closed."""
        self._buf += text
        deltas: list[ToolCallDelta] = []
        if self._pos is None:
            start = self._buf.find("[")
            if start < 0:
                return "", []
            self._pos = start + 1
        while True:
            rest = self._buf[self._pos:]
            stripped = rest.lstrip(" \n\t\r,")
            if not stripped.startswith("{"):
                return "", deltas
            at = self._pos + len(rest) - len(stripped)
            try:
                item, end = self._decoder.raw_decode(self._buf, at)
            except ValueError:
                return "", deltas  # the object is not complete yet
            self._pos = end
            deltas += self._call(item)

    def _call(self, item: Any) -> list[ToolCallDelta]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        params = item.get("parameters")
        args = json.dumps(params if isinstance(params, dict) else {}, ensure_ascii=False)
        call = ToolCall(id=self.new_id(), name=item["name"], arguments=args)
        index = len(self.calls)
        self.calls.append(call)
        return [ToolCallDelta(index=index, id=call.id, name=call.name, arguments=""),
                ToolCallDelta(index=index, id=None, name=None, arguments=args)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Nothing further: calls come out as their objects close."""
        return "", []
