"""The OpenAI-compatible HTTP app.

Routes:
  POST /v1/completions, POST /v1/chat/completions (JSON or SSE; the body must
    be sent as ``application/json``, else 415),
  POST /v1/embeddings (an embedding model's vectors: ``embeddings.py``; other
    models' names get 400, as an embedding model's does on the generation routes),
  GET /v1/models (OpenAI list shape; a LoRA adapter with its ``parent``), GET /v1/models/{id}
    (one model; ids may contain '/'; 404 for a model the caller may not use, as the list hides it),
  POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (admin keys; ``lora_routes.py``),
  GET /v1/usage?start=&end=&group_by=model|key|day|tenant|status|service_tier (the caller's
    tenant; admin keys see every tenant, or one with ``tenant=``),
  GET /v1/requests/{id} (one request's trace, by response id or X-Request-ID),
  POST /v1/responses (JSON or typed SSE events), GET /v1/responses/{id},
    DELETE /v1/responses/{id} (OpenAI's Responses API over chat: ``responses_api.py``),
  POST /v1/rerank (also /rerank, /v2/rerank), POST /v1/score (also /score): a ``--task rerank``
    model's scores (``serving/gateway/rerank/``),
  POST /v1/messages (JSON or typed SSE events), POST /v1/messages/count_tokens (Anthropic's
    Messages API over chat, with Anthropic's error shape: ``serving/gateway/anthropic/``),
  POST /v1/files (multipart upload, purpose "batch", held to
    ``limits.max_file_bytes``), GET /v1/files, GET /v1/files/{id},
    GET /v1/files/{id}/content, DELETE /v1/files/{id} (``files.py``),
  POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
    POST /v1/batches/{id}/cancel (``batches.py``; run by ``batch_runner.py``),
  GET /tokenizer_info, POST /tokenize, POST /detokenize (vLLM's tokenizer
    routes at the root, as lm-evaluation-harness's remote tokenizer calls
    them; see ``tokenizer_routes.py``),
  GET /metrics (Prometheus text format), GET /health (200 when every engine
  is ready, else 503; behind a router: while some replica is up),
  GET /openapi.json (request and response schemas of every route, errors
  included; see ``openapi.py``).

``/v1`` and tokenizer routes need ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) once
keys exist (see ``auth.py``). Every response carries ``X-Request-ID`` (the client's value when
it sent one: visible ASCII, at most 256 characters; otherwise a fresh id),
which is also in every log line of the request, and, for callers with rate
limits, OpenAI's ``x-ratelimit-*`` headers. A request body over
``limits.max_request_bytes`` gets 413 before it is read (``body_limit.py``).
Run with e.g.
``uvicorn.run(create_app({...}))``. Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import uuid
from typing import Mapping

import anyio
from fastapi import Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import MutableHeaders
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.auth import credentials
from serving.gateway.accounts.ledger import GROUP_BY
from serving.gateway.anthropic.anthropic_errors import AnthropicErrorMiddleware, anthropic_error_responses
from serving.gateway.anthropic.messages_api import install_messages_api
from serving.gateway.anthropic.messages_events import MessageStreamEvent
from serving.gateway.anthropic.messages_protocol import CountTokensRequest, MessagesRequest
from serving.gateway.console.console_app import install_console
from serving.gateway.rerank.rerank_api import RERANK_PATHS, SCORE_PATHS, install_rerank_api
from serving.gateway.rerank.rerank_protocol import RerankRequest, ScoreRequest
from serving.gateway.batch.batch_runner import BatchSettings, install_batch_api
from serving.gateway.batch.batches import CreateBatchRequest
from serving.gateway.batch.files import FILES_PATH, upload_body_limit
from serving.gateway.http.body_limit import RequestBodyLimitMiddleware
from serving.gateway.http.errors import OpenAIError, install_error_handlers, model_not_found
from serving.gateway.http.limits import GatewayLimits
from serving.gateway.http.log_context import request_id_var
from serving.gateway.http.openapi import (
    error_responses,
    install_openapi,
    json_or_stream_responses,
    json_request_body,
)
from serving.gateway.http.request_scope import (
    RATE_LIMIT_HEADERS_SCOPE_KEY,
    REQUEST_ID_GIVEN_SCOPE_KEY,
    REQUEST_ID_SCOPE_KEY,
)
from serving.gateway.openai.embeddings import EMBEDDINGS_PATH, EmbeddingServing
from serving.gateway.openai.lora_routes import LoadLoraRequest, UnloadLoraRequest, install_lora_routes
from serving.gateway.openai.openai_serving import OpenAIServing
from serving.gateway.openai.served_model import ServedModel
from serving.gateway.openai.tokenizer_routes import DetokenizeRequest, TokenizeRequest, install_tokenizer_routes
from serving.gateway.responses.response_store import ResponseStore
from serving.gateway.responses.responses_api import RESPONSES_PATH, install_responses_api
from serving.gateway.responses.responses_events import ResponseStreamEvent
from serving.gateway.responses.responses_protocol import ResponseRequest
from serving.gateway.schema.embeddings import EmbeddingRequest, EmbeddingResponse
from serving.gateway.schema.protocol import ChatCompletionRequest, CompletionRequest
from serving.gateway.schema.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    HealthStatus,
    ModelCard,
    ModelList,
)
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.metrics import EngineStatsCollector

__all__ = ["ServedModel", "GatewayServices", "GatewayLimits", "create_app", "RequestIdMiddleware"]

logger = logging.getLogger("xlaserve.gateway")

_MAX_REQUEST_ID_LEN = 256


def _valid_request_id(value: bytes) -> bool:
    return 0 < len(value) <= _MAX_REQUEST_ID_LEN and all(0x21 <= b <= 0x7E for b in value)


class RequestIdMiddleware:
    """Puts ``X-Request-ID`` on every HTTP response (the client's, or a new uuid hex).

    The id is stored in the ASGI scope (``REQUEST_ID_SCOPE_KEY``) for handlers
    and in the log context (every log line of the request shows it); an
    invalid client value (empty, too long, non-visible ASCII) is replaced by a
    fresh one. Rate-limit headers that a handler left in the scope
    (``RATE_LIMIT_HEADERS_SCOPE_KEY``) are added to the response too, unless
    the response already has them (a 429 carries its own).
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
        token = request_id_var.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["X-Request-ID"] = rid
                for k, v in (scope.get(RATE_LIMIT_HEADERS_SCOPE_KEY) or {}).items():
                    if k not in headers:
                        headers[k] = v
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def _parse_time(value: str | None, name: str) -> float | None:
    """Unix seconds, or an ISO 8601 date/datetime (UTC unless it says otherwise).

    Raises:
      OpenAIError: 400 for anything else.
    """
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise OpenAIError(f"'{name}' must be Unix seconds or an ISO 8601 date, got {value!r}.",
                          param=name) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp()


def create_app(models: Mapping[str, ServedModel], services: GatewayServices | None = None,
               limits: GatewayLimits | None = None, batches: BatchSettings | None = None,
               lora_root: str | os.PathLike | None = None) -> FastAPI:
    """Build the gateway app.

    Args:
      models: the served models, keyed by the name clients pass as ``model``.
      services: auth, metering and policies (default: open, nothing recorded).
      limits: request size, prompt length, stream write timeout, tokenizer
        threads (default: :class:`GatewayLimits`'s defaults).
      batches: how batches run: concurrency, lease, clock (default:
        :class:`BatchSettings`'s defaults).
      lora_root: the folder ``POST /v1/load_lora_adapter`` may load from (None: such
        loads are refused; ``lora_routes.py``).

    Returns:
      A FastAPI (ASGI) app.

    Raises:
      ValueError: `models` is empty.
    """
    if not models:
        raise ValueError("create_app needs at least one served model")
    services = services or GatewayServices()
    limits = limits or GatewayLimits()
    serving = OpenAIServing(models, services, limits)
    for m in models.values():  # a LoRA adapter the price table does not name costs what its base does
        if m.parent is not None:
            services.metering.prices.parents[m.name] = m.parent
    # Engines that need the serving event loop (a router's gRPC channels) open in the lifespan.
    engines = list({id(m.engine): m.engine for m in models.values()}.values())
    async_engines = [e for e in engines if callable(getattr(e, "open", None))]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for e in async_engines:
            await e.open()
        if batch_runner is not None:
            await batch_runner.start()
        try:
            yield
        finally:
            if batch_runner is not None:
                await batch_runner.stop()
            for e in async_engines:
                await e.close()

    app = FastAPI(title="xlaserve", summary="OpenAI-compatible LLM serving on JAX/XLA", lifespan=lifespan)
    install_error_handlers(app)
    # Inside the request-id middleware, so a 413 carries X-Request-ID too.
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=limits.max_request_bytes, path_limits={
        FILES_PATH: (upload_body_limit(limits.max_file_bytes), "max_file_bytes plus the form's framing")})
    app.add_middleware(RequestIdMiddleware)  # also tags 500s
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: Anthropic's error shape on /v1/messages
    app.state.serving = serving
    app.state.services = services
    metrics = services.metering.metrics
    metrics.add_engine_collector(EngineStatsCollector(
        lambda: {name: getattr(m.engine, "stats", None) for name, m in serving.models.items()}))
    for name, m in models.items():
        if callable(getattr(m.engine, "collector", None)):  # a router: per-replica series
            metrics.add_engine_collector(m.engine.collector(name))

    async def principal(request: Request) -> Principal:
        p = await services.authenticator.authenticate(credentials(request.headers.get("authorization"),
                                                                  request.headers.get("x-api-key")))
        headers = await services.metering.headers(p)
        if headers:
            request.scope[RATE_LIMIT_HEADERS_SCOPE_KEY] = headers
        return p

    generation_errors = error_responses(400, 401, 403, 404, 413, 415, 429, 503)

    @app.post("/v1/completions", openapi_extra=json_request_body(CompletionRequest),
              responses={**json_or_stream_responses(CompletionResponse, CompletionResponse),
                         **generation_errors})
    async def completions(request: Request, caller: Principal = Depends(principal)) -> Response:
        return await serving.create_completion(request, caller)

    @app.post("/v1/chat/completions", openapi_extra=json_request_body(ChatCompletionRequest),
              responses={**json_or_stream_responses(ChatCompletionResponse, ChatCompletionChunk),
                         **generation_errors})
    async def chat_completions(request: Request, caller: Principal = Depends(principal)) -> Response:
        return await serving.create_chat_completion(request, caller)

    embeddings = EmbeddingServing(serving)

    @app.post(EMBEDDINGS_PATH, openapi_extra=json_request_body(EmbeddingRequest),
              response_model=EmbeddingResponse, responses=generation_errors)
    async def create_embeddings(request: Request, caller: Principal = Depends(principal)) -> Response:
        return await embeddings.create_embedding(request, caller)

    response_store = ResponseStore(services.ledger.engine) if services.ledger is not None else None
    responses = install_responses_api(app, serving, response_store, principal, generation_errors)
    install_messages_api(app, serving, principal, anthropic_error_responses(400, 401, 403, 404, 413, 415, 429, 503, 529))
    rerank = install_rerank_api(app, serving, principal, generation_errors)

    # The endpoints a batch line may name, and their handlers.
    batch_endpoints = {"/v1/completions": serving.create_completion,
                       "/v1/chat/completions": serving.create_chat_completion,
                       RESPONSES_PATH: responses.create,
                       EMBEDDINGS_PATH: embeddings.create_embedding,
                       RERANK_PATHS[0]: rerank.rerank, SCORE_PATHS[0]: rerank.score}
    batch_runner = install_batch_api(app, services, batch_endpoints, principal, limits.max_file_bytes, batches)
    install_tokenizer_routes(app, serving, principal)
    install_lora_routes(app, serving, principal, lora_root)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponseRequest, TokenizeRequest,
                          DetokenizeRequest, CreateBatchRequest, EmbeddingRequest, LoadLoraRequest,
                          UnloadLoraRequest, MessagesRequest, CountTokensRequest, RerankRequest, ScoreRequest],
                    stream_models=[CompletionResponse, ChatCompletionChunk, ResponseStreamEvent, MessageStreamEvent])

    def card(name: str) -> ModelCard:
        m = serving.models[name]
        return ModelCard(id=name, created=m.created, max_model_len=m.max_model_len, parent=m.parent)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401, 403, 413))
    async def list_models(caller: Principal = Depends(principal)) -> Response:
        serving.follow_adapters()
        cards = [card(name) for name in list(serving.models) if caller.may_use(name)]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses=error_responses(401, 403, 404, 413))
    async def retrieve_model(model_id: str, caller: Principal = Depends(principal)) -> Response:
        serving.follow_adapters()
        if model_id not in serving.models or not caller.may_use(model_id):
            raise model_not_found(model_id)
        return JSONResponse(card(model_id).model_dump(mode="json"))

    def _tenant_scope(caller: Principal, tenant: str | None) -> str | None:
        if caller.is_admin:
            return tenant
        if tenant not in (None, caller.tenant):
            raise OpenAIError("Only admin keys may read other tenants' usage.", status_code=403,
                              param="tenant", code="forbidden")
        return caller.tenant

    @app.get("/v1/usage", responses={
        200: {"description": "Usage rows grouped by `group_by`, and their totals.",
              "content": {"application/json": {"schema": {
                  "type": "object", "required": ["object", "group_by", "data", "totals"]}}}},
        **error_responses(400, 401, 403, 404, 413)})
    async def usage(start: str | None = None, end: str | None = None, group_by: str = "model",
                    tenant: str | None = None, caller: Principal = Depends(principal)) -> Response:
        if group_by not in GROUP_BY:
            raise OpenAIError(f"'group_by' must be one of {', '.join(GROUP_BY)}; got {group_by!r}.",
                              param="group_by")
        t0, t1 = _parse_time(start, "start"), _parse_time(end, "end")
        scope = _tenant_scope(caller, tenant)
        if services.ledger is None:
            raise OpenAIError("This server keeps no usage ledger.", status_code=404, code="no_ledger")
        rows = await anyio.to_thread.run_sync(
            lambda: services.ledger.usage(t0, t1, group_by, scope))
        keys = ("requests", "incomplete", "errors", "prompt_tokens", "cached_tokens",
                "completion_tokens", "reasoning_tokens", "total_tokens", "cost_usd")
        totals = {k: sum(r[k] for r in rows) for k in keys}
        return JSONResponse({"object": "list", "group_by": group_by, "start": t0, "end": t1,
                             "tenant": scope, "data": rows, "totals": totals})

    @app.get("/v1/requests/{request_id}", responses={
        200: {"description": "The request's ledger row and trace.",
              "content": {"application/json": {"schema": {
                  "type": "object", "required": ["object", "id", "status", "usage", "events"]}}}},
        **error_responses(401, 403, 404, 413)})
    async def request_trace(request_id: str, caller: Principal = Depends(principal)) -> Response:
        if services.ledger is None:
            raise OpenAIError("This server keeps no request ledger.", status_code=404, code="no_ledger")
        tenant = None if caller.is_admin else caller.tenant
        row = await anyio.to_thread.run_sync(lambda: services.ledger.get(request_id, tenant))
        if row is None:
            raise OpenAIError(f"No request with id {request_id!r}.", status_code=404,
                              param="request_id", code="request_not_found")
        return JSONResponse(_trace_body(row))

    install_console(app, services.authenticator, services.ledger, list(models),
                    lambda: {name: getattr(m.engine, "stats", None) for name, m in serving.models.items()},
                    _trace_body)

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text format."}})
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", response_model=HealthStatus, responses={
        503: {"model": HealthStatus, "description": "Some engine is not ready."}})
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


def _trace_body(row: dict) -> dict:
    """The ``GET /v1/requests/{id}`` body from a ledger row."""
    trace = row.get("trace") or {}
    return {
        "object": "request.trace",
        "id": row["request_id"],
        "x_request_id": row["x_request_id"],
        "model": row["model"],
        "tenant": row["tenant"],
        "key_id": row["key_id"],
        "priority": row["priority"],
        "service_tier": row.get("service_tier"),
        "stream": bool(row["stream"]),
        "status": row["status"],
        "finish_reason": row["finish_reason"],
        "error": row["error"],
        "created_at": row["created_at"],
        "first_token_at": row["first_token_at"],
        "finished_at": row["finished_at"],
        "timings": {k: row[k] for k in ("queue_time_s", "ttft_s", "itl_mean_s", "itl_max_s", "e2e_s")},
        "usage": {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": row["cached_tokens"]},
            "completion_tokens_details": {"reasoning_tokens": row["reasoning_tokens"]},
        },
        "tool_calls": row["tool_calls"],
        "cost_usd": row["cost_usd"],
        "prefix_cache": trace.get("prefix_cache"),
        "host_cached_tokens": trace.get("host_cached_tokens", 0),
        "disk_cached_tokens": trace.get("disk_cached_tokens", 0),
        "cached_tokens_by_tier": trace.get("cached_tokens_by_tier"),
        "replica": trace.get("replica"),
        "prefill_replica": trace.get("prefill_replica"),
        "decode_replica": trace.get("decode_replica"),
        "region": trace.get("region"),
        "replica_retries": trace.get("replica_retries", []),
        "kv_transfer_bytes": trace.get("kv_transfer_bytes", 0),
        "kv_transfer_seconds": trace.get("kv_transfer_seconds", 0.0),
        "num_preemptions": trace.get("num_preemptions", 0),
        "speculative": trace.get("speculative", {"draft_tokens": 0, "accepted_tokens": 0}),
        "retries": row.get("retries", 0),
        "rate_limit": trace.get("rate_limit", []),
        "reserved_tokens": trace.get("reserved_tokens"),
        "settled_tokens": trace.get("settled_tokens"),
        "errors": trace.get("errors", []),
        "events": trace.get("events", []),
    }
