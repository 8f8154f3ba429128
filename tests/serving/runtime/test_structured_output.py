"""Structured output: the device bitmask, llguidance matchers on the tiny tokenizer, the engine loop.

Tiny vocabulary (``Tokenizer.tiny()``, 512 pieces) and the tiny-random model:
only allowed tokens are ever sampled, unconstrained rows are untouched by a
constrained neighbour, and a failing matcher ends its own request only.
"""

from __future__ import annotations

import asyncio
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ModelConfig
from model.gemma3 import Gemma3
from serving.config.config_files import read_config
from serving.contract.engine_client import EngineRequest, RequestRejectedError, SamplingParams, StructuredOutput
from serving.core.structured_output import Grammars, StructuredOutputError
from serving.engine.engine import Engine, EngineConfig
from serving.engine.sample.sampling import SamplingArrays, sample
from serving.engine.sample.token_bitmask import apply_token_bitmask, mask_words, pad_rows
from serving.runtime.engine_loop import EngineLoop
from serving.runtime.structured_steps import request_matcher
from tests.support.engine_helpers import collect

V = 80  # not a multiple of 32: the last word is partial
SAMPLE = jax.jit(sample)


def _bits(allowed: np.ndarray) -> np.ndarray:
    """[R, V] bool -> [R, ceil(V/32)] int32 bitmask."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, mask_words(vocab) * 32), bool)
    padded[:, :vocab] = allowed
    words = (padded.reshape(rows, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def _arrays(rows, temperature, mask=None):
    return SamplingArrays(np.full(rows, temperature, np.float32), np.zeros(rows, np.int32),
                          np.ones(rows, np.float32), np.arange(rows, dtype=np.uint32), token_mask=mask)


def test_bitmask_sets_forbidden_logits_to_minus_inf_and_leaves_the_rest_bitwise():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, V)).astype(np.float32)
    allowed = rng.random((6, V)) < 0.3
    allowed[2:] = True  # unconstrained rows: all ones
    mask = _bits(allowed)
    mask[2:] = -1  # all bits, those past the vocabulary too
    out = np.asarray(jax.jit(apply_token_bitmask)(logits, mask))
    assert np.isneginf(out[~allowed]).all()
    assert np.array_equal(out[allowed], logits[allowed])
    none = np.asarray(jax.jit(apply_token_bitmask)(logits, np.full((6, 3), -1, np.int32)))
    assert np.array_equal(none, logits)
    assert apply_token_bitmask(logits, None) is logits
    with pytest.raises(ValueError):
        apply_token_bitmask(logits, np.full((6, 2), -1, np.int32))


def test_pad_rows():
    m = np.zeros((2, 3), np.int32)
    out = pad_rows(m, 4, 3)
    assert out.shape == (4, 3) and (out[:2] == 0).all() and (out[2:] == -1).all()
    assert (pad_rows(None, 4, 3) == -1).all()
    with pytest.raises(ValueError):
        pad_rows(m, 1, 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_tokens_are_sampled_and_neighbours_are_unchanged(temperature):
    rows = 64
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(rows, V)).astype(np.float32) * 3
    allowed = np.ones((rows, V), bool)
    constrained = np.arange(rows) % 2 == 0
    allowed[constrained] = rng.random((constrained.sum(), V)) < 0.1
    allowed[constrained, rng.integers(0, V, constrained.sum())] = True
    positions = np.arange(rows, dtype=np.int32)
    mask = _bits(allowed)
    mask[~constrained] = -1
    got = np.asarray(SAMPLE(logits, positions, _arrays(rows, temperature, mask)))
    assert allowed[np.arange(rows), got].all()
    # The unconstrained rows draw what they draw with no mask in the batch at all.
    free = np.asarray(SAMPLE(logits, positions, _arrays(rows, temperature, np.full((rows, 3), -1, np.int32))))
    assert np.array_equal(got[~constrained], free[~constrained])
    if temperature == 0.0:  # greedy: the best allowed token
        best = np.where(allowed, logits, -np.inf).argmax(-1)
        assert np.array_equal(got, best)


# ------------------------------------------------------------- host side


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer):
    return Grammars(tiny_tokenizer)


def _allowed(grammars, matcher, vocab=512):
    mask = grammars.fill([(matcher, 0)], 1, vocab)[0]
    return [t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]


def test_matcher_allows_what_the_grammar_allows_and_eos_only_when_complete(grammars, tiny_tokenizer):
    tok = tiny_tokenizer
    m = grammars.matcher(StructuredOutput("choice", json.dumps(["yes", "no"])))
    first = _allowed(grammars, m)
    assert first and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in first)
    assert tok.eos_id not in first
    for t in tok.encode("yes"):
        assert m.consume_token(t)
    assert _allowed(grammars, m) == sorted(tok.stop_token_ids)  # complete: only the stop ids
    # The cache hands out independent copies.
    fresh = grammars.matcher(StructuredOutput("choice", json.dumps(["yes", "no"])))
    assert _allowed(grammars, fresh) == first


def test_fill_masks_ids_past_the_tokenizer_and_leaves_other_rows_open(grammars):
    m = grammars.matcher(StructuredOutput("regex", "[0-9]+"))
    mask = grammars.fill([(m, 1)], 3, 600)  # a model vocabulary larger than the tokenizer's
    assert mask.shape == (3, mask_words(600))
    assert (mask[0] == -1).all() and (mask[2] == -1).all()
    assert (mask[1, 16:] == 0).all()  # ids 512..599 are not tokens
    with pytest.raises(ValueError):
        grammars.fill([(m, 0)], 1, 100)


@pytest.mark.parametrize("so", [
    StructuredOutput("json_schema", '{"type": "foo"}'),
    StructuredOutput("json_schema", "{not json"),
    StructuredOutput("json_schema", "false"),
    StructuredOutput("json_schema", "[1, 2]"),
    StructuredOutput("regex", "a(b"),
    StructuredOutput("choice", "[]"),
    StructuredOutput("grammar", "start: nowhere"),
    StructuredOutput("xml", ""),
])
def test_invalid_constraints_raise(grammars, so):
    with pytest.raises(StructuredOutputError):
        grammars.matcher(so)


# ---------------------------------------------------------- engine loop

TINY = ModelConfig.from_dict(read_config("models.yaml")["tiny-random"]["config"])


@pytest.fixture(scope="module")
def loop(jax_cache, tiny_tokenizer):
    cfg = EngineConfig(max_slots=4, num_pages=64, max_model_len=256, page_size=8, prefill_chunk=32,
                       min_decode_batch=2)
    loop = EngineLoop(Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg),
                      tokenizer=tiny_tokenizer)
    loop.start(warmup=False)
    yield loop
    loop.stop()


def _req(rid, tok, so=None, **kw):
    kw = {"max_tokens": 40, "temperature": 1.0, "seed": 3, "stop_token_ids": tok.stop_token_ids, **kw}
    return EngineRequest(rid, [2, 50, 60, 70, 80], SamplingParams(structured_output=so, **kw))


def _run(loop, reqs):
    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in reqs))
    return asyncio.run(main())


def test_engine_loop_enforces_the_grammar_and_leaves_neighbours_alone(loop, tiny_tokenizer):
    tok = tiny_tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False}
    alone = _run(loop, [_req("free-alone", tok, seed=11, ignore_eos=True)])[0][0]
    (ids_j, ev_j), (ids_r, ev_r), (ids_c, ev_c), (ids_f, _) = _run(loop, [
        _req("json", tok, StructuredOutput("json_schema", json.dumps(schema))),
        _req("regex", tok, StructuredOutput("regex", "[a-c]{3}-[0-9]{2}")),
        _req("choice", tok, StructuredOutput("choice", json.dumps(["alpha", "beta"])), seed=5),
        _req("free", tok, seed=11, ignore_eos=True)])
    for ids, ev in ((ids_j, ev_j), (ids_r, ev_r), (ids_c, ev_c)):
        assert ev[-1].finish_reason == "stop", ev[-1]
        assert ids[-1] in tok.stop_token_ids
    obj = json.loads(tok.decode(ids_j))
    assert set(obj) == {"a", "b"} and 0 <= obj["a"] <= 999 and obj["b"] in ("x", "yz")
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", tok.decode(ids_r))
    assert tok.decode(ids_c) in ("alpha", "beta")
    assert ids_f == alone  # the unconstrained neighbour's tokens are its own
    assert not loop._constrained


def test_a_constraint_after_a_token_starts_once_that_token_is_generated(loop, tiny_tokenizer):
    """StructuredOutput.after_token_id (a reasoning model's think-end): the tokens up to it
    are free, those after it follow the grammar. A +100 bias makes the free part that one
    token; the grammar, once armed, forbids it."""
    tok = tiny_tokenizer
    [end] = tok.encode("9")
    bias = ((end, 100.0),)
    (ids, ev), (ids_now, _) = _run(loop, [
        _req("after", tok, StructuredOutput("regex", "[a-c]{3}", after_token_id=end), logit_bias=bias),
        _req("now", tok, StructuredOutput("regex", "[a-c]{3}"), logit_bias=bias)])
    assert ids[0] == end and ev[-1].finish_reason == "stop"
    assert re.fullmatch("[a-c]{3}", tok.decode(ids[1:]))
    assert end not in ids_now and re.fullmatch("[a-c]{3}", tok.decode(ids_now))
    assert not loop._constrained


def test_a_failing_matcher_fails_its_request_only(loop, tiny_tokenizer, monkeypatch):
    tok = tiny_tokenizer
    monkeypatch.setattr(loop, "_token_mask", lambda *a: None)  # the device no longer enforces it
    (ids_c, ev_c), (ids_f, ev_f) = _run(loop, [
        _req("broken", tok, StructuredOutput("regex", "q{30}")),
        _req("free2", tok, seed=11, ignore_eos=True, max_tokens=12)])
    assert ev_c[-1].finish_reason == "error" and "structured output failed" in ev_c[-1].error
    assert ev_f[-1].finish_reason == "length" and len(ids_f) == 12
    assert loop.kv.num_free == loop.cfg.num_pages - 1


def test_invalid_constraint_or_no_tokenizer_is_rejected_at_submit(loop, tiny_tokenizer):
    async def submit(lp, so):
        lp.submit(_req("bad", tiny_tokenizer, so))

    with pytest.raises(RequestRejectedError, match="regex"):
        asyncio.run(submit(loop, StructuredOutput("regex", "a(b")))
    with pytest.raises(RequestRejectedError, match="tokenizer"):  # an engine loop built without one
        request_matcher(None, _req("x", tiny_tokenizer, StructuredOutput("regex", "a")))


def test_gateway_over_the_engine_loop_returns_constrained_text(loop, tiny_tokenizer):
    """The whole path: the gateway parses and compiles the constraint, the engine enforces it."""
    import httpx

    from serving.gateway.app import ServedModel, create_app

    app = create_app({"tiny": ServedModel("tiny", loop, tiny_tokenizer, loop.max_model_len)})

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            ok = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "pick"}], "max_tokens": 30,
                "seed": 1, "guided_choice": ["left", "right"]})
            bad = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "guided_regex": "(("})
            return ok, bad

    ok, bad = asyncio.run(main())
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert choice["message"]["content"] in ("left", "right") and choice["finish_reason"] == "stop"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
