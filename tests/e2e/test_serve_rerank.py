"""End to end: ``xlaserve serve --model DIR`` for a sentence-transformers CrossEncoder (``--task auto``
picks rerank from its config.json), over httpx: rerank and score equal CrossEncoder's scores within
1e-4 on every alias, ``top_n`` / ``return_documents``, bad requests get OpenAI's error shape, a
rerank of 64 documents shares steps (the loop logs each request's step count), each request is
metered with a trace, and the Batch API runs /v1/rerank and /v1/score lines. A second server,
``--task rerank`` over the tiny Qwen3 decoder scored by its yes / no tokens (Qwen3-Reranker's
recipe), answers the same routes with the reference scores within 1e-4."""

from __future__ import annotations

import contextlib
import json
import re
import time

import httpx
import pytest

from tests.support.rerank_models import RERANK_TINY, golden
from tests.support.server_process import serve_process

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "64", "--embed-max-batch", "16",
               "--embed-max-batch-tokens", "512", "--skip-warmup"]
MODEL = "bert_cross"


@contextlib.contextmanager
def _serving(tmp_path_factory, name: str, args: list[str]):
    """A server process of ``args`` (its log under a tmp folder ``name``): (httpx client, log path)."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    with serve_process(args, log, log_level="INFO") as (_, url, f):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client, f


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _serving(tmp_path_factory, "serve-rerank", ["--model", str(RERANK_TINY / MODEL), *SERVER_ARGS]) as s:
        yield s


def test_rerank_and_score_match_the_cross_encoder(server):
    client, _ = server
    g = golden(MODEL)
    query = g["pairs"][0][0]
    docs = [d for q, d in g["pairs"] if q == query]
    want = g["scores"][:len(docs)]
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = client.post(path, json={"model": MODEL, "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda i: -want[i])
        assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-4 and "document" not in x for x in results)
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == sum(
            len(ids) for ids in g["token_ids"][:len(docs)])
    objs = [{"text": d} for d in docs]
    top = client.post("/v1/rerank", json={"model": MODEL, "query": query, "documents": objs, "top_n": 2,
                                          "return_documents": True}).json()["results"]
    assert len(top) == 2 and top[0]["document"] == {"text": docs[top[0]["index"]]}
    for path in ("/v1/score", "/score"):
        r = client.post(path, json={"model": MODEL, "text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        assert [round(d["score"], 4) for d in r.json()["data"]] == [round(s, 4) for s in want]
    pairwise = client.post("/v1/score", json={"model": MODEL, "text_1": [p[0] for p in g["pairs"]],
                                              "text_2": [p[1] for p in g["pairs"]]}).json()["data"]
    assert max(abs(d["score"] - s) for d, s in zip(pairwise, g["scores"])) < 1e-4
    one = client.post("/v1/score", json={"model": MODEL, "text_1": query, "text_2": docs[0]}).json()
    assert len(one["data"]) == 1 and abs(one["data"][0]["score"] - want[0]) < 1e-4
    trace = client.get(f"/v1/requests/{one['id']}")
    assert trace.status_code == 200, trace.text


def test_bad_requests_get_openai_errors(server):
    client, _ = server
    cases = [
        ({"model": MODEL, "query": "q", "documents": []}, "/v1/rerank", None),
        ({"model": MODEL, "query": "", "documents": ["a"]}, "/v1/rerank", None),
        ({"model": MODEL, "query": "q", "documents": [{"no_text": 1}]}, "/v1/rerank", None),
        ({"model": MODEL, "query": "q", "documents": ["a"], "top_n": -1}, "/v1/rerank", None),
        ({"model": MODEL, "query": "the " * 40, "documents": ["a " * 40]}, "/v1/rerank", "context_length_exceeded"),
        ({"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "/v1/score", "invalid_value"),
        ({"model": MODEL, "text_1": "a", "text_2": []}, "/v1/score", None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions",
         "model_not_supported"),
        ({"model": MODEL, "input": "hi"}, "/v1/embeddings", "model_not_supported"),
    ]
    for body, path, code in cases:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
        assert code is None or err["code"] == code, err
    assert client.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["a"]}).status_code == 404
    assert client.post("/v1/rerank", content=b"{not json", headers={"content-type": "application/json"}
                       ).status_code == 400


def test_64_documents_share_steps(server):
    client, log = server
    g = golden(MODEL)
    docs = [g["pairs"][i % len(g["pairs"])][1] for i in range(64)]
    r = client.post("/v1/rerank", json={"model": MODEL, "query": g["pairs"][0][0], "documents": docs})
    assert r.status_code == 200 and len(r.json()["results"]) == 64
    log.flush()
    steps = [int(m) for m in re.findall(r"64 inputs done in (\d+) steps", open(log.name).read())]
    assert steps == [4], steps  # 16 pairs a step (--embed-max-batch 16; 16 x 32 tokens fit 512)


def test_batch_api_runs_rerank_and_score_lines(server):
    client, _ = server
    lines = [{"custom_id": "r", "method": "POST", "url": "/v1/rerank",
              "body": {"model": MODEL, "query": "paris", "documents": ["paris is a city", "the cat"]}},
             {"custom_id": "s", "method": "POST", "url": "/v1/score",
              "body": {"model": MODEL, "text_1": "paris", "text_2": ["paris is a city"]}}]
    outputs = {}
    for line, endpoint in zip(lines, ("/v1/rerank", "/v1/score")):
        f = client.post("/v1/files", data={"purpose": "batch"},
                        files={"file": ("b.jsonl", (json.dumps(line) + "\n").encode(), "application/jsonl")})
        assert f.status_code == 200, f.text
        b = client.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": endpoint,
                                             "completion_window": "24h"})
        assert b.status_code == 200, b.text
        deadline = time.monotonic() + 60
        while (batch := client.get(f"/v1/batches/{b.json()['id']}").json())["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1, batch
        out = client.get(f"/v1/files/{batch['output_file_id']}/content").text
        outputs[line["custom_id"]] = json.loads(out.splitlines()[0])["response"]
    assert outputs["r"]["status_code"] == 200 and len(outputs["r"]["body"]["results"]) == 2
    assert outputs["s"]["status_code"] == 200 and outputs["s"]["body"]["data"][0]["object"] == "score"


DECODER = "qwen3_rerank"


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory):
    args = ["--model", str(RERANK_TINY / DECODER), "--task", "rerank", "--dtype", "float32", "--max-model-len", "128",
            "--embed-max-batch", "4", "--embed-max-batch-tokens", "512", "--skip-warmup"]
    with _serving(tmp_path_factory, "serve-rerank-decoder", args) as s:
        yield s


def test_a_decoder_reranker_matches_its_reference_over_http(decoder_server):
    client, log = decoder_server
    g = golden(DECODER)
    query = g["pairs"][0][0]
    docs = [d for q, d in g["pairs"] if q == query]
    want = g["scores"][:len(docs)]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = client.post(path, json={"model": DECODER, "query": query, "documents": [{"text": d} for d in docs],
                                    "return_documents": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])
        assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-4 for x in body["results"]), body
        assert all(x["document"] == {"text": docs[x["index"]]} for x in body["results"])
        assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in g["token_ids"][:len(docs)])
    top = client.post("/v1/rerank", json={"model": DECODER, "query": query, "documents": docs, "top_n": 1}).json()
    assert [x["index"] for x in top["results"]] == [max(range(len(docs)), key=lambda i: want[i])]
    for path in ("/v1/score", "/score"):
        r = client.post(path, json={"model": DECODER, "text_1": [p[0] for p in g["pairs"]],
                                    "text_2": [p[1] for p in g["pairs"]]})
        assert r.status_code == 200, r.text
        assert max(abs(d["score"] - s) for d, s in zip(r.json()["data"], g["scores"])) < 1e-4
    log.flush()
    steps = [int(m) for m in re.findall(r": 7 inputs done in (\d+) steps", open(log.name).read())]
    assert steps == [2, 2], steps  # --embed-max-batch 4
    for body, path, code in (({"model": DECODER, "query": query, "documents": ["the " * 70]}, "/v1/rerank",
                              "context_length_exceeded"),
                             ({"model": DECODER, "messages": [{"role": "user", "content": "hi"}]},
                              "/v1/chat/completions", "model_not_supported")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
