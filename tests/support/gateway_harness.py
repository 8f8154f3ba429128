"""The gateway over a scripted fake engine, for the gateway's in-process tests:
an app factory, an ASGI client, SSE parsing and OpenAI error-shape checks, and
constants shared by those tests, and the fixtures ``anyio_backend`` (asyncio),
``engine`` (a FakeEngine answering "Hello world") and ``client`` (an httpx
client of an app over it), registered for every test module by
``tests/conftest.py`` (a module's own fixture of the same name wins)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serving.gateway.app import ServedModel, create_app
from tests.support.gateway_fakes import BYTE_OFFSET, FakeEngine, FakeTokenizer

MODEL = "gemma-3-270m"
TOK = FakeTokenizer()
FFFD = "\ufffd"


def make_app(engine: FakeEngine, max_model_len: int = 512, kv_capacity_tokens: int | None = None):
    return create_app({MODEL: ServedModel(MODEL, engine, TOK, max_model_len, created=1700000000,
                                          kv_capacity_tokens=kv_capacity_tokens)})


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode()]


def parse_sse(body: str) -> list:
    """The `data:` payloads of an SSE body; "[DONE]" stays a string."""
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(r: httpx.Response, status: int, *, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not ...:
        assert err["param"] == param
    if code is not ...:
        assert err["code"] == code
    return err


async def assert_still_serving(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def engine():
    return FakeEngine(text="Hello world")


@pytest.fixture
async def client(engine):
    async with client_for(make_app(engine)) as c:
        yield c


async def call_asgi(app, path: str, body: dict, *, disconnect: asyncio.Event, on_send=None,
                    spec_version: str = "2.4"):
    """Drive the ASGI app directly so the client can disconnect mid-request."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
        "client": ("127.0.0.1", 1234), "server": ("testserver", 80),
    }
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    messages = []

    async def send(message):
        messages.append(message)
        if on_send is not None:
            on_send(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return messages
