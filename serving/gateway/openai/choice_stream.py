"""A started generation's response pieces, shared by completions, chat and the Responses API.

Every completion's whole text (:meth:`ChoiceStreams.collect`), or its pieces as
they come (:meth:`ChoiceStreams.choice_pieces`) and their SSE framing
(:meth:`ChoiceStreams.sse_body`, :meth:`ChoiceStreams.stream_response`): the
request is metered once whichever way it ends, and its engine requests always
end. :class:`~serving.gateway.openai.openai_serving.OpenAIServing` and each
:class:`~serving.gateway.openai.chat_run.ChatRun` share one.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from serving.gateway.http.disconnect import until_disconnect
from serving.gateway.http.errors import SERVER_ERROR, OpenAIError
from serving.gateway.http.limits import GatewayLimits
from serving.gateway.http.sse import SSE_DONE, event_stream_response, sse_chunk, sse_event
from serving.gateway.openai.generation import EngineFailure, MeteredGeneration
from serving.gateway.services.gateway_services import GatewayServices

logger = logging.getLogger("xlaserve.gateway")


class ChoiceStreams:
    """Collecting or streaming the completions of started generations.

    Args:
      services: the gateway's services (``log_text``: completions' text in the log).
      limits: the gateway's limits (``stream_write_timeout``).
    """

    def __init__(self, services: GatewayServices, limits: GatewayLimits) -> None:
        self.services = services
        self.limits = limits

    def log_done(self, gen: MeteredGeneration, texts: list[str] | None = None) -> None:
        """Logs a finished request's usage, and its completions' `texts` when ``log_text`` is on."""
        logger.info(
            "request %s finished: %s, prompt_tokens=%d completion_tokens=%d cached_tokens=%d",
            gen.id, gen.finish_reason, gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens,
        )
        if texts is not None and self.services.log_text:
            logger.info("request %s completion: %r", gen.id, texts[0] if len(texts) == 1 else texts)

    async def collect(self, request: Request | None, gen: MeteredGeneration,
                      before_settle: Callable[[list[str]], None] | None = None) -> list[str]:
        """Every completion's whole text (non-streamed); the engine requests end either
        way, and the request is metered before this returns.

        Args:
          request: the HTTP request whose client going away cancels the
            generation (None: nothing watched).
          before_settle: called with the texts before the request is metered
            (e.g. to parse tool calls, which the ledger counts).
        """
        try:
            work = gen.collect()
            texts = await (work if request is None else until_disconnect(request, work))
            if before_settle is not None:
                before_settle(texts)
        except BaseException as e:
            await gen.settle_exception(e)
            raise
        finally:
            await gen.abort()
        await gen.settle("ok")
        self.log_done(gen, texts)
        return texts

    def stream_response(self, gen: MeteredGeneration, body: AsyncIterator[str]) -> Response:
        """The SSE response for `body`; a client that does not accept a write within
        ``stream_write_timeout`` seconds has its engine requests cancelled and is
        metered as cancelled, with the reason."""

        async def client_not_reading(timeout: float) -> None:
            logger.warning("request %s: client not reading, stream write timed out after %g s; "
                           "cancelling", gen.id, timeout)
            await gen.abort()
            await gen.settle("cancelled", f"client not reading: stream write timed out after {timeout:g} s")

        return event_stream_response(body, write_timeout=self.limits.stream_write_timeout,
                                     on_write_timeout=client_not_reading)

    async def choice_pieces(self, gen: MeteredGeneration, opening, delta, closing) -> AsyncIterator[Any]:
        """The response pieces (chunk objects) of a started generation, shared by
        completions, chat and the Responses API: for each completion what
        ``opening(k)`` returns, then ``delta(k, text)``'s pieces per text delta
        (completions interleaved), then ``closing(k)``'s once it finished; each
        callback returns a list of pieces (maybe empty). Once every completion
        finished, the request is metered "ok".

        Raises:
          OpenAIError: after the request is metered; for an engine failure (e.g.
            its replica died) each unfinished completion's ``closing(k, "error")``
            pieces come first.
          Exception: anything else, metered as an error. The engine requests
            always end (``gen.abort``) and the request is metered "cancelled"
            when the consumer closes the iterator early (the client went away).
        """
        parts: list[list[str]] | None = [[] for _ in gen.outputs] if self.services.log_text else None
        closed: set[int] = set()
        try:
            if opening is not None:
                for k in range(len(gen.outputs)):
                    for p in opening(k):
                        yield p
            async with contextlib.aclosing(gen.deltas()) as deltas:
                async for k, text in deltas:
                    if text is None:
                        closed.add(k)
                        for p in closing(k):
                            yield p
                        continue
                    if parts is not None:
                        parts[k].append(text)
                    for p in delta(k, text):
                        yield p
            await gen.settle("ok")
            self.log_done(gen, None if parts is None else ["".join(p) for p in parts])
        except OpenAIError as e:
            logger.warning("request %s failed mid-stream: %s", gen.id, getattr(e, "detail", e.message))
            await gen.settle_exception(e)
            if isinstance(e, EngineFailure):
                for k in range(len(gen.outputs)):
                    if k not in closed:
                        for p in closing(k, "error"):
                            yield p
            raise
        except Exception as e:
            logger.exception("request %s failed mid-stream", gen.id)
            await gen.settle_exception(e)
            raise
        finally:
            await gen.abort()
            await gen.settle("cancelled")  # the client went away (no-op if already metered)

    @staticmethod
    async def sse_body(pieces: AsyncIterator[Any], include_usage: bool, usage) -> AsyncIterator[str]:
        """The SSE body of :meth:`choice_pieces`' chunks: one event per chunk, the
        usage chunk (``usage()``) if asked for, then ``[DONE]``. An error after
        the first byte becomes an SSE error event before ``[DONE]``."""
        try:
            async for p in pieces:
                yield sse_chunk(p, include_usage)
            if include_usage:
                yield sse_chunk(usage(), True)
        except OpenAIError as e:
            yield sse_event(e.to_body())
        except Exception:
            yield sse_event(_internal_error().to_body())
        finally:
            await pieces.aclose()
        yield SSE_DONE


def _internal_error() -> OpenAIError:
    return OpenAIError(
        "The server had an error while processing your request.", status_code=500, type=SERVER_ERROR
    )
