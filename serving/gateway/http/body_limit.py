"""Request bodies over the size limit get 413, before they are read.

:class:`RequestBodyLimitMiddleware` is a pure ASGI middleware. A request whose
``Content-Length`` is over the limit is answered at once: the app never runs
and no byte of the body is read. A body without a length (chunked upload) or
with a false one is counted as it streams in, and reading it fails with 413
as soon as the count passes the limit, so at most one more chunk than the
limit is ever held.

Starlette's own ``RequestBodyLimitMiddleware`` (and FastAPI's
``max_body_size``, built on it) answer the ``Content-Length`` case with a
plain-text body and signal through private exception classes that the
gateway's catch-all middleware would log as errors; this one answers in
OpenAI's error shape, with the limit in the message, inside the request-id
middleware (so the 413 carries ``X-Request-ID``).

A route may have its own limit instead (``path_limits``): ``POST /v1/files``
is held to the server's ``max_file_bytes`` rather than ``max_request_bytes``.
"""

from __future__ import annotations

import logging
from typing import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.http.errors import REQUEST_TOO_LARGE, error_response

logger = logging.getLogger("xlaserve.gateway")


def request_too_large_message(limit: int, size: int | None = None,
                              setting: str = "max_request_bytes") -> str:
    """The 413's message: the limit, the setting that sets it, and the body's size when it is known."""
    size_text = f" ({size} bytes)" if size is not None else ""
    return (f"The request body{size_text} is larger than this server accepts: at most {limit} bytes "
            f"(the server's {setting}).")


class RequestBodyTooLarge(HTTPException):
    """A streamed body passed the limit while it was read (HTTP 413).

    Raised from ``receive``, so it surfaces where the app reads the body and
    is answered by the HTTP-exception handler (``errors.py``) in OpenAI's shape.
    """

    def __init__(self, limit: int, setting: str = "max_request_bytes") -> None:
        super().__init__(status_code=413, detail=request_too_large_message(limit, setting=setting))


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


class RequestBodyLimitMiddleware:
    """413 for HTTP request bodies over ``max_bytes`` (see the module docstring).

    Args:
      app: the ASGI app.
      max_bytes: the most bytes a body may have; None turns the limit off.
      path_limits: {path: (limit or None, the setting's name)} for routes held to
        another limit than `max_bytes` (matched on the exact path).
    """

    def __init__(self, app: ASGIApp, max_bytes: int | None,
                 path_limits: Mapping[str, tuple[int | None, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit, setting = self.max_bytes, "max_request_bytes"
        if scope["type"] == "http" and scope.get("path") in self.path_limits:
            limit, setting = self.path_limits[scope["path"]]
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            logger.info("refused a %d-byte request body (limit %d bytes)", declared, limit)
            response = error_response(413, request_too_large_message(limit, declared, setting),
                                      code=REQUEST_TOO_LARGE)
            await response(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    logger.info("refused a request body after %d bytes (limit %d bytes)", received, limit)
                    raise RequestBodyTooLarge(limit, setting)
            return message

        await self.app(scope, receive_within_limit, send)
