"""The OpenAI-compatible gateway against a scripted fake engine (no model, no JAX)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from serving.contract.engine_client import EngineRequest
from serving.gateway.app import ServedModel, create_app
from tests.support.gateway_fakes import BOS_ID, END_OF_TURN_ID, START_OF_TURN_ID, FakeEngine
from tests.support.gateway_harness import (
    CHAT,
    FFFD,
    MODEL,
    TOK,
    byte_ids,
    call_asgi,
    client_for,
    make_app,
    parse_sse,
)

pytestmark = pytest.mark.anyio


# ------------------------------------------------------------- completions


async def test_completion_non_streaming(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}
    prompt_ids = TOK.encode("Say hi", add_bos=True)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,  # 11 bytes + EOS
        "total_tokens": len(prompt_ids) + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    (req,) = engine.submitted
    assert isinstance(req, EngineRequest)
    assert list(req.prompt_ids) == prompt_ids and req.prompt_ids[0] == BOS_ID
    assert req.request_id == body["id"]
    assert req.sampling.max_tokens == 16  # OpenAI's default for completions
    assert req.sampling.stop_token_ids == TOK.stop_token_ids
    assert engine.cancelled == []


async def test_completion_length_finish(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5})
    body = r.json()
    assert body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


async def test_completion_token_id_prompt_used_as_is(client, engine):
    ids = [BOS_ID, *byte_ids("abc")]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ids})
    assert r.status_code == 200
    assert list(engine.submitted[0].prompt_ids) == ids
    assert r.json()["usage"]["prompt_tokens"] == 4
    # A one-element batch is unwrapped.
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [ids]})
    assert r.status_code == 200
    assert list(engine.submitted[1].prompt_ids) == ids


async def test_sampling_params_mapping(client, engine):
    r = await client.post(
        "/v1/completions",
        json={
            "model": MODEL, "prompt": "x", "temperature": 0, "top_p": 0.5, "top_k": -1,
            "seed": 7, "max_tokens": 3, "user": "someone", "unknown_extra": 1,
        },
    )
    assert r.status_code == 200, r.text
    sp = engine.submitted[0].sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens) == (0.0, 0.5, 0, 7, 3)
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_k": 40})
    sp = engine.submitted[1].sampling
    assert (sp.top_k, sp.temperature, sp.top_p) == (40, 1.0, 1.0)


async def test_priority_and_cache_salt_reach_the_engine(client, engine):
    for salt in ("tenant-a", None, "tenant-a"):
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "priority": "batch", "cache_salt": salt})
        assert r.status_code == 200, r.text
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert [e.priority for e in engine.submitted] == ["batch"] * 3 + ["interactive"]
    # The engine's salt is composed from the (anonymous) tenant and the client's salt.
    a, none, a_again, absent = (e.cache_salt for e in engine.submitted)
    assert a == a_again and none == absent and a != none and "tenant-a" not in a
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "priority": "urgent"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


async def test_completion_streaming(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_completion_streaming_include_usage(client):
    r = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 4,
              "stream_options": {"include_usage": True}},
    )
    events = parse_sse(r.text)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens"] == 2
    assert usage_chunk["usage"]["total_tokens"] == 6
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hell"


# -------------------------------------------------------------------- chat


async def test_chat_non_streaming(engine):
    engine.cached_tokens = 3
    async with client_for(make_app(engine, max_model_len=100)) as client:
        r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello world"}
    assert choice["finish_reason"] == "stop"
    prompt_ids = TOK.apply_chat_template([{"role": "user", "content": "Hi there"}])
    (req,) = engine.submitted
    assert list(req.prompt_ids) == prompt_ids
    # Chat defaults max_tokens to the rest of the context window.
    assert req.sampling.max_tokens == 100 - len(prompt_ids)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_default_chat_max_tokens_caps_only_requests_without_max_tokens(engine):
    app = create_app({MODEL: ServedModel(MODEL, engine, TOK, 512, default_chat_max_tokens=7)})
    async with client_for(app) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert engine.submitted[-1].sampling.max_tokens == 7
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20})
        assert r.status_code == 200, r.text
        assert engine.submitted[-1].sampling.max_tokens == 20  # the client's own value wins
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert engine.submitted[-1].sampling.max_tokens == 16  # completions keep OpenAI's default


async def test_chat_max_completion_tokens_and_text_parts(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
            "max_tokens": 50,
            "max_completion_tokens": 3,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hel"
    req = engine.submitted[0]
    assert req.sampling.max_tokens == 3
    expected = TOK.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    )
    assert list(req.prompt_ids) == expected


async def test_chat_streaming_with_usage(client, engine):
    engine.chunk = 3
    r = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Hello world"
    assert chunks[-1]["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"
    }
    assert usage_chunk["choices"] == []
    n_prompt = len(TOK.apply_chat_template(CHAT["messages"]))
    assert usage_chunk["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 12,
        "total_tokens": n_prompt + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_ends_where_the_model_opens_the_next_turn(client, engine, stream):
    engine.responder = lambda req: [*byte_ids("Done."), START_OF_TURN_ID, *byte_ids("user\nleak")]
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e for e in parse_sse(r.text) if e != "[DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert (text, finish) == ("Done.", "stop")
    assert START_OF_TURN_ID in engine.submitted[0].sampling.stop_token_ids
    # A completion is plain text: the turn-opening token does not end it.
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10})
    assert START_OF_TURN_ID not in engine.submitted[1].sampling.stop_token_ids
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_stop_token_ids_never_in_text(client, engine):
    engine.responder = lambda req: [*byte_ids("Done."), END_OF_TURN_ID, *byte_ids("leak")]
    r = await client.post("/v1/chat/completions", json=CHAT)
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Done."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 6


# ------------------------------------------------------------ stop strings


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens_is_not_emitted(client, engine, stream):
    engine.text = "The answer is 42. END of story " + "x" * 200
    r = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "q", "max_tokens": 200, "stop": ["END", "zzz"], "stream": stream},
    )
    assert r.status_code == 200
    if stream:
        chunks = parse_sse(r.text)[:-1]
        texts = [c["choices"][0]["text"] for c in chunks]
        text, finish = "".join(texts), chunks[-1]["choices"][0]["finish_reason"]
        assert not any("E" in t for t in texts)
    else:
        body = r.json()
        text, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
        assert body["usage"]["completion_tokens"] == len("The answer is 42. END")
    assert text == "The answer is 42. "
    assert finish == "stop"
    # The engine was told to stop early.
    assert engine.cancelled == [engine.submitted[0].request_id]


async def test_stop_string_found_at_final_flush(client, engine):
    # Generation hits max_tokens while "EN" is held back; it never completes.
    engine.text = "abc EN"
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": 6, "stop": "END"}
    )
    body = r.json()
    assert body["choices"][0]["text"] == "abc EN"
    assert body["choices"][0]["finish_reason"] == "length"


async def test_stop_string_in_chat_stream(client, engine):
    engine.text = "Line one\nLine two"
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stop": "\n"})
    chunks = parse_sse(r.text)[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Line one"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# --------------------------------------------------------------- multibyte


@pytest.mark.parametrize("chunk", [1, 2, 5])
async def test_multibyte_text_streams_intact(client, engine, chunk):
    engine.text = "Grüße, 世界! 😀 ok"
    engine.chunk = chunk
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 100}
    )
    chunks = parse_sse(r.text)[:-1]
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == "Grüße, 世界! 😀 ok"
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
    assert r.json()["choices"][0]["message"]["content"] == "Grüße, 世界! 😀 ok"


# ------------------------------------------------------------- request id


async def test_x_request_id_echoed(client):
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-ID": "trace-123"}
    )
    assert r.headers["x-request-id"] == "trace-123"
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True},
        headers={"X-Request-ID": "trace-456"},
    )
    assert r.headers["x-request-id"] == "trace-456"
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"},
                          headers={"X-Request-ID": "trace-789"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "trace-789"
    r = await client.get("/health", headers={"X-Request-ID": "h"})
    assert r.headers["x-request-id"] == "h"
    # Without one, a fresh id is returned and used in the body id.
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    rid = r.headers["x-request-id"]
    assert rid and r.json()["id"] == f"cmpl-{rid}"


# ------------------------------------------------------- models and health


async def test_models_and_health(client, engine):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "xlaserve",
                  "max_model_len": 512, "parent": None}],
    }
    r = await client.get("/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    engine.ready = False
    r = await client.get("/health")
    assert r.status_code == 503


# ------------------------------------------------------------- disconnects


async def test_disconnect_cancels_non_streaming_request():
    engine = FakeEngine(text="z" * 2000, delay=0.002)
    app = make_app(engine, max_model_len=4096)
    disconnect = asyncio.Event()
    task = asyncio.ensure_future(call_asgi(
        app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2000},
        disconnect=disconnect,
    ))
    await asyncio.wait_for(engine.first_token.wait(), 5)
    disconnect.set()
    messages = await task
    (req,) = engine.submitted
    assert engine.cancelled == [req.request_id]
    starts = [m for m in messages if m["type"] == "http.response.start"]
    assert all(m["status"] != 200 for m in starts)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_disconnect_cancels_streaming_request(spec_version):
    engine = FakeEngine(text="z" * 2000, delay=0.002)
    app = make_app(engine, max_model_len=4096)
    disconnect = asyncio.Event()
    bodies = []

    def on_send(message):
        if message["type"] == "http.response.body" and b'"content":"z"' in message.get("body", b""):
            bodies.append(message["body"])
            disconnect.set()

    await call_asgi(
        app, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 2000},
        disconnect=disconnect, on_send=on_send, spec_version=spec_version,
    )
    (req,) = engine.submitted
    assert engine.cancelled == [req.request_id]
    assert bodies and not any(b"[DONE]" in b for b in bodies)


# ----------------------------------------------------- the official client


async def test_openai_client_streaming_chat(engine):
    engine.text = "Bonjour, 世界!"
    app = make_app(engine)
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    client = openai.AsyncOpenAI(
        api_key="unused", base_url="http://testserver/v1", http_client=http_client, max_retries=0
    )
    async with http_client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Salut"}],
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.7,
            max_tokens=64,
        )
        parts, finish, usage, roles = [], None, None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                if choice.delta.content:
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
        assert "".join(parts) == "Bonjour, 世界!"
        assert roles == ["assistant"]
        assert finish == "stop"
        assert usage.completion_tokens == len("Bonjour, 世界!".encode()) + 1
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

        completion = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert completion.choices[0].text == "Bon"
        assert completion.choices[0].finish_reason == "length"

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5
            )
        assert "temperature" in str(exc.value)
