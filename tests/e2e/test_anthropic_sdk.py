"""Anthropic's Python SDK against a real ``xlaserve serve``: ``/v1/messages`` plain,
streamed, a tools round trip, stop sequences, ``count_tokens``, and ten kinds of bad
request, each with Anthropic's error shape and status; every request's ledger row
(``GET /v1/requests/{id}``) holds the usage the SDK saw.

The session's shared server (``tiny_server``: ``TINY_SERVER_ARGS``, no new compiled
shapes); the tiny random model has no vision tower, so an image block gets the
Anthropic-shaped 400; the SDK's image blocks on a vision model are in
tests/e2e/test_serve_vision.py (its server: the same answer and prompt as the chat route's).
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

MODEL = "tiny-random"
USER = [{"role": "user", "content": "Say hello."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}
PNG_1PX = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="any-key", max_retries=0)


def ledger_row(server: str, message_id: str) -> dict:
    r = httpx.get(f"{server}/v1/requests/{message_id}")
    assert r.status_code == 200, r.text
    return r.json()


def assert_ledger_matches(server: str, message) -> dict:
    row = ledger_row(server, message.id)
    u = message.usage
    assert row["status"] == "ok"
    assert row["usage"]["prompt_tokens"] == u.input_tokens + u.cache_read_input_tokens
    assert row["usage"]["prompt_tokens_details"]["cached_tokens"] == u.cache_read_input_tokens
    assert row["usage"]["completion_tokens"] == u.output_tokens
    return row


def test_plain_message(client, server):
    # The SDK's newer releases no longer name the sampling fields: they go as extra body fields.
    m = client.messages.create(model=MODEL, max_tokens=6, messages=USER, system="Be brief.",
                               extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20},
                               metadata={"user_id": "user-7"})
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens >= 1
    assert all(b.type == "text" for b in m.content)
    row = assert_ledger_matches(server, m)
    assert {"event": "metadata", "user_id": "user-7"}.items() <= next(
        e for e in row["events"] if e["event"] == "metadata").items()


def test_streamed_message(client, server):
    with client.messages.stream(model=MODEL, max_tokens=6, messages=USER) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "".join(b.text for b in final.content)
    assert final.usage.output_tokens >= 1 and final.stop_reason in ("max_tokens", "end_turn")
    assert_ledger_matches(server, final)


def test_stop_sequence_at_greedy_text(client, server):
    greedy = {"temperature": 0}
    base = client.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=greedy)
    text = "".join(b.text for b in base.content)
    stop = text[len(text) // 2:len(text) // 2 + 1]
    if not stop.strip():
        pytest.skip(f"no stop sequence to take from the greedy text {text!r}")
    m = client.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=greedy, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    before = text[:text.index(stop)]
    assert "".join(b.text for b in m.content) == (before if before.strip() else "")
    assert_ledger_matches(server, m)


def test_tools_round_trip(client, server):
    first = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], messages=USER,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo")
    assert ledger_row(server, first.id)["tool_calls"] == 1
    assert_ledger_matches(server, first)
    second = client.messages.create(model=MODEL, max_tokens=5, tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=[*USER, {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "Sunny, 21 C"}]}])
    prompt = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert second.stop_reason in ("max_tokens", "end_turn") and prompt(second) > prompt(first)
    assert_ledger_matches(server, second)


def test_count_tokens_is_the_prompt_a_message_uses(client):
    body = dict(model=MODEL, messages=USER, system="Be brief.", tools=[WEATHER])
    counted = client.messages.count_tokens(**body).input_tokens
    m = client.messages.create(max_tokens=1, tool_choice={"type": "any"}, **body)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


BAD_REQUESTS = [
    ("max_tokens missing", {"model": MODEL, "messages": USER}, 400, "invalid_request_error"),
    ("unknown model", {"model": "nope", "max_tokens": 5, "messages": USER}, 404, "not_found_error"),
    ("temperature above 1", {"model": MODEL, "max_tokens": 5, "messages": USER, "temperature": 1.5},
     400, "invalid_request_error"),
    ("unknown block type", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]}, 400, "invalid_request_error"),
    ("tool_result of no tool_use", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400, "invalid_request_error"),
    ("server tool", {"model": MODEL, "max_tokens": 5, "messages": USER,
                     "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error"),
    ("assistant prefill", {"model": MODEL, "max_tokens": 5, "messages": [*USER, {"role": "assistant",
                                                                                "content": "Hel"}]},
     400, "invalid_request_error"),
    ("thinking budget not below max_tokens", {"model": MODEL, "max_tokens": 100, "messages": USER,
                                              "thinking": {"type": "enabled", "budget_tokens": 1024}},
     400, "invalid_request_error"),
    ("image on a model without vision", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1PX}}]}]},
     400, "invalid_request_error"),
    ("context window exceeded", {"model": MODEL, "max_tokens": 100000, "messages": USER},
     400, "invalid_request_error"),
]


@pytest.mark.parametrize("name,body,status,kind", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_anthropics_error(server, name, body, status, kind):
    r = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.json()
    assert r.headers["request-id"]


def test_sdk_raises_its_typed_errors(client, server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error" and e.value.request_id
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1PX}}]}])
    r = httpx.post(f"{server}/v1/messages", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
