"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request (``messages_protocol.py``) becomes a chat completion and runs as one
(:meth:`OpenAIServing.start_chat`: the chat template with its tools, forced calls
under structured output, reasoning apart, authentication, rate limits, metering,
the ledger row and the trace, all as on ``/v1/chat/completions``); the chat run's
deltas become the message's content blocks and events (``messages_events.py``).
Streamed, each event is ``event: <type>`` and ``data: <JSON>``; an error after the
stream started is an ``event: error`` with Anthropic's error body. Errors before it
are Anthropic-shaped HTTP errors (``anthropic_errors.py``). The message ``id`` is the
ledger row's request id (``msg_…``).

``count_tokens`` renders the messages, system and tools with the chat template, as
``/v1/messages`` would, and answers ``{"input_tokens": N}`` (image soft tokens
included); it generates nothing and is not metered, like ``/tokenize``.

Callers authenticate with ``x-api-key: KEY`` (Anthropic's header) or
``Authorization: Bearer KEY``; ``anthropic-version`` and ``anthropic-beta`` are
accepted and not read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.anthropic.anthropic_errors import COUNT_TOKENS_PATH, MESSAGES_PATH, error_body, from_openai
from serving.gateway.anthropic.messages_events import MessageAssembler, MessageObject, MessageStreamEvent
from serving.gateway.anthropic.messages_protocol import CountTokensRequest, MessagesRequest
from serving.gateway.http.disconnect import until_disconnect
from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.openapi import json_or_typed_stream_responses, json_request_body
from serving.gateway.http.sse import sse_typed_event
from serving.gateway.openai.chat_run import ChatRun
from serving.gateway.openai.openai_serving import OpenAIServing, read_json

logger = logging.getLogger("xlaserve.gateway")


class MessagesServing:
    """The Messages API over the chat handlers.

    Args:
      serving: the completions and chat handlers.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @staticmethod
    def _rename(req: CountTokensRequest, e: OpenAIError) -> None:
        """An error's ``param`` (and message) in the request's terms (``messages[i].content[j]``)."""
        param = req.anthropic_param(e.param)
        if param != e.param:
            e.message, e.param = e.message.replace(e.param, param, 1), param

    async def create(self, request: Request, principal: Principal) -> Response:
        """``POST /v1/messages`` (JSON, or SSE events with ``stream``).

        Raises:
          OpenAIError: everything :meth:`OpenAIServing.start_chat` raises, and 400 for a
            ``tool_result`` of no earlier ``tool_use`` (Anthropic-shaped on the way out).
          pydantic.ValidationError: invalid fields (400).
        """
        arrival = time.time()
        req = MessagesRequest.model_validate(await read_json(request))
        try:
            chat = req.chat_request()
            run = await self.serving.start_chat(request, principal, chat, arrival=arrival, id_prefix="msg_")
        except OpenAIError as e:
            self._rename(req, e)
            raise
        if req.metadata is not None and req.metadata.user_id is not None and run.gen.meter is not None:
            run.gen.meter.note("metadata", user_id=req.metadata.user_id)
        asm = MessageAssembler(run.id, req.model, req.shows_thinking)
        events = self._events(run, asm, req.stream)
        if req.stream:
            return self.serving.streams.stream_response(run.gen, self._sse(events))

        async def consume() -> None:
            async with contextlib.aclosing(events) as evs:
                async for _ in evs:
                    pass

        await until_disconnect(request, consume())
        return JSONResponse(asm.message)

    async def _events(self, run: ChatRun, asm: MessageAssembler, stream: bool) -> AsyncIterator[dict[str, Any]]:
        """The events of `run`. An error mid-way ends a stream with an ``error`` event, and
        is raised otherwise (the request is metered either way)."""
        for e in asm.start(run.usage()):
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
            if not stream:
                raise
            _, body = from_openai(e.status_code, e.to_body())
            yield body
            return
        out = run.outputs[0]
        asm.drop_calls(out.abandoned_calls)
        for e in asm.finish(finish_reason, out.output.stop_string, run.usage()):
            yield e

    @staticmethod
    async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for e in events:
                yield sse_typed_event(e)
        except Exception:
            logger.exception("a /v1/messages stream failed")
            yield sse_typed_event(error_body(500, "The server had an error while processing your request."))
        finally:
            await events.aclose()

    async def count_tokens(self, request: Request, principal: Principal) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``.

        Raises:
          OpenAIError: 404 / 403 for the model, 400 for messages the chat template
            rejects or images the model cannot take (Anthropic-shaped on the way out).
          pydantic.ValidationError: invalid fields (400).
        """
        req = CountTokensRequest.model_validate(await read_json(request))
        served = self.serving.generative(self.serving.model(req.model, principal))
        try:
            _, prompt_ids, _ = await self.serving.chat_prompt(req.chat_request(), served)
        except OpenAIError as e:
            self._rename(req, e)
            raise
        return JSONResponse({"input_tokens": len(prompt_ids)})


def install_messages_api(app: FastAPI, serving: OpenAIServing, principal, generation_errors: dict) -> MessagesServing:
    """Adds ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` to `app`; returns
    their handlers. The app must also wrap itself in
    :class:`~serving.gateway.anthropic.anthropic_errors.AnthropicErrorMiddleware`.

    Args:
      principal: the FastAPI dependency that authenticates callers.
      generation_errors: the error responses the generation routes document.
    """
    messages = MessagesServing(serving)

    @app.post(MESSAGES_PATH, openapi_extra=json_request_body(MessagesRequest),
              responses={**json_or_typed_stream_responses(MessageObject, MessageStreamEvent), **generation_errors})
    async def create_message(request: Request, caller: Principal = Depends(principal)) -> Response:
        return await messages.create(request, caller)

    @app.post(COUNT_TOKENS_PATH, openapi_extra=json_request_body(CountTokensRequest),
              responses={200: {"description": "The prompt's token count.", "content": {"application/json": {
                  "schema": {"type": "object", "required": ["input_tokens"],
                             "properties": {"input_tokens": {"type": "integer"}}}}}}, **generation_errors})
    async def count_message_tokens(request: Request, caller: Principal = Depends(principal)) -> Response:
        return await messages.count_tokens(request, caller)

    return messages
