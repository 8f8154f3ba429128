"""End to end: ``xlaserve serve --model DIR`` for a sentence-transformers directory (``--task auto``
picks embed from its ``modules.json``), with the official ``openai`` client: its default base64
request decodes to sentence-transformers' embeddings, ``dimensions`` truncates and re-normalizes,
a bad input is a 400 and the next request is served."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.support.embedding_models import ST_TINY, golden
from tests.support.server_process import serve_process

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "32", "--embed-max-batch", "4",
               "--embed-max-batch-tokens", "128"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-embed") / "server.log"
    with serve_process(["--model", str(ST_TINY / "gemma3_embed"), *SERVER_ARGS], log) as (_, url, _log):
        yield url


def test_openai_client_embeddings(server):
    g, want = golden("gemma3_embed")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["gemma3_embed"]
    out = client.embeddings.create(model="gemma3_embed", input=g["inputs"])  # base64 on the wire
    got = np.array([d.embedding for d in out.data], np.float32)
    assert np.sum(got * want, axis=1).min() >= 0.9999
    assert out.usage.prompt_tokens == sum(len(ids) for ids in g["token_ids"]) == out.usage.total_tokens
    small = client.embeddings.create(model="gemma3_embed", input=g["inputs"][0], dimensions=8,
                                     encoding_format="float")
    vec = np.array(small.data[0].embedding)
    expect = want[0, :8] / np.linalg.norm(want[0, :8])
    assert vec.shape == (8,) and float(vec @ expect) >= 0.9999
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="gemma3_embed", input=[[2, 5000]])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gemma3_embed", messages=[{"role": "user", "content": "hi"}])
    again = client.embeddings.create(model="gemma3_embed", input=g["token_ids"][2])
    assert float(np.array(again.data[0].embedding) @ want[2]) >= 0.9999


MAX_FUZZ_INPUTS = 8
"""Schema-valid cases embed at most this many inputs (the schema allows 2048)."""


def _embedding_case(case):
    if isinstance(case.body, dict):
        case.body["model"] = "gemma3_embed"
        if isinstance(case.body.get("input"), list) and case.body["input"] and not isinstance(case.body["input"][0], int):
            case.body["input"] = case.body["input"][:MAX_FUZZ_INPUTS]
    return case


def test_schemathesis_on_the_embeddings_route(server):
    """schemathesis's schema-valid (naming the served model) and schema-invalid requests to
    ``POST /v1/embeddings`` of an embedding server: no 5xx, documented statuses and bodies, invalid
    data refused (the checks of test_gateway_fuzz.py)."""
    import schemathesis
    from hypothesis import given, settings
    from schemathesis import GenerationMode

    from tests.e2e.test_gateway_fuzz import FUZZ_SETTINGS, NEGATIVE_CHECKS, POSITIVE_CHECKS, REQUEST_TIMEOUT_S

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    op = next(r.ok() for r in schema.get_all_operations() if r.ok().label == "POST /v1/embeddings")
    report = {}
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategy = op.as_strategy(generation_mode=mode)
        if mode is GenerationMode.POSITIVE:
            strategy = strategy.map(_embedding_case)
        checks = NEGATIVE_CHECKS if mode is GenerationMode.NEGATIVE else POSITIVE_CHECKS
        statuses: dict[int, int] = {}

        @settings(max_examples=60, **FUZZ_SETTINGS)
        @given(case=strategy)
        def run(case):
            response = case.call(base_url=server, timeout=REQUEST_TIMEOUT_S)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=checks)

        run()
        report[mode.value] = dict(sorted(statuses.items()))
        assert sum(statuses.values()) > 0
    print(f"\nschemathesis POST /v1/embeddings: {report}")
    assert report["positive"].get(200, 0) > 0, report  # some schema-valid cases were embedded
