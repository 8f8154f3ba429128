"""Log probabilities, echo, n / best_of and several prompts end to end: a real
`tiny-random` server process (the session's ``tiny_server``: no new compiled shapes) over HTTP.

The gateway's shapes are unit-tested against the fake engine
(``test_gateway_logprobs.py``, ``test_gateway_choices.py``); this checks that the
engine's numbers come through consistently: echoed prompt entries equal
``max_tokens: 0``'s, streamed equals non-streamed, a greedy token's logprob is
its position's best, ``n`` with a seed equals separate requests with the
derived seeds, several prompts equal each prompt alone.
"""

from __future__ import annotations

import json

import httpx
import pytest


MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    blocks = r.text.split("\n\n")[:-1]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def token_ids(url: str, text: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": True}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server):
    prompts = [token_ids(server, "The quick brown fox"), token_ids(server, "Once upon a time")]
    out = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "echo": True,
                                           "logprobs": 1, "temperature": 0, "seed": 1234})
    zero = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True,
                                            "logprobs": 1})
    for choice, alone, prompt in zip(out["choices"], zero["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
        # Greedy: the generated token's logprob is its position's best (lm-eval's is_greedy).
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        # max_tokens 0 scores the same prompt to the same numbers.
        assert alone["finish_reason"] == "length" and alone["text"] == choice["text"][:len(alone["text"])]
        assert alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    assert zero["usage"]["completion_tokens"] == 0
    assert zero["usage"]["prompt_tokens"] == sum(map(len, prompts))
    # n choices of nothing but the prompt: each choice is its scoring.
    both = post(server, "/v1/completions", {"prompt": prompts[0], "max_tokens": 0, "echo": True,
                                            "logprobs": 1, "n": 2})
    assert [c["logprobs"]["token_logprobs"] for c in both["choices"]] == [
        zero["choices"][0]["logprobs"]["token_logprobs"]] * 2


def test_streamed_logprobs_equal_non_streamed(server):
    body = {"prompt": "Hello there, general", "max_tokens": 8, "echo": True, "logprobs": 3,
            "temperature": 1.0, "seed": 7, "return_tokens_as_token_ids": True}
    whole = post(server, "/v1/completions", body)["choices"][0]
    merged = {k: [] for k in whole["logprobs"]}
    text = ""
    for e in stream(server, "/v1/completions", body):
        for c in e["choices"]:
            text += c["text"]
            for k in merged:
                merged[k] += c["logprobs"][k]
    assert text == whole["text"] and merged == whole["logprobs"]
    for tok, lp, top in zip(merged["tokens"][1:], merged["token_logprobs"][1:], merged["top_logprobs"][1:]):
        assert tok.startswith("token_id:") and top[tok] == lp and len(top) <= 4
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "logprobs": True,
            "top_logprobs": 2, "temperature": 1.0, "seed": 3}
    whole = post(server, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    streamed = [x for e in stream(server, "/v1/chat/completions", chat) for c in e["choices"]
                if c.get("logprobs") for x in c["logprobs"]["content"]]
    assert streamed == whole and all(len(x["top_logprobs"]) == 2 for x in whole)


def test_n_with_a_seed_equals_separate_requests(server):
    body = {"prompt": "In a small village", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    together = post(server, "/v1/completions", {**body, "n": 3, "seed": 42})
    alone = [post(server, "/v1/completions", {**body, "seed": 42 + j})["choices"][0]["text"]
             for j in range(3)]
    assert [c["text"] for c in sorted(together["choices"], key=lambda c: c["index"])] == alone
    assert together["usage"]["completion_tokens"] == 18
    assert together["usage"]["prompt_tokens"] == len(token_ids(server, "In a small village"))


def test_several_prompts_equal_each_alone(server):
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    together = post(server, "/v1/completions", {**body, "prompt": prompts, "n": 2})
    texts = {c["index"]: c["text"] for c in together["choices"]}
    for i, p in enumerate(prompts):
        alone = post(server, "/v1/completions", {**body, "prompt": p})["choices"][0]["text"]
        assert texts[2 * i] == texts[2 * i + 1] == alone


def test_best_of_returns_the_most_likely(server):
    body = {"prompt": "The weather today", "max_tokens": 5, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    best = post(server, "/v1/completions", {**body, "best_of": 3, "logprobs": 0})
    scores = []
    for j in range(3):
        c = post(server, "/v1/completions", {**body, "seed": 5 + j, "logprobs": 0})["choices"][0]
        scores.append((sum(c["logprobs"]["token_logprobs"]), c["text"]))
    assert best["choices"][0]["text"] == max(scores)[1]
    assert best["usage"]["completion_tokens"] == 15
