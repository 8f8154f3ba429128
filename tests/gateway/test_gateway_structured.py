"""The gateway's structured-output fields: response_format, structured_outputs, guided_* aliases.

Over the fake engine: what reaches the engine as ``SamplingParams.structured_output``,
and 400s for bad or conflicting constraints (compiled against the fake tokenizer).
"""

from __future__ import annotations

import json

import pytest

from serving.contract.engine_client import StructuredOutput
from tests.support.gateway_harness import CHAT, MODEL, assert_openai_error, assert_still_serving

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


async def _submitted(client, engine, path: str, body: dict) -> StructuredOutput | None:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return engine.submitted[-1].sampling.structured_output


@pytest.mark.parametrize("path, base", [("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)])
async def test_response_format_reaches_the_engine(client, engine, path, base):
    so = await _submitted(client, engine, path, {**base, "response_format": {"type": "json_object"}})
    assert so == StructuredOutput("json_object")
    so = await _submitted(client, engine, path, {**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}})
    assert so.kind == "json_schema" and json.loads(so.value) == SCHEMA
    assert await _submitted(client, engine, path, {**base, "response_format": {"type": "text"}}) is None


async def test_non_strict_schema_is_marked_lenient(client, engine):
    so = await _submitted(client, engine, "/v1/completions", {**PROMPT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
    assert json.loads(so.value) == {**SCHEMA, "x-guidance": {"lenient": True}}


@pytest.mark.parametrize("field, value, expected", [
    ("json", SCHEMA, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ("json", json.dumps(SCHEMA), StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ("regex", "[a-z]+", StructuredOutput("regex", "[a-z]+")),
    ("choice", ["yes", "no"], StructuredOutput("choice", '["yes", "no"]')),
    ("grammar", 'start: "a" | "b"', StructuredOutput("grammar", 'start: "a" | "b"')),
])
async def test_structured_outputs_and_guided_aliases(client, engine, field, value, expected):
    for body in ({"structured_outputs": {field: value}}, {f"guided_{field}": value}):
        for path, base in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
            assert await _submitted(client, engine, path, {**base, **body}) == expected
    so = await _submitted(client, engine, "/v1/completions",
                          {**PROMPT, "structured_outputs": {"json_object": True}})
    assert so == StructuredOutput("json_object")


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
])
async def test_more_than_one_constraint_is_a_400(client, engine, body, param):
    r = await client.post("/v1/completions", json={**PROMPT, **body})
    err = assert_openai_error(r, 400, param=param)
    assert "one structured output" in err["message"]
    assert not engine.submitted


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "dependentRequired": {"a": ["b"]}}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": False}, "guided_json"),
    ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": "a\ud800"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
])
async def test_invalid_constraint_is_a_400_naming_the_field(client, engine, body, param):
    for path, base in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
        r = await client.post(path, content=json.dumps({**base, **body}),  # ASCII: lone surrogates escaped
                              headers={"content-type": "application/json"})
        assert_openai_error(r, 400, param=param)
    assert not engine.submitted
    await assert_still_serving(client)


async def test_lenient_schema_ignores_what_strict_refuses(client, engine):
    schema = {"type": "object", "dependentRequired": {"a": ["b"]}}
    so = await _submitted(client, engine, "/v1/completions", {**PROMPT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "strict": False, "schema": schema}}})
    assert so.kind == "json_schema"
