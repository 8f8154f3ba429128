"""The gRPC engine service and its client, in process: a tiny-random engine loop served on
loopback, called through ``RemoteEngine`` and the ``Router`` (the same compiled shapes as
tests/serving/runtime/test_engine_loop.py)."""

from __future__ import annotations

import asyncio
import contextlib
import filecmp
import shutil
import subprocess
import sys

import grpc
import pytest

from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    RequestRejectedError,
    SamplingParams,
)
from serving.core.kv.kv_cache_manager import prompt_page_hashes
from serving.replica.engine_service import EngineService, model_info, start_server
from serving.rpc import engine_pb2 as pb
from serving.rpc.remote_engine import RemoteEngine
from tests.support.engine_helpers import collect, request
from tests.support.paths import REPO_ROOT as ROOT
from tests.support.tiny_engine import make_loop, prompt


@pytest.fixture(scope="module")
def loop(jax_cache, tiny_tokenizer):
    loop = make_loop()
    loop.tokenizer = tiny_tokenizer
    loop.start(warmup=False)
    yield loop
    loop.stop()


@contextlib.asynccontextmanager
async def served(engine, info=None):
    """(server, RemoteEngine) for `engine` on a free loopback port, the replica taken in."""
    info = info or model_info(engine, "tiny-random", engine.tokenizer)
    server, port = await start_server(EngineService(engine, info, health_timeout=5.0), "127.0.0.1", 0)
    remote = RemoteEngine(f"grpc://127.0.0.1:{port}", info, probe_interval=0.05)
    await remote.open()
    try:
        while not (remote.up and remote.kv_index.seq is not None):
            await asyncio.sleep(0.01)
        yield server, remote
    finally:
        await remote.close()
        await server.stop(grace=None)


async def remote_collect(remote, req):
    ids, events = [], []
    async for ev in remote.generate(req):
        ids.extend(ev.token_ids)
        events.append(ev)
    return ids, events


def test_generated_modules_match_the_proto(tmp_path):
    """The checked-in engine_pb2*.py are what grpcio-tools makes of engine.proto today."""
    (tmp_path / "serving" / "rpc").mkdir(parents=True)
    shutil.copy(ROOT / "serving" / "rpc" / "engine.proto", tmp_path / "serving" / "rpc")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                    "--grpc_python_out=.", "serving/rpc/engine.proto"], cwd=tmp_path, check=True)
    for name in ("engine_pb2.py", "engine_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "serving" / "rpc" / name, ROOT / "serving" / "rpc" / name,
                           shallow=False), f"{name} is stale: regenerate it (see engine.proto)"


def test_remote_stream_equals_in_process(loop):
    """Token ids, counts, log probabilities and finish reasons survive the wire exactly."""
    sampling = SamplingParams(max_tokens=12, logprobs=3, temperature=0.0)

    async def main():  # distinct salts: neither run hits the other's cached prefix
        local = await collect(loop, EngineRequest("local-1", prompt(20), sampling, cache_salt="a"))
        async with served(loop) as (_, remote):
            far = await remote_collect(remote, EngineRequest("far-1", prompt(20), sampling, cache_salt="b"))
        return local, far

    (ids, events), (rids, revents) = asyncio.run(main())
    assert rids == ids and len(ids) == 12
    assert [e.finish_reason for e in revents][-1] == "length"
    flat = [lp for e in events for lp in e.logprobs]
    rflat = [lp for e in revents for lp in e.logprobs]
    assert rflat == flat
    assert revents[-1].completion_tokens == 12 and revents[-1].prompt_tokens == 20


def test_prompt_logprobs_and_seeded_sampling_survive_the_wire(loop):
    sampling = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.8, seed=1234, prompt_logprobs=2,
                              presence_penalty=0.5, logit_bias=((300, 2.5),))

    async def main():
        local = await collect(loop, EngineRequest("local-2", prompt(12), sampling, cache_salt="a"))
        async with served(loop) as (_, remote):
            far = await remote_collect(remote, EngineRequest("far-2", prompt(12), sampling, cache_salt="b"))
        return local, far

    (ids, events), (rids, revents) = asyncio.run(main())
    assert rids == ids
    assert revents[0].prompt_logprobs == events[0].prompt_logprobs
    assert revents[0].prompt_logprobs[0] is None and len(revents[0].prompt_logprobs) == 12


class _Refusing:
    """An engine stand-in whose submit refuses, as a full or draining loop does."""

    def __init__(self, exc):
        self.exc = exc

    def submit(self, req):
        raise self.exc


def test_admission_errors_raise_on_the_gateway_side(loop):
    info = model_info(loop, "tiny-random", loop.tokenizer)

    async def main():
        for exc, expected in ((EngineOverloadedError("queue full"), EngineOverloadedError),
                              (RequestRejectedError("too long"), RequestRejectedError)):
            server, port = await start_server(EngineService(_Refusing(exc), info), "127.0.0.1", 0)
            remote = RemoteEngine(f"grpc://127.0.0.1:{port}", info)
            remote._channel = grpc.aio.insecure_channel(remote.target)
            from serving.rpc import engine_pb2_grpc

            remote._stub = engine_pb2_grpc.EngineServiceStub(remote._channel)
            with pytest.raises(expected, match=str(exc)):
                await remote_collect(remote, request(prompt(5), max_tokens=2))
            await remote._channel.close()
            await server.stop(grace=None)

    asyncio.run(main())


def test_real_rejection_over_the_wire(loop):
    async def main():
        async with served(loop) as (_, remote):
            with pytest.raises(RequestRejectedError, match="context window"):
                await remote_collect(remote, request(prompt(200), max_tokens=100))

    asyncio.run(main())


def test_abort_frees_the_pages_within_one_step(loop):
    """Abort ends the request with "cancelled"; by the loop's next turn (a health ping
    answered) its pages are free, as GetLoad reports."""

    async def main():
        async with served(loop) as (_, remote):
            req = request(prompt(40), max_tokens=200, ignore_eos=True)
            stream = remote.generate(req)
            first = await anext(stream)
            assert first.token_ids
            load = await remote.get_load()
            assert load.kv_pages_used > 0 and load.num_running == 1
            await remote.abort(req.request_id)
            events = [ev async for ev in stream]
            assert events[-1].finish_reason == "cancelled"
            assert (await remote.health()).ready  # the loop turned once more
            load = await remote.get_load()
            assert load.kv_pages_used == 0 and load.num_running == 0

    asyncio.run(main())


def test_leaving_the_stream_cancels_the_request(loop):
    async def main():
        async with served(loop) as (_, remote):
            req = request(prompt(40), max_tokens=200, ignore_eos=True)
            stream = remote.generate(req)
            await anext(stream)
            await stream.aclose()  # the gateway's consumer went away
            while loop.num_unfinished:  # the replica cancels it within a step
                await asyncio.sleep(0.01)
            assert (await remote.health()).ready
            assert (await remote.get_load()).kv_pages_used == 0

    asyncio.run(main())


def test_kv_events_follow_the_cache_and_a_lost_batch_is_resynced(loop):
    """The follower's index equals the replica's cached hashes; a batch dropped on the way
    shows up as a sequence gap, and a fresh snapshot repairs the index."""
    ps = loop.cfg.page_size

    async def settled(remote):
        while remote.kv_index.seq != loop.kv_events.seq:
            await asyncio.sleep(0.01)

    async def main():
        async with served(loop) as (_, remote):
            p = prompt(4 * ps + 3, offset=11)
            salt = "tenant-a"
            await remote_collect(remote, EngineRequest("kv-1", p, SamplingParams(max_tokens=2, temperature=0.0),
                                                        cache_salt=salt))
            await settled(remote)
            assert remote.kv_index.keys == loop.kv_events.cached()
            hashes = prompt_page_hashes(p, ps, salt)
            assert remote.kv_index.matched_pages(hashes) == 4
            assert remote.kv_index.matched_pages(prompt_page_hashes(p, ps, "tenant-b")) == 0

            remote.drop_next_kv_batch = True
            resyncs = remote.kv_index.resyncs
            for k in range(2):  # the first batch is lost; the second reveals the gap
                await remote_collect(remote, request(prompt(3 * ps + 1, offset=50 + k), max_tokens=1))
            while remote.kv_index.resyncs == resyncs:
                await asyncio.sleep(0.01)
            await settled(remote)
            assert remote.kv_index.keys == loop.kv_events.cached()
            loop.kv.check_invariants()

    asyncio.run(main())


def test_health_is_a_real_engine_check(loop):
    """A loop that does not turn is not healthy, however well its socket answers."""

    class Wedged:
        def is_ready(self):
            return True

        def ping(self):
            return asyncio.get_running_loop().create_future()  # never answered

    info = model_info(loop, "tiny-random", loop.tokenizer)

    async def main():
        server, port = await start_server(EngineService(Wedged(), info, health_timeout=0.2), "127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            from serving.rpc import engine_pb2_grpc

            h = await engine_pb2_grpc.EngineServiceStub(ch).Health(pb.HealthRequest())
        await server.stop(grace=None)
        return h

    h = asyncio.run(main())
    assert not h.ready and "did not answer" in h.message


def test_model_info_carries_the_tokenizer(loop):
    from model.tokenizer_files import tokenizer_from_files

    info = model_info(loop, "tiny-random", loop.tokenizer)
    assert info.page_size == loop.cfg.page_size and info.max_model_len == loop.max_model_len
    tok = tokenizer_from_files(dict(info.tokenizer_files))
    text = "Hello, wörld! <start_of_turn> 🙂"
    assert tok.encode(text, add_bos=True) == loop.tokenizer.encode(text, add_bos=True)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == loop.tokenizer.apply_chat_template(msgs)


def test_a_replica_that_goes_away_is_taken_out_and_probed_back_in(loop):
    async def main():
        info = model_info(loop, "tiny-random", loop.tokenizer)
        async with served(loop, info) as (server, remote):
            port = int(remote.target.rsplit(":", 1)[1])
            await server.stop(grace=None)
            while remote.up:  # the next probe fails
                await asyncio.sleep(0.01)
            again, _ = await start_server(EngineService(loop, info), "127.0.0.1", port)
            try:
                while not remote.up:  # Health answers ready again
                    await asyncio.sleep(0.01)
                ids, events = await remote_collect(remote, request(prompt(6), max_tokens=3))
                assert len(ids) == 3 and events[-1].finish_reason == "length"
            finally:
                await again.stop(grace=None)

    asyncio.run(main())
