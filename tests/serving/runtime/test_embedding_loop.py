"""The embedding loop: requests batched together come back whole and in order; a bad request is
refused alone; a failing step fails only its requests; batch priority waits for default work."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serving.contract.engine_client import RequestRejectedError
from serving.runtime.embedding_loop import EmbeddingLoop
from tests.support.embedding_models import embedding_engine, golden


@pytest.fixture()
def loop():
    lp = EmbeddingLoop(embedding_engine("gemma3_embed"), max_waiting=64)
    lp.start(warmup=False)
    yield lp
    lp.stop()


def test_concurrent_requests_share_steps_and_match_goldens(loop):
    g, want = golden("gemma3_embed")
    ids = g["token_ids"]

    async def main():
        return await asyncio.gather(loop.embed(ids[:5]), loop.embed(ids[5:6]), loop.embed(ids[6:], priority="batch"),
                                    return_exceptions=True)

    a, b, c = asyncio.run(main())
    got = np.concatenate([a, b, c])
    assert got.shape == want.shape
    assert np.sum(got * want, axis=1).min() >= 0.9999
    assert loop.is_ready() and loop.stats().num_waiting == 0


def test_bad_request_is_refused_alone(loop):
    g, want = golden("gemma3_embed")

    async def main():
        good = asyncio.ensure_future(loop.embed(g["token_ids"][:2]))
        with pytest.raises(RequestRejectedError, match="input 1 has token id 1000"):
            await loop.embed([[2, 5], [2, 1000]])
        with pytest.raises(RequestRejectedError, match="input 0 is empty"):
            await loop.embed([[]])
        with pytest.raises(RequestRejectedError, match="at most 32"):
            await loop.embed([[2] * 40])
        return await good

    got = asyncio.run(main())
    assert np.sum(got * want[:2], axis=1).min() >= 0.9999


def test_failed_step_fails_only_its_requests(loop, monkeypatch):
    g, want = golden("gemma3_embed")
    real = loop.engine.embed
    calls = []

    def flaky(inputs):
        calls.append(len(inputs))
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return real(inputs)

    monkeypatch.setattr(loop.engine, "embed", flaky)

    async def main():
        first = await asyncio.gather(loop.embed(g["token_ids"][:1]), return_exceptions=True)
        second = await loop.embed(g["token_ids"][1:2])
        return first[0], second

    err, ok = asyncio.run(main())
    assert isinstance(err, RuntimeError) and "device fault" in str(err)
    assert float(np.dot(ok[0], want[1])) >= 0.9999
