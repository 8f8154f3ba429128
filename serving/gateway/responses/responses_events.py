"""The Responses API's output: a chat run's deltas as output items and typed events.

:class:`ResponseAssembler` reads the chunks of a
:class:`~serving.gateway.openai.chat_run.ChatRun` (one choice) and builds the
response's ``output`` items in the order the model produced them, with the
stream's typed events (OpenAI's names and fields) on the way:

* ``response.created``, ``response.in_progress`` (the response, ``in_progress``),
* per item ``response.output_item.added``, then its deltas, then
  ``response.output_item.done``:

  - ``reasoning`` (the thinking): ``response.content_part.added`` (a
    ``reasoning_text`` part), ``response.reasoning_text.delta`` /
    ``.done``, ``response.content_part.done``;
  - ``message`` (the answer): ``response.content_part.added`` (an
    ``output_text`` part), ``response.output_text.delta`` / ``.done``,
    ``response.content_part.done``;
  - ``function_call``: ``response.function_call_arguments.delta`` /
    ``.done`` (the whole arguments, and the name);

* ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens``
  cut it: ``incomplete_details.reason`` "max_output_tokens"), with usage; after
  an error, an ``error`` event and ``response.failed``.

Every event carries a ``sequence_number`` (0, 1, ...). Non-streamed responses
are built by the same assembler (its events dropped), so a stored or
non-streamed response is exactly what the stream reassembles to. Whitespace
between items, or after the last one, opens no message item (nor starts one).
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from serving.gateway.schema.response_models import ChatCompletionChunk, Usage

TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def new_item_id(prefix: str) -> str:
    """A fresh output item id: ``msg_…``, ``rs_…``, ``fc_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(u: Usage) -> dict[str, Any]:
    """The Responses API's usage from a chat completion's."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
    reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details is not None else 0
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponseObject(BaseModel):
    """OpenAI's response object (the schema the OpenAPI document shows; output
    items and usage as the Responses API writes them)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "response"
    created_at: float
    model: str
    status: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One streamed event: ``event: <type>`` and ``data: <this JSON>``."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseAssembler:
    """Builds one response from a chat run's chunks.

    Args:
      response: the response object so far (id, created_at, model, the echoed
        request fields; ``status`` "in_progress", ``output`` []); completed in
        place.
    """

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = response["output"]
        self.seq = 0
        self._open: dict[str, Any] | None = None  # the item whose deltas are streaming
        self._text: list[str] = []  # the open item's text (reasoning or answer)
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._spaces = ""  # whitespace-only answer text not yet given an item

    # ------------------------------------------------------------- events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    # -------------------------------------------------------------- items

    def _index(self) -> int:
        return len(self.output) - 1

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close("completed")
        self.output.append(item)
        self._open, self._text = item, []
        out.append(self._event("response.output_item.added", output_index=self._index(),
                               item=copy.deepcopy(item)))
        if item["type"] in ("message", "reasoning"):
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self._index(), content_index=0, part=self._part(item, "")))
        return out

    @staticmethod
    def _part(item: dict[str, Any], text: str) -> dict[str, Any]:
        if item["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        idx, iid = self.output.index(item), item["id"]
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=iid, output_index=idx,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            text = "".join(self._text)
            part = self._part(item, text)
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(self._event(kind, item_id=iid, output_index=idx, content_index=0, text=text, **extra))
            out.append(self._event("response.content_part.done", item_id=iid, output_index=idx,
                                   content_index=0, part=part))
            item["content"] = [part]
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=idx, item=copy.deepcopy(item)))
        return out

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open["type"] != kind:
            item = ({"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                     "status": "in_progress"} if kind == "reasoning" else
                    {"id": new_item_id("msg"), "type": "message", "role": "assistant", "content": [],
                     "status": "in_progress"})
            out += self._open_item(item)
        self._text.append(text)
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(event, item_id=self._open["id"], output_index=self._index(),
                               content_index=0, delta=text, **extra))
        return out

    def _answer(self, text: str) -> list[dict[str, Any]]:
        if self._open is None or self._open["type"] != "message":
            if not (self._spaces + text).strip():  # no item for whitespace alone (yet)
                self._spaces += text
                return []
            text, self._spaces = self._spaces + text, ""
            if self.output:  # whitespace between items separates them
                text = text.lstrip()
        return self._text_delta("message", text)

    def feed(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        """The events of one chat chunk (choice 0)."""
        out: list[dict[str, Any]] = []
        for choice in chunk.choices:
            d = choice.delta
            if d.reasoning_content:
                out += self._text_delta("reasoning", d.reasoning_content)
            if d.content:
                out += self._answer(d.content)
            for tc in d.tool_calls or ():
                item = self._calls.get(tc.index)
                if item is None:
                    self._spaces = ""
                    item = {"id": new_item_id("fc"), "type": "function_call", "call_id": tc.id,
                            "name": tc.function.name if tc.function else "", "arguments": "",
                            "status": "in_progress"}
                    self._calls[tc.index] = item
                    out += self._open_item(item)
                args = tc.function.arguments if tc.function is not None else None
                if args:
                    item["arguments"] += args
                    out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=self.output.index(item), delta=args))
        return out

    # ---------------------------------------------------------------- end

    def drop_calls(self, indexes: list[int]) -> list[dict[str, Any]]:
        """Leaves out of the output the calls (by tool-call index) whose deltas were
        streamed but which then turned out malformed or unfinished: the parser gave
        their text as content instead (``ToolParser.abandoned``). Returns the events
        that close such a call if it is still open (``incomplete``)."""
        out: list[dict[str, Any]] = []
        for i in indexes:
            item = self._calls.get(i)
            if item is not None and item in self.output:
                if self._open is item:
                    out += self._close("incomplete")
                self.output.remove(item)
        return out

    def finish(self, finish_reason: str | None, usage: Usage) -> list[dict[str, Any]]:
        """Closes the open item and the response: ``completed``, or ``incomplete``
        (finish_reason "length": ``max_output_tokens``; "content_filter")."""
        out: list[dict[str, Any]] = []
        if self._spaces and not self.output:  # the model answered only whitespace
            out += self._text_delta("message", self._spaces)
        incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(finish_reason or "")
        out += self._close("incomplete" if incomplete else "completed")
        r = self.response
        r["status"] = "incomplete" if incomplete else "completed"
        r["incomplete_details"] = {"reason": incomplete} if incomplete else None
        r["usage"] = response_usage(usage)
        r["completed_at"] = int(time.time()) if not incomplete else None
        out.append(self._event(f"response.{r['status']}", response=self._snapshot()))
        return out

    def fail(self, error: dict[str, Any], usage: Usage | None) -> list[dict[str, Any]]:
        """After an error: the open item closed ``incomplete``, an ``error`` event
        (`error`: OpenAI's error object) and ``response.failed``."""
        out = self._close("incomplete")
        r = self.response
        r["status"] = "failed"
        r["error"] = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        if usage is not None:
            r["usage"] = response_usage(usage)
        out.append(self._event("error", code=error.get("code"), message=error.get("message", ""),
                               param=error.get("param")))
        out.append(self._event("response.failed", response=self._snapshot()))
        return out
