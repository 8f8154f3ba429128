"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request (``responses_protocol.py``) becomes a chat completion and runs as
one (:meth:`OpenAIServing.start_chat`: the chat template with its tools,
forced calls under structured output, reasoning apart, authentication, rate
limits, metering and the trace, all as on ``/v1/chat/completions``); the
chat run's deltas become the response's output items and typed events
(``responses_events.py``). Streamed, each event is ``event: <type>`` and
``data: <JSON>`` (no ``[DONE]``: the stream ends after ``response.completed``,
``response.incomplete`` or ``response.failed``).

With ``store`` (the default) a finished response (completed or incomplete) is
kept in the gateway database (``response_store.py``), per tenant, before the
response or its last event is sent, so a client can continue it at once with
``previous_response_id``. A server without a database keeps nothing: ``GET``
answers 404 ``no_ledger`` and ``previous_response_id`` a 400.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator

import anyio
from fastapi import Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.http.disconnect import until_disconnect
from serving.gateway.http.errors import SERVER_ERROR, OpenAIError
from serving.gateway.http.openapi import error_responses, json_or_typed_stream_responses, json_request_body
from serving.gateway.http.sse import sse_typed_event
from serving.gateway.openai.chat_run import ChatRun
from serving.gateway.openai.openai_serving import OpenAIServing, read_json
from serving.gateway.responses.response_store import ResponseStore, previous_response_not_found, response_not_found
from serving.gateway.responses.responses_events import ResponseAssembler, ResponseObject, ResponseStreamEvent
from serving.gateway.responses.responses_protocol import ResponseRequest

logger = logging.getLogger("xlaserve.gateway")

RESPONSES_PATH = "/v1/responses"


def output_message(output: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A response's output items as the one assistant chat message they are
    (for the conversation a later ``previous_response_id`` continues), or None
    when there is no output."""
    text, reasoning, calls = [], [], []
    for item in output:
        if item["type"] == "message":
            text += [p["text"] for p in item.get("content", ())]
        elif item["type"] == "reasoning":
            reasoning += [p["text"] for p in item.get("content", ())]
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    if not (text or calls):
        return None
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return msg


class ResponsesServing:
    """The Responses API over the chat handlers.

    Args:
      serving: the completions and chat handlers.
      store: where responses are kept (None: the server has no database).
    """

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None) -> None:
        self.serving = serving
        self.store = store

    async def create(self, request: Request, principal: Principal) -> Response:
        """``POST /v1/responses`` (JSON, or SSE with ``stream``).

        Raises:
          OpenAIError: 400 for a ``previous_response_id`` the caller has no
            stored response under, and everything
            :meth:`OpenAIServing.start_chat` raises.
          pydantic.ValidationError: invalid fields (turned into 400).
        """
        arrival = time.time()
        req = ResponseRequest.model_validate(await read_json(request))
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            found = None
            if self.store is not None:
                found = await anyio.to_thread.run_sync(self.store.history, req.previous_response_id,
                                                       principal.tenant)
            if found is None:
                raise previous_response_not_found(req.previous_response_id)
            history = found
        chat = req.chat_request(history)
        try:
            run = await self.serving.start_chat(request, principal, chat, arrival=arrival, id_prefix="resp_")
        except OpenAIError as e:  # an image part's error names it as this request has it
            param = req.input_param(e.param)
            if param != e.param:
                e.message, e.param = e.message.replace(e.param, param, 1), param
            raise
        asm = ResponseAssembler(self._skeleton(run, req, arrival))
        events = self._events(run, asm, req, principal, history)
        if req.stream:
            return self.serving.streams.stream_response(run.gen, self._sse(events, asm))

        async def consume() -> None:
            async with contextlib.aclosing(events) as evs:
                async for _ in evs:
                    pass

        await until_disconnect(request, consume())
        return JSONResponse(asm.response)

    @staticmethod
    def _skeleton(run: ChatRun, req: ResponseRequest, arrival: float) -> dict[str, Any]:
        """The response object before any output: the request's settings echoed."""
        return {
            "id": run.id, "object": "response", "created_at": int(arrival), "model": req.model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice_json(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": req.text_json(), "previous_response_id": req.previous_response_id,
            "store": req.store, "metadata": req.metadata or {}, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None}, "background": False, "usage": None,
            "service_tier": run.gen.service_tier,
        }

    async def _events(self, run: ChatRun, asm: ResponseAssembler, req: ResponseRequest,
                      principal: Principal, history: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The typed events of `run`; the response is stored (``store``) before the
        last one. An error mid-way becomes ``error`` + ``response.failed`` events
        when streaming, and is raised otherwise (the request is metered either way)."""
        for e in asm.start():
            yield e
        finish_reason = None
        try:
            async with contextlib.aclosing(run.chunks()) as chunks:
                async for chunk in chunks:
                    for choice in chunk.choices:
                        finish_reason = choice.finish_reason or finish_reason
                    for e in asm.feed(chunk):
                        yield e
        except OpenAIError as e:
            if not req.stream:
                raise
            for ev in asm.fail(e.to_body()["error"], run.usage()):
                yield ev
            return
        final = asm.drop_calls(run.outputs[0].abandoned_calls) + asm.finish(finish_reason, run.usage())
        if req.store and self.store is not None:
            msg = output_message(asm.output)
            convo = history + req.input_messages(history) + ([msg] if msg is not None else [])
            await anyio.to_thread.run_sync(self.store.save, principal.tenant, asm.response, convo)
        for e in final:
            yield e

    @staticmethod
    async def _sse(events: AsyncIterator[dict[str, Any]], asm: ResponseAssembler) -> AsyncIterator[str]:
        try:
            async for e in events:
                yield sse_typed_event(e)
        except Exception:
            logger.exception("a /v1/responses stream failed")
            error = {"code": SERVER_ERROR, "message": "The server had an error while processing your request."}
            for e in asm.fail(error, None):
                yield sse_typed_event(e)
        finally:
            await events.aclose()

    def _need_store(self) -> ResponseStore:
        if self.store is None:
            raise OpenAIError("This server keeps no database for responses.", status_code=404,
                              code="no_ledger")
        return self.store

    async def retrieve(self, response_id: str, principal: Principal) -> Response:
        """``GET /v1/responses/{id}``: the caller's stored response (404 otherwise)."""
        store = self._need_store()
        found = await anyio.to_thread.run_sync(store.get, response_id, principal.tenant)
        if found is None:
            raise response_not_found(response_id)
        return JSONResponse(found)

    async def delete(self, response_id: str, principal: Principal) -> Response:
        """``DELETE /v1/responses/{id}``."""
        store = self._need_store()
        if not await anyio.to_thread.run_sync(store.delete, response_id, principal.tenant):
            raise response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def install_responses_api(app: FastAPI, serving: OpenAIServing, store: ResponseStore | None,
                          principal, generation_errors: dict) -> ResponsesServing:
    """Adds the ``/v1/responses`` routes to `app`; returns their handlers (whose
    ``create`` a batch line for ``/v1/responses`` runs through).

    Args:
      principal: the FastAPI dependency that authenticates callers.
      generation_errors: the error responses the generation routes document.
    """
    responses = ResponsesServing(serving, store)

    @app.post(RESPONSES_PATH, openapi_extra=json_request_body(ResponseRequest),
              responses={**json_or_typed_stream_responses(ResponseObject, ResponseStreamEvent),
                         **generation_errors})
    async def create_response(request: Request, caller: Principal = Depends(principal)) -> Response:
        return await responses.create(request, caller)

    @app.get(RESPONSES_PATH + "/{response_id}", response_model=ResponseObject,
             responses=error_responses(401, 403, 404, 413))
    async def retrieve_response(response_id: str, caller: Principal = Depends(principal)) -> Response:
        return await responses.retrieve(response_id, caller)

    @app.delete(RESPONSES_PATH + "/{response_id}", responses={
        200: {"description": "The response was deleted.", "content": {"application/json": {"schema": {
            "type": "object", "required": ["id", "object", "deleted"]}}}},
        **error_responses(401, 403, 404, 413)})
    async def delete_response(response_id: str, caller: Principal = Depends(principal)) -> Response:
        return await responses.delete(response_id, caller)

    return responses
