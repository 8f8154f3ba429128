"""One started chat completion, as chunks or as one response.

:meth:`OpenAIServing.start_chat <serving.gateway.openai.openai_serving.OpenAIServing.start_chat>`
renders the messages, submits the choices and returns a :class:`ChatRun`;
``/v1/chat/completions`` turns it into SSE or JSON, and the Responses API
(``responses_api.py``) into its own events. Each choice's text goes through
its :class:`~serving.gateway.openai.chat_output.ChatChoiceOutput` (reasoning apart
from content, tool calls parsed), so streamed deltas and the non-streamed
message are built by the same code from the same text.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from starlette.requests import Request

from serving.gateway.openai.chat_output import ChatChoiceOutput
from serving.gateway.openai.choice_logprobs import ChatChoiceRenderer
from serving.gateway.openai.choice_stream import ChoiceStreams
from serving.gateway.openai.generation import MeteredGeneration
from serving.gateway.schema.protocol import ChatCompletionRequest
from serving.gateway.schema.response_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    DeltaMessage,
    Usage,
)


class ChatRun:
    """A chat completion whose choices the engine admitted.

    Consume it once, with :meth:`chunks` (streaming) or :meth:`response`.

    Args:
      streams: the shared piece loop and collector.
      gen: the choices' metered generation.
      req: the validated request.
      created: the response's ``created`` (Unix seconds).
      outputs: one :class:`ChatChoiceOutput` per choice.
      renderers: one logprobs renderer per choice (None: no ``logprobs``).

    Attributes:
      id: the response id (the ledger row's ``request_id``).
      model: the model name as the client sent it.
    """

    def __init__(self, streams: ChoiceStreams, gen: MeteredGeneration, req: ChatCompletionRequest,
                 created: int, outputs: list[ChatChoiceOutput],
                 renderers: list[ChatChoiceRenderer | None]) -> None:
        self.streams = streams
        self.gen = gen
        self.req = req
        self.created = created
        self.outputs = outputs
        self.renderers = renderers
        self.id = gen.id
        self.model = req.model
        if gen.meter is not None:
            gen.meter.usage_details = self._usage_details

    def _usage_details(self) -> dict:
        return {"reasoning_tokens": sum(o.reasoning_tokens for o in self.outputs),
                "tool_calls": sum(len(o.tool_calls) for o in self.outputs)}

    def usage(self) -> Usage:
        """Token counts so far, reasoning tokens included (all of it once consumed)."""
        return Usage.of(self.gen.prompt_tokens, self.gen.completion_tokens, self.gen.cached_tokens,
                        reasoning_tokens=sum(o.reasoning_tokens for o in self.outputs))

    def _finish_reason(self, k: int, reason: str | None = None) -> str | None:
        return self.outputs[k].finish_reason(reason or self.gen.outputs[k].finish_reason)

    def _chunk(self, k: int, delta: DeltaMessage, finish: str | None = None,
               logprobs: bool = True) -> ChatCompletionChunk:
        r = self.renderers[k]
        lp = r.piece() if logprobs and r is not None else None
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   service_tier=self.gen.service_tier, choices=[
            ChatChunkChoice(index=k, delta=delta, logprobs=lp, finish_reason=finish)])

    def usage_chunk(self) -> ChatCompletionChunk:
        """The final usage-only chunk (``choices == []``)."""
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage(), service_tier=self.gen.service_tier)

    def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """The streamed chunks: per choice an opening chunk (``role``, ``content: ""``),
        one chunk per delta that carries something (content, ``reasoning_content``,
        ``tool_calls``), then one with its ``finish_reason`` ("tool_calls" once when
        the choice called tools). No usage chunk: see :meth:`usage_chunk`.

        Raises what :meth:`ChoiceStreams.choice_pieces` raises (the request is
        metered first).
        """

        def delta(k: int, text: str) -> list[ChatCompletionChunk]:
            d = self.outputs[k].feed(text)
            return [] if d is None else [self._chunk(k, d)]

        def closing(k: int, reason: str | None = None) -> list[ChatCompletionChunk]:
            out = []
            if reason is None:  # an error closes what was sent as it is
                d = self.outputs[k].finish()
                if d is not None:
                    out.append(self._chunk(k, d))
            out.append(self._chunk(k, DeltaMessage(), self._finish_reason(k, reason)))
            return out

        return self.streams.choice_pieces(
            self.gen,
            opening=lambda k: [self._chunk(k, DeltaMessage(role="assistant", content=""), logprobs=False)],
            delta=delta, closing=closing)

    async def response(self, request: Request | None = None) -> ChatCompletionResponse:
        """The whole (non-streamed) response; metered before it returns.

        Args:
          request: the HTTP request whose disconnect cancels the generation
            (None: none watched, e.g. a batch line).
        """
        def parse(texts: list[str]) -> None:  # before metering: it counts the tool calls
            for out, text in zip(self.outputs, texts):
                out.feed(text)
                out.finish()

        await self.streams.collect(request, self.gen, parse)
        choices = []
        for k, out in enumerate(self.outputs):
            choices.append(ChatChoice(
                index=k, message=out.message(),
                logprobs=None if self.renderers[k] is None else self.renderers[k].piece(),
                finish_reason=self._finish_reason(k)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=choices, usage=self.usage(), service_tier=self.gen.service_tier)

    async def aclose(self) -> None:
        """Ends the run without consuming it: the engine requests are cancelled and
        the request metered "cancelled" (idempotent)."""
        with contextlib.suppress(Exception):
            await self.gen.abort()
        await self.gen.settle("cancelled")
