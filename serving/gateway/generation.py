"""One admitted request's generation, as the gateway handlers use it.

The text comes from the output pipeline
(:class:`serving.output_processor.TextGeneration`: detokenization, stop
tokens, stop strings, the output policy, cancel on stop). This wrapper adds
what is the gateway's own: metering (every engine event reaches
``RequestMeter.on_event``; :meth:`MeteredGeneration.settle` records the
request once, whatever path ends it), usage in OpenAI's shape, and engine
failures as OpenAI errors (HTTP 500 ``engine_error``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Sequence

import anyio

from serving.engine_client import EngineOverloadedError, EngineRequest, RequestRejectedError
from serving.gateway.errors import SERVER_ERROR, ClientDisconnected, OpenAIError
from serving.gateway.metering import RequestMeter
from serving.gateway.protocol import Usage
from serving.gateway.served_model import ServedModel
from serving.output_processor import GenerationError, OutputFilter, TextGeneration


class EngineFailure(OpenAIError):
    """The engine ended a request with an error (HTTP 500, code ``engine_error``).

    Args:
      message: what went wrong (the engine's message when it gave one).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=500, type=SERVER_ERROR, code="engine_error")


class MeteredGeneration:
    """The output pipeline for one admitted request, metered and with OpenAI errors.

    Args:
      served: the model (engine and tokenizer) to run on.
      request: the engine request.
      stop: stop strings.
      meter: the request's meter (None: nothing is recorded, e.g. in tests).
      output_filter: the output policy's filter for this request, or None.

    Attributes:
      meter: as given.
      output: the underlying :class:`~serving.output_processor.TextGeneration`.
    """

    def __init__(self, served: ServedModel, request: EngineRequest, stop: Sequence[str] = (),
                 meter: RequestMeter | None = None, output_filter: OutputFilter | None = None) -> None:
        self.meter = meter
        self.output = TextGeneration(served.engine, request, served.tokenizer, stop, output_filter,
                                     on_event=None if meter is None else meter.on_event)

    @property
    def id(self) -> str:
        """The engine request id, also the response ``id`` (str)."""
        return self.output.request_id

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "content_filter" once finished, else None."""
        return self.output.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return self.output.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.output.completion_tokens

    @property
    def cached_tokens(self) -> int:
        return self.output.cached_tokens

    def usage(self) -> Usage:
        """Token counts in OpenAI's ``usage`` shape."""
        return Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def start(self) -> None:
        """Submit and wait for the first event (the engine admitted the request).

        Raises:
          EngineOverloadedError, RequestRejectedError: from the engine.
          EngineFailure: the stream ended without any event.
        """
        try:
            await self.output.start()
        except GenerationError as e:
            raise EngineFailure(e.message) from None
        if self.meter is not None:
            self.meter.note("engine_admitted")

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the request finishes (then ``finish_reason`` is set);
        closing it early cancels the engine request.

        Raises:
          EngineFailure: the engine reported "error"/"cancelled" or the stream
            ended early.
        """
        try:
            async with contextlib.aclosing(self.output.deltas()) as deltas:
                async for text in deltas:
                    yield text
        except GenerationError as e:
            raise EngineFailure(e.message) from None

    async def collect(self) -> str:
        """The whole completion text (non-streaming); raises what :meth:`deltas` raises."""
        try:
            return await self.output.collect()
        except GenerationError as e:
            raise EngineFailure(e.message) from None

    async def abort(self) -> None:
        """Cancel the engine request unless it already finished. Idempotent."""
        await self.output.cancel()

    async def settle(self, status: str, error: str | None = None) -> None:
        """Meters the request (ledger, limits, metrics) once; later calls do nothing.

        Args:
          status: "ok", "error" or "cancelled".
          error: what went wrong, for the trace.
        """
        if self.meter is None:
            return
        with anyio.CancelScope(shield=True):
            await self.meter.finish(status, self.finish_reason if status == "ok" else None,
                                    self.completion_tokens, error)

    async def settle_exception(self, exc: BaseException) -> None:
        """Meters a request that ended with `exc`: "cancelled" when the client went
        away, else "error" with a description."""
        if isinstance(exc, (ClientDisconnected, asyncio.CancelledError)):
            await self.settle("cancelled")
        elif isinstance(exc, OpenAIError):
            await self.settle("error", exc.message)
        elif isinstance(exc, (EngineOverloadedError, RequestRejectedError)):
            await self.settle("error", f"{type(exc).__name__}: {exc}")
        else:
            await self.settle("error", repr(exc))
