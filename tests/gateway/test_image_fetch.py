"""Remote image fetches under attack: a server trickling bytes fails at the fetch's total
deadline, a host resolving to a loopback, private, link-local or IPv4-mapped internal address
is refused before any connection, and the fetch connects to the address that was checked (the
name goes as ``Host`` and TLS server name); fetches share one TLS context (building one per
fetch stalled the event loop). httpx's MockTransport, a fake resolver and a loopback server:
no network, no JAX."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.limits import MediaLimits
from serving.gateway.media.image_input import load_image

pytestmark = pytest.mark.anyio
LIMITS = MediaLimits(allowed_media_domains=("*.cdn.test",), fetch_timeout_s=0.3)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _resolver(*addresses):
    async def resolve(host, port):
        return list(addresses)
    return resolve


async def test_a_trickling_server_fails_within_the_total_deadline():
    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self):
            while True:  # a byte every 50 ms: no read ever waits past a per-read timeout
                yield b"\x89"
                await asyncio.sleep(0.05)

    def handler(request):
        return httpx.Response(200, stream=Trickle(), headers={"content-type": "image/png"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        t0 = time.monotonic()
        with pytest.raises(OpenAIError) as e:
            await asyncio.wait_for(load_image("https://a.cdn.test/x.png", LIMITS, "p", client,
                                              resolve=_resolver("93.184.215.14")), 5)
    assert e.value.code == "image_fetch_failed" and "0.3 s" in e.value.message
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.0.7", "169.254.169.254", "100.64.0.1",
                                     "::1", "fe80::1", "::ffff:127.0.0.1", "0.0.0.0"])
async def test_a_host_resolving_to_an_internal_address_is_refused_unasked(address):
    asked = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: asked.append(r))) as client:
        with pytest.raises(OpenAIError) as e:
            await load_image("https://a.cdn.test/x.png", LIMITS, "p", client,
                             resolve=_resolver("93.184.215.14", address))
    assert e.value.code == "image_url_not_allowed" and asked == []


async def test_the_fetch_connects_to_the_checked_address():
    seen = []

    def handler(request):
        seen.append((request.url.host, request.url.port, request.headers["host"],
                     request.extensions.get("sni_hostname")))
        return httpx.Response(404)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(OpenAIError):
            await load_image("https://a.cdn.test:8443/x.png?v=1", LIMITS, "p", client,
                             resolve=_resolver("2606:2800:220:1::1"))
    assert seen == [("2606:2800:220:1::1", 8443, "a.cdn.test:8443", "a.cdn.test")]


async def test_fetches_share_one_tls_context(monkeypatch):
    # Building a TLS context parses the whole CA bundle (tens of ms, on the event loop): once
    # per process, not once per fetch, or a tenant's fetches stall every other tenant's streams.
    import ssl

    from serving.gateway.media import image_input

    async def serve_png(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(PNG), PNG))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve_png, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setattr(image_input, "is_public_address", lambda address: True)  # the server is on loopback
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    limits = MediaLimits(allowed_media_domains=("img.test",), fetch_timeout_s=5)
    async with server:
        for _ in range(3):
            image = await load_image(f"http://img.test:{port}/x.png", limits, "p", resolve=_resolver("127.0.0.1"))
            assert image.size == (2, 3)
    assert len(built) <= 1


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (2, 3), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png()
