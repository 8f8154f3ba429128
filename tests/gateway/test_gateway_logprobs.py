"""Log probabilities and echo through the gateway, against the scripted fake engine.

The fake engine reports deterministic logprobs (``tests.support.gateway_fakes.fake_logprobs``),
so every number in a response is checked exactly: OpenAI's completions shape
(tokens, token_logprobs, top_logprobs, text_offset), chat's (token, logprob,
bytes, top_logprobs), echo's prompt entries, the stop token's entry, byte
pieces, ``return_tokens_as_token_ids``, and streamed pieces that add up to the
non-streamed response.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from serving.gateway.openai.choice_logprobs import LOGPROB_FLOOR, logprob_value
from serving.gateway.openai.token_text import TextOffsets, TokenTexts, spell
from tests.support.gateway_fakes import (
    BOS_ID,
    BYTE_OFFSET,
    END_OF_TURN_ID,
    EOS_ID,
    FakeEngine,
    FakeTokenizer,
    fake_logprobs,
)
from tests.support.gateway_harness import (
    CHAT,
    MODEL,
    TOK,
    assert_openai_error,
    byte_ids,
    client_for,
    make_app,
    parse_sse,
)

pytestmark = pytest.mark.anyio


def tok_text(i: int) -> str:
    return TokenTexts(TOK).text(i)


def completion_entries(ids: list[int], start: int, k: int):
    """Expected (tokens, token_logprobs, top_logprobs) of generated `ids` at positions from `start`."""
    tokens, lps, tops = [], [], []
    for p, t in enumerate(ids):
        e = fake_logprobs(t, start + p, k)
        tokens.append(tok_text(t))
        lps.append(e.logprob)
        top = {tok_text(a): lp for a, lp in e.top}
        top[tok_text(t)] = e.logprob
        tops.append(top)
    return tokens, lps, tops


async def test_completion_logprobs_every_token_and_the_stop_token(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 2,
                                                   "max_tokens": 50})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "stop"
    assert engine.submitted[0].sampling.logprobs == 2
    assert engine.submitted[0].sampling.prompt_logprobs is None
    generated = [*byte_ids("Hello world"), EOS_ID]
    tokens, lps, tops = completion_entries(generated, start=3, k=2)  # prompt: <bos> H i
    lp = choice["logprobs"]
    assert lp["tokens"] == tokens and lp["tokens"][-1] == "<eos>"
    assert lp["token_logprobs"] == lps
    assert lp["top_logprobs"] == tops
    assert all(len(t) <= 3 for t in lp["top_logprobs"])  # logprobs alternatives + the token
    # Offsets into the text; the stop token (no text) starts at the end.
    assert lp["text_offset"] == list(range(len("Hello world") + 1))
    assert "".join(lp["tokens"][:-1]) == choice["text"]


async def test_logprobs_zero_gives_the_token_alone(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 0,
                                                   "max_tokens": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e"]
    assert lp["top_logprobs"] == [{"H": lp["token_logprobs"][0]}, {"e": lp["token_logprobs"][1]}]


async def test_no_logprobs_means_null(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.json()["choices"][0]["logprobs"] is None
    assert engine.submitted[0].sampling.logprobs is None


async def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, engine):
    """lm-evaluation-harness's local-completions: token-id prompts, max_tokens 1, echo,
    logprobs 1; it sums token_logprobs[ctxlen:-1] per choice."""
    contexts = [[BOS_ID, *byte_ids("The cat")], [BOS_ID, *byte_ids("A dog")]]
    continuations = [byte_ids(" sat"), byte_ids(" ran")]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    r = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, prompt, ctx in zip(choices, prompts, contexts):
        lp = choice["logprobs"]
        assert choice["text"] == TOK.decode(prompt) + "H"
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][0] == "<bos>" and lp["text_offset"][0] == 0
        want = [fake_logprobs(t, p, 1).logprob for p, t in enumerate(prompt) if p >= len(ctx)]
        assert lp["token_logprobs"][len(ctx):-1] == want
        assert sum(lp["token_logprobs"][len(ctx):-1]) == pytest.approx(sum(want))
        # The generated token's entry, after the prompt's.
        assert lp["token_logprobs"][-1] == fake_logprobs(byte_ids("H")[0], len(prompt), 1).logprob
        # Offsets follow the echoed text: <bos> is empty, then one character per byte.
        assert lp["text_offset"] == [0, *range(len(prompt))]
        for top in lp["top_logprobs"][1:]:
            assert 1 <= len(top) <= 2
    (a, b) = engine.submitted
    assert a.sampling.prompt_logprobs == 1 and b.sampling.prompt_logprobs == 1
    assert a.parent_id is None and b.parent_id is None  # different prompts


async def test_echo_max_tokens_zero_returns_the_prompt_only(client, engine):
    for logprobs in (None, 2):
        engine.submitted.clear()
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 0, "echo": True, "logprobs": logprobs}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("Once", "length")
        assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 5
        sp = engine.submitted[0].sampling
        assert sp.max_tokens == 0 and sp.prompt_logprobs == (0 if logprobs is None else 2)
        if logprobs is None:
            assert choice["logprobs"] is None
        else:
            assert choice["logprobs"]["tokens"] == ["<bos>", "O", "n", "c", "e"]
            assert choice["logprobs"]["text_offset"] == [0, 0, 1, 2, 3]
    # max_completion_tokens is honoured on /v1/completions too.
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 9,
                                                   "max_completion_tokens": 3})
    assert r.json()["choices"][0]["text"] == "Hel" and engine.submitted[-1].sampling.max_tokens == 3


async def test_echo_without_logprobs_prepends_the_prompt(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Say: ", "echo": True,
                                                   "max_tokens": 5})
    assert r.json()["choices"][0]["text"] == "Say: Hello"
    assert engine.submitted[0].sampling.prompt_logprobs is None


def _merge_completion_stream(events: list) -> dict:
    text, merged, finish = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, []
    for e in events[:-1]:
        for c in e["choices"]:
            text += c["text"]
            for k in merged:
                merged[k] += c["logprobs"][k]
            if c["finish_reason"]:
                finish.append(c["finish_reason"])
    return {"text": text, "logprobs": merged, "finish": finish}


@pytest.mark.parametrize("body", [
    {"prompt": "Hi", "logprobs": 3, "max_tokens": 50},
    {"prompt": "Hi", "logprobs": 1, "echo": True, "max_tokens": 4},
    {"prompt": "Hi", "logprobs": 1, "echo": True, "max_tokens": 0},
])
async def test_streamed_completion_logprobs_equal_non_streamed(engine, body):
    engine.text = "Héllo"  # a 2-byte character: two byte tokens
    async with client_for(make_app(engine)) as c:
        whole = (await c.post("/v1/completions", json={"model": MODEL, **body})).json()["choices"][0]
        r = await c.post("/v1/completions", json={"model": MODEL, **body, "stream": True})
    streamed = _merge_completion_stream(parse_sse(r.text))
    assert streamed["text"] == whole["text"]
    assert streamed["logprobs"] == whole["logprobs"]
    assert streamed["finish"] == [whole["finish_reason"]]


async def test_byte_pieces_are_spelled_as_bytes_and_offsets_stay_in_characters(client, engine):
    engine.text = "é!"
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 0,
                                                   "max_tokens": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    assert lp["text_offset"] == [0, 0, 1]  # both bytes of "é" start at it
    r = await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "max_tokens": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [
        ("bytes:\\xc3", [0xC3]), ("bytes:\\xa9", [0xA9]), ("!", [0x21])]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "é!"


async def test_return_tokens_as_token_ids(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1,
                                                   "max_tokens": 2, "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    h, e = byte_ids("He")
    assert lp["tokens"] == [f"token_id:{h}", f"token_id:{e}"]
    assert set(lp["top_logprobs"][0]) == {f"token_id:{h}", f"token_id:{h + 1}"}


async def test_chat_logprobs_shape_with_top_logprobs(client, engine):
    r = await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2,
                                                        "max_tokens": 50})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello world"
    content = choice["logprobs"]["content"]
    n_prompt = len(engine.submitted[0].prompt_ids)
    generated = [*byte_ids("Hello world"), EOS_ID]
    assert len(content) == len(generated)
    for p, (entry, t) in enumerate(zip(content, generated)):
        want = fake_logprobs(t, n_prompt + p, 2)
        assert entry["logprob"] == want.logprob
        assert [a["logprob"] for a in entry["top_logprobs"]] == [lp for _, lp in want.top]
        assert [a["token"] for a in entry["top_logprobs"]] == [tok_text(i) for i, _ in want.top]
    # The stop token's entry is there; it has no bytes (it adds no text).
    assert (content[-1]["token"], content[-1]["bytes"]) == ("<eos>", None)
    assert engine.submitted[0].sampling.logprobs == 2
    r = await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "max_tokens": 2})
    assert [e["top_logprobs"] for e in r.json()["choices"][0]["logprobs"]["content"]] == [[], []]
    assert engine.submitted[-1].sampling.logprobs == 0


async def test_streamed_chat_logprobs_equal_non_streamed(engine):
    engine.text = "Hé"
    body = {**CHAT, "logprobs": True, "top_logprobs": 1, "max_tokens": 20}
    async with client_for(make_app(engine)) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
    events = parse_sse(r.text)
    content = [x for e in events[:-1] for ch in e["choices"] if ch["logprobs"]
               for x in ch["logprobs"]["content"]]
    assert content == whole["logprobs"]["content"]
    assert content[-1]["token"] == "<eos>"


async def test_engine_without_logprobs_is_an_engine_error(engine):
    class Mute(FakeEngine):
        def submit(self, request):
            events = super().submit(request)

            async def strip():
                async for ev in events:
                    yield type(ev)(**{**ev.__dict__, "logprobs": None, "prompt_logprobs": None})
            return strip()

    async with client_for(make_app(Mute())) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1})
        assert_openai_error(r, 500, code="engine_error")
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200


async def test_official_client_reads_logprobs(engine):
    """The openai package parses both shapes (n, logprobs, echo)."""
    app = make_app(engine)
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    client = openai.AsyncOpenAI(api_key="unused", base_url="http://testserver/v1",
                                http_client=http_client, max_retries=0)
    async with http_client:
        c = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=2,
                                            echo=True, n=2, seed=7)
        assert [ch.index for ch in c.choices] == [0, 1]
        assert c.choices[1].logprobs.tokens == ["<bos>", "H", "i", "H", "e"]
        assert c.choices[1].logprobs.token_logprobs[0] is None
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True,
            top_logprobs=3)
        entry = chat.choices[0].logprobs.content[0]
        assert entry.token == "H" and entry.bytes == [72] and len(entry.top_logprobs) == 3


def test_token_texts_of_sentencepiece_and_byte_level_pieces():
    class Pieces(FakeTokenizer):
        """A SentencePiece-like piece (▁), and GPT-2 byte-level pieces for the others."""

        def id_to_piece(self, i):
            return {10: "\u2581the", 11: "\u0120world", 12: "\u00c3"}.get(i) or super().id_to_piece(i)

        def decode(self, ids):
            return {10: "the", 11: " world", 12: "\ufffd"}.get(ids[0]) if ids[0] in (10, 11, 12) \
                else super().decode(ids)

    texts = TokenTexts(Pieces())
    assert texts.token_bytes(10) == b" the"  # ▁ is a space even where decode drops it
    assert texts.token_bytes(11) == b" world"  # decodes cleanly: decode wins
    assert texts.token_bytes(12) == b"\xc3"  # half a character: read through GPT-2's byte alphabet
    assert texts.text(12) == "bytes:\\xc3" and texts.text(12, as_id=True) == "token_id:12"
    assert texts.token_bytes(END_OF_TURN_ID) is None and texts.text(END_OF_TURN_ID) == "<end_of_turn>"
    assert texts.token_bytes(BYTE_OFFSET + 0xC3) == b"\xc3"  # <0xC3>
    assert spell("é".encode()) == "é"


def test_text_offsets_count_characters():
    off = TextOffsets(5)
    assert [off.next(b) for b in (b"a", b"\xe4", b"\xb8", b"\x96", None, b"b")] == [5, 6, 6, 6, 7, 7]
    assert off.chars == 8


def test_logprob_values_are_finite_json_numbers():
    assert logprob_value(-1.5) == -1.5
    assert logprob_value(float("-inf")) == LOGPROB_FLOOR == logprob_value(-1e30)
    assert logprob_value(float("nan")) == LOGPROB_FLOOR
    assert math.isfinite(logprob_value(float("inf")))


def test_colliding_spellings_keep_the_most_likely_logprob():
    """Two ids spelled alike (e.g. a byte piece and a one-byte token) share a ``top_logprobs``
    key: it keeps the more likely one's logprob, so lm-eval's ``is_greedy``
    (``token_logprob == max(top.values())``) stays false for a token that is not the argmax."""
    from serving.gateway.openai.choice_logprobs import CompletionChoiceRenderer
    from serving.gateway.schema.response_models import CompletionLogprobs

    class SameSpelling:
        def text(self, tid, as_ids=False):
            return "x" if tid in (5, 6) else f"t{tid}"

        def token_bytes(self, tid):
            return b"x"

    renderer = CompletionChoiceRenderer(None, SameSpelling(), echo_text=None, prompt_ids=[],
                                        logprobs=True, as_ids=False)
    out = CompletionLogprobs()
    # Token 6 sampled (logprob -2.0); the argmax is token 5 (-0.5), spelled the same; token 7 next.
    renderer._add(out, 6, -2.0, [(5, -0.5), (7, -1.0)], TextOffsets(0))
    assert out.top_logprobs == [{"x": -0.5, "t7": -1.0}]
    assert out.token_logprobs[0] != max(out.top_logprobs[0].values())
    out = CompletionLogprobs()
    renderer._add(out, 6, -0.5, [(6, -0.5), (5, -2.0)], TextOffsets(0))  # the argmax itself
    assert out.token_logprobs[0] == max(out.top_logprobs[0].values())
