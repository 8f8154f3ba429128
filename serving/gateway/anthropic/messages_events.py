"""The Messages API's output: a chat run's deltas as content blocks and streamed events.

:class:`MessageAssembler` reads the chunks of a
:class:`~serving.gateway.openai.chat_run.ChatRun` (one choice) and builds the
message's ``content`` blocks in the order the model produced them, with the
stream's events (Anthropic's names and order) on the way:

* ``message_start`` (the message, ``content`` empty, ``usage.input_tokens`` set), ``ping``;
* per block ``content_block_start`` (``index``, the empty block), its deltas, then
  ``content_block_stop``:

  - ``thinking`` (shown only when the request enabled ``thinking``): ``thinking_delta``;
  - ``text``: ``text_delta``;
  - ``tool_use`` (``id``, ``name``, ``input: {}``): ``input_json_delta`` with
    ``partial_json`` pieces of the arguments;

* ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``), ``message_stop``;
  after an error mid-way, an ``error`` event instead.

Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from
the prefix cache, ``cache_read_input_tokens`` those that were (so the ledger's
``prompt_tokens`` is their sum), ``cache_creation_input_tokens`` 0, and
``output_tokens`` every generated token (thinking included).

``stop_reason``: ``tool_use`` when the model called tools, ``max_tokens`` at the
limit, ``stop_sequence`` (with ``stop_sequence`` the one matched) when a stop
sequence ended it, else ``end_turn``. Non-streamed messages are built by the same
assembler (its events dropped), so they are exactly what the stream reassembles
to. Whitespace alone opens no text block (it joins the text that follows it, if any).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from serving.gateway.schema.response_models import ChatCompletionChunk, Usage

logger = logging.getLogger("xlaserve.gateway")

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def anthropic_usage(u: Usage) -> dict[str, int]:
    """Anthropic's usage from a chat completion's (see the module docstring)."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
    return {"input_tokens": u.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": u.completion_tokens}


def stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    """Anthropic's ``stop_reason`` for chat's `finish_reason` and the stop string matched."""
    if finish_reason == "stop" and stop_string is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason or "", "end_turn")


class MessageObject(BaseModel):
    """Anthropic's message object (the schema the OpenAPI document shows)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, Any]


class MessageStreamEvent(BaseModel):
    """One streamed event: ``event: <type>`` and this JSON as ``data``."""

    model_config = ConfigDict(extra="allow")
    type: str


class MessageAssembler:
    """Builds a message and its events from chat chunks (see the module docstring).

    Args:
      message_id: the message's ``id`` (the ledger row's request id).
      model: the model name as the request gave it.
      show_thinking: return reasoning as ``thinking`` blocks (else it is dropped).
    """

    def __init__(self, message_id: str, model: str, show_thinking: bool) -> None:
        self.message: dict[str, Any] = {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": None}
        self.show_thinking = show_thinking
        self._open: str | None = None  # the kind of the open block
        self._pending_ws = ""
        self._calls: dict[int, int] = {}  # tool-call index -> block index
        self._args: dict[int, list[str]] = {}  # block index -> argument pieces

    @property
    def content(self) -> list[dict[str, Any]]:
        return self.message["content"]

    def start(self, usage: Usage) -> list[dict[str, Any]]:
        """``message_start`` (with the input usage) and a ``ping``."""
        self.message["usage"] = {**anthropic_usage(usage), "output_tokens": 0}
        return [{"type": "message_start", "message": dict(self.message, content=[])}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _open_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.content.append(block)
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": len(self.content) - 1,
                       "content_block": dict(block)})
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open != "text":
            if not text.strip():
                self._pending_ws += text
                return []
            events += self._open_block({"type": "text", "text": ""})
            text, self._pending_ws = self._pending_ws + text, ""
        self.content[-1]["text"] += text
        events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                       "delta": {"type": "text_delta", "text": text}})
        return events

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open != "thinking":
            events += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
        self.content[-1]["thinking"] += text
        events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                       "delta": {"type": "thinking_delta", "thinking": text}})
        return events

    def _tool(self, call) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if call.id is not None and call.index not in self._calls:
            self._pending_ws = ""
            events += self._open_block({"type": "tool_use", "id": call.id,
                                        "name": call.function.name if call.function else "", "input": {}})
            self._calls[call.index] = len(self.content) - 1
            self._args[len(self.content) - 1] = []
        k = self._calls.get(call.index)
        piece = call.function.arguments if call.function is not None else None
        if k is not None and piece:
            self._args[k].append(piece)
            events.append({"type": "content_block_delta", "index": k,
                           "delta": {"type": "input_json_delta", "partial_json": piece}})
        return events

    def feed(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        """The events of one chat chunk (choice 0)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.choices:
            d = choice.delta
            if d.reasoning_content and self.show_thinking:
                events += self._thinking(d.reasoning_content)
            if d.content:
                events += self._text(d.content)
            for call in d.tool_calls or ():
                events += self._tool(call)
        return events

    def drop_calls(self, abandoned: list[int]) -> None:
        """Removes the ``tool_use`` blocks of calls the parser gave back as text (their
        text came as content); only the non-streamed message can still lose them."""
        drop = {self._calls[i] for i in abandoned if i in self._calls}
        if drop:
            self.message["content"] = [b for k, b in enumerate(self.content) if k not in drop]

    def finish(self, finish_reason: str | None, stop_string: str | None, usage: Usage) -> list[dict[str, Any]]:
        """Closes the open block; the tool calls' inputs parsed; ``message_delta`` and
        ``message_stop``."""
        events = self._close()
        for k, pieces in self._args.items():
            text = "".join(pieces) or "{}"
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                logger.warning("message %s: tool_use arguments are not a JSON object: %.200r",
                               self.message["id"], text)
                value = {}
            if k < len(self.content) and self.content[k]["type"] == "tool_use":
                self.content[k]["input"] = value
        reason = stop_reason(finish_reason, stop_string)
        self.message["stop_reason"] = reason
        self.message["stop_sequence"] = stop_string if reason == "stop_sequence" else None
        self.message["usage"] = anthropic_usage(usage)
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": self.message["stop_sequence"]},
                       "usage": dict(self.message["usage"])})
        events.append({"type": "message_stop"})
        return events
