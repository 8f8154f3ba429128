"""End-to-end tests of the real server: ``python -m serving.cli.main serve`` over HTTP.

One server process (real Gemma 3 270M, small KV pool) is started for the
module and driven with the official ``openai`` client and raw ``httpx``
requests: streaming and usage, greedy output against the golden reference,
multi-byte text, stop strings across token boundaries, chat, OpenAI-shaped
errors and client disconnects. Caches under ``$XLASERVE_DATA_DIR`` (see
conftest.py) make the start take ~20 s once warm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.gemma_engine import SERVER_ARGS as GEMMA_SERVER_ARGS
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.gemma

MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = 240.0
STOP_GRACE_S = 20.0
REQUEST_TIMEOUT_S = 120.0
GOLDEN_TOKENS = 24  # the golden greedy continuations are exactly 24 tokens
CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


# ------------------------------------------------------------------ server


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self, tail_chars: int = 20000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<server log unreadable: {e}>"
        return text[-tail_chars:]

    def assert_alive(self) -> None:
        rc = self.proc.poll()
        assert rc is None, f"server exited with {rc}; log:\n{self.log()}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_GRACE_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    """The real server on a free port, healthy; stopped (SIGTERM, then kill) afterwards."""
    port = _free_port()
    tmp = tmp_path_factory.mktemp("xlaserve_e2e")
    log_path = tmp / "server.log"
    cmd = [
        sys.executable, "-m", "serving.cli.main", "--log-level", "WARNING", "serve",
        "--port", str(port), *GEMMA_SERVER_ARGS, "--database-url", f"sqlite:///{tmp / 'ledger.db'}",
        "--dtype", "float32",  # the golden checks below are float32 claims (bf16: test_engine_gemma_bf16)
    ]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=dict(os.environ),
                                stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    srv = ServerProcess(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            rc = proc.poll()
            if rc is not None:
                pytest.fail(f"server exited with {rc} before becoming healthy; log:\n{srv.log()}")
            try:
                if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S:.0f} s; log:\n{srv.log()}")
            time.sleep(0.5)
        yield srv
    finally:
        _terminate(proc)


@pytest.fixture(scope="module")
def server_url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    c = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused",
                      timeout=REQUEST_TIMEOUT_S, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model_name(client) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


@pytest.fixture(scope="module")
def golden_prompts(golden) -> dict:
    return {p["name"]: p for p in golden["prompts"]}


# ----------------------------------------------------------------- helpers


@dataclass
class Streamed:
    deltas: list[str]  # non-empty text deltas, in order
    finish_reasons: list[str]  # every non-null finish_reason seen
    usage: object | None  # the usage chunk's usage
    chunks: list

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def _stream_completion(client, **kwargs) -> Streamed:
    deltas, finishes, usage, chunks = [], [], None, []
    for chunk in client.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            if choice.text:
                deltas.append(choice.text)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            assert chunk.choices == [], "usage must come in its own chunk with no choices"
            assert usage is None, "more than one usage chunk"
            usage = chunk.usage
    return Streamed(deltas, finishes, usage, chunks)


def _stream_chat(client, **kwargs) -> Streamed:
    deltas, finishes, usage, chunks = [], [], None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            assert chunk.choices == [], "usage must come in its own chunk with no choices"
            assert usage is None, "more than one usage chunk"
            usage = chunk.usage
    return Streamed(deltas, finishes, usage, chunks)


def _assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


# ------------------------------------------------------------------- tests


def test_health_and_models(server_url, model_name):
    assert httpx.get(f"{server_url}/health", timeout=10).json() == {"status": "ok"}
    models = httpx.get(f"{server_url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [model_name]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_streaming_completion_usage(client, model_name, gemma_tokenizer, golden_prompts):
    prompt = golden_prompts["english"]["text"]
    params = dict(model=model_name, prompt=prompt, max_tokens=GOLDEN_TOKENS, temperature=0)

    s = _stream_completion(client, stream_options={"include_usage": True}, **params)
    assert len(s.deltas) >= 3, f"text should arrive as several chunks, got {s.deltas!r}"
    assert s.finish_reasons == ["length"]
    # finish_reason is on the last choice chunk; the usage chunk (no choices) follows it.
    assert s.chunks[-1].choices == [] and s.chunks[-1].usage is not None
    assert s.chunks[-2].choices[0].finish_reason == "length"
    assert s.usage is not None
    prompt_tokens = len(gemma_tokenizer.encode(prompt, add_bos=True))
    assert s.usage.prompt_tokens == prompt_tokens
    assert s.usage.completion_tokens == GOLDEN_TOKENS
    assert s.usage.total_tokens == prompt_tokens + GOLDEN_TOKENS

    r = client.completions.create(**params)
    assert r.choices[0].text == s.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == s.usage.completion_tokens
    assert r.usage.total_tokens == s.usage.total_tokens


def test_streaming_without_include_usage_has_no_usage(client, model_name):
    s = _stream_completion(client, model=model_name, prompt="Hello", max_tokens=4, temperature=0)
    assert s.usage is None
    assert s.finish_reasons == ["length"]


def test_greedy_matches_golden(client, model_name, golden_prompts):
    g = golden_prompts["english"]
    r = client.completions.create(model=model_name, prompt=g["text"], max_tokens=GOLDEN_TOKENS,
                                  temperature=0)
    assert r.choices[0].text == g["greedy"]["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == g["num_tokens"]
    assert r.usage.completion_tokens == GOLDEN_TOKENS


@pytest.mark.parametrize("name", ["english", "emoji", "single_token"])
def test_echo_logprobs_match_golden_by_token_id(client, model_name, golden_prompts, name):
    """lm-eval's scoring request through the official client: top-5 log probabilities at every
    recorded position equal the golden ``top5_logits - logsumexp`` (5e-3, README's tolerance),
    compared by token id (``return_tokens_as_token_ids``: spellings of byte pieces collide);
    earlier positions through echo, the last through the generated token; streamed equal to
    non-streamed."""
    g = golden_prompts[name]
    kwargs = dict(model=model_name, prompt=g["ids"], max_tokens=1, temperature=0, echo=True,
                  logprobs=5, extra_body={"return_tokens_as_token_ids": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert len(lp.tokens) == g["num_tokens"] + 1 and lp.token_logprobs[0] is None
    assert lp.tokens[:g["num_tokens"]] == [f"token_id:{t}" for t in g["ids"]]
    for rec in g["positions"]:
        top = lp.top_logprobs[rec["pos"] + 1]  # the logits at pos score the token at pos + 1
        lse = rec["logit_stats"]["logsumexp"]
        for j, (tok, logit) in enumerate(zip(rec["top5_ids"], rec["top5_logits"])):
            key = f"token_id:{tok}"
            if key in top:
                assert abs(top[key] - (logit - lse)) < 5e-3, (name, rec["pos"], tok)
            else:  # only the 5th may swap with a near-tied 6th
                assert j == 4 and logit - lse - min(top.values()) < 1e-2, (name, rec["pos"])
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                for field in streamed:
                    streamed[field] += getattr(c.logprobs, field)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                        "top_logprobs": lp.top_logprobs}


def test_multibyte_emoji_prompt(client, model_name, gemma_tokenizer, golden_prompts):
    """Emoji in the prompt; its greedy continuation has no near-ties, so it must match exactly."""
    g = golden_prompts["emoji"]
    params = dict(model=model_name, prompt=g["text"], max_tokens=GOLDEN_TOKENS, temperature=0)
    s = _stream_completion(client, stream_options={"include_usage": True}, **params)
    r = client.completions.create(**params)
    assert "\ufffd" not in s.text
    assert s.text == r.choices[0].text
    assert s.text == g["greedy"]["text"]
    assert s.usage.prompt_tokens == len(gemma_tokenizer.encode(g["text"], add_bos=True))
    assert s.usage.completion_tokens == GOLDEN_TOKENS


def test_multibyte_chinese_stream(client, model_name, gemma_tokenizer, golden_prompts):
    """CJK output streamed: no U+FFFD, stream == non-stream, golden up to the step-7 near-tie."""
    g = golden_prompts["chinese"]
    params = dict(model=model_name, prompt=g["text"], max_tokens=GOLDEN_TOKENS, temperature=0)
    s = _stream_completion(client, stream_options={"include_usage": True}, **params)
    r = client.completions.create(**params)
    assert s.text, "empty completion"
    for d in s.deltas:
        assert "\ufffd" not in d, f"U+FFFD in a streamed delta: {s.deltas!r}"
    assert s.text == r.choices[0].text
    assert len(CJK.findall(s.text)) >= 5, s.text
    # Steps 0..6 have clear margins; step 7 is a near-tie (margin ~0.004), so only
    # the decode of the first 7 golden ids is a required prefix.
    margins = g["greedy"]["step_top1_top2_margin"]
    n_safe = next(i for i, m in enumerate(margins) if m < 0.01)
    prefix = gemma_tokenizer.decode(g["greedy"]["ids"][:n_safe]).rstrip("\ufffd")
    assert prefix and CJK.search(prefix)
    assert s.text.startswith(prefix), (s.text, prefix)
    assert s.usage.prompt_tokens == len(gemma_tokenizer.encode(g["text"], add_bos=True))
    assert s.usage.completion_tokens == GOLDEN_TOKENS


def _spans_token_boundary(tokenizer, ids: list[int], text: str, stop: str) -> bool:
    """Whether the first occurrence of `stop` in decode(ids) covers more than one token of `ids`."""
    start = text.index(stop)
    end = start + len(stop)  # exclusive
    offsets = [len(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)]
    assert offsets[-1] == len(text)

    def token_at(char: int) -> int:
        return next(i for i in range(len(ids)) if offsets[i] <= char < offsets[i + 1])

    return token_at(start) != token_at(end - 1)


@pytest.mark.parametrize("stop", ["France. It", "capital of"])
def test_stop_string_across_tokens(client, model_name, gemma_tokenizer, golden_prompts, stop):
    g = golden_prompts["english"]
    golden_text = g["greedy"]["text"]
    assert len(gemma_tokenizer.encode(stop)) > 1, "stop string must not be a single token"
    assert _spans_token_boundary(gemma_tokenizer, g["greedy"]["ids"], golden_text, stop)
    expected = golden_text[: golden_text.index(stop)]
    params = dict(model=model_name, prompt=g["text"], max_tokens=GOLDEN_TOKENS, temperature=0,
                  stop=[stop])

    r = client.completions.create(**params)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text

    s = _stream_completion(client, **params)
    assert s.text == expected
    assert s.finish_reasons == ["stop"]
    assert stop not in s.text


def test_chat_streaming_usage(client, model_name, gemma_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    max_tokens = 16
    s = _stream_chat(client, model=model_name, messages=messages, max_tokens=max_tokens,
                     temperature=0, stream_options={"include_usage": True})
    first = s.chunks[0]
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"
    assert s.text.strip(), "empty chat reply"
    assert "\ufffd" not in s.text
    assert len(s.finish_reasons) == 1 and s.finish_reasons[0] in ("stop", "length")
    assert s.usage is not None
    assert s.usage.prompt_tokens == len(gemma_tokenizer.apply_chat_template(messages))
    assert 1 <= s.usage.completion_tokens <= max_tokens
    if s.finish_reasons[0] == "length":
        assert s.usage.completion_tokens == max_tokens

    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=max_tokens,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == s.text
    assert r.choices[0].finish_reason == s.finish_reasons[0]
    assert r.usage.prompt_tokens == s.usage.prompt_tokens
    assert r.usage.completion_tokens == s.usage.completion_tokens


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


def test_forced_tool_call_streamed_and_not_then_the_tool_result(client, model_name):
    """Gemma through the built-in template's tool format: "required" gives a schema-valid
    call, the streamed deltas reassemble to it, and a tool result sent back is answered."""
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call (maxItems 1): with parallel calls allowed the base model keeps adding calls.
    kw = dict(model=model_name, messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=64)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])

    calls: dict[int, dict] = {}
    finishes = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments}
                else:
                    calls[tc.index]["arguments"] += tc.function.arguments
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert finishes == ["tool_calls"]
    assert list(calls.values()) == [{"name": "get_weather", "arguments": call.function.arguments}]

    follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    r2 = client.chat.completions.create(model=model_name, messages=follow, tools=[WEATHER_TOOL],
                                        tool_choice="none", temperature=0, max_tokens=24)
    answer = r2.choices[0]
    assert answer.message.tool_calls is None and answer.message.content.strip()
    assert answer.finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


def test_responses_api_streamed_and_not_then_continued(client, model_name):
    """``client.responses.create`` on Gemma: the stream's deltas and its last event give the
    non-streamed response's text (greedy), and ``previous_response_id`` puts the first turn
    (input and output) before the second's input."""
    kw = dict(model=model_name, input="Name the capital of France.", instructions="Answer in a few words.",
              max_output_tokens=12, temperature=0)
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{r.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text

    r2 = client.responses.create(model=model_name, input="And of Italy?", previous_response_id=r.id,
                                 max_output_tokens=8, temperature=0)
    assert r2.previous_response_id == r.id and r2.output_text.strip()
    # the first turn's input and output come before the new input; its instructions do not
    assert r2.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens - 8
    assert client.responses.retrieve(r2.id).output_text == r2.output_text


def test_bad_requests_get_openai_errors(server, model_name, gemma_tokenizer):
    url = f"{server.url}/v1/completions"
    ok = {"model": model_name, "prompt": "The capital of France is", "max_tokens": 4}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        resp = http.post(url, content=b'{"model": "x", "prompt": ',
                         headers={"Content-Type": "application/json"})
        _assert_openai_error(resp, 400)

        err = _assert_openai_error(http.post(url, json={**ok, "model": "no-such-model"}), 404)
        assert "no-such-model" in err["message"]

        for field, value in [("temperature", 3), ("top_p", 0), ("max_tokens", 0)]:
            err = _assert_openai_error(http.post(url, json={**ok, field: value}), 400)
            assert err["type"] == "invalid_request_error"
            assert err["param"] == field, err

        prompt_tokens = len(gemma_tokenizer.encode(ok["prompt"], add_bos=True))
        max_tokens = MAX_MODEL_LEN - prompt_tokens + 1
        total = prompt_tokens + max_tokens
        err = _assert_openai_error(http.post(url, json={**ok, "max_tokens": max_tokens}), 400)
        assert str(MAX_MODEL_LEN) in err["message"] and str(total) in err["message"], err

        # ... and the server still serves a normal request.
        resp = http.post(url, json={**ok, "temperature": 0})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
    server.assert_alive()


def _open_and_drop_stream(http: httpx.Client, url: str, body: dict, chunks: int = 2) -> None:
    """Start a streaming request, read `chunks` SSE events, then close the connection."""
    with http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[len("data: "):])
                assert "error" not in payload, payload
                seen += 1
                if seen == chunks:
                    break
        assert seen == chunks
    # leaving the block closes the connection mid-stream


def test_client_disconnect_mid_stream(server, model_name):
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        _open_and_drop_stream(http, url, {"model": model_name, "prompt": "Once upon a time",
                                          "max_tokens": 200, "temperature": 0, "stream": True})

    t0 = time.monotonic()
    with httpx.Client(timeout=60) as http:
        resp = http.post(url, json={"model": model_name, "prompt": "Hello", "max_tokens": 8,
                                    "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
        assert http.get(f"{server.url}/health").status_code == 200
    assert time.monotonic() - t0 < 30, "the request after a disconnect was slow"
    server.assert_alive()
    log = server.log()
    assert "Traceback" not in log, f"server logged an error after the disconnect:\n{log}"


def test_disconnects_free_their_slots(server, model_name):
    """As many dropped long streams as there are slots (8): if a disconnect did not cancel
    its engine request, every slot would stay busy for ~1000 decode steps and the next
    request could not be admitted within the timeout."""
    url = f"{server.url}/v1/completions"
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 1000,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for _ in range(8):
            _open_and_drop_stream(http, url, body, chunks=1)
    with httpx.Client(timeout=60) as http:
        resp = http.post(url, json={"model": model_name, "prompt": "Hello", "max_tokens": 4,
                                    "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
    server.assert_alive()
    log = server.log()
    assert "Traceback" not in log, f"server logged an error after the disconnects:\n{log}"


def test_gemma_requests_are_metered(server_url, client, model_name):
    """The gateway's ledger, trace, usage and metrics on the real model (open, loopback server)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.post(f"{server_url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   headers={"X-Request-ID": "gemma-metered"},
                   json={"model": model_name, "prompt": "The capital of France is", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    t = httpx.get(f"{server_url}/v1/requests/gemma-metered", timeout=30).json()
    assert t["status"] == "ok" and t["finish_reason"] == "length" and t["tenant"] == "anonymous"
    assert t["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert t["usage"]["completion_tokens"] == usage["completion_tokens"] == 8
    assert t["cost_usd"] > 0 and 0 < t["timings"]["ttft_s"] <= t["timings"]["e2e_s"]
    totals = httpx.get(f"{server_url}/v1/usage", timeout=30).json()["totals"]
    metrics = {}
    for family in text_string_to_metric_families(httpx.get(f"{server_url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.labels.get("model_name") == model_name and len(sample.labels) == 1:
                metrics[sample.name] = sample.value
    assert metrics["xlaserve:generation_tokens_total"] == totals["completion_tokens"]
    assert metrics["xlaserve:prompt_tokens_total"] == totals["prompt_tokens"]
    assert metrics["xlaserve:e2e_request_latency_seconds_count"] == totals["requests"]
