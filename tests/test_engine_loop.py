"""The batching loop on the tiny-random model: slots, pages, finish reasons, cancellation, errors."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import pytest
from flax import nnx

from model.config import ModelConfig
from model.gemma3 import Gemma3
from serving.engine import Engine, EngineConfig
from serving.engine_client import EngineOverloadedError, RequestRejectedError
from serving.engine_loop import EngineLoop
from serving.server_config import load_yaml_config
from tests.engine_helpers import collect, generate, request

TINY = ModelConfig.from_dict(load_yaml_config("models.yaml")["tiny-random"]["config"])


def make_loop(**overrides) -> EngineLoop:
    max_waiting = overrides.pop("max_waiting", 256)
    cfg = EngineConfig(**{**dict(max_slots=4, num_pages=64, max_model_len=256, page_size=8,
                                 prefill_chunk=32, min_decode_batch=2), **overrides})
    model = Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return EngineLoop(Engine(model, cfg), max_waiting=max_waiting)


@pytest.fixture(scope="module")
def loop(jax_cache):
    loop = make_loop()
    loop.start(warmup=False)
    yield loop
    loop.stop()


def prompt(n: int, offset: int = 0) -> list[int]:
    return [2] + [(7 * i + offset) % 400 + 100 for i in range(n - 1)]


def all_pages_free(loop: EngineLoop) -> bool:
    return loop._allocator.num_free == loop.cfg.num_pages - 1


def test_max_tokens_finishes_with_length(loop):
    ids, events = asyncio.run(collect(loop, request(prompt(5), max_tokens=7, ignore_eos=True)))
    assert len(ids) == 7
    assert events[-1].finish_reason == "length"
    assert events[-1].completion_tokens == 7 and events[-1].prompt_tokens == 5
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert all_pages_free(loop)


def test_stop_token_finishes_with_stop(loop):
    first = generate(loop, [request(prompt(6), max_tokens=3, ignore_eos=True)])[0]
    ids, events = asyncio.run(collect(loop, request(prompt(6), max_tokens=10,
                                                   stop_token_ids=(first[1],))))
    assert ids == first[:2]
    assert events[-1].finish_reason == "stop"


def test_more_requests_than_slots_all_complete(loop):
    reqs = [request(prompt(3 + i, i), max_tokens=5 + i % 4, ignore_eos=True) for i in range(12)]
    outs = generate(loop, reqs)
    assert [len(o) for o in outs] == [5 + i % 4 for i in range(12)]
    assert all_pages_free(loop)


def test_long_prompt_is_chunked_and_matches_single_chunk():
    """A 100-token prompt in 16-token chunks gives the same greedy ids as in one 128 chunk."""
    outs = []
    for chunk in (16, 128):
        lp = make_loop(prefill_chunk=chunk)
        lp.start(warmup=False)
        try:
            outs.append(generate(lp, [request(prompt(100), max_tokens=8, ignore_eos=True)])[0])
        finally:
            lp.stop()
    assert outs[0] == outs[1]


def test_ragged_prefill_packs_sequences_like_one_at_a_time():
    reqs = lambda: [request(prompt(n, n), max_tokens=6, ignore_eos=True) for n in (3, 17, 9, 30)]
    results = []
    for seqs in (1, 4):
        lp = make_loop(max_prefill_seqs=seqs, prefill_chunk=64)
        lp.start(warmup=False)
        try:
            results.append(generate(lp, reqs()))
        finally:
            lp.stop()
    assert results[0] == results[1]


def test_cancel_stops_within_a_step_and_frees_pages(loop):
    async def main():
        req = request(prompt(4), max_tokens=200, ignore_eos=True)
        stream = loop.submit(req)
        got = []
        async for ev in stream:
            got.append(ev)
            if len(got) == 3:
                await loop.cancel(req.request_id)
            if ev.finish_reason:
                break
        return got

    events = asyncio.run(main())
    assert events[-1].finish_reason == "cancelled"
    assert len(events) < 10  # stopped within a step or two, not after 200 tokens
    assert events[-1].completion_tokens >= 3  # usage so far is reported
    assert all_pages_free(loop)


def test_abandoned_stream_is_cancelled(loop):
    async def main():
        req = request(prompt(4), max_tokens=200, ignore_eos=True)
        stream = loop.submit(req)
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if all_pages_free(loop):
                return True
            await asyncio.sleep(0.02)
        return False

    assert asyncio.run(main())


def test_rejects_what_can_never_fit(loop):
    async def submit(req):
        loop.submit(req)

    with pytest.raises(RequestRejectedError, match="context window of 256"):
        asyncio.run(submit(request(prompt(200), max_tokens=100)))
    with pytest.raises(RequestRejectedError, match="empty"):
        asyncio.run(submit(request([], max_tokens=1)))
    with pytest.raises(RequestRejectedError, match="token ids"):
        asyncio.run(submit(request([2, TINY.vocab_size], max_tokens=1)))


def test_bounded_waiting_queue_overloads():
    lp = make_loop(max_waiting=2)  # not started: nothing leaves the queue

    async def main():
        lp.submit(request(prompt(3)))
        lp.submit(request(prompt(3)))
        with pytest.raises(EngineOverloadedError):
            lp.submit(request(prompt(3)))

    asyncio.run(main())


def test_seeded_sampling_is_reproducible(loop):
    s = dict(max_tokens=8, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    a = generate(loop, [request(prompt(5), **s)])[0]
    b = generate(loop, [request(prompt(9, 3), max_tokens=8, temperature=1.0, seed=1, ignore_eos=True),
                        request(prompt(5), **s)])[1]
    assert a == b
