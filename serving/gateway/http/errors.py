"""OpenAI-shaped errors: one exception type, its handlers, and a catch-all.

Every error body is ``{"error": {"message", "type", "param", "code"}}``:

* malformed JSON, validation errors, unsupported features -> 400
  ``invalid_request_error`` (never FastAPI's default 422); ``param`` names
  the field (a model-level error names it in ``ctx["field"]``);
* a POST body not sent as ``application/json`` -> 415 ``unsupported_media_type``;
* missing or unknown API key -> 401; revoked key or a model the tenant may
  not use -> 403;
* unknown model -> 404 ``model_not_found``;
* a request body over the size limit -> 413 ``request_too_large``;
* over a rate limit -> 429 with ``Retry-After`` and ``x-ratelimit-*`` headers;
* prompt + max_tokens beyond the context window, or a chat prompt that
  leaves no room for a completion in the context window or the KV cache ->
  400 ``context_length_exceeded``;
* :class:`EngineOverloadedError` -> 503 with ``Retry-After``;
* :class:`RequestRejectedError` -> 400;
* anything unexpected -> 500, logged; the server keeps serving.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.contract.engine_client import EngineOverloadedError, RequestRejectedError

logger = logging.getLogger("xlaserve.gateway")


class ErrorDetail(BaseModel):
    """The ``error`` object of an error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail

RETRY_AFTER_S = 1
"""Seconds a client is asked to wait after a 503 (``Retry-After`` header)."""

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
REQUEST_TOO_LARGE = "request_too_large"
"""The ``code`` of a 413 (request body over the server's ``max_request_bytes``)."""


def error_response(
    status_code: int,
    message: str,
    *,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-shaped error ``JSONResponse``.

    Lone surrogates that a message quotes from the request are escaped
    (``\\ud800``), so that the body can always be encoded as UTF-8.
    """
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code, headers=dict(headers or {}))


class OpenAIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response.

    Args:
      message: human-readable description (what was wrong and, where useful,
        the numbers involved).
      status_code: HTTP status (400 unless said otherwise).
      type: OpenAI error type, e.g. ``invalid_request_error`` or ``server_error``.
      param: the request field at fault, if any.
      code: machine-readable code, e.g. ``model_not_found``.
      headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_response(self) -> JSONResponse:
        """The error as a ``JSONResponse``."""
        return error_response(
            self.status_code,
            self.message,
            type=self.type,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )

    def to_body(self) -> dict:
        """The ``{"error": {...}}`` dict (used for mid-stream SSE errors)."""
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


class ClientDisconnected(Exception):
    """The client went away before the response was ready (no body is sent)."""


def model_not_found(name: str) -> OpenAIError:
    """404 for a model this server does not serve."""
    return OpenAIError(
        f"The model `{name}` does not exist or you do not have access to it.",
        status_code=404,
        param="model",
        code="model_not_found",
    )


def model_not_allowed(name: str) -> OpenAIError:
    """403 for a model the caller's tenant may not use."""
    return OpenAIError(
        f"Your API key's tenant may not use the model `{name}`.",
        status_code=403,
        param="model",
        code="model_not_allowed",
    )


def rate_limited(exc) -> OpenAIError:
    """429 for a :class:`~serving.gateway.accounts.rate_limit.RateLimited`.

    The body's ``type`` names the limit ("requests", "tokens" or
    "concurrent", as OpenAI's does), the message names the scope (key or
    tenant) and the limit's value; headers carry ``Retry-After`` (omitted when
    the request alone is over the limit) and the ``x-ratelimit-*`` set.
    """
    headers = dict(exc.headers)
    if exc.retry_after != float("inf"):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return OpenAIError(str(exc), status_code=429, type=exc.limit, code="rate_limit_exceeded",
                       headers=headers)


def context_length_exceeded(
    max_model_len: int, prompt_tokens: int, max_tokens: int, *, where: str
) -> OpenAIError:
    """400 for ``prompt_tokens + max_tokens > max_model_len``.

    Args:
      where: "messages" (chat) or "prompt" (completions); also the ``param``.
    """
    total = prompt_tokens + max_tokens
    return OpenAIError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {total} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
        f"completion). Please reduce the length of the {where} or completion.",
        param=where,
        code="context_length_exceeded",
    )


def no_room_for_completion(max_model_len: int, kv_capacity_tokens: int | None,
                           prompt_tokens: int) -> OpenAIError:
    """400 ``context_length_exceeded`` for a chat request without ``max_tokens`` whose
    messages leave no room for even one completion token.

    Args:
      max_model_len: the context window in tokens.
      kv_capacity_tokens: the most tokens one request can hold in the KV cache
        (None: no bound beyond the context window).
      prompt_tokens: the rendered messages' length in tokens.
    """
    if kv_capacity_tokens is None:
        limits = f"This model's maximum context length is {max_model_len} tokens"
    else:
        limits = (f"This model's maximum context length is {max_model_len} tokens and its KV cache "
                  f"holds at most {kv_capacity_tokens} tokens per request")
    hint = ""
    if kv_capacity_tokens is not None and kv_capacity_tokens < max_model_len:
        hint = " (The server's operator can enlarge the KV cache with --num-pages.)"
    return OpenAIError(
        f"{limits}. However, the messages take {prompt_tokens} tokens, which leaves no room "
        f"for a completion. Please reduce the length of the messages.{hint}",
        param="messages",
        code="context_length_exceeded",
    )


def _loc_str(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_error_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic errors; the message names the field."""
    if not errors:
        return "Invalid request.", None
    err = errors[0]
    loc = tuple(p for p in err.get("loc", ()) if p != "body")
    ctx = err.get("ctx") or {}
    if "field" in ctx:  # a model-level error about one field
        loc += (ctx["field"],)
    param = _loc_str(loc) or None
    kind = err.get("type", "")
    if kind == "missing":
        msg = f"Missing required parameter: '{param}'."
    elif "field" in ctx:
        msg = err["msg"]
    elif kind == "value_error" and "error" in err.get("ctx", {}):
        msg = str(err["ctx"]["error"])
        if param and f"'{param}'" not in msg:
            msg = f"Invalid '{param}': {msg}"
    else:
        msg = err.get("msg", "invalid value")
        value = err.get("input")
        got = f" (got {_short_repr(value)})" if isinstance(value, (int, float, str, bool)) else ""
        msg = f"Invalid '{param}': {msg}{got}." if param else f"Invalid request body: {msg}."
    if len(errors) > 1:
        msg += f" ({len(errors) - 1} more error(s))"
    return msg, param


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return exc.to_response()


async def _validation_error(request: Request, exc: Exception) -> Response:
    errors = exc.errors()  # type: ignore[attr-defined]
    msg, param = validation_error_message(list(errors))
    return error_response(400, msg, param=param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
    code = {404: "not_found", 413: REQUEST_TOO_LARGE}.get(exc.status_code)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        detail = f"Not found: {request.method} {request.url.path}"
    return error_response(
        exc.status_code, detail, type=kind, code=code, headers=getattr(exc, "headers", None)
    )


async def _overloaded(request: Request, exc: EngineOverloadedError) -> Response:
    logger.warning("engine overloaded: %s", exc)  # the detail (replica addresses) stays in the log
    return error_response(
        503,
        f"The engine is overloaded; retry after {RETRY_AFTER_S}s.",
        type=SERVER_ERROR,
        code="engine_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _rejected(request: Request, exc: RequestRejectedError) -> Response:
    return error_response(400, f"The request cannot be served: {exc}", code="request_rejected")


async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)


def install_error_handlers(app: FastAPI) -> None:
    """Register the OpenAI-shaped handlers and the catch-all middleware on `app`."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineOverloadedError, _overloaded)
    app.add_exception_handler(RequestRejectedError, _rejected)
    app.add_exception_handler(ClientDisconnected, _disconnected)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Turns any unhandled exception into a logged 500 instead of a crash.

    Starlette's own server-error handler re-raises after responding; this
    middleware does not, so the ASGI server (and test transports) see a
    normal response. If the response had already started (mid-stream), the
    error is only logged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            logger.exception(
                "unhandled error in %s %s", scope.get("method"), scope.get("path")
            )
            if not started:
                response = error_response(
                    500,
                    "The server had an error while processing your request.",
                    type=SERVER_ERROR,
                )
                await response(scope, receive, send)
