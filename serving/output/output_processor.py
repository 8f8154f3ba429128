"""The output pipeline: one engine request's token events in, text deltas out.

Engines deal in token ids only (``serving/contract/engine_client.py``). Everything that
turns those ids into text for a caller happens here, once, for the HTTP
gateway and for ``xlaserve generate`` alike (the role of vLLM v1's
``OutputProcessor`` next to its ``EngineCore``)::

    engine.submit(request) -> first TokenEvent        (admission errors raise here)
      per event:  on_event hook (metering)
        per id:   count it in completion_tokens
                  drop stop-token ids (request.sampling.stop_token_ids) from the text
                  IncrementalDetokenizer (UTF-8-safe, stop strings)
                  output filter (optional content policy)   -> text delta
      finish:     "stop" (stop token or stop string), "length", "content_filter";
                  engine "error"/"cancelled", or a stream that ends without a
                  finish reason, raise GenerationError

This is the only place stop-token ids are removed from text: the engine
finishes on them and reports them (they count as completion tokens), and no
caller filters them again.

The engine request is cancelled (``engine.cancel``) whenever the text ends it
before the engine did (a stop string, the output filter) and whenever the
consumer goes away (closes the delta iterator, is cancelled, or leaves an
``async with`` block early). It works with any :class:`EngineClient`: the
in-process ``EngineLoop`` or a remote one over gRPC.

Nothing here imports JAX, the model package or the gateway.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Callable, Protocol, Sequence

import anyio

from serving.contract.engine_client import EngineClient, EngineRequest, TokenEvent, TokenLogprobs
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.output.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("xlaserve.output")

FINISH_REASONS = ("stop", "length", "content_filter")
"""The finish reasons a :class:`TextGeneration` ends with."""

_ENGINE_FINISH_REASONS = ("stop", "length")  # engine reasons that end a request normally


class OutputFilter(Protocol):
    """Per-request output policy state: text in, text safe to send out.

    The gateway's content policies (``serving/gateway/services/policy.py``) implement it.
    """

    def feed(self, text: str) -> tuple[str, bool]:
        """Takes new text; returns (text that may be sent now, whether to stop here)."""

    def flush(self) -> tuple[str, bool]:
        """At the end of the stream: (the rest of the held-back text, whether to stop)."""


class GenerationError(RuntimeError):
    """The engine did not finish a request normally.

    Attributes:
      request_id: the engine request.
      reason: the engine's finish_reason ("error" or "cancelled"), or None when
        the event stream ended without one (or without any event).
      message: a human-readable description (the engine's error message when
        it gave one).
    """

    def __init__(self, request_id: str, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.reason = reason
        self.message = message


EventHook = Callable[[TokenEvent], None]
"""Called with every engine event, in order, before its tokens are processed."""


class TextGeneration:
    """One engine request, seen as a stream of text deltas.

    Use :meth:`start`, then iterate :meth:`deltas` (or await :meth:`collect`);
    or ``async with TextGeneration(...) as gen:``, which starts it and cancels
    the engine request on leaving unless it already finished.

    Args:
      engine: any :class:`~serving.contract.engine_client.EngineClient`.
      request: the tokenized request; its ``sampling.stop_token_ids`` are the
        ids dropped from the text.
      tokenizer: decodes the ids (only ``decode`` is used).
      stop: stop strings; the text ends right before the first one (which is
        never emitted) with finish_reason "stop".
      output_filter: an optional :class:`OutputFilter`; when it says stop, the
        text ends there with finish_reason "content_filter".
      on_event: an optional :data:`EventHook` (e.g. the gateway's metering);
        what it raises propagates (and the engine request is cancelled).

    Attributes:
      request: the engine request.
      finish_reason: None until the deltas end; then "stop", "length" or
        "content_filter".
      completion_tokens: tokens generated so far (stop tokens included; when a
        stop string or the filter ends the text, the tokens up to that point).
      cached_tokens: prompt tokens the engine served from its prefix cache.
      token_ids: the generated ids consumed so far (stop tokens included; as
        ``completion_tokens``), in order.
      logprobs: the engine's ``TokenLogprobs`` of ``token_ids`` (when the
        request asked for ``logprobs``; shorter if the engine sent none).
      prompt_logprobs: the engine's prompt log probabilities (first entry
        None), once an event carried them.
    """

    def __init__(
        self,
        engine: EngineClient,
        request: EngineRequest,
        tokenizer: TextTokenizer,
        stop: Sequence[str] = (),
        output_filter: OutputFilter | None = None,
        on_event: EventHook | None = None,
    ) -> None:
        self.engine = engine
        self.request = request
        self.output_filter = output_filter
        self.on_event = on_event
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
        self._detok = IncrementalDetokenizer(tokenizer, stop, min_tokens=request.sampling.min_tokens)
        self._stop_ids = frozenset(request.sampling.stop_token_ids)
        self._events: AsyncIterator[TokenEvent] | None = None
        self._first: TokenEvent | None = None
        self._submitted = False
        self._streaming = False
        self._done = False  # the engine request ended (or was cancelled)

    # ---------------------------------------------------------- properties

    @property
    def request_id(self) -> str:
        """The engine request id (str)."""
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens (int)."""
        return len(self.request.prompt_ids)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._detok.stop_string

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Submit the request and wait for its first event.

        Admission errors therefore surface before any response starts. If this
        raises (or is cancelled) after submitting, the engine request is
        cancelled.

        Raises:
          EngineOverloadedError, RequestRejectedError: from ``engine.submit``.
          GenerationError: the event stream ended without any event.
          RuntimeError: called twice.
        """
        if self._submitted:
            raise RuntimeError(f"start() was already called for {self.request_id}")
        try:
            self._events = aiter(self.engine.submit(self.request))
            self._submitted = True
            self._first = await anext(self._events)
            self.prompt_logprobs = self._first.prompt_logprobs
        except StopAsyncIteration:
            self._done = True
            raise GenerationError(
                self.request_id, "The engine ended the request without a result.") from None
        except BaseException:
            await self.cancel()
            raise

    async def cancel(self) -> None:
        """Cancel the engine request unless it already finished; idempotent.

        Shielded from cancellation, so it completes even while the caller is
        being cancelled. Errors from ``engine.cancel`` are logged, not raised.
        """
        if not self._submitted or self._done:
            return
        self._done = True
        with anyio.CancelScope(shield=True):
            try:
                await self.engine.cancel(self.request_id)
            except Exception:
                logger.exception("engine.cancel(%s) failed", self.request_id)
            await self._close_events()

    async def __aenter__(self) -> "TextGeneration":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cancel()

    # --------------------------------------------------------------- text

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas until the request finishes; then ``finish_reason`` is set.

        Each delta is a non-empty str. Closing the iterator early (or being
        cancelled) cancels the engine request.

        Raises:
          GenerationError: the engine ended the request with "error" or
            "cancelled", or its event stream ended without a finish reason.
          RuntimeError: :meth:`start` was not called, or deltas() was already.
          Whatever ``on_event``, the tokenizer or the output filter raise.
        """
        if self._first is None or self._streaming:
            raise RuntimeError(f"deltas() needs start() first, once ({self.request_id})")
        self._streaming = True
        event, self._first = self._first, None
        try:
            while True:
                if self.on_event is not None:
                    self.on_event(event)
                self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
                if event.prompt_logprobs is not None and self.prompt_logprobs is None:
                    self.prompt_logprobs = event.prompt_logprobs
                blocked = False
                for pos, tid in enumerate(event.token_ids):
                    # One id at a time, so completion_tokens stops where the text does.
                    self.completion_tokens += 1
                    self.token_ids.append(tid)
                    if event.logprobs is not None and pos < len(event.logprobs):
                        self.logprobs.append(event.logprobs[pos])
                    if tid in self._stop_ids:
                        self._detok.skip()  # it still counts toward min_tokens
                        continue  # the one place stop tokens leave the text
                    out, blocked = self._filter(self._detok.add((tid,)))
                    if out:
                        yield out
                    if blocked or self._detok.stopped:
                        break
                if blocked or self._detok.stopped:
                    # The text ended it: a stop string or the output filter.
                    if not blocked:
                        out, blocked = self._filter("", final=True)
                        if out:
                            yield out
                    self.finish_reason = "content_filter" if blocked else "stop"
                    if event.finish_reason is None:
                        await self.cancel()  # the engine can stop now
                    self._done = True
                    return
                if event.finish_reason is not None:
                    self._done = True
                    if event.finish_reason not in _ENGINE_FINISH_REASONS:
                        raise GenerationError(
                            self.request_id,
                            event.error or f"The engine ended the request ({event.finish_reason}).",
                            event.finish_reason)
                    out, blocked = self._filter(self._detok.flush(), final=True)
                    if out:
                        yield out
                    if blocked:
                        self.finish_reason = "content_filter"
                    elif self._detok.stopped:  # completed by the final flush
                        self.finish_reason = "stop"
                    else:
                        self.finish_reason = event.finish_reason
                        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
                    return
                try:
                    event = await anext(self._events)  # type: ignore[arg-type]
                except StopAsyncIteration:
                    self._done = True
                    raise GenerationError(
                        self.request_id, "The engine stream ended without a finish reason.") from None
        finally:
            if not self._done:
                await self.cancel()  # the consumer went away, or something raised
            else:
                await self._close_events()

    async def collect(self) -> str:
        """The whole text (str); raises what :meth:`deltas` raises."""
        parts = []
        async with contextlib.aclosing(self.deltas()) as it:
            async for d in it:
                parts.append(d)
        return "".join(parts)

    # ----------------------------------------------------------- internals

    def _filter(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Runs text through the output filter: (text to send, whether it stopped)."""
        if self.output_filter is None:
            return text, False
        out, blocked = self.output_filter.feed(text) if text else ("", False)
        if final and not blocked:
            rest, blocked = self.output_filter.flush()
            out += rest
        return out, blocked

    async def _close_events(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await aclose()
                except Exception:
                    logger.exception("closing the event stream of %s failed", self.request_id)
