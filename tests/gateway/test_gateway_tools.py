"""Tool calling and reasoning on /v1/chat/completions, over the scripted fake engine:
forced calls under a JSON schema, the model's own calls parsed ("auto"), tool results
through the chat template, streamed tool-call deltas, reasoning apart from the answer
and counted by token ids, and the ledger's reasoning_tokens / tool_calls columns."""

from __future__ import annotations

import json

import openai
import pytest

from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import (
    THINK_END_ID,
    THINK_START_ID,
    FakeEngine,
    ThinkingTokenizer,
)
from tests.support.gateway_harness import MODEL, TOK, assert_openai_error, byte_ids, client_for, parse_sse

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]


def _app(engine: FakeEngine, tokenizer=TOK, services: GatewayServices | None = None, **served):
    return create_app({MODEL: ServedModel(MODEL, engine, tokenizer, 512, created=1, **served)}, services)


def _openai(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                              http_client=client_for(app))


async def _streamed(client: openai.AsyncOpenAI, **kw) -> tuple[list, dict]:
    """(chunks, the reassembled choice 0: content, reasoning, tool calls, finish reasons)."""
    stream = await client.chat.completions.create(model=MODEL, stream=True, **kw)
    chunks = [c async for c in stream]
    calls: dict[int, dict] = {}
    out = {"content": "", "reasoning": "", "finish": [], "calls": calls}
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: all but the arguments
                    assert tc.id and tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
            if ch.finish_reason is not None:
                out["finish"].append(ch.finish_reason)
    return chunks, out


async def test_required_forces_a_schema_valid_call_streamed_and_not():
    script = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    engine = FakeEngine(text=script, chunk=3)
    client = _openai(_app(engine))
    r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                             tool_choice="required")
    so = engine.submitted[0].sampling.structured_output
    schema = json.loads(so.value)
    assert so.kind == "json_schema" and schema["type"] == "array" and schema["minItems"] == 1
    assert {i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]} == {"get_weather", "get_time"}
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    _, s = await _streamed(client, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    assert s["finish"] == ["tool_calls"] and s["content"] == ""
    assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [
        (call.function.name, call.function.arguments)]


async def test_parallel_tool_calls_false_allows_one_call():
    engine = FakeEngine(text='[{"name": "get_time", "parameters": {}}]')
    r = await _openai(_app(engine)).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(engine.submitted[0].sampling.structured_output.value)["maxItems"] == 1
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        ("get_time", "{}")]


async def test_named_function_streams_its_arguments():
    engine = FakeEngine(text='{"city": "Paris"}', chunk=2)
    client = _openai(_app(engine))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chunks, s = await _streamed(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    so = engine.submitted[0].sampling.structured_output
    assert json.loads(so.value) == WEATHER["function"]["parameters"]
    assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [("get_weather", '{"city": "Paris"}')]
    assert s["finish"] == ["tool_calls"]
    fragments = [tc.function.arguments for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert len(fragments) > 3  # the arguments came in pieces, not at the end


async def test_auto_parses_the_models_own_calls_two_in_one_delta():
    text = '[get_weather(city="Paris"), get_time()]'
    engine = FakeEngine(text=text, chunk=len(byte_ids(text)))  # the whole output in one event
    client = _openai(_app(engine, tool_call_parser="pythonic"))
    _, s = await _streamed(client, messages=ASK, tools=[WEATHER, TIME])
    assert engine.submitted[0].sampling.structured_output is None
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert s["calls"][1]["arguments"] == "{}" and s["finish"] == ["tool_calls"]
    r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    assert [c.function.arguments for c in r.choices[0].message.tool_calls] == ['{"city": "Paris"}', "{}"]


async def test_auto_answer_without_a_call_is_content():
    engine = FakeEngine(text="It is sunny.")
    r = await _openai(_app(engine, tool_call_parser="pythonic")).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


async def test_tool_results_render_through_the_template():
    engine = FakeEngine(text="Sunny in Paris.")
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = await _openai(_app(engine, tool_call_parser="pythonic")).chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "Sunny in Paris."
    prompt = TOK.decode(engine.submitted[0].prompt_ids)
    assert "tool: sunny, 21 C" in prompt and '"get_weather"' in prompt
    assert '"arguments": {"city": "Paris"}' in prompt  # arguments reach the template as an object


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages"),
])
async def test_bad_tool_requests_are_400s(body, param):
    async with client_for(_app(FakeEngine(), tool_call_parser="pythonic")) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    err = assert_openai_error(r, 400)
    assert err["param"] == param or (err["param"] or "").startswith(param), err


async def test_auto_without_a_parser_is_a_400():
    async with client_for(_app(FakeEngine())) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]})
    assert "--tool-call-parser" in assert_openai_error(r, 400, param="tool_choice")["message"]


# ---------------------------------------------------------------- reasoning


K = 7  # thinking tokens in the scripts below


def _thinking_script(opened_by_template: bool) -> list[int]:
    thought = byte_ids("abcdefg")
    assert len(thought) == K
    return [*([] if opened_by_template else [THINK_START_ID]), *thought, THINK_END_ID, *byte_ids("\nParis.")]


@pytest.mark.parametrize("opened_by_template", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_tokens_counted_by_ids_and_in_the_ledger(tmp_path, opened_by_template, stream):
    tok = ThinkingTokenizer(opens_thinking=opened_by_template)
    engine = FakeEngine(responder=lambda r: _thinking_script(opened_by_template), chunk=2)
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        client = _openai(_app(engine, tok, services, reasoning_parser="think"))
        if stream:
            chunks, s = await _streamed(client, messages=ASK, stream_options={"include_usage": True})
            usage, content, reasoning = chunks[-1].usage, s["content"], s["reasoning"]
        else:
            r = await client.chat.completions.create(model=MODEL, messages=ASK)
            usage, content = r.usage, r.choices[0].message.content
            reasoning = r.choices[0].message.reasoning_content
        assert (reasoning, content) == ("abcdefg", "Paris.")
        assert usage.completion_tokens_details.reasoning_tokens == K
        assert usage.completion_tokens == len(_thinking_script(opened_by_template)) + 1  # + EOS
        services.ledger.flush()
        [row] = services.ledger.rows()
        assert (row["status"], row["reasoning_tokens"], row["completion_tokens"]) == (
            "ok", K, usage.completion_tokens)
    finally:
        services.close()


async def test_structured_output_starts_after_the_thinking():
    engine = FakeEngine(responder=lambda r: _thinking_script(False))
    async with client_for(_app(engine, ThinkingTokenizer(), reasoning_parser="think")) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    so = engine.submitted[0].sampling.structured_output
    assert (so.kind, so.after_token_id) == ("json_object", THINK_END_ID)


async def test_a_template_that_closed_the_thinking_turns_reasoning_off():
    class Closed(ThinkingTokenizer):
        def apply_chat_template(self, messages, tools=None):
            return super().apply_chat_template(messages, tools) + [THINK_START_ID, THINK_END_ID]

    engine = FakeEngine(text='{"a": 1}')
    async with client_for(_app(engine, Closed(), reasoning_parser="think")) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "response_format": {"type": "json_object"}})
    assert engine.submitted[0].sampling.structured_output.after_token_id is None
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 1}'}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


async def test_no_reasoning_parser_leaves_the_message_as_it_was(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    events = parse_sse((await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "stream": True})).text)
    assert all(set(e["choices"][0]["delta"]) <= {"role", "content"} for e in events[:-1] if e["choices"])
