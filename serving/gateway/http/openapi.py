"""The gateway's OpenAPI description (``GET /openapi.json``).

The generation handlers read their JSON body themselves (Content-Type check,
strict JSON, validation errors as 400 rather than FastAPI's 422), so FastAPI
cannot infer their request bodies: routes declare them with
:func:`json_request_body` (``openapi_extra``) and :func:`install_openapi` adds
the request models to ``components.schemas``. Responses are declared per
route: the 200 body (JSON, and ``text/event-stream`` where the route streams)
and every error status the route can answer, each with :class:`ErrorResponse`.
FastAPI's 422 entries are removed: validation errors are 400 here.
"""

from __future__ import annotations

from typing import Any, Iterable

from fastapi import FastAPI
from pydantic import BaseModel

from serving.gateway.http.errors import ErrorResponse

_REF = "#/components/schemas/{model}"

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message names the field (`param`).",
    401: "Missing or unknown API key.",
    403: "Revoked key, or a model, tenant or service tier the key may not use.",
    404: "Unknown model, route or record.",
    409: "The record's state does not allow it (e.g. cancelling a finished batch).",
    413: "Request body too large.",
    415: "Content-Type is not `application/json`.",
    429: "Over a rate limit (`Retry-After`, `x-ratelimit-*` headers), a flex request shed "
         "under load (`resource_unavailable`, `Retry-After`), or a storage quota "
         "(`quota_exceeded`, `param` names it).",
    503: "Engine overloaded or draining (`Retry-After`).",
    507: "The server's storage is full (`storage_full`): nothing was stored.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses`` entries: each of `statuses` with an :class:`ErrorResponse` body."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def json_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring a required ``application/json`` body of `model`
    (the schema itself is added to the components by :func:`install_openapi`)."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def json_or_stream_responses(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict]:
    """A 200 that is `model` as JSON, or with ``"stream": true`` an SSE stream of
    ``data: <chunk JSON>`` events ending with ``data: [DONE]``.

    The ``text/event-stream`` schema describes one event (OpenAPI 3.1 reading;
    3.2 calls it ``itemSchema``): its ``data`` is ``[DONE]`` or a JSON `chunk`
    (or, after an error mid-stream, an :class:`ErrorResponse`), given as
    ``contentMediaType`` / ``contentSchema``. `chunk` must be passed to
    :func:`install_openapi` among the models it adds.
    """
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)},
                         {"$ref": _REF.format(model=ErrorResponse.__name__)}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
    ]}}}
    return {200: {
        "model": model,
        "description": (f"`{model.__name__}`; with `\"stream\": true`, server-sent events "
                        f"`data: <{chunk.__name__}>` ending with `data: [DONE]`."),
        "content": {"text/event-stream": {"schema": event}},
    }}


def json_or_typed_stream_responses(model: type[BaseModel], event: type[BaseModel]) -> dict[int | str, dict]:
    """A 200 that is `model` as JSON, or with ``"stream": true`` an SSE stream of
    typed events, ``event: <type>`` and ``data: <event JSON>`` (the Responses
    API's form: no ``[DONE]``). `event` must be passed to :func:`install_openapi`."""
    payload = {"$ref": _REF.format(model=event.__name__)}
    sse = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}}}
    return {200: {
        "model": model,
        "description": (f"`{model.__name__}`; with `\"stream\": true`, server-sent events "
                        f"`event: <type>` / `data: <{event.__name__}>`."),
        "content": {"text/event-stream": {"schema": sse}},
    }}


def install_openapi(app: FastAPI, request_models: Iterable[type[BaseModel]],
                    stream_models: Iterable[type[BaseModel]] = ()) -> None:
    """Make ``app.openapi()`` also describe `request_models` (as read) and
    `stream_models` (SSE payloads, as written), with the models they use, under
    ``components.schemas``, and drop FastAPI's 422 responses."""
    models = [(m, "validation") for m in request_models] + [(m, "serialization") for m in stream_models]

    def openapi() -> dict[str, Any]:
        schema = FastAPI.openapi(app)  # cached by FastAPI; the changes below are idempotent
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model, mode in models:
            model_schema = model.model_json_schema(ref_template=_REF, mode=mode)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
