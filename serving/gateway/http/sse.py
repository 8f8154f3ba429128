"""Server-sent events: how streamed responses are framed.

Each event is ``data: <compact JSON>\\n\\n``; a stream ends with
``data: [DONE]\\n\\n`` (OpenAI's convention). :func:`event_stream_response`
wraps an async iterator of such events in a response that cancels its work
when the client disconnects or stops reading.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from serving.gateway.http.disconnect import CancellingStreamingResponse

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream."""


def sse_event(payload: Any) -> str:
    """One SSE event carrying `payload` (anything ``json.dumps`` accepts) as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_typed_event(payload: dict[str, Any]) -> str:
    """One SSE event named after its payload's ``type`` (the Responses API's
    ``event: <type>`` / ``data: <JSON>``)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(',', ':'))
    return f"event: {payload['type']}\ndata: {data}\n\n"


def sse_chunk(chunk: Any, include_usage: bool) -> str:
    """One SSE event for a pydantic response chunk; its ``usage`` field is left
    out unless the client asked for usage (``stream_options.include_usage``)."""
    d = chunk.model_dump(mode="json")
    if not include_usage:
        d.pop("usage", None)
    return sse_event(d)


def event_stream_response(body: AsyncIterator[str], write_timeout: float | None = None,
                          on_write_timeout: Callable[[float], Awaitable[None]] | None = None) -> Response:
    """A ``text/event-stream`` response streaming `body` (SSE events, str),
    unbuffered, closing `body` when the client disconnects, or when a write
    does not complete within `write_timeout` seconds (after awaiting
    ``on_write_timeout(write_timeout)``); see :class:`CancellingStreamingResponse`."""
    return CancellingStreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        write_timeout=write_timeout,
        on_write_timeout=on_write_timeout,
    )
