"""Request limits of the gateway (413 before the body is read, prompt length before
tokenizing) and tokenization off the event loop, against the scripted fake engine (no JAX)."""

from __future__ import annotations

import json
import threading

import pytest

from serving.gateway.app import GatewayLimits, ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.policy import Policies
from tests.support.gateway_fakes import BOS_ID, FakeEngine, FakeTokenizer
from tests.support.gateway_harness import MODEL, assert_openai_error, byte_ids, client_for

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class RecordingTokenizer(FakeTokenizer):
    """Records (method, argument, thread id) of every encode, chat render and decode."""

    def __init__(self):
        self.calls: list[tuple[str, object, int]] = []

    def encode(self, text, add_bos=False):
        self.calls.append(("encode", text, threading.get_ident()))
        return super().encode(text, add_bos)

    def apply_chat_template(self, messages):
        self.calls.append(("apply_chat_template", messages, threading.get_ident()))
        return super().apply_chat_template(messages)

    def decode(self, ids):
        self.calls.append(("decode", tuple(ids), threading.get_ident()))
        return super().decode(ids)


def make_app(engine, tok=None, services=None, **limits):
    served = ServedModel(MODEL, engine, tok or FakeTokenizer(), 4096, created=1)
    return create_app({MODEL: served}, services, GatewayLimits(**limits))


async def call_raw(app, body_chunks: list[bytes], headers: list[tuple[bytes, bytes]]):
    """Drives the ASGI app with a body in `body_chunks`; returns (status, headers, body, chunks read)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1234), "server": ("testserver", 80),
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
    }
    chunks = list(body_chunks)
    read = 0

    async def receive():
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    messages = []

    async def send(message):
        messages.append(message)

    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body, read


# ------------------------------------------------------------ request size


async def test_a_declared_body_over_the_limit_gets_413_before_any_byte_is_read():
    engine, tok = FakeEngine(), RecordingTokenizer()
    app = make_app(engine, tok, max_request_bytes=1000)
    body = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
    status, headers, raw, read = await call_raw(
        app, [body], [(b"content-length", str(len(body)).encode()), (b"x-request-id", b"big-1")])
    assert status == 413
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "1000 bytes" in err["message"] and f"({len(body)} bytes)" in err["message"]
    assert "max_request_bytes" in err["message"]
    assert headers[b"x-request-id"] == b"big-1"
    assert read == 0  # the body was never read
    assert tok.calls == [] and engine.submitted == []


async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    engine = FakeEngine()
    pulled = 0

    async def upload():
        nonlocal pulled
        yield b'{"model": "%s", "prompt": "' % MODEL.encode()
        for _ in range(1000):  # 300 kB in all, if anyone read it
            pulled += 1
            yield b"x" * 300
        yield b'"}'

    async with client_for(make_app(engine, max_request_bytes=1000)) as client:
        r = await client.post("/v1/completions", content=upload(),
                              headers={"content-type": "application/json"})
        err = assert_openai_error(r, 413, code="request_too_large")
        assert "1000 bytes" in err["message"]
        assert pulled <= 4  # read with the limit: stopped at the chunk that passed it
        assert engine.submitted == []
        # A body of exactly the limit is served.
        body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
        body = body[:-1] + b" " * (1000 - len(body)) + b"}"
        assert len(body) == 1000
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------ prompt length


async def test_prompts_over_max_prompt_chars_get_400_before_tokenizing():
    engine, tok = FakeEngine(), RecordingTokenizer()
    async with client_for(make_app(engine, tok, max_prompt_chars=100)) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "é" * 101})
        err = assert_openai_error(r, 400, param="prompt", code="string_above_max_length")
        assert "101 characters" in err["message"] and "at most 100" in err["message"]
        messages = [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "u" * 61}]
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        err = assert_openai_error(r, 400, param="messages", code="string_above_max_length")
        assert "101 characters" in err["message"] and "at most 100" in err["message"]
        assert tok.calls == [] and engine.submitted == []
        # At the limit both are served.
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "é" * 100})
        assert r.status_code == 200, r.text
        messages[1]["content"] = "u" * 60
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text


# ------------------------------------------------------- off the event loop


@pytest.mark.parametrize("stream", [False, True])
async def test_tokenization_rendering_and_prompt_decoding_run_off_the_event_loop(stream):
    loop_thread = threading.get_ident()
    engine, tok = FakeEngine(text="ok"), RecordingTokenizer()
    services = GatewayServices(policies=Policies.from_config(blocklist=["zap"]))  # decodes id prompts
    ids = [BOS_ID, *byte_ids("from ids")]
    async with client_for(make_app(engine, tok, services)) as client:
        for path, body in [
            ("/v1/completions", {"prompt": "from text"}),
            ("/v1/completions", {"prompt": ids}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "from chat"}]}),
        ]:
            r = await client.post(path, json={"model": MODEL, "stream": stream, **body})
            assert r.status_code == 200, r.text
    prompt_work = [(name, thread) for name, arg, thread in tok.calls
                   if name == "apply_chat_template" or (name, arg) in {("encode", "from text"),
                                                                       ("decode", tuple(ids))}]
    assert sorted(name for name, _ in prompt_work) == ["apply_chat_template", "decode", "encode"]
    assert all(thread != loop_thread for _, thread in prompt_work)
