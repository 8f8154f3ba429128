"""The router and LoRA adapters over stand-in replicas (no gRPC, no engine): adapter requests go
only to replicas serving the adapter, their page hashes are salted with the digest each replica
reports (as its engine salts them), and load / unload reach every replica; the adapter fields
survive the engine service's messages."""

from __future__ import annotations

import asyncio

import pytest

from serving.contract.engine_client import EngineOverloadedError, LoraInUseError, RequestRejectedError
from serving.core.kv.kv_cache_manager import KVCacheManager, lora_salt
from serving.routing.router import Router
from serving.rpc import convert
from tests.support.router_fakes import PS, FakeReplica, drain, prompt, req


def _pair(digest="d1"):
    a, b = FakeReplica("a"), FakeReplica("b")
    for r in (a, b):
        r.serves_lora = True
        r.loras = {"sql": digest}
    return a, b


def test_router_salts_adapter_pages_as_the_engine_does():
    """The keys the engine's prefix cache stores for an adapter request (its salt joined with the
    adapter's digest) are the ones the router computes for that replica."""
    a, _ = _pair("d1")
    kv = KVCacheManager(num_pages=32, page_size=PS)
    p = prompt(3 * PS + 1)
    assert kv.allocate_pages("x", len(p))
    kv.cache_pages("x", p, len(p), lora_salt("tenant", "d1"))
    router = Router([a])
    assert set(router.page_hashes(req(p, salt="tenant", lora="sql"), a)) == set(kv._page_of)
    assert not set(router.page_hashes(req(p, salt="tenant"), a)) & set(kv._page_of)


def test_adapter_request_goes_where_the_adapters_pages_are_not_the_base_models():
    a, b = _pair()
    router = Router([a, b])
    p = prompt(32 * PS)
    a.cache(p)  # the base model's pages of the prompt
    b.cache(p, salt=lora_salt(None, "d1"))  # the adapter's
    for k in range(4):
        assert router.pick(req(p + [k + 1] * 5, lora="sql"))[:3] == (b, "cache_hit", 32)
        assert router.pick(req(p + [k + 1] * 5))[:3] == (a, "cache_hit", 32)


def test_pages_of_other_weights_under_the_same_name_attract_nothing():
    """Replica a cached the adapter's pages, then was given other weights under its name (a new
    digest): its old pages are no hit; b's, of the weights both serve now, are."""
    a, b = _pair("new")
    p = prompt(16 * PS)
    a.cache(p, salt=lora_salt(None, "old"))
    b.cache(p[:8 * PS], salt=lora_salt(None, "new"))
    assert Router([a, b]).pick(req(p, lora="sql"))[:3] == (b, "cache_hit", 8)


def test_adapter_requests_never_go_to_a_replica_without_the_adapter():
    a, b = FakeReplica("a"), FakeReplica("b")
    b.loras = {"sql": "d1"}
    router = Router([a, b])
    p = prompt(32 * PS)
    a.cache(p)
    a.cache(p, salt=lora_salt(None, "d1"))  # even holding pages that would match
    for k in range(6):
        events = asyncio.run(drain(router, req(p + [k], rid=f"r{k}", lora="sql")))
        assert events[-1].replica == b.url
    assert a.served == [] and b.served == [f"r{k}" for k in range(6)]
    asyncio.run(drain(router, req(p, rid="base")))
    assert "base" in a.served  # base requests still use both


def test_an_adapter_no_replica_serves_is_rejected_and_one_on_a_down_replica_is_overloaded():
    a, b = FakeReplica("a"), FakeReplica("b")
    b.loras = {"sql": "d1"}
    router = Router([a, b])
    with pytest.raises(RequestRejectedError, match="no engine replica serves the LoRA adapter 'chat'"):
        asyncio.run(drain(router, req(prompt(PS), lora="chat")))
    b.up = False
    with pytest.raises(EngineOverloadedError, match="'sql'"):
        asyncio.run(drain(router, req(prompt(PS), lora="sql")))
    assert a.served == []


def test_adapter_requests_are_served_whole_beside_prefill_and_decode_replicas():
    """KV transfer carries no adapter requests: they go whole to a (decode) replica serving it."""
    from serving.rpc import engine_pb2 as pb
    from tests.support.router_fakes import INFO

    pre = FakeReplica("pre", info=pb.ModelInfo(**{**_info_fields(INFO), "role": "prefill", "kv_transport": "grpc"}))
    dec = FakeReplica("dec", info=pb.ModelInfo(**{**_info_fields(INFO), "role": "decode", "kv_transport": "grpc"}))
    pre.loras = dec.loras = {"sql": "d1"}
    router = Router([pre, dec])
    events = asyncio.run(drain(router, req(prompt(4 * PS), rid="x", lora="sql")))
    assert events[-1].replica == dec.url and pre.served == [] and dec.served == ["x"]


def _info_fields(info):
    return {f.name: v for f, v in info.ListFields()}


def test_routed_lora_names_and_load_unload_fan_out():
    a, b = _pair()
    b.loras = {}
    router = Router([a, b])
    assert router.serves_lora and router.routed_lora_names() == ["sql"]
    asyncio.run(router.load_lora("chat", "/adapters/chat"))
    assert a.loras["chat"] == b.loras["chat"] == "digest-of-/adapters/chat"
    assert router.routed_lora_names() == ["chat", "sql"]
    b.refuse_lora = "rank 32 is above --max-lora-rank 16"
    with pytest.raises(ValueError, match=f"engine replica {b.url}: rank 32"):
        asyncio.run(router.load_lora("big", "/adapters/big"))
    assert "big" not in a.loras  # undone where it was taken
    a.lora_in_use = {"chat"}
    with pytest.raises(LoraInUseError):
        asyncio.run(router.unload_lora("chat"))
    a.lora_in_use = set()
    asyncio.run(router.unload_lora("chat"))
    assert "chat" not in a.loras and "chat" not in b.loras
    with pytest.raises(KeyError):
        asyncio.run(router.unload_lora("chat"))


def test_a_replica_that_does_not_answer_a_load_is_a_retry_not_a_refusal():
    a, b = _pair()
    b.fail_before_first = True
    with pytest.raises(EngineOverloadedError, match=f"engine replica {b.url} did not load"):
        asyncio.run(Router([a, b]).load_lora("chat", "/adapters/chat"))
    assert "chat" not in a.loras


def test_load_needs_a_replica_that_takes_adapters():
    with pytest.raises(ValueError, match="no engine replica up takes LoRA adapters"):
        asyncio.run(Router([FakeReplica("a")]).load_lora("sql", "/x"))


def test_lora_fields_cross_the_engine_service_messages():
    r = req(prompt(5), rid="q", salt="s", lora="sql")
    back = convert.request_from_proto(convert.request_to_proto(r))
    assert back.lora_name == "sql" and back.cache_salt == "s"
    assert convert.request_from_proto(convert.request_to_proto(req(prompt(5)))).lora_name is None
    loras = {"sql": "d1", "chat": "d2"}
    assert convert.loras_from_proto(convert.loras_to_proto(loras)) == loras
