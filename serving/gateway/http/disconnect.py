"""A client that goes away, or stops reading, cancels its work.

:func:`until_disconnect` runs a step of a request (e.g. waiting for the engine
to admit it, or collecting a non-streamed completion) and cancels it when the
client disconnects first. :class:`CancellingStreamingResponse` does the same
for a streamed body: its generator is closed, so its ``finally`` (which
cancels the engine request) runs promptly. It also ends a stream whose client
stays connected but stops reading: a write that the client does not accept
within ``write_timeout`` seconds (the server's kernel buffers for the
connection are full) ends the response and closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from serving.gateway.http.errors import ClientDisconnected

logger = logging.getLogger("xlaserve.gateway")

T = TypeVar("T")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it if the client disconnects first.

    Returns:
      What `aw` returns.

    Raises:
      ClientDisconnected: the client went away (after `aw` was cancelled and
        had cleaned up).
      Whatever `aw` raises.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        completed = task.done()
    finally:
        if not watcher.cancel() and not watcher.cancelled():
            watcher.exception()  # mark retrieved
        if not task.done():
            task.cancel()
    if completed:
        return task.result()
    # Disconnected: wait for the cancelled work to clean up (engine.cancel).
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved; the client is gone anyway
    raise ClientDisconnected()


class StreamWriteTimeout(Exception):
    """A write of a streamed response did not complete within the write timeout."""


class CancellingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always stops and closes its body on disconnect,
    and on a client that stops reading.

    Starlette only listens for ``http.disconnect`` under ASGI spec < 2.4 and
    otherwise leaves the body generator unclosed when a send fails. This class
    listens in every case and ``aclose()``-s the body iterator afterwards, so
    the generator's ``finally`` (which cancels the engine request) always runs
    promptly.

    Args:
      content, **kwargs: as for ``StreamingResponse``.
      write_timeout: seconds one ``send`` may take (None: no limit). When a
        send takes longer the response ends unfinished (the server closes the
        connection), ``on_write_timeout(write_timeout)`` is awaited, then the
        body is closed.
      on_write_timeout: see `write_timeout` (e.g. cancel and meter the request
        with the reason, before the body's own ``finally`` runs).
    """

    def __init__(self, content: Any, *, write_timeout: float | None = None,
                 on_write_timeout: Callable[[float], Awaitable[None]] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout = write_timeout
        self.on_write_timeout = on_write_timeout

    async def _send_within_timeout(self, send: Send, message: Message) -> None:
        with anyio.move_on_after(self.write_timeout) as scope:
            await send(message)
        if scope.cancelled_caught:
            raise StreamWriteTimeout()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timed_out = False
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    nonlocal timed_out
                    try:
                        await self.stream_response(lambda m: self._send_within_timeout(send, m))
                    except OSError:
                        logger.info("client went away while streaming")
                    except StreamWriteTimeout:
                        logger.info("client not reading: a stream write took over %g s", self.write_timeout)
                        timed_out = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
            if timed_out and self.on_write_timeout is not None:
                with anyio.CancelScope(shield=True):
                    await self.on_write_timeout(self.write_timeout)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
