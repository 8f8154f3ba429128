"""The router's two hops over stand-in prefill and decode replicas (no gRPC, no engine): what each
hop is sent, what the request's events say, failover on either side, requests kept whole."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    KvTransferParams,
    SamplingParams,
    StructuredOutput,
    TokenEvent,
)
from serving.routing import disaggregation
from serving.routing.router import Router
from serving.rpc import engine_pb2 as pb
from serving.rpc.remote_engine import ReplicaUnavailable
from tests.support.router_fakes import INFO, FakeReplica, drain, prompt


def info(role: str, kv_transport: str = "jax") -> pb.ModelInfo:
    m = pb.ModelInfo()
    m.CopyFrom(INFO)
    m.role = role
    m.kv_transport = kv_transport
    return m


class FakePrefill(FakeReplica):
    """Answers a kv_produce request with an offer (and its own cached tokens)."""

    def __init__(self, name: str, kv_transport: str = "jax"):
        super().__init__(name, info("prefill", kv_transport))
        self.requests: list[EngineRequest] = []
        self.released: list[str] = []
        self.fail_with_error = False

    async def generate(self, req):
        if self.fail_before_first:
            self.up = False
            raise ReplicaUnavailable(f"{self.url}: UNAVAILABLE")
        self.requests.append(req)
        if self.fail_with_error:
            yield TokenEvent(req.request_id, (), "error", error="prefill failed: boom")
            return
        offer = KvTransferParams(f"t-{req.request_id}", self.kv_transport, 32, 16, (1, 1, 16, 8), "bfloat16")
        yield TokenEvent(req.request_id, (5,), "length", prompt_tokens=len(req.prompt_ids), cached_tokens=16,
                         completion_tokens=1, scheduled_time=100.0, kv_transfer=offer)

    async def release_kv(self, transfer_id):
        self.released.append(transfer_id)


class FakeDecode(FakeReplica):
    def __init__(self, name: str, kv_transport: str = "jax"):
        super().__init__(name, info("decode", kv_transport))
        self.requests: list[EngineRequest] = []

    async def generate(self, req):
        self.requests.append(req)
        moved = 4096 if req.kv_transfer is not None else 0
        async for ev in super().generate(req):
            yield dataclasses.replace(ev, kv_transfer_bytes=moved, kv_transfer_seconds=0.02 if moved else 0.0,
                                      cached_tokens=32, scheduled_time=101.0)


def request(rid="r", **sampling) -> EngineRequest:
    s = SamplingParams(**{**dict(max_tokens=2, logprobs=2, stop_token_ids=(9,), structured_output=StructuredOutput(
        "regex", "a+")), **sampling})
    return EngineRequest(rid, prompt(40), s)


def test_each_request_takes_two_hops_and_its_events_say_so():
    p, d = FakePrefill("p"), FakeDecode("d")
    router = Router([p, d])
    evs = asyncio.run(drain(router, request()))
    hop1, hop2 = p.requests[0], d.requests[0]
    assert hop1.kv_produce and hop1.sampling.max_tokens == 1
    assert hop1.sampling.logprobs is None and hop1.sampling.structured_output is None
    assert not hop1.sampling.stop_token_ids
    assert hop2.kv_transfer.transfer_id == "t-r" and hop2.kv_transfer.source_url == p.url
    assert hop2.sampling == request().sampling and not hop2.kv_produce
    assert [ev.token_ids for ev in evs] == [(1,), (2,)], "only the decode side's tokens reach the client"
    for ev in evs:
        assert (ev.replica, ev.prefill_replica) == (d.url, p.url)
        assert ev.cached_tokens == 16, "the prefill replica's cache hit, not the pages it sent"
        assert ev.scheduled_time == 100.0, "queued until the prefill replica scheduled it"
    assert evs[-1].kv_transfer_bytes == 4096
    assert router.decisions[(p.url, "prefill_load")] == 1 and router.decisions[(d.url, "decode")] == 1
    assert router.transfers.count == 1 and router.transfers.bytes == 4096
    text = generate_latest(_registry(router)).decode()
    assert 'xlaserve:kv_transfer_bytes_total{model_name="m"} 4096.0' in text
    assert 'xlaserve:kv_transfer_seconds_bucket{le="0.025",model_name="m"} 1.0' in text


def _registry(router):
    reg = CollectorRegistry()
    reg.register(router.collector("m"))
    return reg


def test_prefill_kv_aware_and_decode_by_load():
    p1, p2, d1, d2 = FakePrefill("p1"), FakePrefill("p2"), FakeDecode("d1"), FakeDecode("d2")
    router = Router([p1, p2, d1, d2])
    p2.cache(prompt(40))
    d1.load = dataclasses.replace(d1.load, num_running=3)
    asyncio.run(drain(router, request()))
    assert len(p2.requests) == 1 and not p1.requests
    assert router.decisions[(p2.url, "prefill_cache_hit")] == 1
    assert len(d2.requests) == 1 and not d1.requests


def test_a_failed_prefill_replica_is_replaced_and_with_none_left_the_decode_side_computes_the_prompt():
    p1, p2, d = FakePrefill("p1"), FakePrefill("p2"), FakeDecode("d")
    router = Router([p1, p2, d], policy="round-robin")
    p1.fail_before_first = True
    evs = asyncio.run(drain(router, request("a")))
    assert evs[-1].prefill_replica == p2.url and d.requests[-1].kv_transfer.source_url == p2.url
    p2.fail_before_first = True
    evs = asyncio.run(drain(router, request("b")))
    assert d.requests[-1].kv_transfer is None and evs[-1].prefill_replica is None
    assert evs[-1].finish_reason == "length"


def test_a_failed_decode_replica_is_replaced_and_the_next_pulls_the_same_offer():
    p, d1, d2 = FakePrefill("p"), FakeDecode("d1"), FakeDecode("d2")
    router = Router([p, d1, d2])
    d2.load = dataclasses.replace(d2.load, num_running=1)  # d1 first
    d1.fail_before_first = True
    evs = asyncio.run(drain(router, request()))
    assert evs[-1].replica == d2.url and d2.requests[0].kv_transfer.transfer_id == "t-r"
    assert router.decisions[(d2.url, "decode_retry")] == 1
    d2.overloaded = True
    with pytest.raises(EngineOverloadedError):
        asyncio.run(drain(router, request("z")))
    assert p.released == ["t-z"], "an offer no decode replica will pull is released at once"


def test_a_prefill_error_ends_the_request_with_it():
    p, d = FakePrefill("p"), FakeDecode("d")
    router = Router([p, d])
    p.fail_with_error = True
    evs = asyncio.run(drain(router, request()))
    assert [(ev.finish_reason, ev.replica, ev.error) for ev in evs] == [("error", p.url, "prefill failed: boom")]
    assert not d.requests


@pytest.mark.parametrize("why", [dict(prompt_logprobs=1), dict(presence_penalty=0.5),
                                 dict(repetition_penalty=1.2)])
def test_requests_that_compute_their_prompt_in_their_slot_go_whole_to_a_decode_replica(why):
    p, d = FakePrefill("p"), FakeDecode("d")
    router = Router([p, d])
    evs = asyncio.run(drain(router, request(**why)))
    assert not p.requests and d.requests[0].kv_transfer is None and evs[-1].replica == d.url


def test_cancel_during_the_decode_hop_aborts_on_the_decode_replica():
    p, d = FakePrefill("p"), FakeDecode("d")
    router = Router([p, d])
    d.gate = asyncio.Event()

    async def main():
        g = router.submit(request("c"))
        await anext(g)
        await router.cancel("c")
        d.gate.set()
        await g.aclose()

    asyncio.run(main())
    assert d.aborted == ["c"] and p.aborted == []


def test_only_replicas_of_one_kv_transport_pair():
    """A decode replica is chosen among those that pull over the offer's transport; a prefill
    replica no decode replica can pull from takes no prompts, and the gateway says why."""
    pj, pg, dj, dg = FakePrefill("pj"), FakePrefill("pg", "grpc"), FakeDecode("dj"), FakeDecode("dg", "grpc")
    dj.load = dataclasses.replace(dj.load, num_running=5)  # busier: least load alone would pick dg
    router = Router([pj, dg, dj], policy="round-robin")
    for i in range(3):
        asyncio.run(drain(router, request(f"r{i}")))
    assert len(pj.requests) == 3 and len(dj.requests) == 3 and not dg.requests
    assert all(r.kv_transfer.transport == "jax" for r in dj.requests)
    assert disaggregation.unpaired([pj, dg, dj]) == []

    lone = Router([pg, dj])  # nothing pulls over grpc: the decode replica computes prompts itself
    evs = asyncio.run(drain(lone, request("x")))
    assert evs[-1].finish_reason == "length" and not pg.requests and dj.requests[-1].kv_transfer is None
    [why] = disaggregation.unpaired([pg, dj])
    assert pg.url in why and "--kv-transport" in why and "'grpc'" in why and "'jax'" in why
