"""The gateway's errors against a scripted fake engine: malformed and invalid requests, context
overflow, engine admission errors and failures, unexpected exceptions (OpenAI's error shape)."""

from __future__ import annotations

import pytest

from serving.gateway.app import ServedModel, create_app
from tests.support.gateway_fakes import FakeTokenizer
from tests.support.gateway_harness import (
    CHAT,
    MODEL,
    TOK,
    assert_openai_error,
    assert_still_serving,
    client_for,
    make_app,
    parse_sse,
)

pytestmark = pytest.mark.anyio


# ------------------------------------------------------------------ errors


async def test_malformed_json(client):
    r = await client.post(
        "/v1/chat/completions", content=b'{"model": "x", ', headers={"content-type": "application/json"}
    )
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]
    await assert_still_serving(client)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": [1]}, "echo"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": ["x"] * 20, "n": 100}, "n"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 17}, "min_tokens"),  # default max_tokens 16
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 3_000_000_000}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stream": "yes please"}, "stream"),
    ("/v1/completions", {"prompt": ["one", 5]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),  # no vision
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                           {"role": "system", "content": "late"}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
async def test_bad_requests_are_400_naming_the_field(client, engine, path, body, param):
    r = await client.post(path, json={"model": MODEL, **body})
    err = assert_openai_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in err["message"]
    assert engine.submitted == []
    await assert_still_serving(client)


async def test_missing_model_and_n_message(client):
    r = await client.post("/v1/completions", json={"prompt": "x"})
    err = assert_openai_error(r, 400, param="model")
    assert "model" in err["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 200})
    assert "'n'" in assert_openai_error(r, 400, param="n")["message"]


async def test_unknown_model_404(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    err = assert_openai_error(r, 404, code="model_not_found", param="model")
    assert "gpt-9" in err["message"]
    await assert_still_serving(client)


async def test_context_overflow_completions(engine):
    async with client_for(make_app(engine, max_model_len=64)) as client:
        prompt = "p" * 49  # 50 tokens with BOS
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20})
        err = assert_openai_error(r, 400, code="context_length_exceeded")
        msg = err["message"]
        assert "maximum context length is 64 tokens" in msg
        assert "70 tokens" in msg and "50 in the prompt" in msg and "20 in the completion" in msg
        # Default max_tokens (16) still fits: 50 + 14 would, 50 + 16 does not.
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert "16 in the completion" in assert_openai_error(r, 400)["message"]
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 14})
        assert r.status_code == 200
        assert engine.submitted[-1].sampling.max_tokens == 14


async def test_context_overflow_chat(engine):
    async with client_for(make_app(engine, max_model_len=40)) as client:
        msgs = [{"role": "user", "content": "y" * 30}]
        n_prompt = len(TOK.apply_chat_template(msgs))
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 5})
        msg = assert_openai_error(r, 400, code="context_length_exceeded", param="messages")["message"]
        assert f"{n_prompt + 5} tokens ({n_prompt} in the messages, 5 in the completion)" in msg
        # Without max_tokens the prompt alone does not fit.
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
        assert_openai_error(r, 400, code="context_length_exceeded")
        assert engine.submitted == []


async def test_chat_default_max_tokens_fits_a_kv_cache_smaller_than_the_context(engine):
    async with client_for(make_app(engine, max_model_len=100, kv_capacity_tokens=48)) as client:
        n_prompt = len(TOK.apply_chat_template(CHAT["messages"]))
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert engine.submitted[-1].sampling.max_tokens == 48 - n_prompt
        # A prompt that fits the context window but leaves no room in the KV cache.
        msgs = [{"role": "user", "content": "z" * 40}]
        n_prompt = len(TOK.apply_chat_template(msgs))
        assert 48 <= n_prompt < 100
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
        msg = assert_openai_error(r, 400, code="context_length_exceeded", param="messages")["message"]
        assert "context length is 100 tokens" in msg and "at most 48 tokens per request" in msg
        assert f"the messages take {n_prompt} tokens" in msg and "--num-pages" in msg
        # An explicit max_tokens is the engine's to judge.
        r = await client.post("/v1/chat/completions",
                              json={"model": MODEL, "messages": msgs, "max_tokens": 5})
        assert r.status_code == 200, r.text
    assert len(engine.submitted) == 2


async def test_overloaded_engine_503_with_retry_after(client, engine):
    engine.overloaded = True
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        err = assert_openai_error(r, 503, code="engine_overloaded")
        assert err["type"] == "server_error"
        assert int(r.headers["Retry-After"]) >= 1
    engine.overloaded = False
    await assert_still_serving(client)


async def test_rejected_request_400(client, engine):
    engine.reject = True
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_openai_error(r, 400, code="request_rejected")
    engine.reject = False
    await assert_still_serving(client)


async def test_engine_error_mid_request(client, engine):
    engine.fail_after = 3
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    err = assert_openai_error(r, 500, code="engine_error")
    # The client gets a code and its request id to quote; the engine's words stay in the log.
    assert "device fell over" not in err["message"] and r.headers["X-Request-ID"] in err["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 200
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    assert "device fell over" not in events[-2]["error"]["message"]
    # The completion is closed first, with finish_reason "error".
    assert events[-3]["choices"][0]["finish_reason"] == "error"
    assert [e["choices"][0]["finish_reason"] for e in events[:-3]] == [None] * (len(events) - 3)
    engine.fail_after = None
    await assert_still_serving(client)


class ExplodingTokenizer(FakeTokenizer):
    def encode(self, text, add_bos=False):
        if text == "boom":
            raise RuntimeError("tokenizer bug")
        return super().encode(text, add_bos)


async def test_unexpected_exception_is_500_and_server_keeps_serving(engine):
    app = create_app({MODEL: ServedModel(MODEL, engine, ExplodingTokenizer(), 512)})
    async with client_for(app) as client:
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "boom"}, headers={"X-Request-ID": "abc-1"}
        )
        err = assert_openai_error(r, 500)
        assert err["type"] == "server_error"
        assert "tokenizer bug" not in err["message"]
        assert r.headers["x-request-id"] == "abc-1"
        await assert_still_serving(client)


async def test_unknown_route_and_method_are_openai_shaped(client):
    assert_openai_error(await client.get("/v1/nothing"), 404)
    assert_openai_error(await client.get("/v1/completions"), 405)
