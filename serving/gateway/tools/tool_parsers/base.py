"""The parts every tool call format shares: the call and delta types, the
parser's interface and its emitting of content and deltas (see the package
docstring for the rules)."""

from __future__ import annotations

import json
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


def held_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of
    `marker` (text that may yet turn out to be the marker)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


strict_json = json.JSONDecoder(parse_constant=_reject_constant).decode
"""``json.loads`` without the ``NaN`` / ``Infinity`` extension."""


class ToolParser:
    """Splits a model's generated text into content and tool calls, as it
    streams (see :mod:`serving.gateway.tools.tool_parsers` for the formats and the rules).

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
