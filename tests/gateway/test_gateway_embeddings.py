"""``POST /v1/embeddings`` in process: the real embedding loop over the tiny sentence-transformers
models (tests/data/st_tiny), a SQLite ledger, and a generation model beside them.

Every input form against sentence-transformers' goldens; base64 is the same floats; ``dimensions``
truncates and re-normalizes (Matryoshka only); each bad input is a 400 naming what is wrong and
leaves the server serving; rows are metered; the Batch API runs ``/v1/embeddings`` lines, a bad
line failing alone; generation routes refuse an embedding model and vice versa."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from model.bpe_tokenizer import BPETokenizer
from serving.gateway.app import ServedModel, create_app
from serving.gateway.batch.batch_runner import BatchSettings
from serving.gateway.http.limits import GatewayLimits
from serving.gateway.services.gateway_services import GatewayServices
from serving.runtime.embedding_loop import EmbeddingLoop
from tests.gateway.batch.test_batches import Clock, batch_in, client as openai_client, read_lines, start_batch
from tests.support.embedding_models import ST_TINY, embedding_engine, golden
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error

pytestmark = pytest.mark.anyio
GEMMA, QWEN, GEN = "gemma-embed", "qwen-embed", "gemma-3-270m"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _served(name: str, case: str, loop: EmbeddingLoop) -> ServedModel:
    head = loop.engine.head
    return ServedModel(name, loop, BPETokenizer.from_hf_dir(ST_TINY / case), loop.max_model_len, task="embed",
                       embedding_dim=head.dim, matryoshka_dims=head.matryoshka_dims, vocab_size=loop.vocab_size)


@pytest.fixture
def app_services(tmp_path):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    loops = {case: EmbeddingLoop(embedding_engine(case)) for case in ("gemma3_embed", "qwen3_embed")}
    for lp in loops.values():
        lp.start(warmup=False)
    app = create_app({GEMMA: _served(GEMMA, "gemma3_embed", loops["gemma3_embed"]),
                      QWEN: _served(QWEN, "qwen3_embed", loops["qwen3_embed"]),
                      GEN: ServedModel(GEN, FakeEngine(text="Hello world"), FakeTokenizer(), 512)},
                     services, GatewayLimits(),
                     BatchSettings(concurrency=2, lease_seconds=0.3, poll_seconds=0.05, clock=Clock()))
    yield app, services
    for lp in loops.values():
        lp.stop()
    services.close()


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def vectors(body: dict) -> np.ndarray:
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], np.float32)


@pytest.mark.parametrize("model,case", [(GEMMA, "gemma3_embed"), (QWEN, "qwen3_embed")])
async def test_every_input_form_matches_sentence_transformers(app_services, model, case):
    app, services = app_services
    g, want = golden(case)
    async with http(app) as c:
        many = await c.post("/v1/embeddings", json={"model": model, "input": g["inputs"]},
                            headers={"X-Request-ID": f"emb-{model}"})
        assert many.status_code == 200, many.text
        got = vectors(many.json())
        assert np.sum(got * want, axis=1).min() >= 0.9999
        total = sum(len(ids) for ids in g["token_ids"])
        assert many.json()["usage"] == {"prompt_tokens": total, "total_tokens": total}
        assert many.json()["model"] == model
        one = await c.post("/v1/embeddings", json={"model": model, "input": g["inputs"][3]})
        ids = await c.post("/v1/embeddings", json={"model": model, "input": g["token_ids"][3]})
        id_lists = await c.post("/v1/embeddings", json={"model": model, "input": g["token_ids"][:2]})
    np.testing.assert_allclose(vectors(one.json())[0], got[3], atol=1e-5)
    np.testing.assert_allclose(vectors(ids.json())[0], got[3], atol=1e-5)
    np.testing.assert_allclose(vectors(id_lists.json()), got[:2], atol=1e-5)
    row = services.ledger.get(f"emb-{model}")
    assert row["status"] == "ok" and row["prompt_tokens"] == total and row["completion_tokens"] == 0


async def test_base64_is_the_same_floats_and_dimensions_renormalize(app_services):
    app, _ = app_services
    g, want = golden("gemma3_embed")
    async with http(app) as c:
        floats = (await c.post("/v1/embeddings", json={"model": GEMMA, "input": g["inputs"]})).json()
        b64 = (await c.post("/v1/embeddings", json={"model": GEMMA, "input": g["inputs"],
                                                     "encoding_format": "base64"})).json()
        small = (await c.post("/v1/embeddings", json={"model": GEMMA, "input": g["inputs"], "dimensions": 16})).json()
        full = await c.post("/v1/embeddings", json={"model": GEMMA, "input": "paris", "dimensions": 32})
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]])
    np.testing.assert_array_equal(decoded, vectors(floats))
    got = vectors(small)
    assert got.shape == (8, 16)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    expect = want[:, :16] / np.linalg.norm(want[:, :16], axis=1, keepdims=True)
    assert np.sum(got * expect, axis=1).min() >= 0.9999
    assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == 32


@pytest.mark.parametrize("body,param,code,words", [
    ({"model": GEMMA, "input": ""}, "input", None, "empty string"),
    ({"model": GEMMA, "input": []}, "input", None, "non-empty"),
    ({"model": GEMMA, "input": ["ok", ""]}, "input", None, "item 1"),
    ({"model": GEMMA, "input": [[2, 5], []]}, "input", None, "item 1"),
    ({"model": GEMMA, "input": [2, 1000]}, "input", "invalid_value", "token id 1000"),
    ({"model": GEMMA, "input": [[2, 5], [-1]]}, "input", "invalid_value", "item 1 has token id -1"),
    ({"model": GEMMA, "input": " ".join(["cat"] * 40)}, "input", "context_length_exceeded", "42 tokens"),
    ({"model": GEMMA, "input": "cat", "dimensions": 20}, "dimensions", "invalid_value", "8, 16, 32"),
    ({"model": QWEN, "input": "cat", "dimensions": 16}, "dimensions", "invalid_value", "not a Matryoshka"),
    ({"model": GEMMA, "input": "cat", "encoding_format": "int8"}, "encoding_format", None, "float"),
    ({"model": GEN, "input": "cat"}, "model", "model_not_supported", "does not serve embeddings"),
])
async def test_bad_input_is_a_400_naming_it_and_disturbs_nothing(app_services, body, param, code, words):
    app, _ = app_services
    async with http(app) as c:
        r = await c.post("/v1/embeddings", json=body)
        err = assert_openai_error(r, 400, param=param, **({} if code is None else {"code": code}))
        assert words in err["message"], err
        ok = await c.post("/v1/embeddings", json={"model": GEMMA, "input": ["cat", "the dog"]})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 2
        gen = await c.post("/v1/completions", json={"model": GEN, "prompt": "hi"})
        assert gen.status_code == 200


async def test_generation_routes_refuse_an_embedding_model(app_services):
    app, _ = app_services
    async with http(app) as c:
        r = await c.post("/v1/chat/completions", json={"model": GEMMA, "messages": [{"role": "user", "content": "x"}]})
        assert_openai_error(r, 400, param="model", code="model_not_supported")
        r = await c.post("/v1/completions", json={"model": QWEN, "prompt": "x"})
        assert_openai_error(r, 400, param="model", code="model_not_supported")
        assert (await c.get("/health")).status_code == 200


async def test_batch_api_runs_embedding_lines_and_a_bad_line_fails_alone(app_services):
    app, services = app_services
    g, want = golden("gemma3_embed")
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": GEMMA, "input": text}} for i, text in enumerate(g["inputs"][:3])]
    lines.insert(1, {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                     "body": {"model": GEMMA, "input": [2, 999]}})
    async with app.router.lifespan_context(app):
        oai = openai_client(app)
        batch = await start_batch(oai, lines, endpoint="/v1/embeddings")
        done = await batch_in(oai, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
        out = {x["custom_id"]: x for x in await read_lines(oai, done.output_file_id)}
        errors = {x["custom_id"]: x for x in await read_lines(oai, done.error_file_id)}
    for i in range(3):
        vec = np.array(out[f"e{i}"]["response"]["body"]["data"][0]["embedding"], np.float32)
        assert float(vec @ want[i]) >= 0.9999
    bad = errors["bad"]["response"]
    assert bad["status_code"] == 400 and "token id 999" in json.dumps(bad["body"])


async def test_input_policy_applies_and_is_metered(tmp_path):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'p.db'}", blocklist=["fox"])
    loop = EmbeddingLoop(embedding_engine("gemma3_embed"))
    loop.start(warmup=False)
    try:
        app = create_app({GEMMA: _served(GEMMA, "gemma3_embed", loop)}, services)
        async with http(app) as c:
            r = await c.post("/v1/embeddings", json={"model": GEMMA, "input": ["the cat", "a quick brown fox"]},
                             headers={"X-Request-ID": "emb-pol"})
            assert_openai_error(r, 400, param="input", code="content_policy_violation")
            assert (await c.post("/v1/embeddings", json={"model": GEMMA, "input": "the cat"})).status_code == 200
        row = services.ledger.get("emb-pol")
        assert row["status"] == "error" and row["prompt_tokens"] == 0
    finally:
        loop.stop()
        services.close()
