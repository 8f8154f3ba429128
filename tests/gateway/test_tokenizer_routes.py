"""vLLM's tokenizer routes at the server root, as lm-evaluation-harness's remote tokenizer
calls them (``lm_eval.utils.RemoteTokenizer``, lm-eval 0.4.13): ``GET /tokenizer_info``,
``POST /tokenize`` and ``POST /detokenize``; against the fake tokenizer and the real
SentencePiece code (the tiny Gemma-like vocabulary)."""

from __future__ import annotations

import pytest

from model.tokenizer import Tokenizer
from serving.gateway.app import ServedModel, create_app
from serving.gateway.openai.token_text import TokenTexts
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import BOS_ID, EOS_ID, PAD_ID, START_OF_TURN_ID, VOCAB_SIZE, FakeEngine
from tests.support.gateway_harness import MODEL, TOK, assert_openai_error, byte_ids, client_for

pytestmark = pytest.mark.anyio


async def test_tokenizer_info(client):
    # RemoteTokenizer sends Content-Type: application/json on its GET too.
    r = await client.get("/tokenizer_info", headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "model": MODEL, "eos_token": "<eos>", "eos_token_id": EOS_ID, "bos_token": "<bos>",
        "bos_token_id": BOS_ID, "pad_token": "<pad>", "pad_token_id": PAD_ID,
        "chat_template": TOK.chat_template_source, "vocab_size": VOCAB_SIZE, "max_model_len": 512}
    assert (await client.get("/tokenizer_info", params={"model": MODEL})).status_code == 200
    assert_openai_error(await client.get("/tokenizer_info", params={"model": "nope"}), 404,
                        code="model_not_found")


async def test_tokenize_reads_special_token_spellings_as_lm_eval_needs(client):
    """RemoteTokenizer derives the EOS and BOS ids as encode(spelling)[0], add_special_tokens false."""
    async def tokenize(**body):
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    assert (await tokenize(prompt="<eos>", add_special_tokens=False))["tokens"] == [EOS_ID]
    assert (await tokenize(prompt="<bos>", add_special_tokens=False))["tokens"] == [BOS_ID]
    got = await tokenize(prompt="hi<eos>", model=MODEL)
    assert got == {"tokens": [BOS_ID, *byte_ids("hi"), EOS_ID], "count": 4, "max_model_len": 512}


async def test_tokenize_messages_keeps_typed_control_text_as_text(client):
    messages = [{"role": "user", "content": "say <start_of_turn>"}]
    r = await client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == TOK.apply_chat_template([{"role": "user", "content": "say <start_of_turn>"}])
    assert tokens.count(START_OF_TURN_ID) == 2  # the template's two turns, not the typed text
    r = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert_openai_error(r, 400, param="add_generation_prompt")


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"), ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ({"prompt": 5}, "prompt"), ({"prompt": "x", "model": "nope"}, "model"),
    ({"messages": [{"role": "function", "content": "y"}]}, "messages[0].role"),
])
async def test_tokenize_bad_requests_are_openai_400s(client, body, param):
    r = await client.post("/tokenize", json=body)
    assert_openai_error(r, 404 if param == "model" else 400, param=param)


async def test_detokenize(client):
    r = await client.post("/detokenize", json={"tokens": [BOS_ID, *byte_ids("héllo"), EOS_ID]})
    assert r.json() == {"prompt": "héllo"}
    assert_openai_error(await client.post("/detokenize", json={"tokens": [VOCAB_SIZE]}), 400,
                        param="tokens")
    assert_openai_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens[0]")
    r = await client.post("/detokenize", content=b"tokens", headers={"Content-Type": "text/plain"})
    assert_openai_error(r, 415)


async def test_tokenizer_routes_need_a_key_once_keys_exist(tmp_path):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        app = create_app({MODEL: ServedModel(MODEL, FakeEngine(), TOK, 512, created=1)}, services)
        key, _ = services.authenticator.key_store.create_key("acme")
        services.authenticator._has_keys = (-1e9, False)
        async with client_for(app) as c:
            assert_openai_error(await c.get("/tokenizer_info"), 401, code="invalid_api_key")
            assert_openai_error(await c.post("/tokenize", json={"prompt": "x"}), 401)
            assert_openai_error(await c.post("/detokenize", json={"tokens": [3]}), 401)
            auth = {"Authorization": f"Bearer {key}"}
            assert (await c.get("/tokenizer_info", headers=auth)).status_code == 200
            assert (await c.post("/tokenize", json={"prompt": "x"}, headers=auth)).status_code == 200
    finally:
        services.close()


async def test_real_sentencepiece_tokenizer_routes_and_token_texts():
    tok = Tokenizer.tiny()
    app = create_app({MODEL: ServedModel(MODEL, FakeEngine(), tok, 256, created=1)})
    async with client_for(app) as c:
        info = (await c.get("/tokenizer_info")).json()
        assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<eos>", "<bos>", "<pad>")
        for name in ("eos_token", "bos_token"):
            r = await c.post("/tokenize", json={"prompt": info[name], "add_special_tokens": False})
            assert r.json()["tokens"][0] == info[f"{name}_id"]
        text = "the cat é"
        ids = (await c.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
        assert ids == tok.encode(text)
        assert (await c.post("/detokenize", json={"tokens": ids})).json()["prompt"] == text
    texts = TokenTexts(tok)
    # The tokens' own bytes add up to the text (Gemma: no dummy prefix).
    assert b"".join(texts.token_bytes(i) for i in ids) == text.encode()
    assert texts.token_bytes(tok.eos_id) is None and texts.text(tok.eos_id) == "<eos>"
