"""The fuzzing gate: schemathesis and hypothesis against a real `tiny-random` server.

The session's shared server (``tiny_server`` in tests/conftest.py: ``TINY_SERVER_ARGS``, no
new compiled shapes). For every operation of ``/openapi.json`` schemathesis generates requests from the
schema (``MAX_EXAMPLES`` per operation and mode: schema-valid ones, and
schema-invalid ones where a body or query exists to break) and checks:
no 5xx, the status code is documented, the content type is documented, the
body matches the documented schema, schema-invalid data is refused with a 4xx,
every streamed (SSE) response is well-formed and ends with ``[DONE]``, and no
request hangs (``REQUEST_TIMEOUT_S``). Schema-valid requests to the generation
routes, and half of those to ``/v1/models/{model_id}``, name the served model
(otherwise nearly all would be a 404; schema-invalid ones keep their names). The number of
cases run per operation is asserted (> 0) and printed.

Then hypothesis sends awkward Unicode (lone surrogates, NULs, RTL marks,
combining sequences, very long words, noncharacters) through both generation
endpoints, streamed and not, and expects a 200 or an OpenAI-shaped 4xx.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)


MODEL = "tiny-random"
MAX_EXAMPLES = {"POST": 50, "GET": 15, "DELETE": 10}
"""Generated cases per operation and generation mode (by HTTP method)."""
MAX_EXAMPLES_BY_ROUTE = {"POST /tokenize": 40, "POST /detokenize": 40, "POST /v1/files": 20,
                         "POST /v1/batches": 40, "POST /v1/batches/{batch_id}/cancel": 15,
                         "POST /v1/responses": 40, "POST /v1/embeddings": 40,
                         "POST /v1/messages": 20, "POST /v1/messages/count_tokens": 10,
                         **{f"POST {p}": 15 for p in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score")}}
"""Fewer for the tokenizer routes (small bodies, no engine behind them: test_tokenizer_routes.py),
the files and batches routes (no engine behind them: test_batches.py) and the Responses API
(chat completions in other words: test_responses_api.py), the Messages API (the same:
test_anthropic_messages.py, test_anthropic_sdk.py) and ``/v1/embeddings`` (a 400 on this
generation server; test_serve_embeddings.py fuzzes it on an embedding model's server), and the
rerank and score routes (a 400 here too; test_serve_rerank.py sends them to a reranker's server)."""
UNICODE_EXAMPLES = 100
REQUEST_TIMEOUT_S = 30

POSITIVE_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
                   response_schema_conformance]
NEGATIVE_CHECKS = [*POSITIVE_CHECKS, negative_data_rejection]

# Hypothesis settings shared by both fuzzers: no deadline (a request's time is the
# server's), no example database (CI runs stay independent), generation only.
FUZZ_SETTINGS = dict(deadline=None, database=None, phases=[Phase.generate],
                     suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


MAX_STREAM_EVENTS = 5000
"""Read streams whole (schemathesis stops after 20 events by default): a schema-valid case
may ask for 4 choices of up to 512 tokens each. A stream cut short is one that outran the
request timeout (a hang), and fails."""


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    # A schema-violating body over max_request_bytes (an array past its maxItems) is rejected
    # before it is parsed, with 413: a rejection as good as 400.
    rejection = schema.config.checks.negative_data_rejection
    rejection.expected_statuses = [*rejection.expected_statuses, "413"]
    return schema


def _operations(api_schema):
    return [result.ok() for result in api_schema.get_all_operations()]


def _modes(operation) -> list[GenerationMode]:
    """Schema-invalid data exists only for an operation with a body or query parameters."""
    breakable = operation.body or any(p.location == "query" for p in operation.iter_parameters())
    return [GenerationMode.POSITIVE, *([GenerationMode.NEGATIVE] if breakable else [])]


MAX_FUZZ_CHOICES = 4
"""Schema-valid cases ask for at most this many choices (``n``, ``best_of``) and prompts:
the schema allows 128 x 1024 completions, which a 4-slot CPU engine takes minutes to
generate (load, not conformance; the bounds themselves are unit-tested)."""


MAX_FUZZ_TOKENS = 32
"""Schema-valid cases that name a token budget above this get this one (a request without one
keeps the route's default): a generated 500-token answer costs the engine seconds and checks
nothing a 32-token one does not (finish reasons and lengths: test_server_e2e.py)."""
TOKEN_BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
UNBOUNDED_ROUTES = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens"}
"""Routes whose default budget is the rest of the context (~500 tokens here: 10 of the fuzzer's
34 s, against 5 with this), and the field a schema-valid case without any budget gets, set to
MAX_FUZZ_TOKENS. The default itself: tests/gateway/test_gateway.py."""


def _served_model(case):
    """The case naming the served model (in its body or path), with few choices and tokens."""
    if isinstance(case.body, dict):
        case.body["model"] = MODEL
        for name in ("n", "best_of"):  # an integral float (90.0) is an integer to pydantic
            if isinstance(case.body.get(name), (int, float)) and case.body[name] > MAX_FUZZ_CHOICES:
                case.body[name] = MAX_FUZZ_CHOICES
        for name in TOKEN_BUDGETS:
            if isinstance(case.body.get(name), (int, float)) and case.body[name] > MAX_FUZZ_TOKENS:
                case.body[name] = MAX_FUZZ_TOKENS
        if case.path in UNBOUNDED_ROUTES and not any(name in case.body for name in TOKEN_BUDGETS):
            case.body[UNBOUNDED_ROUTES[case.path]] = MAX_FUZZ_TOKENS
        prompt = case.body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            case.body["prompt"] = prompt[:MAX_FUZZ_CHOICES]
    if case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = MODEL
    return case


def assert_sse(text: str) -> None:
    """A well-formed SSE body: `data: <JSON object>` events, the last one `data: [DONE]`;
    or (the Responses API) typed events `event: <type>` / `data: <JSON of that type>`,
    numbered in order, the last one ending the response; or (the Messages API) typed events
    from `message_start` to `message_stop` (or `error`)."""
    if text.startswith("event: "):
        events = []
        for block in text.split("\n\n")[:-1]:
            head, data = block.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: "), block
            events.append(json.loads(data[len("data: "):]))
            assert events[-1]["type"] == head[len("event: "):], block
        if events[0]["type"] == "message_start":
            assert events[-1]["type"] in ("message_stop", "error"), events[-1]
            return
        assert [e["sequence_number"] for e in events] == list(range(len(events))), text[-300:]
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed"), events[-1]
        return
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    for block in text.split("\n\n")[:-2]:
        assert block.startswith("data: "), block
        event = json.loads(block[len("data: "):])
        assert isinstance(event, dict) and ("choices" in event or "error" in event), event


@pytest.mark.slow(50)
def test_schemathesis_finds_no_server_error_or_schema_violation(server, api_schema):
    """schemathesis sends examples of every route of /openapi.json: no 5xx, every response
    as the schema says.

    Slow: hundreds of generated requests against a real server, some of which generate tokens."""
    operations = _operations(api_schema)
    labels = {op.label for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
            "GET /v1/models/{model_id}", "GET /v1/usage", "GET /v1/requests/{request_id}",
            "GET /metrics", "GET /health", "GET /tokenizer_info", "POST /tokenize",
            "POST /detokenize", "POST /v1/responses", "GET /v1/responses/{response_id}",
            "POST /v1/embeddings", "POST /v1/messages", "POST /v1/messages/count_tokens"} <= labels
    report = []
    t0 = time.monotonic()
    for op in operations:
        for mode in _modes(op):
            strategy = op.as_strategy(generation_mode=mode)
            if mode is GenerationMode.POSITIVE and op.method.upper() == "POST":
                strategy = strategy.map(_served_model)
            elif mode is GenerationMode.POSITIVE and "model_id" in op.path:
                strategy = st.one_of(strategy.map(_served_model), strategy)
            checks = NEGATIVE_CHECKS if mode is GenerationMode.NEGATIVE else POSITIVE_CHECKS
            statuses: dict[int, int] = {}
            t_op = time.monotonic()

            @settings(max_examples=MAX_EXAMPLES_BY_ROUTE.get(op.label, MAX_EXAMPLES[op.method.upper()]),
                      **FUZZ_SETTINGS)
            @given(case=strategy)
            def run(case):
                response = case.call(base_url=server, timeout=REQUEST_TIMEOUT_S)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=checks)
                if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
                    assert not response.stream_cut_short, f"a stream outran {REQUEST_TIMEOUT_S} s"
                    assert_sse(response.text)

            run()
            n = sum(statuses.values())
            report.append(f"{op.label} [{mode.value}]: {n} cases, statuses {dict(sorted(statuses.items()))}, "
                          f"{time.monotonic() - t_op:.1f} s")
            assert n > 0, f"no case was generated for {op.label} ({mode.value})"
    total = sum(int(line.split(": ")[1].split()[0]) for line in report)
    print(f"\nschemathesis: {total} cases in {time.monotonic() - t0:.1f} s, 0 failures\n" + "\n".join(report))


def test_integer_bounds_on_the_real_engine(server):
    """top_k beyond int32 used to reach the engine's int32 arrays (a 500 from the prefill
    step); top_k of the whole vocabulary or more is off."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 1, "seed": 2**63 - 1,
            "ignore_eos": True}
    r = httpx.post(f"{server}/v1/completions", json={**body, "top_k": 3_000_000_000}, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "top_k")
    for top_k in (2**31 - 1, 1):
        r = httpx.post(f"{server}/v1/completions", json={**body, "top_k": top_k}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------- Unicode


AWKWARD = ["\ud800", "\udfff", "\ud83d", "\x00", "\u200f", "\u202e", "\u2066", "\u200d", "\ufeff",
           "\uffff", "\U0010ffff", "e\u0301\u0301\u0301\u0301", "\u0915\u094d\u0937",
           "\U0001F469\u200d\U0001F4BB", "x" * 20_000, "\u00e9" * 3_000, "\r\n", "<start_of_turn>",
           "<end_of_turn>", "\\u0000", "\U0001F600"]


def awkward_text():
    return st.lists(st.one_of(st.sampled_from(AWKWARD), st.text(max_size=20)), max_size=6).map("".join)


@st.composite
def awkward_request(draw):
    """(path, body) with awkward text in one of the string fields a request has."""
    text = draw(awkward_text())
    stream = draw(st.booleans())
    common = {"model": MODEL, "max_tokens": 4, "stream": stream}
    where = draw(st.sampled_from(["prompt", "stop", "content", "part", "system"]))
    if where in ("prompt", "stop"):
        body = {**common, "prompt": text if where == "prompt" else "hello"}
        if where == "stop":
            body["stop"] = [text]
        return "/v1/completions", body
    content = [{"type": "text", "text": text}] if where == "part" else text
    messages = [{"role": "user", "content": content}]
    if where == "system":
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    return "/v1/chat/completions", {**common, "messages": messages}


def test_awkward_unicode_gets_200_or_an_openai_4xx(server):
    counts: dict[int, int] = {}
    t0 = time.monotonic()
    with httpx.Client(base_url=server, timeout=REQUEST_TIMEOUT_S) as client:

        @settings(max_examples=UNICODE_EXAMPLES, **FUZZ_SETTINGS)
        @given(request=awkward_request())
        def run(request):
            path, body = request
            # ensure_ascii: a lone surrogate travels as its JSON escape ("\ud800"), as a client sends it.
            raw = json.dumps(body, ensure_ascii=True).encode()
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            if r.status_code == 200:
                if body["stream"]:
                    assert r.headers["content-type"].startswith("text/event-stream")
                    assert_sse(r.text)
                else:
                    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                return
            assert 400 <= r.status_code < 500, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if any("\ud800" <= c <= "\udfff" for c in json.dumps(body, ensure_ascii=False)):
                assert err["param"] and "surrogate" in err["message"], err

        run()
    n = sum(counts.values())
    assert n > 0 and counts.get(200, 0) > 0, counts
    print(f"\nunicode: {n} requests in {time.monotonic() - t0:.1f} s, statuses {dict(sorted(counts.items()))}")
