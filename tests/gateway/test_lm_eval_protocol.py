"""lm-evaluation-harness's scoring traffic, replayed against the gateway on the real engine loop.

lm-eval itself is not a test dependency (benchmarks/lm_eval_check.py runs the real one on Gemma 3
270M; benchmarks/RESULTS.md has its output). This test sends, on the tiny-random model, the same
requests lm-eval 0.4.13's ``local-completions`` model sends with ``tokenizer_backend=remote`` and
``--batch_size 4`` (``lm_eval/models/openai_completions.py``, ``api_models.py``,
``utils.RemoteTokenizer``), reads the answers as it does, and compares its loglikelihoods with a
direct forward pass of the same weights (``benchmarks.lm_eval_reference``):

* ``GET /tokenizer_info`` for ``eos_token`` / ``bos_token``; the ids as the first id of ``POST
  /tokenize {"prompt": spelling, "add_special_tokens": false}``;
* every context and context + continuation through ``/tokenize`` (no BOS), split as
  ``TemplateLM._encode_pair`` splits them;
* ``POST /v1/completions`` with ``prompt`` a list of 4 token-id lists, ``max_tokens: 1, echo: true,
  logprobs: 1, temperature: 0, seed: 1234``; the loglikelihood is ``sum(token_logprobs[ctxlen:-1])``
  of the choice with the prompt's index, ``is_greedy`` whether each of those equals the max of its
  ``top_logprobs`` entry.
"""

from __future__ import annotations

import httpx
import jax.numpy as jnp
import pytest
from flax import nnx

from benchmarks.lm_eval_reference import ReferenceScorer, encode_pair
from model.gemma3 import Gemma3
from serving.gateway.app import ServedModel, create_app
from tests.support.tiny_engine import TINY, make_loop

pytestmark = pytest.mark.anyio
MODEL = "tiny-random"
TOLERANCE = 1e-4  # nats per summed loglikelihood: the same float32 weights, engine vs direct pass

# (context, continuation) pairs as a multiple-choice task makes them: four choices per context.
CONTEXT_A = "Question: which word is a colour? Answer:"
CONTEXT_B = "the quick brown fox jumps over the lazy dog and then "
PAIRS = [(CONTEXT_A, c) for c in (" red", " table", " seven", " running")] + [
    (CONTEXT_B, c) for c in ("sleeps", "runs away quickly", "eats", "barks at the moon")]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def loop(jax_cache):
    loop = make_loop()  # the usual tiny shapes (tests/support/tiny_engine.py): their compiled programs
    loop.start(warmup=False)
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def scorer():
    return ReferenceScorer(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)))  # make_loop's weights


async def _tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert isinstance(tokens, list)
    return tokens


def _parse_logprobs(body: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs``, restated."""
    out = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        lp = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(lp), all(t == max(d.values()) for t, d in zip(lp, top, strict=True))))
    return out


async def test_lm_eval_loglikelihoods_equal_a_direct_forward_pass(loop, scorer, tiny_tokenizer):
    app = create_app({MODEL: ServedModel(MODEL, loop, tiny_tokenizer, loop.max_model_len,
                                         kv_capacity_tokens=loop.kv_capacity_tokens)})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                                 headers={"Authorization": "Bearer "}, timeout=60) as client:
        r = await client.get("/tokenizer_info")
        assert r.status_code == 200, r.text
        info = r.json()
        assert (await _tokenize(client, info["eos_token"]))[0] == tiny_tokenizer.eos_id
        assert (await _tokenize(client, info["bos_token"]))[0] == tiny_tokenizer.bos_id

        requests = []
        for context, continuation in PAIRS:
            # _encode_pair through the remote tokenizer: the trailing space moves to the continuation.
            ctx = context.rstrip()
            cont = context[len(ctx):] + continuation
            whole = await _tokenize(client, ctx + cont)
            ctx_ids = await _tokenize(client, ctx)
            assert (ctx_ids, whole[len(ctx_ids):]) == encode_pair(tiny_tokenizer, context, continuation)
            requests.append((whole, len(ctx_ids)))
        # A continuation of the model's own two greedy tokens: is_greedy must come out True
        # (token_logprobs and top_logprobs from the same float32 log-softmax, compared with ==).
        greedy = list(requests[0][0][:requests[0][1]])
        for _ in range(2):
            greedy.append(scorer.next_token(greedy))
        requests.append((greedy, len(greedy) - 2))
        requests.sort(key=lambda r: -len(r[0]))  # lm-eval's order: longest first

        scores = []
        for i in range(0, len(requests), 4):
            batch = requests[i:i + 4]
            r = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": [ids for ids, _ in batch], "temperature": 0,
                "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert sorted(c["index"] for c in body["choices"]) == list(range(len(batch)))
            for c, (ids, _) in zip(sorted(body["choices"], key=lambda c: c["index"]), batch):
                # every prompt token (the first null) and the one generated token
                assert len(c["logprobs"]["token_logprobs"]) == len(ids) + 1
                assert c["logprobs"]["token_logprobs"][0] is None
            scores += _parse_logprobs(body, [ctxlen for _, ctxlen in batch])

        # The generated token's entry is there when it is a stop id too (here EOS, forced by a
        # bias: logprobs are the raw logits' log-softmax, so the prompt's sum does not move).
        ids, ctxlen = requests[0]
        r = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True, "logit_bias": {str(tiny_tokenizer.eos_id): 100}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        (logprob, is_greedy), = _parse_logprobs(r.json(), [ctxlen])
        assert abs(logprob - scores[0][0]) <= TOLERANCE and is_greedy == scores[0][1]

    greedy_seen = []
    for (ids, ctxlen), (logprob, is_greedy) in zip(requests, scores, strict=True):
        ref = scorer.score(ids, ctxlen)
        assert abs(logprob - ref.logprob) <= TOLERANCE, (ids, ctxlen, logprob, ref)
        assert is_greedy == ref.is_greedy or ref.max_gap <= TOLERANCE, (ids, ctxlen, is_greedy, ref)
        if ids == greedy:
            assert is_greedy
        greedy_seen.append(is_greedy)
    assert len(scores) == len(PAIRS) + 1 and False in greedy_seen
