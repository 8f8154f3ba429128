"""Protocol strictness of the gateway (issue 18): input validation to 400, Content-Type,
null as absent, unsupported fields, GET /v1/models/{id}, the OpenAPI description.

In-process, against the scripted fake engine (no model, no JAX).
"""

from __future__ import annotations

import json

import httpx
import pytest

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.app import ServedModel, create_app
from serving.gateway.schema.protocol import INT32_MAX, ChatCompletionRequest, CompletionRequest
from serving.gateway.schema.unsupported_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    SAMPLING_FIELDS,
    STREAM_OPTION_FIELDS,
)
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import VOCAB_SIZE, FakeEngine, FakeTokenizer
from tests.support.gateway_harness import (
    CHAT,
    MODEL,
    assert_openai_error,
    assert_still_serving,
    client_for,
    parse_sse,
)

pytestmark = pytest.mark.anyio
COMPLETION = {"model": MODEL, "prompt": "Say hi"}
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


def post_raw(client: httpx.AsyncClient, path: str, raw: bytes, content_type="application/json"):
    headers = {} if content_type is None else {"content-type": content_type}
    return client.post(path, content=raw, headers=headers)


# ------------------------------------------------------------- lone surrogates

# Each body holds "\ud800" (as JSON escapes it) in one string field; param is that field.
SURROGATE_CASES = [
    ("/v1/completions", '{"model": "M", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "M", "prompt": ["a\\udc00"]}', "prompt"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "stop": "\\ud800"}', "stop[0]"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "stop": ["ok", "\\udfff"]}', "stop[1]"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "cache_salt": "s\\ud800"}', "cache_salt"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "stream": true, "stream_options": '
                        '{"include_usage": true}, "suffix": "\\ud800"}', "suffix"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"model": "M", "stream": true, "messages": [{"role": "system", "content": "s"},'
                             ' {"role": "user", "content": [{"type": "text", "text": "ok"},'
                             ' {"type": "text", "text": "\\udbff"}]}]}', "messages[1].content"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "\\ud800", "content": "x"}]}',
     "messages[0].role"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
     "model"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_CASES)
async def test_lone_surrogates_are_400_naming_the_field(client, engine, path, raw, param):
    r = await post_raw(client, path, raw.replace('"M"', json.dumps(MODEL)).encode())
    err = assert_openai_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"]
    assert engine.submitted == []
    await assert_still_serving(client)


async def test_surrogate_pairs_are_valid_text(client, engine):
    r = await post_raw(client, "/v1/completions",
                       json.dumps({**COMPLETION, "prompt": "smile \U0001F600"}).encode())
    assert r.status_code == 200, r.text
    assert list(engine.submitted[0].prompt_ids) == FakeTokenizer().encode("smile \U0001F600", add_bos=True)


# ------------------------------------------------------------- integer bounds


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field,value", [
    ("top_k", 3_000_000_000), ("top_k", INT32_MAX + 1),
    ("max_tokens", INT32_MAX + 1), ("max_tokens", 10**30),
    ("max_completion_tokens", INT32_MAX + 1),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("n", 10**20),
])
async def test_integers_out_of_range_are_400(client, engine, path, field, value):
    r = await client.post(path, json={**ROUTES[path], field: value})
    assert_openai_error(r, 400, param=field)
    assert engine.submitted == []


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "best_of", 10**20), ("/v1/completions", "logprobs", 21),
    ("/v1/chat/completions", "top_logprobs", 21)])
async def test_refused_integers_out_of_range_are_400(client, path, field, value):
    assert_openai_error(await client.post(path, json={**ROUTES[path], field: value}), 400, param=field)


@pytest.mark.parametrize("top_k,engine_top_k", [
    (VOCAB_SIZE - 1, VOCAB_SIZE - 1), (VOCAB_SIZE, 0), (INT32_MAX, 0), (0, 0), (-1, 0)])
async def test_top_k_of_the_whole_vocabulary_disables_it(client, engine, top_k, engine_top_k):
    r = await client.post("/v1/completions", json={**COMPLETION, "top_k": top_k})
    assert r.status_code == 200, r.text
    assert engine.submitted[0].sampling.top_k == engine_top_k


async def test_seed_range_reaches_the_engine(client, engine):
    """seed is an int64, as vLLM checks it."""
    for seed in (-(2**63), 2**63 - 1):
        r = await client.post("/v1/completions", json={**COMPLETION, "seed": seed})
        assert r.status_code == 200, r.text
    assert [r.sampling.seed for r in engine.submitted] == [-(2**63), 2**63 - 1]
    assert_openai_error(await client.post("/v1/completions", json={**COMPLETION, "seed": 2**63}),
                        400, param="seed")


async def test_largest_max_tokens_gets_the_context_error(client):
    for path in ROUTES:
        r = await client.post(path, json={**ROUTES[path], "max_tokens": INT32_MAX})
        assert_openai_error(r, 400, code="context_length_exceeded")


@pytest.mark.parametrize("raw,detail", [
    (b'{"model": "M", "prompt": ' + b"7" * 5000 + b"}", "digits"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "M", "prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"model": "M", "prompt": "x", "top_p": Infinity}', "Infinity"),
    (b'{"model": "M", "prompt": "\xff"}', "decode"),
])
async def test_json_that_python_parses_loosely_or_not_at_all_is_400(client, raw, detail):
    for path in ROUTES:
        r = await post_raw(client, path, raw)
        err = assert_openai_error(r, 400, code="invalid_json")
        assert detail in err["message"]
    await assert_still_serving(client)


# ------------------------------------------------------------- Content-Type


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/jsonx"])
async def test_json_routes_need_the_json_content_type(client, engine, content_type):
    for path, body in ROUTES.items():
        r = await post_raw(client, path, json.dumps(body).encode(), content_type)
        err = assert_openai_error(r, 415, code="unsupported_media_type")
        assert "application/json" in err["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", "Application/JSON;Charset=UTF-8"])
async def test_json_content_type_variants_are_served(client, content_type):
    for path, body in ROUTES.items():
        r = await post_raw(client, path, json.dumps(body).encode(), content_type)
        assert r.status_code == 200, r.text


# ------------------------------------------------------------- null means absent


def _optional_fields(model) -> list[str]:
    return [name for name, f in model.model_fields.items() if not f.is_required()]


@pytest.mark.parametrize("path,model", [
    ("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)])
async def test_null_is_absent_for_every_optional_field(client, engine, path, model):
    fields = _optional_fields(model)
    assert {"stream", "echo", "stream_options", "n", "priority"} & set(fields)
    nulls = dict.fromkeys([*fields, *COMPLETION_FIELDS, *CHAT_FIELDS])
    r = await client.post(path, json={**ROUTES[path], **nulls})
    assert r.status_code == 200, r.text
    r = await client.post(path, json={**ROUTES[path], "stream": True, "stream_options": {
        "include_usage": None, "continuous_usage_stats": None}})
    assert r.status_code == 200, r.text
    assert "usage" not in parse_sse(r.text)[-2]
    messages = [{"role": "user", "content": None, "tool_calls": None}]
    r = await client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


async def test_null_for_a_required_field_is_missing(client):
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt": None})
    assert "Missing" in assert_openai_error(r, 400, param="prompt")["message"]


# ------------------------------------------------------------- stream_options, max_completion_tokens


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("stream", [{}, {"stream": False}, {"stream": None}])
async def test_stream_options_without_stream_are_400(client, engine, path, stream):
    r = await client.post(path, json={**ROUTES[path], **stream, "stream_options": {"include_usage": True}})
    err = assert_openai_error(r, 400, param="stream_options")
    assert "stream" in err["message"]
    assert engine.submitted == []


async def test_completions_take_max_completion_tokens(client, engine):
    r = await client.post("/v1/completions", json={**COMPLETION, "max_completion_tokens": 3})
    assert r.json()["choices"][0]["text"] == "Hel"
    r = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 40, "max_completion_tokens": 5})
    assert r.json()["choices"][0]["text"] == "Hello"
    assert [r.sampling.max_tokens for r in engine.submitted] == [3, 5]
    r = await client.post("/v1/completions", json={**COMPLETION, "max_completion_tokens": 0})
    assert_openai_error(r, 400, param="max_completion_tokens")


# ------------------------------------------------------------- unsupported fields


def _non_neutral(name: str, table):
    """A value of `name` that would change the output."""
    special = {"min_p": 0.05, "repetition_penalty": 1.1, "length_penalty": 0.5, "min_tokens": 4,
               "truncate_prompt_tokens": 8, "prompt_logprobs": 1, "stop_token_ids": [5],
               "allowed_token_ids": [5, 6], "bad_words": ["no"], "logits_processors": ["m.P"],
               "guided_choice": ["yes", "no"], "guided_json": {"type": "object"},
               "structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"},
               "modalities": ["text", "audio"], "chat_template_kwargs": {"enable_thinking": True},
               "vllm_xargs": {"k": 1}, "documents": [{"title": "t", "text": "x"}],
               "web_search_options": {}, "audio": {"voice": "alloy"}, "prompt_embeds": "AAAA",
               "best_of": 3}
    if name in special:
        return special[name]
    neutral = table[name].neutral
    if neutral and isinstance(neutral[0], bool):
        return not neutral[0]
    return "x"


def _table_cases():
    for path, table in (("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)):
        for name in table:
            yield path, name


def test_the_table_lists_the_vllm_fields_that_change_output():
    must = {"guided_decoding_backend", "use_beam_search", "length_penalty",
            "include_stop_str_in_output", "prompt_logprobs", "bad_words", "allowed_token_ids",
            "truncate_prompt_tokens", "skip_special_tokens", "logits_processors"}
    assert must <= set(SAMPLING_FIELDS)
    # Implemented now: fields of the request models, off the refusal tables.
    implemented = {"min_p", "repetition_penalty", "min_tokens", "stop_token_ids"}
    assert implemented <= set(CompletionRequest.model_fields) & set(ChatCompletionRequest.model_fields)
    assert SAMPLING_FIELDS.keys() <= COMPLETION_FIELDS.keys() & CHAT_FIELDS.keys()
    # A field the models implement is never in the tables (it would be refused twice).
    for model, table in ((CompletionRequest, COMPLETION_FIELDS), (ChatCompletionRequest, CHAT_FIELDS)):
        assert not set(model.model_fields) & set(table)


@pytest.mark.parametrize("path,name", list(_table_cases()))
async def test_unsupported_field_is_400_naming_it_unless_neutral(client, engine, path, name):
    table = COMPLETION_FIELDS if path == "/v1/completions" else CHAT_FIELDS
    r = await client.post(path, json={**ROUTES[path], name: _non_neutral(name, table)})
    err = assert_openai_error(r, 400, param=name)
    assert f"'{name}'" in err["message"] and "Omit it" in err["message"]
    assert engine.submitted == []
    for value in (*table[name].neutral, None):
        r = await client.post(path, json={**ROUTES[path], name: value})
        assert r.status_code == 200, (name, value, r.text)


async def test_neutral_means_equal_not_truthy_alike(client):
    for name, value in [("skip_special_tokens", 1), ("use_beam_search", 0),
                        ("include_stop_str_in_output", 0), ("length_penalty", True),
                        ("length_penalty", "1")]:
        r = await client.post("/v1/completions", json={**COMPLETION, name: value})
        assert_openai_error(r, 400, param=name)
    r = await client.post("/v1/completions", json={**COMPLETION, "use_beam_search": False,
                                                   "length_penalty": 1.0})
    assert r.status_code == 200


@pytest.mark.parametrize("name", STREAM_OPTION_FIELDS)
async def test_unsupported_stream_option_is_400_naming_it(client, name):
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True, name: True}}
    r = await client.post("/v1/completions", json=body)
    assert_openai_error(r, 400, param=f"stream_options.{name}")
    body["stream_options"][name] = False
    assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_unknown_fields_stay_ignored(client):
    r = await client.post("/v1/completions", json={
        **COMPLETION, "user": "u", "metadata": {"a": "b"}, "request_id": "r", "kv_transfer_params": {},
        "spaces_between_special_tokens": False, "future_field": [1, 2]})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------- GET /v1/models/{id}


class _OneTenant:
    """An authenticator whose every caller may use only `models`."""

    def __init__(self, models):
        self.models = frozenset(models)

    async def authenticate(self, header):
        return Principal(tenant="t", key_id="k", models=self.models)


def _two_model_app(services=None):
    engine = FakeEngine()
    served = {name: ServedModel(name, engine, FakeTokenizer(), 512, created=1700000000)
              for name in (MODEL, "org/model-b")}
    return create_app(served, services)


async def test_retrieve_model():
    async with client_for(_two_model_app()) as client:
        r = await client.get(f"/v1/models/{MODEL}")
        assert r.status_code == 200
        assert r.json() == {"id": MODEL, "object": "model", "created": 1700000000,
                            "owned_by": "xlaserve", "max_model_len": 512, "parent": None}
        r = await client.get("/v1/models/org/model-b")
        assert (r.status_code, r.json()["id"]) == (200, "org/model-b")
        r = await client.get("/v1/models/org%2Fmodel-b")
        assert (r.status_code, r.json()["id"]) == (200, "org/model-b")
        for missing in ("gpt-9", "org/model-b/extra", "org"):
            r = await client.get(f"/v1/models/{missing}")
            err = assert_openai_error(r, 404, code="model_not_found", param="model")
            assert missing in err["message"]


async def test_retrieve_model_hides_models_the_caller_may_not_use():
    app = _two_model_app(GatewayServices(authenticator=_OneTenant({"org/model-b"})))
    async with client_for(app) as client:
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["org/model-b"]
        assert (await client.get("/v1/models/org/model-b")).status_code == 200
        assert_openai_error(await client.get(f"/v1/models/{MODEL}"), 404, code="model_not_found")


# ------------------------------------------------------------- OpenAPI


async def test_openapi_describes_every_route(client):
    schema = (await client.get("/openapi.json")).json()
    paths = schema["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}",
            "/v1/usage", "/v1/requests/{request_id}", "/metrics", "/health"} <= set(paths)
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):
        op = paths[path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"200", "400", "401", "403", "404", "413", "415", "429", "503"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"messages", "model"} <= set(components["ChatCompletionRequest"]["required"])
    assert "ChatMessage" in components and "StreamOptions" in components
    refs = json.dumps(schema)
    for name in set(_refs(schema)):
        assert name in components, name
    assert "422" not in refs and "HTTPValidationError" not in refs
    for path, ops in paths.items():
        for op in ops.values():
            for status, response in op["responses"].items():
                assert response.get("content"), (path, status)
                if status.startswith("4"):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    shape = "/AnthropicErrorResponse" if path.startswith("/v1/messages") else "/ErrorResponse"
                    assert ref.endswith(shape), (path, status)


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v.rsplit("/", 1)[-1]
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


async def test_sampling_fields_reach_the_engine(client, engine):
    r = await client.post("/v1/chat/completions", json={
        **ROUTES["/v1/chat/completions"], "presence_penalty": 0.5, "frequency_penalty": -1.25,
        "repetition_penalty": 1.3, "logit_bias": {"72": -100, "3": 2.5}, "min_p": 0.05,
        "min_tokens": 2, "max_tokens": 9, "stop_token_ids": [80, 1], "top_k": 5})
    assert r.status_code == 200, r.text
    sp = engine.submitted[0].sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.25, 1.3)
    assert sp.logit_bias == ((72, -100.0), (3, 2.5))
    assert (sp.min_p, sp.min_tokens, sp.max_tokens, sp.top_k) == (0.05, 2, 9, 5)
    # The chat stop ids, then the request's own (no duplicates).
    assert sp.stop_token_ids == (*FakeTokenizer().chat_stop_token_ids, 80)
    assert (sp.logprobs, sp.prompt_logprobs) == (None, None)
    r = await client.post("/v1/completions", json=COMPLETION)
    sp = engine.submitted[1].sampling
    assert (sp.presence_penalty, sp.repetition_penalty, sp.logit_bias, sp.min_p, sp.min_tokens) == (
        0.0, 1.0, (), 0.0, 0)
