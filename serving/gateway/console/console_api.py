"""The console's JSON routes, under ``/console/api`` (admin keys: ``console_auth.py``).

    GET  /console/api/overview?step=minute|hour|day&buckets=60&by=model|tenant|key|service_tier&end=
    GET  /console/api/engines                   queue depth and KV-cache use of each model's engine
    GET  /console/api/requests?limit=&after=&q=&status=&tenant=&model=&key_id=
    GET  /console/api/requests/{id}             the ``GET /v1/requests/{id}`` body
    GET  /console/api/keys?tenant=&limit=&after=
    POST /console/api/keys                      {tenant, name, admin, rpm, tpm, max_concurrent, service_tiers}
    POST /console/api/keys/{key_id}/revoke
    GET  /console/api/tenants
    PUT  /console/api/tenants/{name}            {rpm, tpm, max_concurrent, models, service_tiers}
    GET  /console/api/audit?limit=&before=

The overview of the current window (no ``end``) is reused for :data:`OVERVIEW_TTL_S` seconds
(``computed_at`` says when it was read); one with ``end`` is read each time. Every list is
bounded and paginated with a cursor (``ledger_views.py``, ``key_audit.py``); key and
tenant changes go through :class:`~serving.gateway.accounts.api_keys.KeyStore`, as ``xlaserve keys``
and ``xlaserve tenants`` do, with the same validation, audited as the admin key's. Errors are in
OpenAI's JSON shape: 400 for bad parameters or bodies, 401/403 (``console_auth.py``), 404
``no_ledger`` / ``no_key_store`` when the server keeps none, 404 for an unknown request or key.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import anyio
from fastapi import Depends, FastAPI, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import KeyInfo, KeyStore, Limits, Principal, Quotas
from serving.gateway.accounts.key_audit import MAX_AUDIT_PAGE, audit_page
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.console.console_auth import ConsoleAuth
from serving.gateway.console.ledger_views import BY, MAX_BUCKETS, MAX_PAGE, STEPS, OverviewReader, request_page
from serving.gateway.http.errors import OpenAIError

OVERVIEW_TTL_S = 5.0
"""How long an overview of the current window is reused (by every viewer asking for the same
step, buckets and split): the page refreshes every 5 s, and a poller at 1 Hz computes it once in five."""

ENGINE_FIELDS = ("num_running", "num_waiting", "waiting_prompt_tokens", "kv_cache_usage", "kv_pages_used",
                 "kv_pages_total")


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rpm: int | None = Field(None, ge=1, description="requests per minute (None: unlimited)")
    tpm: int | None = Field(None, ge=1, description="tokens per minute (None: unlimited)")
    max_concurrent: int | None = Field(None, ge=1, description="requests in flight (None: unlimited)")
    service_tiers: list[str] | None = Field(None, description="default, flex, priority (None: all)")

    def limits(self) -> Limits:
        return Limits(rpm=self.rpm, tpm=self.tpm, max_concurrent=self.max_concurrent)


class CreateKeyRequest(_Limits):
    """``POST /console/api/keys``: what ``xlaserve keys create`` takes."""

    tenant: str = Field(min_length=1, max_length=128)
    name: str | None = Field(None, max_length=256)
    admin: bool = False


class SetTenantRequest(_Limits):
    """``PUT /console/api/tenants/{name}``: what ``xlaserve tenants set`` takes. The storage
    quotas change only when the body names one of them (unnamed: kept as they are)."""

    models: list[str] | None = Field(None, description="models the tenant may use (None: all)")
    max_file_bytes: int | None = Field(None, ge=1, description="bytes of files it may store (None: unlimited)")
    max_files: int | None = Field(None, ge=1, description="files it may store (None: unlimited)")
    max_batches: int | None = Field(None, ge=1, description="unfinished batches it may have (None: unlimited)")

    def quotas(self) -> Quotas | None:
        """The quotas to set, or None when the body names none of them."""
        if not {"max_file_bytes", "max_files", "max_batches"} & self.model_fields_set:
            return None
        return Quotas(file_bytes=self.max_file_bytes, files=self.max_files, batches=self.max_batches)


def key_body(info: KeyInfo) -> dict:
    """A key as the console shows it (never its secret)."""
    return {"key_id": info.key_id, "tenant": info.tenant, "name": info.name, "key_prefix": info.key_prefix,
            "is_admin": info.is_admin, **dataclasses.asdict(info.limits), "created_at": info.created_at,
            "revoked_at": info.revoked_at,
            "service_tiers": None if info.service_tiers is None else sorted(info.service_tiers)}


def engine_snapshot(stats: Callable[[], object] | None) -> dict | None:
    """The load fields of one engine's ``stats()`` (None: it keeps none, or they failed)."""
    if stats is None:
        return None
    try:
        s = stats()
    except Exception:
        return None
    return {f: getattr(s, f, None) for f in ENGINE_FIELDS}


def install_console_api(app: FastAPI, auth: ConsoleAuth, ledger: Ledger | None, key_store: KeyStore | None,
                        engine_stats: Callable[[], Mapping[str, Callable[[], object] | None]],
                        trace_body: Callable[[dict], dict]) -> None:
    """Adds the routes above to `app`.

    Args:
      auth: the console's admin check.
      ledger: the request ledger (None: the ledger routes answer 404 ``no_ledger``).
      key_store: the keys (None: the key routes answer 404 ``no_key_store``).
      engine_stats: () -> {model: its engine's ``stats`` callable or None}.
      trace_body: a ledger row -> the ``GET /v1/requests/{id}`` body.
    """

    def need_ledger() -> Ledger:
        if ledger is None:
            raise OpenAIError("This server keeps no request ledger.", status_code=404, code="no_ledger")
        return ledger

    def need_keys() -> KeyStore:
        if key_store is None:
            raise OpenAIError("This server keeps no API keys.", status_code=404, code="no_key_store")
        return key_store

    overviews: dict[tuple, tuple[float, dict]] = {}  # (step, buckets, by) -> (monotonic time, body)
    reader = OverviewReader(ledger.engine) if ledger is not None else None

    async def blocking(fn: Callable[[], Any]) -> Any:
        try:
            return await anyio.to_thread.run_sync(fn)
        except ValueError as e:  # KeyStore's and the views' validation
            raise OpenAIError(str(e)) from None

    @app.get("/console/api/overview", include_in_schema=False)
    async def overview(step: str = "minute", buckets: int = Query(60, ge=1, le=MAX_BUCKETS),
                       by: str = "model", end: float | None = None,
                       _: Principal = Depends(auth)) -> Response:
        if step not in STEPS:
            raise OpenAIError(f"'step' must be one of {', '.join(STEPS)}; got {step!r}.", param="step")
        if by not in BY:
            raise OpenAIError(f"'by' must be one of {', '.join(BY)}; got {by!r}.", param="by")
        if end is not None and not 0 <= end < 1e11:
            raise OpenAIError(f"'end' must be Unix seconds; got {end!r}.", param="end")
        need_ledger()
        cached = overviews.get((step, buckets, by)) if end is None else None
        if cached is not None and time.monotonic() - cached[0] < OVERVIEW_TTL_S:
            body = dict(cached[1])
        else:
            now = time.time()
            body = await blocking(lambda: reader.read(now if end is None else end, step, buckets, by, now=now))
            body["computed_at"] = now
            if end is None:
                if len(overviews) >= 64:
                    overviews.clear()
                overviews[(step, buckets, by)] = (time.monotonic(), dict(body))
        body["engines"] = {name: engine_snapshot(s) for name, s in engine_stats().items()}
        return JSONResponse({"object": "console.overview", **body})

    @app.get("/console/api/engines", include_in_schema=False)
    async def engines(_: Principal = Depends(auth)) -> Response:
        return JSONResponse({"object": "console.engines", "at": time.time(),
                             "data": {name: engine_snapshot(s) for name, s in engine_stats().items()}})

    @app.get("/console/api/requests", include_in_schema=False)
    async def requests(limit: int = Query(50, ge=1, le=MAX_PAGE), after: str | None = None,
                       q: str | None = Query(None, max_length=256), status: str | None = None,
                       tenant: str | None = None, model: str | None = None, key_id: str | None = None,
                       _: Principal = Depends(auth)) -> Response:
        engine = need_ledger().engine
        rows, more = await blocking(lambda: request_page(engine, limit, after or None, q, status, tenant,
                                                         model, key_id))
        return JSONResponse({"object": "list", "data": rows, "has_more": more,
                             "last_id": rows[-1]["request_id"] if rows else None})

    @app.get("/console/api/requests/{request_id}", include_in_schema=False)
    async def request_trace(request_id: str, _: Principal = Depends(auth)) -> Response:
        led = need_ledger()
        row = await anyio.to_thread.run_sync(lambda: led.get(request_id))
        if row is None:
            raise OpenAIError(f"No request with id {request_id!r}.", status_code=404, param="request_id",
                              code="request_not_found")
        return JSONResponse(trace_body(row))

    @app.get("/console/api/keys", include_in_schema=False)
    async def list_keys(tenant: str | None = None, limit: int = Query(50, ge=1, le=MAX_PAGE),
                        after: str | None = None, _: Principal = Depends(auth)) -> Response:
        store = need_keys()
        keys, more = await blocking(lambda: store.list_keys_page(tenant or None, limit, after or None))
        return JSONResponse({"object": "list", "data": [key_body(k) for k in keys], "has_more": more,
                             "last_id": keys[-1].key_id if keys else None})

    @app.post("/console/api/keys", include_in_schema=False)
    async def create_key(body: CreateKeyRequest, admin: Principal = Depends(auth)) -> Response:
        store = need_keys()
        key, info = await blocking(lambda: store.create_key(
            body.tenant, name=body.name, limits=body.limits(), is_admin=body.admin,
            service_tiers=body.service_tiers, actor=admin.key_id or "console"))
        return JSONResponse({"object": "console.key", "key": key, **key_body(info)}, status_code=201)

    @app.post("/console/api/keys/{key_id}/revoke", include_in_schema=False)
    async def revoke_key(key_id: str, admin: Principal = Depends(auth)) -> Response:
        store = need_keys()
        if not await blocking(lambda: store.revoke(key_id, actor=admin.key_id or "console")):
            raise OpenAIError(f"No active key {key_id!r}.", status_code=404, param="key_id", code="key_not_found")
        return JSONResponse({"object": "console.key", "key_id": key_id, "revoked": True})

    @app.get("/console/api/tenants", include_in_schema=False)
    async def tenants(_: Principal = Depends(auth)) -> Response:
        store = need_keys()
        rows = await blocking(store.list_tenants)
        return JSONResponse({"object": "list", "data": rows[:MAX_PAGE], "has_more": len(rows) > MAX_PAGE})

    @app.put("/console/api/tenants/{name}", include_in_schema=False)
    async def set_tenant(name: str, body: SetTenantRequest, admin: Principal = Depends(auth)) -> Response:
        store = need_keys()
        if not name or len(name) > 128:
            raise OpenAIError("A tenant's name is 1 to 128 characters.", param="name")
        await blocking(lambda: store.set_tenant(name, body.limits(), body.models, body.service_tiers,
                                                actor=admin.key_id or "console", quotas=body.quotas()))
        return JSONResponse({"object": "console.tenant", "name": name, **body.model_dump()})

    @app.get("/console/api/audit", include_in_schema=False)
    async def audit(limit: int = Query(50, ge=1, le=MAX_AUDIT_PAGE), before: int | None = None,
                    _: Principal = Depends(auth)) -> Response:
        store = need_keys()
        rows, more = await blocking(lambda: audit_page(store.engine, limit, before))
        return JSONResponse({"object": "list", "data": rows, "has_more": more})
