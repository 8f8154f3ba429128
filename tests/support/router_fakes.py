"""Stand-in replicas for the router tests (no gRPC, no engine), and their requests and prompts."""

from __future__ import annotations

import asyncio

from serving.contract.engine_client import EngineOverloadedError, EngineRequest, EngineStats, SamplingParams, TokenEvent
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
        self.role = info.role or "both"
        self.kv_transport = info.kv_transport
        self.fail_before_first = False
        self.overloaded = False
        self.gate: asyncio.Event | None = None  # set: generate waits for it before finishing
        self.aborted: list[str] = []
        self.served: list[str] = []

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


def req(prompt, rid="r", salt=None, parent=None, max_tokens=2):
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens), cache_salt=salt, parent_id=parent)


def prompt(n, offset=0):
    return [(7 * i + offset) % 500 + 3 for i in range(n)]


async def drain(router, r):
    return [ev async for ev in router.submit(r)]
