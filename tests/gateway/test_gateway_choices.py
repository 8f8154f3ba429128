"""``n``, ``best_of`` and several prompts per request: one engine request per (prompt,
choice), ``parent_id`` and seeds per choice, prompt-major indices, usage counting each
prompt once, interleaved streams, cancellation of every choice, one ledger row.

Against the scripted fake engine; its responder makes each choice's text depend on
the request (seed, prompt), so the checks can tell choices apart.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from serving.contract.engine_client import SamplingParams
from serving.gateway.openai.choices import choice_seed, fan_out
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import BOS_ID, EOS_ID, FakeEngine, fake_logprobs
from tests.support.gateway_harness import (
    CHAT,
    MODEL,
    TOK,
    assert_openai_error,
    byte_ids,
    call_asgi,
    client_for,
    make_app,
    parse_sse,
)

pytestmark = pytest.mark.anyio


def by_request(req):
    """Text naming the request's seed and the prompt's last character."""
    last = TOK.decode(list(req.prompt_ids)[-1:])
    return byte_ids(f"{last}{req.sampling.seed}")


@pytest.fixture
def engine():
    return FakeEngine(responder=by_request)


async def test_n_choices_share_the_prompt_and_take_seed_plus_index(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "n": 3, "seed": 5,
                                                   "max_tokens": 10})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "b5"), (1, "b6"), (2, "b7")]
    first, *rest = engine.submitted
    rid = out["id"]
    assert [e.request_id for e in engine.submitted] == [f"{rid}-0", f"{rid}-1", f"{rid}-2"]
    assert first.parent_id is None and [e.parent_id for e in rest] == [first.request_id] * 2
    assert [e.sampling.seed for e in engine.submitted] == [5, 6, 7]
    assert all(list(e.prompt_ids) == list(first.prompt_ids) for e in rest)
    # Each prompt counted once; every completion's tokens (EOS included) summed.
    assert out["usage"]["prompt_tokens"] == 3
    assert out["usage"]["completion_tokens"] == 3 * 3


async def test_n_equals_separate_requests_with_the_derived_seeds(client, engine):
    body = {"model": MODEL, "prompt": "zz", "max_tokens": 5, "temperature": 1.0}
    together = (await client.post("/v1/completions", json={**body, "n": 3, "seed": 40})).json()
    alone = [(await client.post("/v1/completions", json={**body, "seed": 40 + j})).json()
             for j in range(3)]
    assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert [s.sampling for s in engine.submitted[:3]] == [s.sampling for s in engine.submitted[3:]]


async def test_several_prompts_are_indexed_prompt_major(client, engine):
    prompts = ["xa", [BOS_ID, *byte_ids("yb")], "zc"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2,
                                                   "seed": 0, "max_tokens": 10})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b0"), (3, "b1"), (4, "c0"), (5, "c1")]
    parents = [e.parent_id for e in engine.submitted]
    ids = [e.request_id for e in engine.submitted]
    assert parents == [None, ids[0], None, ids[2], None, ids[4]]
    assert list(engine.submitted[2].prompt_ids) == prompts[1]  # token ids used as given
    assert out["usage"]["prompt_tokens"] == 3 * 3
    assert out["usage"]["completion_tokens"] == 6 * 3


async def test_a_prompt_over_the_context_window_refuses_the_request(engine):
    async with client_for(make_app(engine, max_model_len=20)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["ok", "x" * 30],
                                                  "max_tokens": 2})
    assert_openai_error(r, 400, code="context_length_exceeded")
    assert engine.submitted == []


async def test_best_of_returns_the_n_most_likely_and_bills_all(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "q", "n": 2, "best_of": 4,
                                                   "seed": 10, "max_tokens": 5})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(engine.submitted) == 4 and all(e.sampling.logprobs == 0 for e in engine.submitted)
    n_prompt = 2

    def score(seed):
        ids = [*byte_ids(f"q{seed}"), EOS_ID]
        return sum(fake_logprobs(t, n_prompt + p, 0).logprob for p, t in enumerate(ids))

    ranked = sorted(range(10, 14), key=lambda s: -score(s))
    assert [c["text"] for c in out["choices"]] == [f"q{s}" for s in ranked[:2]]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])  # not asked for
    assert out["usage"]["completion_tokens"] == 4 * 4  # all best_of completions are billed


async def test_streamed_choices_interleave_with_one_finish_each(client, engine):
    r = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": ["ma", "mb"], "n": 2, "seed": 1, "max_tokens": 10, "stream": True,
        "stream_options": {"include_usage": True}})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    texts, finishes, order = {}, {}, []
    for e in events[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        order.append(c["index"])
        if c["finish_reason"]:
            assert c["index"] not in finishes
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {0: "a1", 1: "a2", 2: "b1", 3: "b2"}
    assert finishes == {i: "stop" for i in range(4)}
    assert order[:4] == [0, 1, 2, 3]  # interleaved, not one after the other
    assert events[-2]["usage"]["completion_tokens"] == 4 * 3 and events[-2]["usage"]["prompt_tokens"] == 6


async def test_chat_n_streams_a_role_chunk_and_a_finish_per_choice(client, engine):
    r = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 3, "stream": True,
                                                        "max_tokens": 10})
    events = [e for e in parse_sse(r.text)[:-1]]
    roles = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role")]
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    content = {}
    for e in events:
        for c in e["choices"]:
            content[c["index"]] = content.get(c["index"], "") + c["delta"].get("content", "")
    assert roles == [0, 1] and sorted(finishes) == [0, 1]
    assert content == {0: "\n3", 1: "\n4"}
    r = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 3, "max_tokens": 10})
    assert [c["message"]["content"] for c in r.json()["choices"]] == ["\n3", "\n4"]
    assert r.json()["usage"]["prompt_tokens"] == len(engine.submitted[-1].prompt_ids)


async def test_one_failing_choice_fails_the_request_and_cancels_the_others():
    engine = FakeEngine(text="z" * 500, delay=0.001, fail_after=3, fail_only=("-1",))
    async with client_for(make_app(engine, max_model_len=4096)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 3,
                                                  "max_tokens": 400})
    assert_openai_error(r, 500, code="engine_error")
    ids = [e.request_id for e in engine.submitted]
    assert len(ids) == 3 and {ids[0], ids[2]} <= set(engine.cancelled)


async def test_disconnect_cancels_every_choice():
    engine = FakeEngine(text="z" * 2000, delay=0.002)
    app = make_app(engine, max_model_len=4096)
    disconnect = asyncio.Event()

    def on_send(message):
        if message["type"] == "http.response.body" and b'"text":"z"' in message.get("body", b""):
            disconnect.set()

    await call_asgi(app, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2,
                                             "max_tokens": 2000, "stream": True},
                    disconnect=disconnect, on_send=on_send)
    assert sorted(engine.cancelled) == sorted(e.request_id for e in engine.submitted)
    assert len(engine.submitted) == 4


async def test_one_ledger_row_with_the_summed_usage(tmp_path, engine):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        async with client_for(_app(engine, services)) as c:
            r = await c.post("/v1/completions", headers={"X-Request-ID": "fan-1"}, json={
                "model": MODEL, "prompt": ["pa", "pb"], "n": 2, "seed": 0, "max_tokens": 10})
            assert r.status_code == 200
            usage = r.json()["usage"]
            row = services.ledger.get("fan-1")
            assert row["status"] == "ok"
            assert (row["prompt_tokens"], row["completion_tokens"]) == (
                usage["prompt_tokens"], usage["completion_tokens"]) == (6, 12)
            total = await c.get("/v1/usage")
            assert total.json()["totals"]["requests"] == 1
            # The prompt alone (echo, max_tokens 0) bills the prompt: its logprobs came back.
            r = await c.post("/v1/completions", headers={"X-Request-ID": "fan-2"}, json={
                "model": MODEL, "prompt": "abc", "echo": True, "max_tokens": 0})
            row = services.ledger.get("fan-2")
            assert (row["status"], row["finish_reason"]) == ("ok", "length")
            assert (row["prompt_tokens"], row["completion_tokens"]) == (4, 0)
    finally:
        services.close()


def _app(engine, services):
    from serving.gateway.app import ServedModel, create_app
    return create_app({MODEL: ServedModel(MODEL, engine, TOK, 512, created=1)}, services)


def test_fan_out_ids_parents_seeds_and_prompt_logprobs():
    sp = SamplingParams(max_tokens=4, seed=2**63 - 2, prompt_logprobs=1)
    reqs, slots = fan_out("cmpl-x", [[1, 2], [3]], sp, 3)
    assert [r.request_id for r in reqs] == [f"cmpl-x-{k}" for k in range(6)]
    assert [(s.prompt, s.choice) for s in slots] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [r.parent_id for r in reqs] == [None, "cmpl-x-0", "cmpl-x-0", None, "cmpl-x-3", "cmpl-x-3"]
    assert [r.sampling.seed for r in reqs[:3]] == [2**63 - 2, 2**63 - 1, -(2**63)]  # int64 wrap
    assert [r.sampling.prompt_logprobs for r in reqs] == [1, None, None, 1, None, None]
    # max_tokens 0: every choice is the prompt's scoring alone, so each asks for it.
    zero, _ = fan_out("cmpl-z", [[1, 2]], dataclasses.replace(sp, max_tokens=0), 2)
    assert [r.sampling.prompt_logprobs for r in zero] == [1, 1]
    single, _ = fan_out("cmpl-y", [[1]], sp, 1)
    assert single[0].request_id == "cmpl-y" and single[0].sampling == sp
    assert choice_seed(None, 3) is None
