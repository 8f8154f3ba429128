"""KV transfer between two engine loops in one process (``serving.replica.kv_connector``), over both
transports, each loop behind its real gRPC engine service on loopback: a prompt computed on one
and decoded on the other gives what one co-located engine gives; only missing chunks move; an
offer nobody pulls is freed at the timeout; a bad offer is refused."""

from __future__ import annotations

import asyncio
import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from model.gemma3 import Gemma3
from serving.contract.engine_client import EngineRequest, RequestRejectedError, SamplingParams
from serving.engine.engine import Engine, EngineConfig
from serving.replica.engine_service import EngineService, model_info, start_server
from serving.replica.kv_connector import KvConnector
from serving.replica.kv_transport import Transport
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import collect
from tests.support.tiny_engine import TINY, prompt

CFG = EngineConfig(max_slots=4, num_pages=64, max_model_len=256, page_size=8, prefill_chunk=32,
                   min_decode_batch=2, kv_dtype="bfloat16")
CHUNK = 4  # pages per chunk: a 60-token prompt's 7 full pages take 2 chunks


def make_loop(kind: str, timeout_s: float = 30.0, cfg: EngineConfig = CFG) -> EngineLoop:
    loop = EngineLoop(Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg))
    loop.connector = KvConnector(loop.engine, loop.kv, Transport(kind), timeout_s=timeout_s,
                                 chunk_pages=CHUNK, wake=loop.wake)
    loop.start(warmup=False)
    return loop


@pytest.fixture(scope="module", params=["jax", "grpc"])
def pair(request, jax_cache, tiny_tokenizer):
    prefill, decode = make_loop(request.param), make_loop(request.param)
    yield prefill, decode, tiny_tokenizer
    prefill.stop()
    decode.stop()


async def serve(loop: EngineLoop, tokenizer):
    server, port = await start_server(EngineService(loop, model_info(loop, "tiny", tokenizer)), "127.0.0.1", 0)
    return server, f"grpc://127.0.0.1:{port}"


def sampling(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234), **kw})


async def disaggregated(prefill: EngineLoop, decode: EngineLoop, url: str, rid: str, ids, s: SamplingParams):
    """The router's two hops, by hand: returns (decode-side token ids, its events, the offer)."""
    _, pev = await collect(prefill, EngineRequest(f"{rid}-p", ids, dataclasses.replace(s, max_tokens=1),
                                                  kv_produce=True))
    offer = dataclasses.replace(pev[-1].kv_transfer, source_url=url)
    out, events = await collect(decode, EngineRequest(rid, ids, s, kv_transfer=offer))
    return out, events, offer


def wait_for(cond, loop: EngineLoop) -> None:
    """Waits (on loop turns, bounded by the test's own timeout) until cond() holds."""
    import time

    while not cond():
        loop.wake()
        time.sleep(0.01)


def test_disaggregated_equals_colocated_and_frees_both_sides(pair):
    prefill, decode, tok = pair
    ids = prompt(60)  # 7 full pages of the first 59 tokens move; the 60th is computed where it decodes

    async def main():
        server, url = await serve(prefill, tok)
        try:
            want, _ = await collect(decode, EngineRequest("co", ids, sampling()))
            got, events, offer = await disaggregated(prefill, decode, url, "pd", ids, sampling())
            return want, got, events, offer
        finally:
            await server.stop(None)

    base_p = prefill.kv.num_free
    want, got, events, offer = asyncio.run(main())
    assert got == want and len(got) == 12
    assert offer.num_tokens == 56 and len(offer.page_hashes) == 7
    last = events[-1]
    assert last.finish_reason == "length" and last.error is None
    # The co-located run left the prompt's pages in the decode side's prefix cache: nothing moved.
    assert last.kv_transfer_bytes == 0
    wait_for(lambda: prefill.connector.num_offers == 0, prefill)
    assert prefill.kv.num_free == base_p and not prefill.kv.pinned_ids()
    assert decode.kv.num_free == CFG.num_pages - 1 and not decode.kv.pinned_ids()


def test_pages_the_decode_side_lacks_are_pulled_in_whole_chunks(pair):
    prefill, decode, tok = pair
    ids = prompt(60, offset=5)
    shared = ids[:32] + prompt(28, offset=9)[1:] + [7]  # shares 4 pages (one chunk) with ids

    async def main():
        server, url = await serve(prefill, tok)
        try:
            await collect(decode, EngineRequest("warm", shared, sampling(max_tokens=1)))
            want, _ = await collect(prefill, EngineRequest("co", ids, sampling()))  # prefill: co-located
            got, events, _ = await disaggregated(prefill, decode, url, "pd2", ids, sampling())
            return want, got, events
        finally:
            await server.stop(None)

    want, got, events = asyncio.run(main())
    assert got == want
    page = 2 * TINY.num_layers * TINY.num_kv_heads * CFG.page_size * TINY.head_dim * 2  # bf16
    # Pages 0-3 were cached on the decode side: only the second chunk (pages 4-6, padded to 4) moved.
    assert events[-1].kv_transfer_bytes == CHUNK * page
    assert events[-1].kv_transfer_seconds > 0


def test_an_offer_nobody_pulls_is_freed_at_the_timeout(jax_cache):
    loop = make_loop("grpc", timeout_s=0.5)
    try:
        base = loop.kv.num_free

        async def main():
            return await collect(loop, EngineRequest("lonely", prompt(60, 3), sampling(max_tokens=1),
                                                     kv_produce=True))

        _, events = asyncio.run(main())
        assert events[-1].kv_transfer.num_tokens == 56
        assert loop.kv.pinned_ids(), "the offer's pages are held"
        wait_for(lambda: loop.connector.num_offers == 0, loop)  # the timeout is the only clock
        assert loop.connector.offers_expired == 1 and not loop.kv.pinned_ids() and loop.kv.num_free == base
    finally:
        loop.stop()


def test_an_offer_for_another_prompt_or_shape_is_refused(pair):
    prefill, decode, tok = pair
    ids = prompt(40, offset=11)

    async def main():
        _, pev = await collect(prefill, EngineRequest("p", ids, sampling(max_tokens=1), kv_produce=True))
        offer = pev[-1].kv_transfer
        errors = []
        for bad_ids, bad in ((ids[:5] + [9] + ids[6:], offer), (ids, dataclasses.replace(offer, dtype="float32")),
                             (ids, dataclasses.replace(offer, num_tokens=offer.num_tokens + 3)),
                             (ids, dataclasses.replace(offer, kv_format="int8", dtype="int8"))):
            with pytest.raises(RequestRejectedError) as e:
                decode.submit(EngineRequest("d", bad_ids, sampling(), kv_transfer=bad))
            errors.append(str(e.value))
        prefill.connector.release(offer.transfer_id)
        return errors

    errors = asyncio.run(main())
    assert "page hashes differ" in errors[0] and "float32" in errors[1] and "whole pages" in errors[2]
    assert "KV pages are int8, this replica's unquantized: serve both with the same --kv-cache-dtype" in errors[3]


def test_quantized_chunks_carry_their_scale_pages_over_grpc():
    """An int8 offer's chunks: values and float32 scale pages go over PullKv and come back bit for
    bit; a message missing its scales is refused."""
    import numpy as np

    from serving.contract.engine_client import KvTransferParams
    from serving.replica.kv_transport import _pull_grpc, chunk_messages
    from serving.rpc import engine_pb2 as pb

    rng = np.random.default_rng(0)
    params = KvTransferParams(transfer_id="ab" * 6, transport="grpc", num_tokens=16, chunk_pages=2,
                              page_shape=(3, 1, 8, 4), dtype="int8", kv_format="int8")
    chunks = [{"k": rng.integers(-127, 128, (3, 1, 2, 8, 4)).astype(np.int8),
               "k_scale": rng.random((3, 1, 2, 8)).astype(np.float32),
               "v": rng.integers(-127, 128, (3, 1, 2, 8, 4)).astype(np.int8),
               "v_scale": rng.random((3, 1, 2, 8)).astype(np.float32)} for _ in range(2)]

    class Stub:
        def __init__(self, messages):
            self.messages = messages

        def PullKv(self, request, timeout):
            return self.messages(request.chunks)

    got = _pull_grpc(Stub(lambda ids: chunk_messages(chunks, ids)), params, [1, 0], deadline=1e12)
    assert [sorted(c) for c in got] == [["k", "k_scale", "v", "v_scale"]] * 2
    for c, want in zip(got, (chunks[1], chunks[0])):
        for name in want:
            assert c[name].dtype == want[name].dtype
            np.testing.assert_array_equal(c[name], want[name])
    no_scales = lambda ids: [pb.KvChunk(index=0, k=chunks[0]["k"].tobytes(), v=chunks[0]["v"].tobytes())]
    with pytest.raises(Exception, match="0 bytes of k_scale"):
        _pull_grpc(Stub(no_scales), params, [0], deadline=1e12)


def test_int8_pages_and_their_scales_move_over_jax_transfer(jax_cache, tiny_tokenizer):
    """Two int8 replicas (``--kv-cache-dtype int8``) over the jax transport: the offer says its
    format, the decode side pulls values and scale pages of every chunk and decodes what its own
    co-located run decodes; the pulled pages equal the prefill side's bit for bit."""
    import numpy as np

    cfg = dataclasses.replace(CFG, kv_cache_dtype="int8")
    prefill, decode = make_loop("jax", cfg=cfg), make_loop("jax", cfg=cfg)
    ids = prompt(60, offset=3)

    async def main():
        server, url = await serve(prefill, tiny_tokenizer)
        try:
            got, events, offer = await disaggregated(prefill, decode, url, "pd8", ids, sampling())
            return got, events, offer
        finally:
            await server.stop(None)

    try:
        got, events, offer = asyncio.run(main())
        assert offer.kv_format == "int8" and offer.dtype == "int8" and events[-1].error is None
        assert events[-1].kv_transfer_bytes == 2 * CHUNK * 8 * TINY.num_layers * TINY.num_kv_heads * (
            TINY.head_dim + 4) * 2  # 2 chunks of K and V: int8 values and float32 scales
        mine = decode.engine.read_pages(decode.kv.lookup_prefix(ids, None, 56).page_ids, 8)
        theirs = prefill.engine.read_pages(prefill.kv.lookup_prefix(ids, None, 56).page_ids, 8)
        for name in ("k", "k_scale", "v", "v_scale"):
            np.testing.assert_array_equal(np.asarray(mine[name])[:, :, :7], np.asarray(theirs[name])[:, :, :7])
        want, _ = asyncio.run(collect(prefill, EngineRequest("co8", ids, sampling())))
        assert got == want and len(got) == 12
    finally:
        prefill.stop()
        decode.stop()
