"""A client that goes away cancels its work.

:func:`until_disconnect` runs a step of a request (e.g. waiting for the engine
to admit it, or collecting a non-streamed completion) and cancels it when the
client disconnects first. :class:`CancellingStreamingResponse` does the same
for a streamed body: its generator is closed, so its ``finally`` (which
cancels the engine request) runs promptly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from serving.gateway.errors import ClientDisconnected

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


class CancellingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always stops and closes its body on disconnect.

    Starlette only listens for ``http.disconnect`` under ASGI spec < 2.4 and
    otherwise leaves the body generator unclosed when a send fails. This class
    listens in every case and ``aclose()``-s the body iterator afterwards, so
    the generator's ``finally`` (which cancels the engine request) always runs
    promptly.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        logger.info("client went away while streaming")
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
