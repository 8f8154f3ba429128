"""The Responses API (/v1/responses) in-process with the official ``openai`` client,
over the scripted fake engine: text, streamed typed events, function calls (forced
and the model's own), reasoning, max_output_tokens, previous_response_id chains
stored per tenant, GET / DELETE, and a batch line for /v1/responses."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serving.gateway.app import ServedModel, create_app
from serving.gateway.batch.batch_runner import BatchSettings
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import THINK_END_ID, THINK_START_ID, FakeEngine, FakeTokenizer, ThinkingTokenizer
from tests.support.gateway_harness import assert_openai_error, byte_ids

pytestmark = pytest.mark.anyio
MODEL = "gemma-3-270m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def services(tmp_path):
    s = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    yield s
    s.close()


def _app(engine, services=None, tokenizer=None, **served):
    return create_app({MODEL: ServedModel(MODEL, engine, tokenizer or FakeTokenizer(), 512, created=1, **served)},
                      services, batches=BatchSettings(poll_seconds=0.05))


def _client(app, key: str = "unused") -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def _prompt(engine: FakeEngine, k: int = -1) -> str:
    return FakeTokenizer().decode(engine.submitted[k].prompt_ids)


async def test_text_response_streamed_and_not(services):
    engine = FakeEngine(text="Paris is the capital.", chunk=3)
    client = _client(_app(engine, services))
    r = await client.responses.create(model=MODEL, input="Capital of France?", instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Paris is the capital."
    [msg] = r.output
    assert (msg.type, msg.role, msg.status, msg.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert r.usage.output_tokens == len(byte_ids("Paris is the capital.")) + 1  # and the EOS
    assert r.usage.input_tokens == len(engine.submitted[0].prompt_ids)
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.instructions == "Be brief."
    assert "Be brief." in _prompt(engine) and "Capital of France?" in _prompt(engine)

    stream = await client.responses.create(model=MODEL, input="Capital of France?", stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == "Paris is the capital."
    final = events[-1].response
    assert final.output_text == "Paris is the capital." and final.usage.total_tokens > 0
    # the stored response is the one the stream ended with
    assert (await client.responses.retrieve(final.id)).model_dump() == final.model_dump()
    rows = {row["request_id"]: row for row in services.ledger.rows()}
    assert rows[r.id]["status"] == "ok" and rows[final.id]["stream"]


async def test_required_tool_call_streamed_and_not_then_its_output_answered(services):
    calls = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    scripts = iter([calls, calls, "It is sunny in Paris."])
    engine = FakeEngine(responder=lambda r: byte_ids(next(scripts)), chunk=4)
    client = _client(_app(engine, services, tool_call_parser="pythonic"))
    r = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                      tool_choice="required")
    [call] = r.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather"

    stream = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                           tool_choice="required", stream=True)
    events = [e async for e in stream]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name, i.arguments) for i in added] == [("function_call", "get_weather", "")]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(fragments) == done.arguments == call.arguments
    assert events[-1].type == "response.completed"

    # the tool's result, continuing the first response: rendered through the template
    answer = await client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert answer.output_text == "It is sunny in Paris." and answer.previous_response_id == r.id
    prompt = _prompt(engine)
    assert "Weather in Paris?" in prompt and '"get_weather"' in prompt and "tool: sunny, 21 C" in prompt


async def test_the_models_own_calls_then_text_as_items_in_order():
    engine = FakeEngine(text='[get_weather(city="Paris"), get_weather(city="Rome")]\n Checking.', chunk=5)
    client = _client(_app(engine, tool_call_parser="pythonic"))
    r = await client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], store=False)
    assert [i.type for i in r.output] == ["function_call", "function_call", "message"]
    assert [json.loads(i.arguments)["city"] for i in r.output[:2]] == ["Paris", "Rome"]
    assert len({i.call_id for i in r.output[:2]}) == 2
    assert r.output[2].content[0].text == "Checking."


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unfinished_streamed_call_is_left_out_and_its_text_is_content(stream):
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    client = _client(_app(FakeEngine(text=text, chunk=6), tool_call_parser="hermes"))
    kw = dict(model=MODEL, input="Weather?", tools=[WEATHER], store=False)
    if stream:
        events = [e async for e in await client.responses.create(**kw, stream=True)]
        assert any(e.type == "response.function_call_arguments.delta" for e in events)  # it had started
        r = events[-1].response
    else:
        r = await client.responses.create(**kw)
    # the text before the call, then the call's own text: two messages, as they were streamed
    assert [i.type for i in r.output] == ["message", "message"]
    assert r.output_text == text


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_its_own_item_and_counted(services, stream):
    thought = byte_ids("abcdefg")
    engine = FakeEngine(responder=lambda r: [THINK_START_ID, *thought, THINK_END_ID, *byte_ids("\nParis.")],
                        chunk=2)
    client = _client(_app(engine, services, ThinkingTokenizer(), reasoning_parser="think"))
    if stream:
        events = [e async for e in await client.responses.create(model=MODEL, input="Capital?", stream=True)]
        text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert text == "abcdefg"
        r = events[-1].response
    else:
        r = await client.responses.create(model=MODEL, input="Capital?")
    reasoning, msg = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "abcdefg"
    assert msg.content[0].text == "Paris." and r.output_text == "Paris."
    assert r.usage.output_tokens_details.reasoning_tokens == len(thought)
    [row] = services.ledger.rows()
    assert row["reasoning_tokens"] == len(thought)
    # the output sent back as input, as clients build the next turn (reasoning item included)
    items = [i.model_dump(exclude_none=True) for i in r.output]
    again = await client.responses.create(model=MODEL, input=[*items, {"role": "user", "content": "And?"}],
                                          store=False)
    assert again.status == "completed" and "Paris." in ThinkingTokenizer().decode(engine.submitted[-1].prompt_ids)


async def test_max_output_tokens_makes_it_incomplete():
    client = _client(_app(FakeEngine(text="a long answer that goes on")))
    r = await client.responses.create(model=MODEL, input="Go on.", max_output_tokens=5, store=False)
    assert (r.status, r.incomplete_details.reason, r.output[0].status) == (
        "incomplete", "max_output_tokens", "incomplete")
    assert r.output_text == "a lon" and r.usage.output_tokens == 5


async def test_previous_response_id_continues_the_conversation_per_tenant(services):
    answers = iter(["Paris.", "About two million.", "x"])
    engine = FakeEngine(responder=lambda r: byte_ids(next(answers)))
    app = _app(engine, services)
    keys = services.authenticator.key_store
    (key_a, _), (key_b, _) = keys.create_key("acme"), keys.create_key("globex")
    a, b = _client(app, key_a), _client(app, key_b)
    first = await a.responses.create(model=MODEL, input="Capital of France?", instructions="Be brief.")
    second = await a.responses.create(model=MODEL, input="Its population?", previous_response_id=first.id)
    prompt = _prompt(engine)
    assert prompt.index("Capital of France?") < prompt.index("Paris.") < prompt.index("Its population?")
    assert "Be brief." not in prompt  # instructions do not carry over
    assert second.output_text == "About two million."
    assert (await a.responses.retrieve(second.id)).previous_response_id == first.id

    with pytest.raises(openai.NotFoundError):
        await b.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        await b.responses.create(model=MODEL, input="And?", previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        await b.responses.delete(first.id)
    await a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(first.id)
    assert len(engine.submitted) == 2  # the refused requests never reached the engine


async def test_store_false_keeps_nothing(services):
    client = _client(_app(FakeEngine(), services))
    r = await client.responses.create(model=MODEL, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "42"}]}, "input[0].call_id"),
])
async def test_bad_requests_get_a_clear_400(body, param):
    engine = FakeEngine()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(engine)),
                                 base_url="http://testserver") as c:
        r = await c.post("/v1/responses", json={"model": MODEL, **body})
    err = assert_openai_error(r, 400, param=param)
    assert "response_format" not in err["message"]  # the Responses API's own field names
    assert engine.submitted == []


async def test_a_batch_line_for_v1_responses(services):
    app = _app(FakeEngine(text="Hello"), services)
    client = _client(app)
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "input": "Hi", "max_output_tokens": 8}}
    async with app.router.lifespan_context(app):
        f = await client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                                            completion_window="24h")
        for _ in range(400):
            batch = await client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed"):
                break
            await asyncio.sleep(0.025)
        assert batch.status == "completed", batch
        [out] = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).text.splitlines()]
    body = out["response"]["body"]
    assert (out["custom_id"], body["object"], body["status"]) == ("r1", "response", "completed")
    assert body["output"][0]["content"][0]["text"] == "Hello"
    [row] = services.ledger.rows()
    assert (row["priority"], row["status"], row["request_id"]) == ("batch", "ok", body["id"])
