"""LoRA over the engine service, in process on loopback with a stand-in engine loop (no JAX): the
replica reports its adapters and their digests (GetModelInfo, then every GetLoad, which the
client follows), a request's adapter reaches the engine, and LoadLora / UnloadLora map the
engine's refusals to the client's exceptions."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from model.lora_adapter import LoraAdapterError
from serving.contract.engine_client import EngineRequest, EngineStats, LoraInUseError, SamplingParams, TokenEvent
from serving.core.kv.kv_events import KvEventJournal
from serving.replica.engine_service import EngineService, start_server
from serving.rpc import engine_pb2 as pb
from serving.rpc.remote_engine import RemoteEngine

INFO = pb.ModelInfo(model="m", tokenizer_id="t", page_size=16, max_model_len=64, kv_capacity_tokens=64)


class FakeLoraLoop:
    """The parts of an engine loop the engine service uses, with LoRA adapters {name: digest}."""

    serves_lora = True

    def __init__(self, digests):
        self.digests = dict(digests)  # name -> digest
        self.kv_events = KvEventJournal()
        self.submitted: list[EngineRequest] = []
        self.in_use: set[str] = set()
        self.connector = None

    def lora_digests(self):
        return dict(self.digests)

    def is_ready(self):
        return True

    async def ping(self):
        return None

    def stats(self):
        return EngineStats()

    def submit(self, request):
        self.submitted.append(request)

        async def events():
            yield TokenEvent(request.request_id, (5,), "length", prompt_tokens=len(request.prompt_ids),
                             completion_tokens=1)
        return events()

    async def cancel(self, request_id):
        pass

    async def load_lora(self, name, path):
        if name in self.digests:
            raise ValueError(f"a LoRA adapter named {name!r} is already served")
        if path.endswith("dora"):
            raise LoraAdapterError(f"{path}: DoRA (use_dora) is not supported")
        self.digests[name] = f"digest:{path}"

    async def unload_lora(self, name):
        if name not in self.digests:
            raise KeyError(name)
        if name in self.in_use:
            raise LoraInUseError(f"LoRA adapter {name!r} has 1 request running")
        del self.digests[name]


@contextlib.asynccontextmanager
async def served(engine):
    server, port = await start_server(EngineService(engine, INFO), "127.0.0.1", 0)
    remote = RemoteEngine(f"grpc://127.0.0.1:{port}", None, probe_interval=0.02, expected=INFO)
    await remote.open()
    try:
        while not remote.up:
            await asyncio.sleep(0.01)
        yield remote
    finally:
        await remote.close()
        await server.stop(grace=None)


async def _until(condition):
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met within 5 s")


def test_replica_reports_its_adapters_and_the_client_follows_them():
    engine = FakeLoraLoop({"sql": "d1"})

    async def main():
        async with served(engine) as remote:
            assert remote.serves_lora and remote.loras == {"sql": "d1"}  # from GetModelInfo
            engine.digests["chat"] = "d2"  # loaded there by someone else
            await _until(lambda: remote.loras == {"sql": "d1", "chat": "d2"})  # GetLoad carries it
            del engine.digests["sql"]
            await _until(lambda: remote.loras == {"chat": "d2"})

    asyncio.run(main())


def test_request_adapter_reaches_the_engine():
    engine = FakeLoraLoop({"sql": "d1"})

    async def main():
        async with served(engine) as remote:
            req = EngineRequest("q", (1, 2, 3), SamplingParams(max_tokens=1), lora_name="sql")
            return [ev async for ev in remote.generate(req)]

    events = asyncio.run(main())
    assert events[-1].finish_reason == "length"
    assert [r.lora_name for r in engine.submitted] == ["sql"]


def test_load_and_unload_over_the_wire():
    engine = FakeLoraLoop({"sql": "d1"})

    async def main():
        async with served(engine) as remote:
            assert await remote.load_lora("chat", "/a/chat") == "digest:/a/chat"
            assert remote.loras["chat"] == "digest:/a/chat"  # at once, before the next probe
            with pytest.raises(ValueError, match="DoRA"):
                await remote.load_lora("d", "/a/dora")
            with pytest.raises(ValueError, match="already served"):
                await remote.load_lora("sql", "/a/other")
            engine.in_use = {"sql"}
            with pytest.raises(LoraInUseError, match="1 request running"):
                await remote.unload_lora("sql")
            engine.in_use = set()
            await remote.unload_lora("sql")
            assert "sql" not in remote.loras and "sql" not in engine.digests
            with pytest.raises(KeyError):
                await remote.unload_lora("sql")
            assert remote.up  # refusals are answers, not failures

    asyncio.run(main())
