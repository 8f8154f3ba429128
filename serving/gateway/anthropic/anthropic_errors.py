"""Anthropic's error shape on the Messages routes.

Every error of ``/v1/messages`` and ``/v1/messages/count_tokens`` is
``{"type": "error", "error": {"type": ..., "message": ...}}``, its ``type`` by status
as Anthropic's API has it:

====== =========================
status ``error.type``
====== =========================
400    ``invalid_request_error`` (also 415: the body is not JSON)
401    ``authentication_error``
403    ``permission_error``
404    ``not_found_error``
413    ``request_too_large``
429    ``rate_limit_error``
500    ``api_error``
529    ``overloaded_error`` (the engine's queue is full: 503 on the OpenAI routes)
====== =========================

The gateway's handlers raise OpenAI-shaped errors (``serving.gateway.http.errors``),
from wherever they arise: the body limit, authentication, validation, the engine's
admission, the catch-all. :class:`AnthropicErrorMiddleware` rewrites those
responses on the Messages paths, headers kept (``Retry-After``, rate limits), and
adds Anthropic's ``request-id`` header (the ``X-Request-ID``) to every response there.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
OVERLOADED_STATUS = 529

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          OVERLOADED_STATUS: "overloaded_error"}


class AnthropicErrorDetail(BaseModel):
    """The ``error`` object of an Anthropic error body."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""

    type: str = "error"
    error: AnthropicErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request (`invalid_request_error`).", 401: "Missing or unknown API key (`authentication_error`).",
    403: "Revoked key, or a model the key may not use (`permission_error`).",
    404: "Unknown model (`not_found_error`).", 413: "Request body too large (`request_too_large`).",
    415: "Content-Type is not `application/json` (`invalid_request_error`).",
    429: "Over a rate limit (`rate_limit_error`; `Retry-After`).",
    503: "The key database is unreachable (`api_error`; `Retry-After`).",
    529: "The engine is overloaded or draining (`overloaded_error`; `Retry-After`).",
}


def anthropic_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses`` entries: each of `statuses` with an :class:`AnthropicErrorResponse` body."""
    return {s: {"model": AnthropicErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for `status`."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai(status: int, body: Any) -> tuple[int, dict[str, Any]]:
    """(status, Anthropic body) for an OpenAI-shaped error body with `status`: an
    overloaded engine's 503 becomes 529; the message is kept, and the field at
    fault, when named, is added to it."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return status, error_body(status, "The request failed." if not isinstance(body, dict)
                                  else str(body.get("detail") or body))
    if err.get("code") == "engine_overloaded":
        status = OVERLOADED_STATUS
    message = str(err.get("message") or "The request failed.")
    param = err.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    return status, error_body(status, message)


def _on_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicErrorMiddleware:
    """Rewrites the JSON error responses (status >= 400) of the Messages paths into
    Anthropic's shape, and adds ``request-id`` there; other paths pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _on_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" in headers:
                    headers["request-id"] = headers["x-request-id"]
                if message["status"] >= 400 and headers.get("content-type", "").startswith("application/json"):
                    start = message  # held until the body is complete
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            try:
                status, body = from_openai(start["status"], json.loads(b"".join(chunks)))
            except ValueError:
                status, body = start["status"], error_body(start["status"], "The request failed.")
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            headers = MutableHeaders(scope=start)
            headers["content-length"] = str(len(data))
            await send({**start, "status": status})
            await send({"type": "http.response.body", "body": data, "more_body": False})

        await self.app(scope, receive, rewrite)
