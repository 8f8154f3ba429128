"""The Messages API in process, over a scripted fake engine: the translation into chat,
content blocks and the streamed events in Anthropic's order, thinking, tool calls parsed
from text, errors mid-stream, the overloaded engine's 529, and ``x-api-key``.

The real server with Anthropic's SDK: tests/e2e/test_anthropic_sdk.py."""

from __future__ import annotations

import json

import pytest

from serving.gateway.anthropic.messages_protocol import MessagesRequest
from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, ThinkingTokenizer
from tests.support.gateway_harness import MODEL, TOK, client_for, make_app

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Hi"}]


def typed_events(body: str) -> list[dict]:
    """The ``event: <type>`` / ``data: <JSON>`` events of a body, each type checked."""
    events = []
    for block in body.split("\n\n")[:-1]:
        head, data = block.split("\n", 1)
        event = json.loads(data[len("data: "):])
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def assert_anthropic_error(r, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    assert r.headers["request-id"] == r.headers["x-request-id"]
    return body["error"]["message"]


def test_translation_into_chat():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "hmm", "signature": "s"},
                         {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                         {"type": "text", "text": "and?", "cache_control": {"type": "ephemeral"}}]}]})
    chat = req.chat_request()
    msgs = [m.to_template() for m in chat.messages]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert msgs[2]["reasoning_content"] == "hmm"
    assert (msgs[3]["tool_call_id"], msgs[3]["name"], msgs[3]["content"]) == ("t1", "f", "42")
    assert chat.effective_tool_choice.name == "f" and chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (9, ["END"], 0.5, 3)


async def test_stream_events_in_anthropic_order_and_the_same_message_unstreamed():
    app = make_app(FakeEngine(text="Hello world"))
    async with client_for(app) as c:
        body = {"model": MODEL, "max_tokens": 50, "messages": USER}
        whole = (await c.post("/v1/messages", json=body)).json()
        r = await c.post("/v1/messages", json={**body, "stream": True}, headers={"anthropic-version": "2023-06-01"})
    events = typed_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello world" == whole["content"][0]["text"]
    assert whole["stop_reason"] == events[-2]["delta"]["stop_reason"] == "end_turn"
    assert whole["id"].startswith("msg_") and whole["type"] == "message" and whole["role"] == "assistant"
    start = events[0]["message"]["usage"]
    assert start["output_tokens"] == 0 and start["input_tokens"] == whole["usage"]["input_tokens"]
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == len("Hello world") + 1


async def test_thinking_blocks_only_when_enabled():
    tok = ThinkingTokenizer()
    engine = FakeEngine(responder=lambda req: [*tok.encode_markup("<think>plan</think>"), *tok.encode("Done")],
                        model_len=4096)
    app = create_app({MODEL: ServedModel(MODEL, engine, tok, 4096, created=1, reasoning_parser="think")})
    body = {"model": MODEL, "max_tokens": 2000, "messages": USER}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    async with client_for(app) as c:
        shown = (await c.post("/v1/messages", json={**body, "thinking": thinking})).json()
        hidden = (await c.post("/v1/messages", json=body)).json()
        r = await c.post("/v1/messages", json={**body, "thinking": thinking, "stream": True})
    assert shown["content"] == [{"type": "thinking", "thinking": "plan", "signature": ""},
                                {"type": "text", "text": "Done"}]
    assert hidden["content"] == [{"type": "text", "text": "Done"}]
    deltas = [e["delta"]["type"] for e in typed_events(r.text) if e["type"] == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"


async def test_tool_call_parsed_from_text_streams_input_json_deltas():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    app = create_app({MODEL: ServedModel(MODEL, FakeEngine(text=call), TOK, 512, created=1,
                                         tool_call_parser="hermes")})
    body = {"model": MODEL, "max_tokens": 200, "messages": USER, "tools": [
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}
    async with client_for(app) as c:
        whole = (await c.post("/v1/messages", json=body)).json()
        r = await c.post("/v1/messages", json={**body, "stream": True})
    assert whole["stop_reason"] == "tool_use"
    [block] = whole["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {"city": "Paris"})
    events = typed_events(r.text)
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}


async def test_stop_sequence_reported():
    app = make_app(FakeEngine(text="one two three"))
    async with client_for(app) as c:
        r = (await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": USER,
                                                "stop_sequences": ["xyz", " two"]})).json()
    assert (r["stop_reason"], r["stop_sequence"], r["content"][0]["text"]) == ("stop_sequence", " two", "one")


async def test_error_mid_stream_is_an_error_event():
    app = make_app(FakeEngine(text="Hello world", fail_after=3))
    async with client_for(app) as c:
        r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 50, "messages": USER, "stream": True})
    events = typed_events(r.text)
    assert r.status_code == 200 and events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"


async def test_overloaded_engine_is_529_and_unknown_model_404():
    async with client_for(make_app(FakeEngine(overloaded=True))) as c:
        r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": USER})
        assert_anthropic_error(r, 529, "overloaded_error")
        assert "Retry-After" in r.headers
        r = await c.post("/v1/messages/count_tokens", json={"model": "nope", "messages": USER})
        assert_anthropic_error(r, 404, "not_found_error")


async def test_x_api_key_once_keys_exist(tmp_path):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        app = create_app({MODEL: ServedModel(MODEL, FakeEngine(), TOK, 512, created=1)}, services)
        key, _ = services.authenticator.key_store.create_key("acme")
        services.authenticator._has_keys = (-1e9, False)
        body = {"model": MODEL, "max_tokens": 5, "messages": USER}
        async with client_for(app) as c:
            assert_anthropic_error(await c.post("/v1/messages", json=body), 401, "authentication_error")
            r = await c.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
            assert_anthropic_error(r, 401, "authentication_error")
            r = await c.post("/v1/messages", json=body, headers={"x-api-key": key})
            assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello"
            r = await c.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER},
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["input_tokens"] > 0
            assert (await c.get("/v1/models", headers={"x-api-key": key})).status_code == 200
    finally:
        services.close()
