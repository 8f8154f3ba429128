"""The OpenAI-compatible HTTP app.

Routes:
  POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
  GET /v1/models (OpenAI list shape), GET /health (200 when every engine is
  ready, else 503).

Every response carries ``X-Request-ID``: the client's value when it sent one
(visible ASCII, at most 256 characters), otherwise a fresh id. Run with e.g.
``uvicorn.run(create_app({...}))``. Nothing here imports JAX.
"""

from __future__ import annotations

import logging
import uuid
from typing import Mapping

from fastapi import FastAPI, Request
from starlette.datastructures import MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.errors import install_error_handlers
from serving.gateway.openai_serving import (
    REQUEST_ID_GIVEN_SCOPE_KEY,
    REQUEST_ID_SCOPE_KEY,
    OpenAIServing,
    ServedModel,
)
from serving.gateway.protocol import ModelCard, ModelList

__all__ = ["ServedModel", "create_app", "RequestIdMiddleware"]

logger = logging.getLogger("xlaserve.gateway")

_MAX_REQUEST_ID_LEN = 256


def _valid_request_id(value: bytes) -> bool:
    return 0 < len(value) <= _MAX_REQUEST_ID_LEN and all(0x21 <= b <= 0x7E for b in value)


class RequestIdMiddleware:
    """Puts ``X-Request-ID`` on every HTTP response (the client's, or a new uuid hex).

    The id is stored in the ASGI scope (``REQUEST_ID_SCOPE_KEY``) for handlers
    and logs; an invalid client value (empty, too long, non-visible ASCII) is
    replaced by a fresh one.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                given = value
                break
        if given is not None and _valid_request_id(given):
            rid = given.decode("ascii")
            scope[REQUEST_ID_GIVEN_SCOPE_KEY] = True
        else:
            rid = uuid.uuid4().hex
            scope[REQUEST_ID_GIVEN_SCOPE_KEY] = False
        scope[REQUEST_ID_SCOPE_KEY] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-ID"] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(models: Mapping[str, ServedModel]) -> FastAPI:
    """Build the gateway app.

    Args:
      models: the served models, keyed by the name clients pass as ``model``.

    Returns:
      A FastAPI (ASGI) app.

    Raises:
      ValueError: `models` is empty.
    """
    if not models:
        raise ValueError("create_app needs at least one served model")
    serving = OpenAIServing(models)
    app = FastAPI(title="xlaserve", summary="OpenAI-compatible LLM serving on JAX/XLA")
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)  # outermost: also tags 500s
    app.state.serving = serving

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.create_chat_completion(request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [
            ModelCard(id=name, created=m.created, max_model_len=m.max_model_len)
            for name, m in serving.models.items()
        ]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    @app.get("/health")
    async def health() -> Response:
        not_ready = []
        for name, m in serving.models.items():
            try:
                ready = bool(m.engine.is_ready())
            except Exception:
                logger.exception("is_ready() of %s failed", name)
                ready = False
            if not ready:
                not_ready.append(name)
        if not_ready:
            return JSONResponse({"status": "unavailable", "not_ready": not_ready}, status_code=503)
        return JSONResponse({"status": "ok"})

    return app
