"""Slow clients against a real uvicorn server (in process, fake engine): connections that never
finish their request headers (slowloris) are closed at the header deadline, while ``/health``
answers at once throughout; and a kept-alive connection gets a fresh deadline after each response.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import uvicorn

from serving.gateway.app import ServedModel, create_app
from serving.gateway.http.header_timeout import header_timeout_protocol
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.server_process import free_port

pytestmark = pytest.mark.anyio
TIMEOUT_S = 2.0  # seconds: the slow connections are held this long, /health must answer within it
IDLE = 300  # slowloris connections


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _serve(port: int) -> tuple[uvicorn.Server, asyncio.Task]:
    app = create_app({"fake": ServedModel("fake", FakeEngine(text="ok"), FakeTokenizer(), 512, created=1)})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", limit_concurrency=IDLE + 64,
                                           http=header_timeout_protocol(TIMEOUT_S)))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task


async def _read_until_cut(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection. A close while the client's bytes
    sit unread in the server's receive buffer reaches the client as a reset (RST) rather than
    an EOF (Linux, RFC 2525 2.17): both are the cut, so a reset reads as the end here."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def test_slowloris_connections_are_cut_at_the_header_deadline_and_health_answers():
    port = free_port()
    server, task = await _serve(port)
    try:
        idle = []
        for i in range(IDLE):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:  # half send part of a request line and headers, half nothing at all
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            idle.append((reader, writer))
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):
                assert (await client.get("/health")).status_code == 200
        # /health answered while every slow connection was still held open, none cut yet
        assert not [r for r, _ in idle if r.at_eof() or r.exception() is not None]
        # Each slow connection is closed by the server (EOF or reset), about at the deadline.
        closed = await asyncio.wait_for(asyncio.gather(*(_read_until_cut(r) for r, _ in idle)),
                                        10 * TIMEOUT_S + 5)
        assert closed == [b""] * IDLE
        assert time.monotonic() - started >= TIMEOUT_S * 0.5
        for _, w in idle:
            w.close()
        # A kept-alive connection: a request, then silence: closed after its next deadline
        # (uvicorn's keep-alive timeout would too; here the headers of a second request never end).
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\n")
        await asyncio.wait_for(_read_until_cut(reader), 10 * TIMEOUT_S + 5)  # the rest of the body, then the cut
        writer.close()
    finally:
        server.should_exit = True
        await task
