"""Stand-in replicas for the router tests (no gRPC, no engine), and their requests and prompts."""

from __future__ import annotations

import asyncio

from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    EngineStats,
    LoraInUseError,
    SamplingParams,
    TokenEvent,
)
from serving.core.kv.kv_cache_manager import prompt_page_hashes
from serving.rpc import engine_pb2 as pb
from serving.rpc.remote_engine import ReplicaKvIndex, ReplicaUnavailable

PS = 16


INFO = pb.ModelInfo(model="m", tokenizer_id="t", page_size=PS, max_model_len=4096, kv_capacity_tokens=8192)


class FakeReplica:
    """A replica stand-in: ``generate`` yields one token per ``step`` set, or fails."""

    def __init__(self, name: str, info=INFO, region: str = ""):
        self.url = f"grpc://{name}:1"
        self.info = info
        self.region = region
        self.labels = {"region": region} if region else {}
        self.up = True
        self.load = EngineStats()
        self.kv_index = ReplicaKvIndex()
        self.kv_index.reset(0)
        self.page_size = info.page_size
        self.kv_format = info.kv_format
        self.role = info.role or "both"
        self.kv_transport = info.kv_transport
        self.fail_before_first = False
        self.overloaded = False
        self.gate: asyncio.Event | None = None  # set: generate waits for it before finishing
        self.aborted: list[str] = []
        self.served: list[str] = []
        self.loras: dict[str, str] = {}  # LoRA adapter name -> digest, as RemoteEngine.loras
        self.serves_lora = False
        self.refuse_lora: str | None = None  # set: load_lora raises ValueError with it
        self.lora_in_use: set[str] = set()  # unload_lora raises LoraInUseError for these

    def cache(self, prompt, salt=None):
        self.kv_index.keys.update(prompt_page_hashes(prompt, PS, salt))

    async def generate(self, req):
        if self.fail_before_first:
            self.up = False  # as RemoteEngine takes itself out
            raise ReplicaUnavailable(f"{self.url}: UNAVAILABLE")
        if self.overloaded:
            raise EngineOverloadedError(f"{self.url}: queue full")
        self.served.append(req.request_id)
        yield TokenEvent(req.request_id, (1,), prompt_tokens=len(req.prompt_ids), completion_tokens=1)
        if self.gate is not None:
            await self.gate.wait()
        yield TokenEvent(req.request_id, (2,), "length", prompt_tokens=len(req.prompt_ids), completion_tokens=2)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def load_lora(self, name, path):
        if self.fail_before_first:
            raise ConnectionError(f"{self.url}: UNAVAILABLE")  # stands for grpc's AioRpcError
        if self.refuse_lora is not None:
            raise ValueError(self.refuse_lora)
        self.loras = {**self.loras, name: f"digest-of-{path}"}
        return self.loras[name]

    async def unload_lora(self, name):
        if name not in self.loras:
            raise KeyError(name)
        if name in self.lora_in_use:
            raise LoraInUseError(f"LoRA adapter {name!r} has requests running")
        self.loras = {n: d for n, d in self.loras.items() if n != name}


def req(prompt, rid="r", salt=None, parent=None, max_tokens=2, lora=None):
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens), cache_salt=salt, parent_id=parent,
                         lora_name=lora)


def prompt(n, offset=0):
    return [(7 * i + offset) % 500 + 3 for i in range(n)]


async def drain(router, r):
    return [ev async for ev in router.submit(r)]
